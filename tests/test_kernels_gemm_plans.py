"""bf16 GEMM plans (kernels/gemm.py `low_plan`): the C++ `onednn_matmul_rows` kernel (one single-threaded oneDNN call
per thread on its block of rows), the per-machine probe that picks a plan per shape, graphtrain::gemm run by each
plan with its gradients, and the lower_gemm_plans pass on a model trained against eager autocast."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import graphtrain
from graphtrain.kernels import _cpu_ext, capability
from graphtrain.kernels.gemm import LOW_PLANS, gemm, low_plan, mm_plan, onednn_available, thread_rows_available
from graphtrain.testing import assert_close

gemm_mod = importlib.import_module("graphtrain.kernels.gemm")  # the module: `graphtrain.kernels.gemm` is the function


def _rows_kernel_runs() -> bool:
    a = torch.zeros(64, 8, dtype=torch.bfloat16)
    return (
        _cpu_ext.load() is not None
        and onednn_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and (gemm_mod.ONEDNN_MATMUL_ROWS.holds(a, a.t(), torch.empty(64, 64, dtype=torch.bfloat16)))
    )


needs_rows = pytest.mark.skipif(not _rows_kernel_runs(), reason="oneDNN's bf16 matmul or the C++ kernels not here")


def _operand(rows: int, cols: int, transposed: bool, g: torch.Generator) -> torch.Tensor:
    t = torch.randn(cols, rows, generator=g).bfloat16().t() if transposed else torch.randn(rows, cols, generator=g)
    return t.bfloat16()


@pytest.fixture
def threads():
    """Runs the test body at a thread count and restores the process's."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@needs_rows
