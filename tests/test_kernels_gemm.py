"""graphtrain::gemm (oneDNN fp32 GEMM on CPU) and the lower_gemm_onednn pass that routes the step's
matmuls to it: values against fp64 and aten.mm, every operand layout, autograd, and whole models
trained through the engine against eager."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

import graphtrain
from graphtrain.config.fallback import GraphtrainFallbackWarning
from graphtrain.config.sections import EngineConfig
from graphtrain.kernels.gemm import (
    WIN_MARGIN,
    gemm,
    gemm_onednn,
    gemm_probe,
    onednn_available,
    onednn_fp32,
    onednn_gemm_wins,
)
from graphtrain.testing import assert_close, assert_grads_close

needs_onednn = pytest.mark.skipif(
    not onednn_available(), reason=f"oneDNN's fp32 matmul is not usable here: {onednn_fp32()[1]}"
)


def _operand(rows: int, cols: int, transposed: bool, g: torch.Generator) -> torch.Tensor:
    return torch.randn(cols, rows, generator=g).t() if transposed else torch.randn(rows, cols, generator=g)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 5, 3), (33, 17, 65), (256, 1024, 96)])
@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
@pytest.mark.parametrize("bias", [None, "row", "full", "col"])
def test_gemm_is_fp32_accurate_in_every_layout(m, k, n, a_t, b_t, bias):
    """On oneDNN where it runs, on aten.mm/addmm elsewhere (an AVX2-only CPU): the same contract either way."""
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    a, b = _operand(m, k, a_t, g), _operand(k, n, b_t, g)
    c = {
        None: None,
        "row": torch.randn(n, generator=g),
        "full": torch.randn(m, n, generator=g),
        "col": torch.randn(m, 1, generator=g),
    }[bias]
    out = gemm(a, b, c)
    ref = a.double() @ b.double() + (0 if c is None else c.double())
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.is_contiguous()
    # fp32 accumulation over k terms: ~1e-6 relative to the largest entry here. A bf16/tf32 down-conversion
    # (oneDNN's fast-math modes) would be ~1e-3: this bound tells the two apart.
    err = ((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    assert err < 5e-6, err


@needs_onednn
def test_gemm_writes_into_out_and_accumulates():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 48, generator=g), torch.randn(48, 40, generator=g)
    buf = torch.zeros(128, 40)
    gemm_onednn(a, b, out=buf[32:96])  # a row slice of a contiguous buffer is contiguous
    assert_close(buf[32:96], a @ b, name="out=")
    assert torch.count_nonzero(buf[:32]) == 0 and torch.count_nonzero(buf[96:]) == 0
    acc = torch.randn(64, 40, generator=g)
    want = acc + a @ b
    gemm_onednn(a, b, out=acc, accumulate=True)
    assert_close(acc, want, name="accumulate")
    bias = torch.randn(40, generator=g)
    acc2 = torch.ones(64, 40)
    gemm_onednn(a.t().contiguous().t(), b, bias, out=acc2, accumulate=True)
    assert_close(acc2, 1 + a @ b + bias, name="accumulate + bias, transposed a")


def test_gemm_other_dtypes_use_aten_and_autograd_matches():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float64, torch.bfloat16):
        a, b = torch.randn(9, 6, generator=g).to(dtype), torch.randn(6, 5, generator=g).to(dtype)
        assert torch.equal(gemm(a, b), a @ b)
    a = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    c = torch.randn(6, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(gemm, (a, b, c))
    # fp32 (the oneDNN path where available): gradients against eager's mm
    a32, b32, c32 = (t.detach().float().requires_grad_() for t in (a, b, c))
    (gemm(a32, b32, c32) ** 2).sum().backward()
    a2, b2, c2 = (t.detach().float().requires_grad_() for t in (a, b, c))
    ((a2 @ b2 + c2) ** 2).sum().backward()
    for x, y, name in ((a32, a2, "da"), (b32, b2, "db"), (c32, c2, "dbias")):
        assert_close(x.grad, y.grad, name=name)


@pytest.mark.parametrize("a_t", [False, True])
@pytest.mark.parametrize("b_t", [False, True])
def test_gradients_come_back_in_their_operands_layout(a_t, b_t):
    """The weight gradient of x @ w.t() comes back transposed like w.t() (computed as grad^T @ x), as aten's mm
    backward does: the autograd engine then stores it without a copy, and a tied weight adds it without striding."""
    g = torch.Generator().manual_seed(3)
    a = _operand(37, 24, a_t, g).requires_grad_()
    b = _operand(24, 19, b_t, g).requires_grad_()
    dy = torch.randn(37, 19, generator=g)
    ga, gb = torch.autograd.grad(gemm(a, b), (a, b), dy)
    for grad, operand, want, name in ((ga, a, dy @ b.detach().t(), "da"), (gb, b, a.detach().t() @ dy, "db")):
        assert grad.stride() == operand.stride(), (name, grad.stride(), operand.stride())
        assert_close(grad, want, name=name)


def test_gemm_rejects_bad_inputs():
    with pytest.raises(ValueError, match="inner dimensions"):
        gemm(torch.randn(3, 4), torch.randn(5, 2))
    with pytest.raises(ValueError, match="2-D"):
        gemm(torch.randn(2, 3, 4), torch.randn(4, 2))
    with pytest.raises(TypeError, match="dtypes must match"):
        gemm(torch.randn(3, 4), torch.randn(4, 2, dtype=torch.float64))


def test_probe_reports_both_rates_or_why_it_did_not_run():
    p = gemm_probe()
    assert {"aten", "onednn", "shapes", "cached"} <= set(p)
    if onednn_available():
        assert p["aten"] > 0 and p["onednn"] > 0 and len(p["shapes"]) >= 2
        assert onednn_gemm_wins() == (p["onednn"] > WIN_MARGIN * p["aten"] > 0)
    else:  # nothing timed, the reason names the missing capability
        assert p["aten"] is None and p["skipped"] == onednn_fp32()[1] and not onednn_gemm_wins()


def test_lower_gemm_forced_without_onednn_reports_why(monkeypatch):
    """Asked for by name where oneDNN's fp32 path does not run (simulated AVX2 CPU): the fallback policy says
    why, and the step still trains on aten's matmuls."""
    from graphtrain.kernels import capability

    with capability.simulate("avx2"):
        assert not onednn_available()
        m = graphtrain.accelerate(_tiny_gpt2(), provider="inductor", passes={"lower_gemm_onednn": True})
        ids = torch.randint(0, 512, (2, 16))
        with pytest.warns(GraphtrainFallbackWarning, match="AVX-512"):
            m(input_ids=ids, labels=ids).backward()
        rep = graphtrain.report(m)
        assert any("lower_gemm_onednn" in part and "AVX-512" in why for part, why in rep.fallbacks)
        assert "oneDNN's fp32 GEMM unavailable" in str(rep)


