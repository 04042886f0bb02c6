"""Fused ops: reference vs the eager unfused sequence, CPU fast path vs reference, gradcheck in fp64,
odd shapes, dtypes, torch.compile."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
import torch.nn.functional as F

from graphtrain.kernels import (
    KERNELS,
    attention,
    bias_dropout_add,
    bias_gelu,
    cross_entropy,
    implementation_for,
    layer_norm,
    linear_cross_entropy,
    rms_norm,
)
from graphtrain.kernels._common import dropout_keep_mask
from graphtrain.testing import assert_close

SHAPES = [(1, 1), (3, 7), (2, 5, 33)]


def grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    y = fn(*xs)
    g = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)
    (y * g).sum().backward()
    return y.detach(), [x.grad for x in xs if x.requires_grad]


def check_vs_eager(fused, eager, *xs, **tol):
    yf, gf = grads(fused, *xs)
    ye, ge = grads(eager, *xs)
    assert_close(yf, ye, name="out", **tol)
    for i, (a, b) in enumerate(zip(gf, ge)):
        assert_close(a, b, name=f"grad {i}", **tol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_and_rms_norm_vs_eager(shape, dtype):
    n = shape[-1]
    x, w, b = torch.randn(shape, dtype=dtype), torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
    check_vs_eager(
        lambda x, w, b: layer_norm(x, w, b, 1e-5), lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5), x, w, b
    )
    check_vs_eager(lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (n,), w, 1e-6), x, w)


@pytest.mark.parametrize("approx", ["none", "tanh"])
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_vs_eager(approx, shape):
    x, b = torch.randn(shape), torch.randn(shape[-1])
    check_vs_eager(lambda x, b: bias_gelu(x, b, approx), lambda x, b: F.gelu(x + b, approximate=approx), x, b)
    check_vs_eager(lambda x: bias_gelu(x, None, approx), lambda x: F.gelu(x, approximate=approx), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpp_tanh_gelu_matches_the_reference_at_the_edges(dtype):
    """The C++ tanh-form kernel (exp-based tanh, Taylor series below |u| < 1/8): forward and backward against the
    fp64 reference over a wide range, with a bias and without, on a row longer than its 1024-element chunk; inf and
    nan as aten.gelu gives them."""
    from graphtrain.kernels import _cpu_ext
    from graphtrain.kernels.bias_gelu import bias_gelu_backward_reference, bias_gelu_reference

    mod = _cpu_ext.load()
    if mod is None:
        pytest.skip(f"no C++ compiler: {_cpu_ext.build_error()}")
    x = (torch.linspace(-12, 12, 3 * 1031) ** 3 / 100).reshape(3, 1031)
    x[0, :200] = torch.linspace(-0.3, 0.3, 200)  # around the series/exp switch (|u| = 1/8 near |x| = 0.156)
    x, b, dy = x.to(dtype), torch.randn(1031).to(dtype), torch.randn(3, 1031).to(dtype)
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    from graphtrain.kernels.bias_gelu import cpp_tanh_ok, gelu_tanh_probe

    wins = gelu_tanh_probe()["cpp_wins"]  # the op takes the C++ kernel where it measured faster than aten's
    assert cpp_tanh_ok(x, b, "tanh") == wins == cpp_tanh_ok(x, None, "tanh") and not cpp_tanh_ok(x, b, "none")
    for bias in (b, None):
        nb = x.new_empty(0) if bias is None else bias
        ref = bias_gelu_reference(x.double(), None if bias is None else bias.double(), "tanh")
        dref = bias_gelu_backward_reference(dy.double(), x.double(), None if bias is None else bias.double(), "tanh")
        for fwd, bwd in (
            (mod.gelu_tanh_fwd(x, nb), mod.gelu_tanh_bwd(dy, x, nb)),
            (bias_gelu(x, bias, "tanh"), torch.ops.graphtrain.bias_gelu_backward(dy, x, bias, "tanh")),
        ):
            assert_close(fwd, ref.to(dtype), name="forward", **tol)
            assert_close(bwd, dref.to(dtype), name="backward", **tol)
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e30, -1e30, 1e-30, -0.0], dtype=dtype)
    none = special.new_empty(0)
    for got, want in (
        (mod.gelu_tanh_fwd(special, none), torch.ops.aten.gelu(special, approximate="tanh")),
        (
            mod.gelu_tanh_bwd(torch.ones_like(special), special, none),
            torch.ops.aten.gelu_backward(torch.ones_like(special), special, approximate="tanh"),
        ),
    ):
        assert torch.equal(got.isnan(), want.isnan()), (got, want)
        assert_close(got[~want.isnan()], want[~want.isnan()], name="special values")


def test_gradcheck_fp64_references():
    d = dict(dtype=torch.float64, requires_grad=True)
    x, w, b = torch.randn(3, 5, **d), torch.randn(5, **d), torch.randn(5, **d)
    assert torch.autograd.gradcheck(lambda x, w, b: layer_norm(x, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w), (x, w))
    for a in ("none", "tanh"):
        assert torch.autograd.gradcheck(lambda x, b, a=a: bias_gelu(x, b, a), (x, b))
    r = torch.randn(3, 5, **d)

    def bda(x, b, r):
        torch.manual_seed(1)  # same seed each call: gradcheck's perturbations see one mask
        return bias_dropout_add(x, b, r, 0.4)

    assert torch.autograd.gradcheck(bda, (x, b, r))
    q, k, v = (torch.randn(1, 2, 4, 3, **d) for _ in range(3))

    def att(q, k, v):
        torch.manual_seed(1)
        return attention(q, k, v, torch.randn(4, 4, dtype=torch.float64), 0.5, False, 0.3)

    assert torch.autograd.gradcheck(att, (q, k, v))
    t = torch.tensor([1, -100, 4])
    assert torch.autograd.gradcheck(lambda x: cross_entropy(x, t), (x,))
    wv = torch.randn(6, 5, **d)
    assert torch.autograd.gradcheck(
        lambda x, w: linear_cross_entropy(x, w, torch.tensor([1, 5, 0]), chunk_rows=2), (x, wv)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_dropout_add_cpu_path_matches_reference_mask(dtype):
    x, b, r = torch.randn(37, 19, dtype=dtype), torch.randn(19, dtype=dtype), torch.randn(37, 19, dtype=dtype)
    assert implementation_for("bias_dropout_add", "cpu", x, b, r) != "reference"
    out, seed = torch.ops.graphtrain.bias_dropout_add(x, b, r, 0.25)
    keep = dropout_keep_mask(x.numel(), 0.25, seed).reshape(x.shape)
    expect = torch.where(keep, (x.float() + b.float()) / 0.75, 0.0) + r.float()
    assert_close(out, expect.to(dtype), name="bda")
    frac = dropout_keep_mask(1 << 16, 0.25, 7).float().mean().item()
    assert abs(frac - 0.75) < 0.01
    xg = x.float().requires_grad_()
    bias_dropout_add(xg, None, None, 0.0).sum().backward()  # p = 0: identity
    assert torch.equal(xg.grad, torch.ones_like(xg))
    with pytest.raises(ValueError, match="dropout probability"):
        bias_dropout_add(x, b, r, 1.0)
    with pytest.raises(ValueError, match="bias must have shape"):
        bias_dropout_add(x, torch.randn(3, dtype=dtype), r, 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 2500), (5, 7, 1031), (40000,)])
def test_bias_dropout_add_cpu_chunks_match_reference_forward_and_backward(dtype, shape):
    # Rows longer than the C++ kernel's 1024-element chunk and flat sizes over its 16384 grain:
    # the mask must not depend on how the kernel splits the work.
    from graphtrain.kernels.bias_dropout_add import dropout_backward_reference

    x, r = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    b = torch.randn(shape[-1], dtype=dtype)
    out, seed = torch.ops.graphtrain.bias_dropout_add(x, b, r, 0.1)
    keep = dropout_keep_mask(x.numel(), 0.1, seed).reshape(shape)
    assert_close(out, (torch.where(keep, (x.float() + b.float()) / 0.9, 0.0) + r.float()).to(dtype), name="fwd")
    g = torch.randn(shape, dtype=dtype)
    got = torch.ops.graphtrain.dropout_backward(g, 0.1, seed)
    assert torch.equal(got, dropout_backward_reference(g, 0.1, seed))
    assert torch.equal((got != 0) | (g == 0), keep | (g == 0))  # dropped exactly where the mask says


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1, 4), (2, 3, 9, 5)])
def test_attention_vs_eager_and_reference(p, causal, shape):
    q, k, v = (torch.randn(shape) for _ in range(3))
    mask = torch.randn(shape[2], shape[2])
    assert implementation_for("attention", "cpu", q, k, v, mask, 0.3, causal, p) != "reference"
    if p == 0:
        cm = (
            torch.zeros(shape[2], shape[2]).masked_fill(
                torch.ones(shape[2], shape[2], dtype=torch.bool).triu(1), float("-inf")
            )
            if causal
            else 0.0
        )
        check_vs_eager(
            lambda q, k, v: attention(q, k, v, mask, 0.3, causal, 0.0),
            lambda q, k, v: F.softmax(q @ k.transpose(-1, -2) * 0.3 + mask + cm, -1) @ v,
            q,
            k,
            v,
        )
    from graphtrain.kernels.attention import attention_backward_reference, attention_reference

    out, lse, seed = torch.ops.graphtrain.attention(q, k, v, mask, 0.3, causal, p)
    ro, rl = attention_reference(q, k, v, mask, 0.3, causal, p, seed)
    assert_close(out, ro, name="out vs reference")
    do = torch.randn_like(out)
    got = torch.ops.graphtrain.attention_backward(do, q, k, v, mask, out, lse, seed, 0.3, causal, p)
    ref = attention_backward_reference(do, q, k, v, mask, ro, rl, 0.3, causal, p, seed)
    for a, e in zip(got, ref):
        assert_close(a, e, name="grad vs reference")


@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(150, 150), (70, 150), (150, 70), (1, 1)])
def test_attention_head_by_head_cpu_path_vs_reference(p, causal, sq, sk):
    # fp32 without a mask (with dropout, or causal) takes the head-by-head C++ kernel: query blocks of HEADS_QB rows
    # (150 = two whole blocks
    # and a partial one), causal blocks above the diagonal skipped, q/k/v read through [B, S, H, D] strides.
    from graphtrain.kernels._common import force_reference
    from graphtrain.kernels.attention import attention_backward_reference, attention_reference

    B, H, D = 2, 3, 16
    q, k, v = (torch.randn(B, s, H, D).transpose(1, 2) for s in (sq, sk, sk))
    with force_reference(ops=()) as chosen:
        out, lse, seed = torch.ops.graphtrain.attention(q, k, v, None, 0.3, causal, p)
        do = torch.randn(B, sq, H, D).transpose(1, 2)
        got = torch.ops.graphtrain.attention_backward(do, q, k, v, None, out, lse, seed, 0.3, causal, p)
    # without dropout only causal attention: elsewhere aten's flash kernel is as fast (nothing to skip)
    path = "c++ heads" if p > 0 or causal else "cpu flash"
    assert chosen == {("attention", path), ("attention_backward", path)}, chosen
    ro, rl = attention_reference(q, k, v, None, 0.3, causal, p, seed)
    assert_close(out, ro, name="out")
    assert_close(lse, rl, name="lse")
    ref = attention_backward_reference(do, q, k, v, None, ro, rl, 0.3, causal, p, seed)
    # outputs in the inputs' [B, S, H, D] layout: the model's merge of the heads and the gradients' way back are views
    assert out.transpose(1, 2).is_contiguous() or sq == 1
    for name, a, e, x in zip("qkv", got, ref, (q, k, v)):
        assert a.shape == e.shape and (a.stride() == x.stride() or x.shape[2] == 1)
        assert_close(a, e, name=f"d{name}")
    if p > 0:  # the same entries dropped as the batched-matmul path (same hash, same element numbering)
        from graphtrain.kernels.attention import _cpu_fwd

        assert_close(_cpu_fwd(q, k, v, None, 0.3, causal, p, seed)[0], out, name="out vs the batched path")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "padding", "full", "strided", "fully_masked_row"])
@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 1100)])
def test_attention_cpu_dropout_path_vs_reference(dtype, mask_kind, sq, sk):
    # The p > 0 CPU path (aten bmm + C++ softmax/dropout pass) against the fp32-accumulating reference,
    # same seed so the same dropout mask: masks broadcast over batch/heads (stride 0), a non-unit
    # innermost mask stride, rows longer than the kernel's 1024 chunk, and a row with no visible key.
    from graphtrain.kernels.attention import attention_backward_reference, attention_reference

    B, H, D = 2, 3, 8
    q, k, v = (
        torch.randn(B, H, sq, D, dtype=dtype),
        torch.randn(B, H, sk, D, dtype=dtype),
        torch.randn(B, H, sk, D, dtype=dtype),
    )
    mask = {
        "none": None,
        "padding": torch.zeros(B, 1, 1, sk).masked_fill(torch.rand(B, 1, 1, sk) < 0.3, float("-inf")),
        "full": torch.randn(sq, sk),
        "strided": torch.randn(sk, sq).t(),
        "fully_masked_row": torch.zeros(sq, sk).index_fill(0, torch.tensor([1]), float("-inf")),
    }[mask_kind]
    mask = None if mask is None else mask.to(dtype)
    assert implementation_for("attention", "cpu", q, k, v, mask, 0.3, False, 0.2) != "reference"
    out, lse, seed = torch.ops.graphtrain.attention(q, k, v, mask, 0.3, False, 0.2)
    ro, rl = attention_reference(q, k, v, mask, 0.3, False, 0.2, seed)
    tol = {} if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    assert_close(out, ro, name="out", **tol)
    assert_close(lse, rl, name="lse", **tol)
    if mask_kind == "fully_masked_row":
        assert torch.all(out[:, :, 1] == 0) and torch.all(torch.isinf(lse[:, :, 1]))
    do = torch.randn_like(out)
    got = torch.ops.graphtrain.attention_backward(do, q, k, v, mask, out, lse, seed, 0.3, False, 0.2)
    ref = attention_backward_reference(do, q, k, v, mask, ro, rl, 0.3, False, 0.2, seed)
    for name, a, e in zip("qkv", got, ref):
        assert torch.isfinite(a).all(), name
        assert_close(a, e, name=f"d{name}", **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sk,path", [(33, "c++"), (512, "c++"), (513, "cpu flash")])
def test_half_attention_without_dropout_takes_the_batched_path_over_few_keys(dtype, causal, sk, path):
    # bf16/fp16 without dropout: batched matmuls around the C++ softmax pass up to PROBS_MAX_KEYS_WITHOUT_DROPOUT
    # keys (faster than aten's flash kernel there), flash beyond; fp16 has no flash kernel on CPU, so the reference
    # runs past the bound. Grouped-query heads in Hugging Face's [B, S, H, D] layout, checked forward and backward.
    from graphtrain.kernels._common import force_reference
    from graphtrain.kernels.attention import attention_backward_reference, attention_reference

    B, H, Hkv, D = 1, 4, 2, 16
    q = torch.randn(B, sk, H, D, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(B, sk, Hkv, D, dtype=dtype).transpose(1, 2) for _ in range(2))
    with force_reference(ops=()) as chosen:
        out, lse, seed = torch.ops.graphtrain.attention(q, k, v, None, 0.25, causal, 0.0)
        do = torch.randn_like(out)
        got = torch.ops.graphtrain.attention_backward(do, q, k, v, None, out, lse, seed, 0.25, causal, 0.0)
    want = path if dtype == torch.bfloat16 or path == "c++" else None
    assert chosen == ({("attention", want), ("attention_backward", want)} if want else set()), chosen
    ro, rl = attention_reference(q, k, v, None, 0.25, causal, 0.0, seed)
    tol = dict(atol=3e-2, rtol=3e-2)
    assert_close(out, ro, name="out", **tol)
    assert_close(lse, rl, name="lse", **tol)
    ref = attention_backward_reference(do, q, k, v, None, ro, rl, 0.25, causal, 0.0, seed)
    for name, a, e in zip("qkv", got, ref):
        assert_close(a, e, name=f"d{name}", **tol)


def test_attention_bool_mask_and_errors():
    q = torch.randn(1, 2, 5, 4)
    keep = torch.rand(5, 5) > 0.3
    keep[:, 0] = True
    assert_close(attention(q, q, q, keep), F.scaled_dot_product_attention(q, q, q, attn_mask=keep), name="bool mask")
    with pytest.raises(ValueError, match="batch, heads"):
        attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="requires grad"):
        attention(q, q, q, torch.zeros(5, 5, requires_grad=True))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_vs_eager(reduction):
    x, t = torch.randn(11, 29), torch.randint(0, 29, (11,))
    t[4] = -100
    check_vs_eager(
        lambda x: cross_entropy(x, t, reduction=reduction), lambda x: F.cross_entropy(x, t, reduction=reduction), x
    )


@pytest.mark.parametrize("chunk", [0, 1, 4])
def test_linear_cross_entropy_vs_eager(chunk):
    h, w, t = torch.randn(2, 5, 12), torch.randn(31, 12), torch.randint(0, 31, (2, 5))
    t[1, 3] = -100
    check_vs_eager(
        lambda h, w: linear_cross_entropy(h, w, t, chunk_rows=chunk),
        lambda h, w: F.cross_entropy((h @ w.t()).view(-1, 31), t.view(-1)),
        h,
        w,
    )


@pytest.mark.parametrize("plan", ["whole", "blocks", "threads", "transpose"])
def test_bf16_linear_cross_entropy_head_gemms_by_each_plan_match_eager(plan, monkeypatch):
    """bf16 on CPU, d hidden (d logits @ weight, the vocabulary its inner dimension) and d weight (d logits read
    transposed) run by the plan the per-machine probe decided for their shapes (gemm.low_plan): each plan, forced,
    against eager's fp32 math. A plan that cannot run here (threads or transpose without the C++ kernels) is
    measured as unavailable by the probe and never chosen; forced, it runs the whole product through aten (threads on
    an AVX2-only CPU, where oneDNN's bf16 matmul refuses to run, raised here before mm_plan checked its contract)."""

    gemm_mod = importlib.import_module("graphtrain.kernels.gemm")
    g = torch.Generator().manual_seed(0)
    h = torch.randn(gemm_mod.ROW_BLOCK * 2 + 37, 64, generator=g).bfloat16()
    w = (torch.randn(1000, 64, generator=g) * 0.1).bfloat16()
    t = torch.randint(0, 1000, (h.shape[0],), generator=g)
    monkeypatch.setattr(gemm_mod, "low_plan", lambda a, b: plan if plan != "transpose" or a.stride(0) == 1 else "whole")
    check_vs_eager(
        lambda h, w: linear_cross_entropy(h, w, t, chunk_rows=h.shape[0]),
        lambda h, w: F.cross_entropy(h.float() @ w.float().t(), t),
        h,
        w,
        atol=3e-2,
        rtol=3e-2,
    )


@pytest.mark.parametrize("gemm", ["default", "aten"])
def test_linear_cross_entropy_chunks_overwrite_stale_memory(gemm, monkeypatch):
    """Over several chunks d weight accumulates in a buffer that is not zeroed first (the first chunk's product
    overwrites it). Blocks of its size filled with NaN are freed just before each call, where the allocator hands
    them out again: nothing stale may reach the gradient. `aten`: the GEMMs that oneDNN would take go to aten's
    mm / addmm_ with `out` (what machines where oneDNN does not win run)."""
    if gemm == "aten":
        monkeypatch.setattr(importlib.import_module("graphtrain.kernels.gemm"), "onednn_gemm_wins", lambda: False)
    h, w, t = torch.randn(24, 32), torch.randn(96, 32), torch.randint(0, 96, (24,))
    want = torch.autograd.grad(F.cross_entropy(h.requires_grad_() @ w.requires_grad_().t(), t), (h, w))
    for _ in range(4):
        poison = [torch.full(w.shape, float("nan")) for _ in range(8)]
        del poison
        got = torch.autograd.grad(linear_cross_entropy(h, w, t, chunk_rows=5), (h, w))
        for g, e in zip(got, want):
            assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("returns_logits", [False, True])
def test_a_power_of_two_vocabulary_head_runs_on_padded_rows_as_eager(returns_logits, monkeypatch):
    """An fp32 CPU head of vocabulary 128 (512-byte rows: an even number of cache lines), GEMMs on aten (machines
    where oneDNN does not win): its logits buffer's rows lie one cache line further apart than their width
    (logits_row_stride), the C++ pass and aten's GEMMs read and write them in place, and the loss and gradients are
    eager's, over three chunks of a buffer of stale memory. Both ops: the loss alone and the one that also returns
    its logits (the C++ pass reads each chunk's rows from them)."""
    lce = importlib.import_module("graphtrain.kernels.linear_cross_entropy")
    ext = lce._cpu_ext.load()
    if ext is None:
        pytest.skip(f"no C++ compiler: {lce._cpu_ext.build_error()}")
    for mod in (lce, importlib.import_module("graphtrain.kernels.gemm")):
        monkeypatch.setattr(mod, "onednn_gemm_wins", lambda: False)
    strides = []

    class Seen:  # the extension, recording the layout of each buffer the C++ pass is given
        def __getattr__(self, name):
            return getattr(ext, name)

        def ce_fwd_bwd_inplace(self, x, *args):
            strides.append(x.stride())
            return ext.ce_fwd_bwd_inplace(x, *args)

        def ce_fwd_bwd_rows(self, x, *args):
            strides.append(x.stride())
            return ext.ce_fwd_bwd_rows(x, *args)

    monkeypatch.setattr(lce._cpu_ext, "load", lambda: Seen())
    assert lce.logits_row_stride(128, torch.float32) == 144 and lce.logits_row_stride(97, torch.float32) == 97
    assert lce.logits_row_stride(128, torch.bfloat16) == 128
    g = torch.Generator().manual_seed(3)
    h, w, t = (
        torch.randn(21, 24, generator=g),
        torch.randn(128, 24, generator=g),
        torch.randint(0, 128, (21,), generator=g),
    )
    t[5] = -100

    def fused(h, w):
        if returns_logits:
            return torch.ops.graphtrain.linear_cross_entropy_logits(h, w, t, -100, 1, 8, True)[0]
        return linear_cross_entropy(h, w, t, chunk_rows=8)

    poison = [torch.full((8, 144), float("nan")) for _ in range(8)]
    del poison
    check_vs_eager(fused, lambda h, w: F.cross_entropy(h @ w.t(), t), h, w)
    assert strides and all(s == (144, 1) for s in strides), strides


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_cross_entropy_skips_ignored_rows(reduction, with_bias):
    """Masked-LM labels (most rows ignored): only labelled rows are computed; loss, d hidden (zero on ignored
    rows), d weight and d bias still match eager, in fp32 (oneDNN GEMMs where they win) and chunked."""
    g = torch.Generator().manual_seed(5)
    h, w, b = torch.randn(3, 40, 24, generator=g), torch.randn(97, 24, generator=g), torch.randn(97, generator=g)
    t = torch.randint(0, 97, (3, 40), generator=g)
    t[torch.rand(3, 40, generator=g) > 0.15] = -100
    t[0, 0] = 7  # at least one labelled row
    for chunk in (0, 3):
        check_vs_eager(
            lambda h, w, b, chunk=chunk: (
                linear_cross_entropy(h, w, t, reduction=reduction, chunk_rows=chunk, bias=b if with_bias else None)
                + 0 * b.sum()
            ),
            lambda h, w, b: (
                F.cross_entropy((h @ w.t() + (b if with_bias else 0)).view(-1, 97), t.view(-1), reduction=reduction)
                + 0 * b.sum()
            ),
            h,
            w,
            b,
        )


def test_a_sparse_head_skips_rows_only_where_an_eighth_or_more_are_ignored():
    """skips_rows: a masked-LM batch (85% ignored) runs sparse; a causal LM's, one position a sequence ignored (16 of
    2048), runs dense, and so does a batch with no label or no ignored row. Both ways match eager."""
    from graphtrain.kernels.linear_cross_entropy import SPARSE_MIN_SKIPPED, skips_rows

    assert skips_rows(328, 2048) and skips_rows(int(2048 * (1 - SPARSE_MIN_SKIPPED)), 2048)
    assert not skips_rows(2032, 2048) and not skips_rows(2048, 2048) and not skips_rows(0, 2048)
    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(4, 16, 24, generator=g), torch.randn(97, 24, generator=g)
    t = torch.randint(0, 97, (4, 16), generator=g)
    t[:, -1] = -100  # a causal LM's shifted labels: the last position of each sequence has none
    check_vs_eager(
        lambda h, w: linear_cross_entropy(h, w, t, chunk_rows=5),
        lambda h, w: F.cross_entropy((h @ w.t()).view(-1, 97), t.view(-1)),
        h,
        w,
    )


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("skip_ignored", [False, True])
@pytest.mark.parametrize("chunk", [0, 3])
def test_linear_cross_entropy_that_returns_its_logits(with_bias, skip_ignored, chunk):
    """The *_logits ops (a head whose logits are also returned): the logits as hidden @ weight^T (+ bias), every row,
    the loss and its gradients (computed in the forward, scaled in the backward) as eager's, chunked or not, with
    the gradient GEMMs on the labelled rows only or on all; odd sizes, most rows ignored."""
    g = torch.Generator().manual_seed(11)
    h, w, b = torch.randn(37, 13, generator=g), torch.randn(29, 13, generator=g), torch.randn(29, generator=g)
    t = torch.randint(0, 29, (37,), generator=g)
    t[torch.rand(37, generator=g) > 0.3] = -100
    t[0] = 4
    ops = torch.ops.graphtrain

    def fused(h, w, b):
        if with_bias:
            loss, *_, logits = ops.linear_bias_cross_entropy_logits(h, w, b, t, -100, 2, chunk, skip_ignored)
        else:
            loss, *_, logits = ops.linear_cross_entropy_logits(h, w, t, -100, 2, chunk, skip_ignored)
        assert not logits.requires_grad  # returned detached: its own gradient is the caller's (_HeadGrad)
        assert_close(logits, h.detach() @ w.detach().t() + (b.detach() if with_bias else 0), name="logits")
        return loss + 0 * b.sum()

    check_vs_eager(
        fused,
        lambda h, w, b: F.cross_entropy(h @ w.t() + (b if with_bias else 0), t, reduction="sum") + 0 * b.sum(),
        h,
        w,
        b,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_cross_entropy_that_returns_its_logits_low_precision(dtype):
    """The *_logits op in bf16/fp16, chunked (the C++ pass reads each chunk's rows from the returned logits): loss and
    gradients as eager's on the same rounded inputs in fp32; the returned logits untouched."""
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(37, 16, generator=g).to(dtype), torch.randn(53, 16, generator=g).to(dtype)
    t = torch.randint(0, 53, (37,), generator=g)
    t[3] = -100

    def fused(h, w):
        loss, *_, logits = torch.ops.graphtrain.linear_cross_entropy_logits(h, w, t, -100, 1, 8, True)
        assert_close(logits.float(), (h.detach() @ w.detach().t()).float(), name="logits", atol=5e-2, rtol=5e-2)
        return loss.float()

    check_vs_eager(fused, lambda h, w: F.cross_entropy(h.float() @ w.float().t(), t), h, w, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("op", ["linear_cross_entropy", "linear_cross_entropy_logits"])
def test_a_low_precision_cpu_head_runs_as_one_chunk_where_that_is_the_smaller_buffer(op, monkeypatch):
    """train_chunk_rows: a bf16 head on CPU whose n x v chunk is no larger than the fp32 d weight accumulator of
    several chunks (2n <= 4k) runs as one chunk (d weight is one GEMM, bitwise the op given chunk_rows=n); a wider
    batch, and an fp32 head, keep their ~32 MiB chunks (bitwise the op given that chunk). The byte budget is made
    small here so that the small shapes have several default chunks."""
    lce = importlib.import_module("graphtrain.kernels.linear_cross_entropy")
    monkeypatch.setattr(lce, "default_chunk_rows", lambda n, v, itemsize=4, budget=0: min(n, 8))
    assert lce.train_chunk_rows(32, 50, 16, 2, cpu=True) == 32  # 64 <= 64: one chunk
    assert lce.train_chunk_rows(33, 50, 16, 2, cpu=True) == 8  # 66 > 64: chunked
    assert lce.train_chunk_rows(32, 50, 16, 4, cpu=True) == 8  # fp32 accumulates in place: chunked
    assert lce.train_chunk_rows(32, 50, 16, 2, cpu=False) == 8  # CUDA: unchanged
    g = torch.Generator().manual_seed(3)
    fn = getattr(torch.ops.graphtrain, op)
    for n, dtype, expect in ((32, torch.bfloat16, 32), (40, torch.bfloat16, 8), (32, torch.float32, 8)):
        h, w = torch.randn(n, 16, generator=g).to(dtype), torch.randn(50, 16, generator=g).to(dtype)
        t = torch.randint(0, 50, (n,), generator=g)
        default, given = fn(h, w, t, -100, 1, 0, True), fn(h, w, t, -100, 1, expect, True)
        for name, a, b in zip(("loss", "d hidden", "d weight"), default[:3], given[:3]):
            assert torch.equal(a, b), f"{op} n={n} {dtype}: {name} differs from chunk_rows={expect}"
    # one chunk against several differ in d weight's rounding, so the comparison above tells them apart
    h, w = torch.randn(32, 16, generator=g).bfloat16(), torch.randn(50, 16, generator=g).bfloat16()
    t = torch.randint(0, 50, (32,), generator=g)
    assert not torch.equal(fn(h, w, t, -100, 1, 32, True)[2], fn(h, w, t, -100, 1, 8, True)[2])
    # the memory plan's workspace: one chunk's logits, and for several bf16 chunks d weight's fp32 accumulator with
    # a chunk's product and its fp32 copy (4 + 2 + 4 bytes per weight element)
    spec = next(d for d in lce.SPEC.ops if d.name == op)
    for n, dtype, rows, extra in (
        (32, torch.bfloat16, 32, 0),
        (40, torch.bfloat16, 8, 10 * 50 * 16),
        (32, torch.float32, 8, 0),
    ):
        graph = torch.fx.Graph()
        args = [graph.placeholder(x) for x in ("h", "w", "t")]
        for a, v in zip(args, (torch.empty(n, 16, dtype=dtype), torch.empty(50, 16, dtype=dtype), torch.empty(n))):
            a.meta["val"] = v
        node = graph.call_function(fn, (*args, -100, 1, 0, True))
        assert spec.workspace_bytes(node) == rows * 50 * torch.empty((), dtype=dtype).element_size() + extra


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_cross_entropy_low_precision_and_bad_targets(dtype):
    """bf16/fp16 hidden and weight (fp32 softmax math inside) against eager on the same rounded inputs in fp32,
    and a target outside the vocabulary is a clear error, not a wrong loss."""
    g = torch.Generator().manual_seed(9)
    h, w = torch.randn(37, 16, generator=g).to(dtype), torch.randn(53, 16, generator=g).to(dtype)
    t = torch.randint(0, 53, (37,), generator=g)
    t[5] = -100
    check_vs_eager(
        lambda h, w: linear_cross_entropy(h, w, t, chunk_rows=8).float(),
        lambda h, w: F.cross_entropy(h.float() @ w.float().t(), t),
        h,
        w,
        atol=3e-2,
        rtol=3e-2,
    )
    t[3] = 53
    with pytest.raises((RuntimeError, IndexError), match="out of (range|bounds)"):
        linear_cross_entropy(h, w, t)


@pytest.mark.parametrize("impl", ["default", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_cross_entropy_loss_alone_as_eager(impl, dtype, with_bias):
    """graphtrain::linear_cross_entropy_loss (an evaluation graph's LM head: passes/fuse_cross_entropy.py
    loss_only_lm_head): the loss alone, as eager's cross_entropy of hidden @ weight^T (+ bias), chunked or not, with
    and without skipping the ignored rows, mean and sum; on the C++ row kernel and on the torch math; no
    gradient is computed (it has no autograd formula)."""
    from graphtrain.kernels._common import force_reference

    g = torch.Generator().manual_seed(11)
    h, w = torch.randn(45, 16, generator=g).to(dtype), torch.randn(53, 16, generator=g).to(dtype)
    b = torch.randn(53, generator=g).to(dtype) if with_bias else None
    t = torch.randint(0, 53, (45,), generator=g)
    t[::4] = -100
    logits = h.float() @ w.float().t() + (b.float() if with_bias else 0)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    ctx = force_reference(ops=("linear_cross_entropy",)) if impl == "torch" else contextlib.nullcontext()
    with ctx:
        for reduction, code in (("mean", 1), ("sum", 2)):
            want = F.cross_entropy(logits, t, reduction=reduction)
            for chunk in (0, 7, 45):
                for skip in (False, True):
                    got = torch.ops.graphtrain.linear_cross_entropy_loss(h, w, b, t, -100, code, chunk, skip)
                    assert got.dtype == torch.float32 and got.shape == ()
                    assert_close(got, want, **tol)
    with pytest.raises(RuntimeError, match="autograd"):
        torch.ops.graphtrain.linear_cross_entropy_loss(
            h.float().requires_grad_(), w.float(), None, t, -100, 1, 0, True
        ).backward()


def test_registry_and_torch_compile():
    assert set(KERNELS) == {
        "attention",
        "bias_dropout_add",
        "bias_gelu",
        "cross_entropy",
        "gemm",
        "layer_norm",
        "linear_cross_entropy",
        "rms_norm",
    }
    x, w = torch.randn(4, 8), torch.randn(8)

    def f(x, w):
        return bias_gelu(layer_norm(x, w, w), w, "tanh").sum() + cross_entropy(x, torch.arange(4))

    xs = x.clone().requires_grad_()
    f(xs, w).backward()
    xc = x.clone().requires_grad_()
    torch.compile(f, backend="aot_eager", fullgraph=True)(xc, w).backward()
    assert_close(xc.grad, xs.grad, name="compiled grad")