@pytest.mark.parametrize("m", [33, 64, 100, 1000])
@pytest.mark.parametrize("a_t,b_t", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_thread_rows_matches_aten(m, a_t, b_t, beta, n_threads, threads):
    """Every row block, the last one short, a row count under a block per thread, both operand layouts that training
    runs, written (beta 0) or added (beta 1) into `out`, on one and two threads: the product aten's oneDNN call
    computes, within bf16's rounding of the result (both accumulate in fp32; the blocking may differ). The process's
    thread count is left as it was."""
    threads(n_threads)
    g = torch.Generator().manual_seed(m)
    a, b = _operand(m, 96, a_t, g), _operand(96, 40, b_t, g)
    start = torch.randn(m, 40, generator=g).bfloat16()
    out = start.clone() if beta else torch.full((m, 40), float("nan"), dtype=torch.bfloat16)
    _cpu_ext.load().onednn_matmul_rows(a, b, out, beta)
    assert torch.get_num_threads() == n_threads
    want = torch.mm(a, b) if not beta else torch.addmm(start, a, b)
    assert_close(out, want, name="rows vs aten", rtol=2**-7, atol=2**-7)
    exact = a.double() @ b.double() + (start.double() if beta else 0)
    assert_close(out.double(), exact, name="rows vs fp64", rtol=2**-7, atol=2**-6)


@needs_rows
@pytest.mark.parametrize(
    "a,b,out,why",
    [
        ((64, 8), (9, 4), (64, 4), "shapes must be"),
        ((2, 64, 8), (2, 8, 4), (2, 64, 4), "must be 2-D"),
        ((64, 8), (8, 4), "strided", "contiguous out"),
        ((64, 8), "fp32", (64, 4), "one floating dtype"),
    ],
)
def test_thread_rows_checks_its_contract_before_it_writes(a, b, out, why):
    """A call whose operands break the contract raises one line naming it, and `out` is untouched."""
    mk = lambda s: torch.randn(*s).bfloat16()  # noqa: E731
    ta = mk(a)
    tb = torch.randn(8, 4) if b == "fp32" else mk(b)
    to = torch.full((64, 8), 7.0, dtype=torch.bfloat16)[:, :4] if out == "strided" else torch.full(out, 7.0).bfloat16()
    with pytest.raises(RuntimeError, match=why):
        _cpu_ext.load().onednn_matmul_rows(ta, tb, to, 0.0)
    assert bool((to == 7).all())


def _transpose_kernel():
    return None if _cpu_ext.load() is None else _cpu_ext.load().transpose_bf16


@pytest.mark.skipif(_cpu_ext.load() is None, reason="graphtrain's C++ kernels are not built here")
@pytest.mark.parametrize("rows,cols", [(1024, 1408), (33, 65), (100, 7), (1, 5), (5, 1), (0, 3), (64, 32)])
@pytest.mark.parametrize("padded", [False, True])
def test_transpose_copies_a_transposed_view_row_major_bit_for_bit(rows, cols, padded):
    """Whole 32 x 32 tiles, partial ones at both edges, a single row or column, an empty matrix, and a view whose
    leading dimension is longer than its rows (a slice of a wider matrix): equal to aten's contiguous copy."""
    g = torch.Generator().manual_seed(rows * 7 + cols)
    base = torch.randn(cols, rows + (3 if padded else 0), generator=g).bfloat16()
    src = base[:, :rows].t()
    dst = torch.full((rows, cols), float("nan"), dtype=torch.bfloat16)
    _transpose_kernel()(src, dst)
    assert torch.equal(dst, src.contiguous())


@pytest.mark.skipif(_cpu_ext.load() is None, reason="graphtrain's C++ kernels are not built here")
def test_transpose_checks_its_contract_before_it_writes():
    dst = torch.full((5, 8), 7.0, dtype=torch.bfloat16)
    for src, why in (
        (torch.randn(5, 8).bfloat16(), "transposed view"),  # row-major already
        (torch.randn(8, 5).t(), "bf16 CPU"),  # fp32
        (torch.randn(8, 6).bfloat16().t(), "contiguous, shaped as src"),
    ):
        with pytest.raises(RuntimeError, match=why):
            _transpose_kernel()(src, dst)
        assert bool((dst == 7).all())


@needs_rows
def test_a_plan_is_measured_once_per_shape_and_every_plan_computes_the_product():
    g = torch.Generator().manual_seed(5)
    a, b = _operand(300, 64, False, g), _operand(64, 48, True, g)
    plan = low_plan(a, b)
    assert plan in LOW_PLANS
    assert capability.cached_probe("gemm_low_plan_v4 300x64x48 nt bfloat16", lambda: pytest.fail("measured twice"))[
        "cached"
    ]
    r = capability.peek_probe("gemm_low_plan_v4 300x64x48 nt bfloat16")
    out = torch.empty(300, 48, dtype=torch.bfloat16)
    assert r["whole_s"] > 0 and r["blocks_s"] > 0 and (r["threads_s"] > 0) == thread_rows_available(a, b, out)
    assert r["transpose_s"] == 0  # a is row-major: nothing to copy
    for p in LOW_PLANS:
        out = torch.full((300, 48), float("nan"), dtype=torch.bfloat16)
        mm_plan(a, b, out, p)
        assert_close(out, torch.mm(a, b), name=p, rtol=2**-7, atol=2**-7)


@pytest.mark.skipif(_cpu_ext.load() is None, reason="graphtrain's C++ kernels are not built here")
def test_the_probe_times_the_transpose_plan_into_one_block_as_a_step_runs_it():
    """A step reuses the copy's block (kept by glibc under keep, by the block cache under release); a probe that
    allocated it on every timed call timed its page faults and picked "whole" for the LM head's d weight, 20 ms a
    step slower. The probe's allocations of the copy's size: the operand's own and the one block, whatever the
    number of rounds."""
    m, k, n = 256, 192, 64
    gemm_mod.plan_for(m, k, n, False, False, torch.bfloat16)  # the product's own plan, measured outside the count
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        r = gemm_mod._measure_low_plans(m, k, n, True, False, torch.bfloat16)
    assert r["transpose_s"] > 0
    # allocations of the copy's size, by the op that made them
    sized = [e.name for e in prof.events() if e.self_cpu_memory_usage == m * k * 2]
    assert len(sized) == 2, f"{len(sized)} blocks of the copy's size over {gemm_mod.PROBE_ROUNDS} rounds"
    g = torch.Generator().manual_seed(3)
    a, b = _operand(m, k, True, g), _operand(k, n, False, g)
    block, out = torch.full((m, k), float("nan"), dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
    mm_plan(a, b, out, "transpose", block)
    assert torch.equal(block, a.contiguous())  # the copy went into the block given
    assert_close(out, torch.mm(a, b), name="transpose into a block", rtol=2**-7, atol=2**-7)


@needs_rows
@pytest.mark.parametrize("plan", LOW_PLANS)
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_op_runs_bf16_by_its_plan_with_gradients(plan, bias, monkeypatch):
    """graphtrain::gemm on bf16 operands runs the plan decided for each of its GEMMs (here forced), forward and both
    gradients (whose own shapes are planned as well), against eager bf16 autograd."""
    monkeypatch.setattr(gemm_mod, "low_plan", lambda a, b: plan)
    g = torch.Generator().manual_seed(9)
    x = _operand(320, 64, False, g).requires_grad_()
    w = (torch.randn(48, 64, generator=g) * 0.2).bfloat16().requires_grad_()
    c = torch.randn(48, generator=g).bfloat16().requires_grad_() if bias else None
    dy = torch.randn(320, 48, generator=g).bfloat16()
    got = gemm(x, w.t(), c)
    grads = torch.autograd.grad(got, [t for t in (x, w, c) if t is not None], dy)
    ref_in = [t.detach().clone().requires_grad_() for t in (x, w, c) if t is not None]
    want = torch.nn.functional.linear(*ref_in)
    want_grads = torch.autograd.grad(want, ref_in, dy)
    assert_close(got, want, name="forward", rtol=2**-7, atol=2**-6)
    for name, gg, wg in zip(("dx", "dw", "dbias"), grads, want_grads):
        assert_close(gg, wg, name=name, rtol=2**-7, atol=2**-5)


def _tiny_gpt2():
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))


