"""Layout fuzzing of the fused ops (issue #49, item 3): Hypothesis draws each op's inputs (sizes including 1 and
primes; transposed, sliced, expanded and channels-last views; fp32, bf16, fp16; optional bias/weight/residual,
dropout on and off) and checks the fused op's forward and backward against its reference (the KernelSpec's
plain-PyTorch specification, run in fp64 on the same values) within the tolerance table. Attention, which may
crash a process, is fuzzed in a child process: tests/test_fuzz_attention.py.

Every fast path runs under the `error` fallback policy, so a kernel that its gate chose and that then raised fails
the example instead of quietly handing over to the reference; and each op's test checks that its fast path ran on
some examples (a fuzz run on the references alone would check nothing). See tests/fuzz_layouts.py for the budgets.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from fuzz_layouts import BUDGET_PARAMS, check_op, fuzz_per_dtype, optional, sizes, tensor
from graphtrain.config import fallback
from graphtrain.kernels import (
    _cpu_ext,
    bias_dropout_add,
    bias_gelu,
    cross_entropy,
    gemm,
    layer_norm,
    linear_cross_entropy,
    rms_norm,
)
from graphtrain.kernels._common import force_reference
from graphtrain.kernels.bias_dropout_add import bias_dropout_add_reference
from graphtrain.kernels.bias_gelu import bias_gelu_reference
from graphtrain.kernels.cross_entropy import REDUCTIONS, cross_entropy_reference
from graphtrain.kernels.gemm import gemm_reference, onednn_available
from graphtrain.kernels.layer_norm import layer_norm_reference
from graphtrain.kernels.linear_cross_entropy import linear_cross_entropy_reference
from graphtrain.kernels.rms_norm import rms_norm_reference


@pytest.fixture
def strict_fast_paths():
    """A fast path that raises fails the example (policy `error`); collects the (op, implementation) fast paths
    that ran."""
    before = fallback.policy()
    fallback.set_policy("error")
    with force_reference(ops=()) as chosen:  # forces nothing: only records
        yield chosen
    fallback.set_policy(before)


def _shape(data, min_dims: int = 1, max_dims: int = 4, last=None) -> list[int]:
    nd = data.draw(st.integers(min_dims, max_dims), label="dims")
    lead = [data.draw(sizes(1, 13), label=f"dim{i}") for i in range(nd - 1)]
    return lead + [data.draw(last or sizes(1, 67), label="last dim")]


VECTOR = ("contiguous", "sliced", "expanded")
"""The layouts a 1-D weight or bias can have."""


# --- layer_norm, rms_norm --------------------------------------------------------------------------------------


def _norm_prop(kind: str):
    def prop(data, dtype):
        shape = _shape(data)
        n = shape[-1]
        # a spread and an offset: the mean subtraction must not lose the spread
        x = tensor(
            data,
            shape,
            dtype,
            scale=data.draw(st.sampled_from([1.0, 0.01, 30.0])),
            offset=data.draw(st.sampled_from([0.0, 3.0])),
            label="x",
        )
        w = tensor(data, [n], dtype, layouts=VECTOR, label="w") if optional(data, "weight") else None
        b = (
            tensor(data, [n], dtype, layouts=VECTOR, label="b")
            if kind == "layer_norm" and optional(data, "bias")
            else None
        )
        eps = data.draw(st.sampled_from([1e-5, 1e-6, 0.1]), label="eps")
        if kind == "layer_norm":
            check_op(
                data,
                kind,
                dtype,
                [x, w, b],
                lambda x, w, b: layer_norm(x, w, b, eps),
                lambda x, w, b: F.layer_norm(x, (n,), w, b, eps),
                lambda x, w, b: layer_norm_reference(x, w, b, eps)[0],
            )
        else:
            check_op(
                data,
                kind,
                dtype,
                [x, w],
                lambda x, w: rms_norm(x, w, eps),
                lambda x, w: F.rms_norm(x, (n,), w, eps),
                lambda x, w: rms_norm_reference(x, w, eps)[0],
            )

    return prop


@pytest.mark.parametrize("budget", BUDGET_PARAMS)
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_fuzz_norms(kind, budget, strict_fast_paths):
    fuzz_per_dtype(_norm_prop(kind), budget)
    assert (kind, "cpu") in strict_fast_paths, strict_fast_paths  # aten's fused kernel for fp32 inputs ran


# --- bias_gelu ---------------------------------------------------------------------------------------------------


def _gelu_prop(data, dtype):
    shape = _shape(data)
    approx = data.draw(st.sampled_from(["none", "tanh"]), label="approximate")
    x = tensor(data, shape, dtype, scale=data.draw(st.sampled_from([1.0, 4.0])), label="x")
    b = tensor(data, [shape[-1]], dtype, layouts=VECTOR, label="b") if optional(data, "bias") else None
    check_op(
        data,
        f"bias_gelu ({approx})",
        dtype,
        [x, b],
        lambda x, b: bias_gelu(x, b, approx),
        lambda x, b: F.gelu(x + b if b is not None else x, approximate=approx),
        lambda x, b: bias_gelu_reference(x, b, approx),
    )


@pytest.mark.parametrize("budget", BUDGET_PARAMS)
def test_fuzz_bias_gelu(budget, strict_fast_paths):
    fuzz_per_dtype(_gelu_prop, budget)
    assert strict_fast_paths & {("bias_gelu", "cpu"), ("bias_gelu", "c++")}, strict_fast_paths


# --- bias_dropout_add: the fused op draws its seed, eager and the reference use that seed -----------------------


def _bda_prop(data, dtype):
    shape = _shape(data)
    p = data.draw(st.sampled_from([0.0, 0.1, 0.5, 0.9]), label="p")
    x = tensor(data, shape, dtype, label="x")
    b = tensor(data, [shape[-1]], dtype, layouts=VECTOR, label="b") if optional(data, "bias") else None
    r = tensor(data, shape, dtype, label="residual") if optional(data, "residual") else None
    seed = []

    def fused(x, b, r):
        out, s = torch.ops.graphtrain.bias_dropout_add(x, b, r, p)
        seed.append(s)
        return out

    check_op(
        data,
        f"bias_dropout_add (p={p})",
        dtype,
        [x, b, r],
        fused,
        lambda x, b, r: bias_dropout_add_reference(x, b, r, p, seed[0]),
        lambda x, b, r: bias_dropout_add_reference(x, b, r, p, seed[0]),
    )


@pytest.mark.parametrize("budget", BUDGET_PARAMS)
def test_fuzz_bias_dropout_add(budget, strict_fast_paths):
    fuzz_per_dtype(_bda_prop, budget)
    if _cpu_ext.load() is not None:
        assert ("bias_dropout_add", "c++") in strict_fast_paths and ("dropout_backward", "c++") in strict_fast_paths


def test_bias_dropout_add_masks_keep_one_minus_p():
    """The seeded comparison above checks the fused op against the reference's mask; this checks the mask itself:
    over many elements the kept fraction is 1 - p (within 4 standard deviations) and kept values are scaled by
    1/(1-p), on a row longer than the C++ kernel's chunk."""
    for p in (0.1, 0.5, 0.9):
        x = torch.ones(257, 1031)
        out = bias_dropout_add(x, None, None, p)
        kept = out != 0
        frac, n = kept.float().mean().item(), x.numel()
        assert abs(frac - (1 - p)) < 4 * ((p * (1 - p) / n) ** 0.5), (p, frac)
        assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / (1 - p)))