def _gemm_rewrites(m) -> int:
    recs = [r for r in graphtrain.report(m).passes if r["name"] == "lower_gemm_onednn"]
    assert all(r["error"] is None and r["stage"] == "pre_autodiff" for r in recs), recs
    return sum(r["rewrites"] for r in recs)


def _tiny_gpt2(dropout=0.0):
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(name="gpt2-tiny", dropout=dropout))


@needs_onednn
@pytest.mark.parametrize("provider", ["aten", "inductor"])
def test_pass_routes_every_matmul_of_the_step_and_trains_like_eager(provider):
    ref = _tiny_gpt2()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    # forced on by name (no probe): the aten provider leaves matmuls to aten unless asked
    m = graphtrain.accelerate(
        copy.deepcopy(ref), provider=provider, fallback="error", passes={"lower_gemm_onednn": True}
    )
    for step in range(2):
        for mod in (m, ref):
            mod.zero_grad(set_to_none=True)
        with torch.profiler.profile() as prof:
            lf = m(input_ids=ids, labels=ids)
            lf.backward()
        le = ref(input_ids=ids, labels=ids)
        le.backward()
        assert_close(lf, le, name=f"loss step {step}")
        assert_grads_close(m, ref)
    # gpt2-tiny: 2 layers x 4 linears (the LM head is inside graphtrain::linear_cross_entropy); AOTAutograd derives
    # the backward's 2 gradient products per linear from graphtrain::gemm's own backward, so all 24 run on oneDNN
    assert _gemm_rewrites(m) == 8
    calls = sum(e.count for e in prof.key_averages() if e.key == "graphtrain::gemm")
    assert calls == 8 + 16, calls
    rep = graphtrain.report(m).to_dict()
    assert rep["graphs"] and not rep["eager_only"]