@needs_rows
def test_pass_rewrites_each_gemm_whose_plan_wins_and_trains_like_eager_autocast(monkeypatch):
    """After autodiff each bf16 GEMM is its own decision: here (a stand-in probe) the products with a longer inner
    dimension than output run as threads, the others stay aten's. Loss and gradients of two steps match eager under
    bf16 autocast within bf16's tolerance, and the report names every decision."""
    from graphtrain.passes import lower_gemm

    def plan_for(m, k, n, a_t, b_t, dtype):
        return "threads" if k > n and not a_t else "whole"

    monkeypatch.setattr(lower_gemm, "plan_for", plan_for)
    monkeypatch.setattr(gemm_mod, "low_plan", lambda a, b: "threads")
    ref = _tiny_gpt2()
    m = graphtrain.accelerate(
        copy.deepcopy(ref), provider="aten", precision="bf16", fallback="error", passes={"lower_gemm_plans": True}
    )
    ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(1))
    for step in range(2):
        for mod in (m, ref):
            mod.zero_grad(set_to_none=True)
        with torch.profiler.profile() as prof:
            lf = m(input_ids=ids, labels=ids)
            lf.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            le = ref(input_ids=ids, labels=ids)
        le.backward()
        assert_close(lf, le.float(), name=f"loss step {step}", rtol=2e-2, atol=2e-2)
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            rel = float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12))
            assert rel < 5e-2, (name, rel)
    recs = [r for r in graphtrain.report(m).passes if r["name"] == "lower_gemm_plans"]
    assert recs and all(r["error"] is None and r["stage"] in ("forward", "backward") for r in recs)
    # gpt2-tiny, width 64, MLP 256: the MLP's down projection (k 256 > n 64) forward and the input gradients of the
    # attention and MLP up projections (k 192 / 256 > n 64); 2 layers
    assert sum(r["rewrites"] for r in recs) == 6, recs
    assert sum(e.count for e in prof.key_averages() if e.key == "graphtrain::gemm") == 6
    assert "64x256x64nt threads" in str(graphtrain.report(m)) or "64x256x64nn threads" in str(graphtrain.report(m))


def test_pass_is_on_under_inductor_only_and_leaves_fp32_alone():
    from graphtrain.config.sections import EngineConfig
    from graphtrain.passes.manager import pipeline

    for stage in ("forward", "backward"):
        assert "lower_gemm_plans" in {s.name for s in pipeline(stage, EngineConfig(provider="inductor"))}
        assert "lower_gemm_plans" not in {s.name for s in pipeline(stage, EngineConfig(provider="aten"))}
    m = graphtrain.accelerate(_tiny_gpt2(), provider="aten", fallback="error", passes={"lower_gemm_plans": True})
    ids = torch.randint(0, 512, (4, 16))
    m(input_ids=ids, labels=ids).backward()
    recs = [r for r in graphtrain.report(m).passes if r["name"] == "lower_gemm_plans"]
    assert sum(r["rewrites"] for r in recs) == 0


def test_memory_prediction_counts_the_row_major_copy_of_a_transposed_operand():
    """The transpose plan copies a bf16 a stored transposed before the product: the op's workspace says how much, for
    the memory predictor, and nothing for a row-major a or fp32 (which never takes the plan)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphtrain.kernels.registry import OPS

    def f(g, x):
        return torch.ops.graphtrain.gemm(g.t(), x, None), torch.ops.graphtrain.gemm(x.t().contiguous(), g, None)

    for dtype, want in ((torch.bfloat16, 96 * 40 * 2), (torch.float32, 0)):
        gm = make_fx(f, tracing_mode="fake")(torch.randn(96, 40, dtype=dtype), torch.randn(96, 24, dtype=dtype))
        calls = [n for n in gm.graph.nodes if n.target == torch.ops.graphtrain.gemm.default]
        assert [OPS["gemm"].workspace_bytes(n) for n in calls] == [want, 0], dtype
