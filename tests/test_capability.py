"""Capabilities are probed, never assumed: a simulated AVX2-only CPU selects the next implementation of every
kernel, probe and precision; a fused op that fails at run time falls back to its reference (or stops the run
under fallback: error); the C++ kernels built for AVX2 compute what the references compute; probes are bounded
in time and cached per machine; and the default job's engine path runs end to end on a simulated AVX2 EPYC."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import graphtrain
from graphtrain.kernels import _common, _cpu_ext, capabilities, capability
from graphtrain.kernels._common import GraphtrainFallbackWarning, KernelFallbackError, dropout_keep_mask
from graphtrain.testing import assert_close

ROOT = Path(__file__).resolve().parents[1]
AVX2_ENV = {"GRAPHTRAIN_SIMULATE_CPU": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
x86 = pytest.mark.skipif(capability.cpu().arch not in ("x86_64", "AMD64"), reason="an x86-64 CPU is simulated")


@pytest.fixture(autouse=True)
def _clean_fallbacks():
    _common.reset_runtime_fallbacks()
    yield
    _common.reset_runtime_fallbacks()
    _common.set_fallback_policy("warn")


def _tiny_gpt2(dropout=0.0):
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(name="gpt2-tiny", dropout=dropout))


def test_cpu_facts_come_from_torch():
    c = capability.cpu()
    assert c.torch_isa == str(torch.backends.cpu.get_cpu_capability())
    assert c.simulated is None
    if c.arch in ("x86_64", "AMD64"):
        assert c.avx2 == torch.cpu._is_avx2_supported()
        assert ("avx512_f" in c.flags) == torch.cpu._is_avx512_supported()
        assert ("avx512_bf16" in c.flags) == torch.cpu._is_avx512_bf16_supported()


@x86
def test_simulated_avx2_machine_selects_the_next_implementation():
    with capability.simulate("avx2") as c:
        assert c.simulated == "avx2" and c.isa == "avx2" and not c.avx512 and not c.native_bf16 and not c.amx
        assert _cpu_ext.isa_level() == "avx2"
        from graphtrain.kernels.gemm import gemm_probe, onednn_available, onednn_fp32

        ok, why = onednn_fp32()
        assert not ok and "AVX-512" in why and not onednn_available()
        assert gemm_probe()["skipped"] == why  # nothing timed
        assert capability.resolve_precision("auto") == "fp32"
        caps = capabilities()
        assert caps["isa"] == "avx2" and caps["simulated"] == "avx2"
        assert "oneDNN's fp32 GEMM unavailable" in caps["cpu_fp32_gemm"]
        assert caps["native_bf16"]["ok"] is False and "30x" in caps["native_bf16"]["why"]
    assert capability.cpu().simulated is None
    with pytest.raises(ValueError, match="simulation"):
        with capability.simulate("pentium"):
            pass


@x86
def test_precision_auto_and_the_slow_bf16_warning():
    from graphtrain.runtime.providers import _WARNED_SLOW, SlowPrecisionWarning

    ids = torch.randint(0, 512, (2, 16))
    with capability.simulate("avx2"):
        m = graphtrain.accelerate(_tiny_gpt2(), provider="aten", precision="auto", fallback="error")
        m(input_ids=ids, labels=ids).backward()
        rep = graphtrain.report(m)
        assert rep.graphs and all(g["precision"] == "fp32" for g in rep.graphs)
        assert "precision fp32" in str(rep)
        _WARNED_SLOW.clear()
        m = graphtrain.accelerate(_tiny_gpt2(), provider="aten", precision="bf16")
        with pytest.warns(SlowPrecisionWarning, match="engine.precision=fp32, or auto"):
            m(input_ids=ids, labels=ids).backward()
        assert all(g["precision"] == "bf16" for g in graphtrain.report(m).graphs)  # asked for: honoured


class _BrokenExt:
    """A C++ module whose kernels raise, as an illegal instruction or a missing primitive would."""

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError(f"simulated failure of {name}")

        return fail


def _break_cpp(monkeypatch):
    real = _cpu_ext.load
    monkeypatch.setattr(_cpu_ext, "load", lambda level=None: _BrokenExt() if real(level) is not None else None)
    return real(None) is not None


def test_fused_op_that_fails_at_run_time_falls_back_to_its_reference(monkeypatch):
    from graphtrain.kernels.bias_dropout_add import bias_dropout_add_reference

    if not _break_cpp(monkeypatch):
        pytest.skip(f"graphtrain's C++ kernels are not built here: {_cpu_ext.build_error()}")
    x, b, r = torch.randn(33, 17), torch.randn(17), torch.randn(33, 17)
    with pytest.warns(
        GraphtrainFallbackWarning,
        match=r"bias_dropout_add: its c\+\+ implementation failed.*"
        r"simulated failure",
    ):
        out, seed = torch.ops.graphtrain.bias_dropout_add(x, b, r, 0.25)
    assert torch.equal(out, bias_dropout_add_reference(x, b, r, 0.25, seed))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per op and implementation: the next call is quiet
        torch.ops.graphtrain.bias_dropout_add(x, b, r, 0.25)
    fb = capabilities()["runtime_fallbacks"]
    assert [(f["op"], f["implementation"]) for f in fb] == [("bias_dropout_add", "c++")]
    # under fallback: error the run stops, naming the op and the fix
    _common.reset_runtime_fallbacks()
    _common.set_fallback_policy("error")
    with pytest.raises(KernelFallbackError, match="bias_dropout_add.*engine.fallback=warn"):
        torch.ops.graphtrain.bias_dropout_add(x, b, r, 0.25)


@pytest.mark.parametrize("fallback", ["warn", "error"])
def test_engine_step_survives_a_failing_kernel_under_warn_only(monkeypatch, fallback):
    """Through the engine: the compiled step calls the fused ops; their C++ paths raise. Under `warn` the step
    runs on the references with the same hash masks, so it matches an unbroken run; `error` stops it."""
    if _cpu_ext.load() is None:
        pytest.skip(f"graphtrain's C++ kernels are not built here: {_cpu_ext.build_error()}")
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    good = graphtrain.accelerate(_tiny_gpt2(dropout=0.1), provider="aten")
    torch.manual_seed(5)
    want = good(input_ids=ids, labels=ids)
    want.backward()
    _break_cpp(monkeypatch)
    bad = graphtrain.accelerate(_tiny_gpt2(dropout=0.1), provider="aten", fallback=fallback)
    torch.manual_seed(5)
    if fallback == "error":
        with pytest.raises(KernelFallbackError):
            bad(input_ids=ids, labels=ids).backward()
        return
    with pytest.warns(GraphtrainFallbackWarning, match="fused op"):
        got = bad(input_ids=ids, labels=ids)
        got.backward()
    assert_close(got, want, name="loss")
    for (n, p), q in zip(bad.named_parameters(), good.parameters()):
        assert_close(p.grad, q.grad, name=f"grad of {n}")
    text = str(graphtrain.report(bad))
    assert "fell back to their reference at run time: " in text and "bias_dropout_add (c++)" in text


@x86
def test_avx2_build_of_the_cpp_kernels_matches_the_references():
    """The kernels as built for an AVX2-only CPU (no 64-bit vector multiply: the hash is emulated) draw the same
    dropout masks and compute the same values as the plain-PyTorch references. On an AVX-512 host this builds
    and runs the AVX2 variant; on an AVX2 host it is the build every other test uses."""
    from graphtrain.kernels.attention import attention_backward_reference, attention_reference
    from graphtrain.kernels.bias_dropout_add import dropout_backward_reference

    with capability.simulate("avx2"):
        if _cpu_ext.load() is None:
            pytest.skip(f"no C++ compiler: {_cpu_ext.build_error()}")
        assert _cpu_ext.loaded_variant() == "c++ (avx2 build)"
        mod = _cpu_ext.load()
        for shape in [(3, 2500), (40000,), (5, 7, 1031)]:
            mask = mod.dropout_mask(list(shape), 0.1, 123)
            assert torch.equal(mask, dropout_keep_mask(mask.numel(), 0.1, 123).reshape(shape)), shape
            for dtype in (torch.float32, torch.bfloat16):
                g = torch.randn(shape).to(dtype)
                assert torch.equal(mod.dropout_bwd(g, 0.1, 77), dropout_backward_reference(g, 0.1, torch.tensor([77])))
                x, r, bias = (
                    torch.randn(shape).to(dtype),
                    torch.randn(shape).to(dtype),
                    torch.randn(shape[-1]).to(dtype),
                )
                out = mod.bias_dropout_add_fwd(x, bias, r, 0.1, 77)
                keep = dropout_keep_mask(x.numel(), 0.1, 77).reshape(shape)
                assert_close(out, (torch.where(keep, (x.float() + bias.float()) / 0.9, 0.0) + r.float()).to(dtype))
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (torch.randn(2, 3, 37, 16).to(dtype) for _ in range(3))
            out, lse, seed = torch.ops.graphtrain.attention(q, k, v, None, 0.25, True, 0.2)
            ro, rl = attention_reference(q, k, v, None, 0.25, True, 0.2, seed)
            tol = {} if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
            assert_close(out, ro, name="attention out", **tol)
            do = torch.randn_like(out)
            got = torch.ops.graphtrain.attention_backward(do, q, k, v, None, out, lse, seed, 0.25, True, 0.2)
            ref = attention_backward_reference(do, q, k, v, None, ro, rl, 0.25, True, 0.2, seed)
            for name, a, e in zip("qkv", got, ref):
                assert_close(a, e, name=f"d{name}", **tol)
        from graphtrain.kernels.bias_gelu import bias_gelu_backward_reference, bias_gelu_reference

        for dtype in (torch.float32, torch.bfloat16):
            x, bias = (torch.randn(5, 1031) * 4).to(dtype), torch.randn(1031).to(dtype)
            dy = torch.randn(5, 1031).to(dtype)
            tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            assert_close(
                mod.gelu_tanh_fwd(x, bias),
                bias_gelu_reference(x.double(), bias.double(), "tanh").to(dtype),
                name="gelu tanh",
                **tol,
            )
            assert_close(
                mod.gelu_tanh_bwd(dy, x, bias),
                bias_gelu_backward_reference(dy.double(), x.double(), bias.double(), "tanh").to(dtype),
                name="gelu tanh backward",
                **tol,
            )
        from graphtrain.kernels import linear_cross_entropy

        h, w, t = torch.randn(40, 24), torch.randn(97, 24), torch.randint(0, 97, (40,))
        hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
        linear_cross_entropy(hc, wc, t, chunk_rows=7).backward()
        he, we = h.clone().requires_grad_(), w.clone().requires_grad_()
        torch.nn.functional.cross_entropy(he @ we.t(), t).backward()
        assert_close(hc.grad, he.grad, name="d hidden")
        assert_close(wc.grad, we.grad, name="d weight")
        src = torch.randn(70, 45).bfloat16().t()  # the transpose, ATen's generic (scalar) tiles below AVX-512
        dst = torch.empty(45, 70, dtype=torch.bfloat16)
        mod.transpose_bf16(src, dst)
        assert torch.equal(dst, src.contiguous())
    assert not _common.runtime_fallbacks()


def test_probes_are_bounded_and_cached_per_machine(tmp_path, monkeypatch):
    from graphtrain.kernels.flops import machine_peak, measure_peak

    monkeypatch.setenv("GRAPHTRAIN_PROBE_CACHE", str(tmp_path / "probes.json"))
    t0 = time.perf_counter()
    p = measure_peak(sizes=(64, 128, 4096), repeats=2, budget_s=0.3)
    took = time.perf_counter() - t0
    assert p["fp32"] > 0 and p["bf16"] > 0 and set(p["sizes_run"]) >= {"bf16", "fp32_aten"}
    assert 4096 not in p["sizes_run"]["bf16"]  # a 4096^3 matmul never fits 0.3 s on a 2-core CPU
    assert took < 10, took
    calls = []

    def run():
        calls.append(1)
        return {"value": 42}

    first = capability.cached_probe("demo", run)
    again = capability.cached_probe("demo", run)
    assert first == {"value": 42, "cached": False} and again == {"value": 42, "cached": True} and len(calls) == 1
    table = json.loads((tmp_path / "probes.json").read_text())
    assert table[capability.machine_key()]["demo"] == {"value": 42}
    with capability.simulate("avx2"):  # another machine, another entry
        assert capability.cached_probe("demo", run)["cached"] is False
    monkeypatch.setattr("graphtrain.kernels.flops.measure_peak", lambda device="cpu": {"fp32": 1.0, "bf16": 2.0})
    assert machine_peak()["cached"] is False and machine_peak()["cached"] is True


@x86
def test_default_job_engine_path_end_to_end_on_a_simulated_avx2_epyc(tmp_path):
    """`graphtrain train` with the default job's model, data, engine and passes (shortened: 3 steps at batch 2,
    seq 64) as a new user runs it, on an AVX2-only CPU approximated by capability simulation plus torch's own
    ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2: it trains through the engine, with no fallback and
    no fused op falling back, and says which machine it saw."""
    env = dict(os.environ, **AVX2_ENV)
    cmd = [
        sys.executable,
        "-m",
        "graphtrain",
        "train",
        str(ROOT / "configs" / "default.yaml"),
        "train.steps=3",
        "train.batch_size=2",
        "data.seq_len=64",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_tokens=4",
        "train.progress=false",
        f"train.out_dir={tmp_path / 'run'}",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "done: 3 steps" in out.stdout
    # provider auto measures each graph: Inductor or aten, whichever ran it faster on this machine
    assert (
        "engine: " in out.stdout
        and re.search(r"graph\(s\)(?:, provider| on) (aten|inductor)", out.stdout)
        and "precision fp32" in out.stdout
    )
    assert "machine: " in out.stdout and "avx2, simulated avx2" in out.stdout
    assert "fallbacks 0" in out.stdout and "fused-op fallbacks 0" in out.stdout
    assert "oneDNN's fp32 GEMM unavailable" in out.stdout
    assert "GraphtrainFallbackWarning" not in text and "Traceback" not in text


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_process(tmp_path):
    """torch's extension lock is a plain file: a build killed mid-way (preemption, Ctrl-C) left it behind and every
    later process waited on it forever, silently. A fresh process now clears it under graphtrain's flock, warns, and
    loads the kernels."""
    if _cpu_ext.load() is None:
        pytest.skip(f"graphtrain's C++ kernels are not built here: {_cpu_ext.build_error()}")
    name = f"{_cpu_ext.module_name()}_{_cpu_ext.isa_level()}"
    lock = Path(_cpu_ext.build_directory(name)) / "lock"
    lock.touch()
    try:
        code = (
            "import warnings; warnings.simplefilter('always')\n"
            "from graphtrain.kernels import _cpu_ext\n"
            "assert _cpu_ext.load() is not None, _cpu_ext.build_error()\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        )
    finally:
        lock.unlink(missing_ok=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "removed a build lock left by a killed build" in r.stderr, r.stderr[-2000:]
    assert not lock.exists()


def test_the_kernels_build_folder_is_per_torch_install(monkeypatch):
    """Two environments sharing ~/.cache (a checkout and CI's fresh clone) each rebuilt the shared folder in turn."""
    a = _cpu_ext.build_directory("graphtrain_probe")
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    b = _cpu_ext.build_directory("graphtrain_probe")
    assert a != b and Path(a).name.startswith("graphtrain_probe-")
    for d in (a, b):
        os.rmdir(d)