# --- cross_entropy ---------------------------------------------------------------------------------------------


def _targets(data, n: int, v: int, ignore_index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="target seed"))
    t = torch.randint(0, v, (n,), generator=gen)
    ignored = data.draw(st.sampled_from(["none", "some", "all"]), label="ignored rows")
    if ignored == "all":
        t[:] = ignore_index
    elif ignored == "some":
        t[torch.rand(n, generator=gen) < 0.4] = ignore_index
    return t


def _lead(data, hi: int) -> tuple[list[int], int]:
    lead = [data.draw(sizes(1, hi), label=f"lead{i}") for i in range(data.draw(st.integers(1, 2), label="lead dims"))]
    n = 1
    for d in lead:
        n *= d
    return lead, n


def _ce_prop(data, dtype):
    lead, n = _lead(data, 13)
    v = data.draw(sizes(1, 130), label="vocab")
    reduction = data.draw(st.sampled_from(sorted(REDUCTIONS)), label="reduction")
    ignore_index = data.draw(st.sampled_from([-100, 0]), label="ignore_index")
    logits = tensor(data, lead + [v], dtype, scale=data.draw(st.sampled_from([1.0, 8.0])), label="logits")
    t = _targets(data, n, v, ignore_index).reshape(lead)

    def ref(x):
        loss = cross_entropy_reference(x.reshape(-1, v), t.reshape(-1), ignore_index, REDUCTIONS[reduction])[0]
        return loss.reshape(lead) if reduction == "none" else loss

    check_op(
        data,
        f"cross_entropy ({reduction})",
        dtype,
        [logits],
        lambda x: cross_entropy(x, t, ignore_index, reduction),
        lambda x: F.cross_entropy(
            x.reshape(-1, v), t.reshape(-1), ignore_index=ignore_index, reduction=reduction
        ).reshape(lead if reduction == "none" else ()),
        ref,
    )