@needs_onednn
def test_pass_switched_off_by_name_and_off_by_default_under_aten():
    from graphtrain.passes.manager import pipeline

    assert "lower_gemm_onednn" not in {s.name for s in pipeline("pre_autodiff", EngineConfig(provider="aten"))}
    assert "lower_gemm_onednn" in {s.name for s in pipeline("pre_autodiff", EngineConfig(provider="inductor"))}
    m = graphtrain.accelerate(_tiny_gpt2(), provider="inductor", fallback="error", passes={"lower_gemm_onednn": False})
    ids = torch.randint(0, 512, (2, 16))
    m(input_ids=ids, labels=ids).backward()
    assert _gemm_rewrites(m) == 0


@needs_onednn
def test_pass_leaves_graphs_with_aten_dropout_alone():
    """Dropout left as ATen's (fuse_bias_dropout_add and fuse_attention off) draws from eager's RNG stream. Inductor
    on CPU misordered such a mask's bernoulli_ after its reader (see passes/lower_gemm.py, runtime/providers.py), so
    those graphs are not given to Inductor: they fall back to aten (loudly), keep aten's matmuls, and the loss
    matches eager's under the same seed; fallback=error refuses them with the fix."""
    ref = _tiny_gpt2(dropout=0.1)
    ref.train()
    passes = {"fuse_bias_dropout_add": False, "fuse_attention": False, "lower_gemm_onednn": True}
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="inductor", fallback="warn", passes=passes)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(7)
    with pytest.warns(GraphtrainFallbackWarning, match="ATen random ops"):
        lf = m(input_ids=ids, labels=ids)
    torch.manual_seed(7)
    le = ref(input_ids=ids, labels=ids)
    assert_close(lf, le, name="loss with aten dropout")  # the same masks: a misordered one moved it by 0.4%
    assert _gemm_rewrites(m) == 0
    assert "aten" in {g["provider"] for g in graphtrain.report(m).graphs}
    strict = graphtrain.accelerate(copy.deepcopy(ref), provider="inductor", fallback="error", passes=passes)
    with pytest.raises(Exception, match="fuse_bias_dropout_add"):
        strict(input_ids=ids, labels=ids)


@needs_onednn
def test_pass_runs_after_mixed_precision_and_leaves_bf16_matmuls_to_aten():
    """Under precision bf16 every matmul is bf16 once apply_mixed_precision ran, and aten sends bf16 matmuls
    to oneDNN itself: nothing to rewrite (before the ordering fix the pass took the fp32 matmuls first and
    the step silently stayed fp32)."""
    m = graphtrain.accelerate(
        _tiny_gpt2(), provider="inductor", fallback="error", precision="bf16", passes={"lower_gemm_onednn": True}
    )
    ids = torch.randint(0, 512, (2, 16))
    m(input_ids=ids, labels=ids).backward()
    mp = [r for r in graphtrain.report(m).passes if r["name"] == "apply_mixed_precision"]
    assert mp and sum(r["rewrites"] for r in mp) > 0
    assert _gemm_rewrites(m) == 0


def _two_layer_graph():
    """A pre-autodiff aten graph with GEMMs of two shapes: (8 x 16) @ W1.t() with W1 (32, 16), (8 x 32) @ W2 with
    W2 (32, 24) stored (k, n) as HF's Conv1D stores it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w1, w2):
        return torch.mm(torch.relu(torch.mm(x, w1.t())), w2)

    return make_fx(f, tracing_mode="fake")(torch.randn(8, 16), torch.randn(32, 16), torch.randn(32, 24))


def test_pass_decides_gemm_by_gemm_from_the_shapes_the_graph_runs(monkeypatch):
    """Each distinct (m, k, n, layout) is probed (here: a stand-in probe), only the winners are rewritten, and the
    pass's note names every shape with its speedup and choice; the report prints it."""
    from graphtrain.passes import lower_gemm
    from graphtrain.passes.manager import PassContext

    asked = []

    def probe(m, k, n, b_transposed):
        asked.append((m, k, n, b_transposed))
        wins = (k, n) == (16, 32)
        return {"speedup": 2.0 if wins else 1.01, "wins": wins}

    monkeypatch.setattr(lower_gemm, "onednn_available", lambda: True)
    monkeypatch.setattr(lower_gemm, "shape_probe", probe)
    gm = _two_layer_graph()
    ctx = PassContext(EngineConfig(provider="inductor"), "pre_autodiff", input_kinds=["input", "param", "param"])
    out = lower_gemm.lower_gemm_onednn_pass(gm, ctx)
    assert sorted(asked) == [(8, 16, 32, True), (8, 32, 24, False)]
    targets = [n.target for n in out.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.graphtrain.gemm.default) == 1 and torch.ops.aten.mm.default in targets
    assert ctx.rewrites == 1
    assert "8x16x32t 2.00x -> oneDNN" in ctx.notes[0] and "8x32x24 1.01x -> aten" in ctx.notes[0]