@pytest.mark.parametrize("budget", BUDGET_PARAMS)
def test_fuzz_cross_entropy(budget, strict_fast_paths):
    fuzz_per_dtype(_ce_prop, budget)
    assert ("cross_entropy", "cpu") in strict_fast_paths and ("cross_entropy_backward", "cpu") in strict_fast_paths


# --- linear_cross_entropy: hidden [.., H] @ weight [V, H]^T (+ bias), chunked ----------------------------------


def _lce_prop(data, dtype):
    lead, n = _lead(data, 11)
    h, v = data.draw(sizes(1, 37), label="hidden"), data.draw(sizes(1, 67), label="vocab")
    reduction = data.draw(st.sampled_from(["mean", "sum"]), label="reduction")
    chunk = data.draw(st.sampled_from([0, 1, 2, 3, 7]), label="chunk_rows")
    hid = tensor(data, lead + [h], dtype, label="hidden")
    w = tensor(data, [v, h], dtype, scale=0.5, label="weight")
    bias = tensor(data, [v], dtype, layouts=VECTOR, label="bias") if optional(data, "bias") else None
    t = _targets(data, n, v, -100).reshape(lead)
    red = {"mean": 1, "sum": 2}[reduction]

    def eager(x, w, b):  # as under autocast: the matmul in the input dtype, the cross-entropy in fp32
        logits = x.reshape(-1, h) @ w.t() + (b if b is not None else 0)
        return F.cross_entropy(logits.float(), t.reshape(-1), reduction=reduction)

    # bf16/fp16 inputs give an fp32 loss from logits rounded to the input dtype: the input dtype's tolerance applies
    check_op(
        data,
        f"linear_cross_entropy ({reduction}, chunk {chunk})",
        dtype,
        [hid, w, bias],
        lambda x, w, b: linear_cross_entropy(x, w, t, -100, reduction, chunk_rows=chunk, bias=b).to(dtype),
        lambda x, w, b: eager(x, w, b).to(dtype),
        lambda x, w, b: linear_cross_entropy_reference(x.reshape(-1, h), w, t.reshape(-1), -100, red, b),
    )


@pytest.mark.parametrize("budget", BUDGET_PARAMS)
def test_fuzz_linear_cross_entropy(budget, strict_fast_paths):
    fuzz_per_dtype(_lce_prop, budget)
    if _cpu_ext.load() is not None:
        assert ("linear_cross_entropy", "c++") in strict_fast_paths, strict_fast_paths


# --- gemm: a [m, k] @ b [k, n] (+ bias broadcastable to [m, n]) ------------------------------------------------


def _gemm_prop(data, dtype):
    m, k, n = (data.draw(sizes(1, 67), label=d) for d in "mkn")
    a = tensor(data, [m, k], dtype, label="a")
    b = tensor(data, [k, n], dtype, label="b")
    bias_shape = data.draw(st.sampled_from([None, (n,), (1, n), (m, 1), (m, n), ()]), label="bias shape")
    bias = tensor(data, bias_shape, dtype, label="bias") if bias_shape is not None else None
    check_op(
        data, "gemm", dtype, [a, b, bias], gemm, lambda a, b, c: a @ b + (c if c is not None else 0), gemm_reference
    )


@pytest.mark.parametrize("budget", BUDGET_PARAMS)
def test_fuzz_gemm(budget, strict_fast_paths):
    fuzz_per_dtype(_gemm_prop, budget)
    if onednn_available():
        assert ("gemm", "onednn") in strict_fast_paths, strict_fast_paths


# --- empty tensors: an empty result, never a crash ----------------------------------------------------------------

_EMPTY_CHILD = """
import torch
from graphtrain.kernels import bias_dropout_add, bias_gelu, layer_norm, rms_norm
calls = {"bias_gelu tanh": lambda x: bias_gelu(x, None, "tanh"), "bias_gelu none": lambda x: bias_gelu(x, None, "none"),
         "bias_dropout_add": lambda x: bias_dropout_add(x, None, None, 0.1), "layer_norm": layer_norm,
         "rms_norm": rms_norm}
for name, fn in calls.items():
    for shape in ((3, 0), (0, 5), (2, 0, 3)):
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(shape, dtype=dt, requires_grad=True)
            y = fn(x)
            y.sum().backward()
            assert y.shape == x.shape and x.grad.shape == x.shape, (name, shape, dt, y.shape, x.grad.shape)
    print("ok", name, flush=True)
"""


def test_empty_tensors_give_empty_results_not_a_crash():
    """Zero-sized dims, the last one included: the C++ row kernels divided by the row length (16384 / n) and died of
    SIGFPE, the norms' references could not reshape an empty last dim. In a child process, so a crash fails this test
    instead of ending the session; every op must print its ok."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _EMPTY_CHILD], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.count("ok ") == 5, f"rc {r.returncode}: {r.stdout}{r.stderr[-2000:]}"