@needs_onednn
def test_shape_probe_times_both_libraries_once_per_machine_and_shape():
    from graphtrain.kernels.gemm import WIN_MARGIN, shape_probe

    first = shape_probe(64, 48, 80, True)
    again = shape_probe(64, 48, 80, True)
    assert first["aten_s"] > 0 and first["onednn_s"] > 0 and first["rows"] == 64
    assert again["cached"] and again["aten_s"] == first["aten_s"]
    assert first["wins"] == (first["speedup"] >= WIN_MARGIN)
    assert shape_probe(4096, 48, 80, False)["rows"] == 512  # rows capped: the rate, not the probe's cost, counts


def test_probe_follows_the_thread_count_the_process_runs_with(monkeypatch):
    """A process that changes its thread count (a Trainer with train.threads) must pick the GEMM library a fresh
    process with that count picks: the probe is kept per machine key, threads included (a suite once ran its
    reference Trainer on the 2-thread winner while the resumed 1-thread run used the other library: not bitwise)."""
    import importlib

    from graphtrain.kernels import capability

    gemm_mod = importlib.import_module("graphtrain.kernels.gemm")
    measured = []

    def fake_probe(name, run, replace=False):
        measured.append(torch.get_num_threads())
        fast = "onednn" if torch.get_num_threads() == 1 else "aten"
        return {
            "aten": 200.0 if fast == "aten" else 100.0,
            "onednn": 200.0 if fast == "onednn" else 100.0,
            "shapes": [],
            "cached": True,
        }

    monkeypatch.setattr(capability, "cached_probe", fake_probe)
    monkeypatch.setattr(gemm_mod, "onednn_fp32", lambda: (True, ""))
    monkeypatch.setattr(gemm_mod, "_PROBES", {})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not gemm_mod.gemm_probe_ran()
        assert not onednn_gemm_wins() and gemm_mod.gemm_probe_ran()
        torch.set_num_threads(1)
        assert not gemm_mod.gemm_probe_ran()
        assert onednn_gemm_wins()
        torch.set_num_threads(2)
        assert not onednn_gemm_wins()
    finally:
        torch.set_num_threads(before)
    assert measured == [2, 1]  # once per thread count


_BIAS_PEAK = """
import sys, torch
from graphtrain.kernels.gemm import gemm_reference, matmul
from graphtrain.memory.process import reset_peak_rss, rss_bytes
torch.set_num_threads(1)
fn = {"matmul": matmul, "reference": gemm_reference}[sys.argv[1]]
a, b, bias = torch.randn(4096, 8), torch.randn(8, 8192), torch.randn(8192)  # the result: 128 MiB
fn(a, b, bias)  # warm: libraries' own buffers
before = rss_bytes()
assert reset_peak_rss()
out = fn(a, b, bias)
print((rss_bytes("VmHWM") - before) / out.nbytes)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc/self/status")
@pytest.mark.parametrize("fn", ["matmul", "reference"])
def test_a_product_with_a_bias_holds_one_result_at_its_peak(fn):
    """graphtrain's CPU kernels (the chunked LM head returning BERT's logits) call matmul with a bias; on a CPU
    where oneDNN's matmul does not run it is aten's: `a @ b + bias` held two [m, n] results at once (BERT's head,
    vocabulary 30522, 4096 tokens: 477 MiB more on the process peak, measured on an AVX2 EPYC). Measured in a fresh
    process: the peak grows by one result, not two."""
    out = subprocess.run([sys.executable, "-c", _BIAS_PEAK, fn], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    grown = float(out.stdout.split()[-1])
    assert 0.9 < grown < 1.5, f"the peak grew by {grown:.2f} results"
