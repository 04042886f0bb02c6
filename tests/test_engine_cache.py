"""The persistent compile cache: a second process starts its first step from it (graphtrain's pass results,
Inductor's FX graphs, AOTAutograd), filled ahead of a job by `graphtrain precompile`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=2",
    "train.threads=1",
    "train.progress=false",
]


def _precompile(tmp_path, *items: str) -> dict:
    env = {**os.environ, "GRAPHTRAIN_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrain", "precompile", *TINY, *items, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_second_process_reuses_the_pass_results(tmp_path):
    first = _precompile(tmp_path, "engine.provider=aten")
    second = _precompile(tmp_path, "engine.provider=aten")
    n = len(first["graphs"])
    assert n >= 3 and first["cache"]["passes_miss"] == n and first["cache"]["passes_hit"] == 0, first["cache"]
    assert second["cache"]["passes_hit"] == n and second["cache"]["passes_miss"] == 0, second["cache"]
    assert [g["pass_cache"] for g in second["graphs"]] == ["hit"] * n
    # the cached graphs are the optimized ones: the same fused ops, the same op counts
    assert second["fused_ops"] == first["fused_ops"] and second["fused_ops"], second["fused_ops"]
    assert [g["ops_pre_autodiff"] for g in second["graphs"]] == [g["ops_pre_autodiff"] for g in first["graphs"]]


@pytest.mark.slow
def test_second_process_compiles_nothing_with_inductor(tmp_path):
    first = _precompile(tmp_path, "engine.provider=inductor")
    second = _precompile(tmp_path, "engine.provider=inductor")
    assert first["cache"]["fxgraph_miss"] > 0 and first["cache"]["aot_miss"] > 0, first["cache"]
    c = second["cache"]
    assert c["passes_miss"] == 0 and c["fxgraph_miss"] == 0 and c["aot_miss"] == 0, c
    assert c["aot_hit"] == first["cache"]["aot_miss"], c
    assert second["first_step_seconds"] < first["first_step_seconds"]


def test_precompile_refuses_a_job_that_compiles_nothing(tmp_path):
    env = {**os.environ, "GRAPHTRAIN_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrain", "precompile", *TINY, "train.accelerate=false"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2 and "nothing to precompile" in proc.stderr, proc.stderr


def test_stored_graph_keeps_ops_without_inputs_random():
    """Regression: FX's own GraphModule pickle re-traces the code on load and froze a dropout mask (an op chain
    with no graph input) into a constant. The stored graph must draw a new mask on every call."""
    import pickle

    import torch
    import torch.fx as fx

    from graphtrain.pipeline.cache import _decode_graph, _encode_graph
    from graphtrain.pipeline.stages import trace

    gm = trace(
        fx.symbolic_trace(lambda x: torch.nn.functional.dropout(x, 0.5, True) + torch.arange(8.0)), [torch.randn(8, 8)]
    )
    loaded = _decode_graph(pickle.loads(pickle.dumps(_encode_graph(gm))))
    x = torch.ones(8, 8)
    torch.manual_seed(0)
    a = gm(x)
    torch.manual_seed(0)
    b = loaded(x)
    assert torch.equal(a, b)  # the same ops, the same random stream
    assert not torch.equal(loaded(x), b)  # and a fresh mask on the next call


def test_stored_graph_keeps_a_size_node_inside_a_slice():
    """Regression: under dynamic shapes Dynamo writes ``x[:, :n]`` as getitem with a slice whose stop is the size
    node; the decoder rebuilt lists, tuples and dicts but left the slice holding the encoded reference, and the
    graph's code failed to compile (HF BERT's position ids, in provider auto's background job)."""
    import operator
    import pickle

    import torch
    import torch.fx as fx

    from graphtrain.pipeline.cache import _decode_graph, _encode_graph

    g = fx.Graph()
    x, n = g.placeholder("x"), g.placeholder("n")
    g.output(g.call_function(operator.getitem, (x, (slice(None, None, None), slice(0, n, None)))))
    loaded = _decode_graph(pickle.loads(pickle.dumps(_encode_graph(fx.GraphModule({}, g)))))
    x = torch.arange(12).reshape(2, 6)
    assert torch.equal(loaded(x, 4), x[:, :4])


def test_a_stored_graph_registers_a_libraries_custom_op_in_a_fresh_process(tmp_path, monkeypatch):
    """Regression: a graph that calls a library's custom op (HF Mixtral's experts: ``transformers::grouped_mm_fallback``)
    failed to load in the background compile's process, which had not imported the module that registers the op, so
    Inductor's candidate fell back. The stored graph names that module; a fresh interpreter loads and runs it."""
    import pickle

    import torch
    import torch.fx as fx

    from graphtrain.pipeline.cache import _encode_graph

    (tmp_path / "gt_user_ops.py").write_text(
        "import torch\n"
        "@torch.library.custom_op('gt_user_ops::twice', mutates_args=())\n"
        "def twice(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x * 2\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import gt_user_ops  # noqa: F401  (registers the op in this process only)

    g = fx.Graph()  # Dynamo's graphs call the op's packet, graphtrain's passes an overload
    x = g.call_function(torch.ops.gt_user_ops.twice, (g.placeholder("x"),))
    g.output(g.call_function(torch.ops.gt_user_ops.twice.default, (x,)))
    (tmp_path / "graph.pkl").write_bytes(pickle.dumps(_encode_graph(fx.GraphModule({}, g))))
    code = (
        "import pickle, sys, torch\n"
        "from graphtrain.pipeline.cache import _decode_graph\n"
        "assert 'gt_user_ops' not in sys.modules\n"
        f"gm = _decode_graph(pickle.loads(open({str(tmp_path / 'graph.pkl')!r}, 'rb').read()))\n"
        "print(gm(torch.arange(3.0)).tolist())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[0.0, 4.0, 8.0]"


def test_cached_pass_failure_still_warns_and_reports(tmp_path, monkeypatch):
    """Regression (a CI failure): a pass that fell back on the first compile is stored with its error; a later
    compile that hits the cache must warn and report the same fallback, not run the stored graph silently."""
    import torch

    import graphtrain
    from graphtrain.config import fallback
    from graphtrain.config.sections import ModelConfig
    from graphtrain.kernels import capability
    from graphtrain.models import build_model

    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(tmp_path / "cache"))
    ids = torch.randint(0, 512, (2, 16))
    caches = []
    with capability.simulate("avx2"):
        for _ in range(2):
            torch._dynamo.reset()
            fallback._WARNED.clear()
            torch.manual_seed(0)
            m = graphtrain.accelerate(
                build_model(ModelConfig(name="gpt2-tiny", dropout=0.0), vocab_size=512),
                provider="aten",
                passes={"lower_gemm_onednn": True},
                compile_blocks=False,
            )
            with pytest.warns(fallback.GraphtrainFallbackWarning, match="lower_gemm_onednn"):
                m(ids, ids)
            rep = graphtrain.report(m)
            assert any(part == "pass lower_gemm_onednn" for part, _ in rep.fallbacks), rep.fallbacks
            caches.append([g["pass_cache"] for g in rep.graphs])
    assert caches == [["miss"], ["hit"]], caches


def test_the_pass_cache_key_names_what_is_compiled_not_where_or_how_loudly():
    import dataclasses

    import torch
    import torch.fx as fx

    from graphtrain.config.sections import EngineConfig
    from graphtrain.pipeline.cache import pass_cache_key

    gm = fx.symbolic_trace(torch.nn.Linear(4, 3))
    x = torch.randn(2, 4)
    base = EngineConfig()
    key = pass_cache_key(gm, [x], ["input"], base)
    for same in (
        {"fallback": "error"},
        {"background_at_exit": "stop"},
        {"compile_in_background": False},
        {"cache_dir": "/elsewhere"},
        {"background_timeout": 5.0},
    ):
        assert pass_cache_key(gm, [x], ["input"], dataclasses.replace(base, **same)) == key, same
    for other in ({"recompute": "selective"}, {"precision": "bf16"}, {"provider": "aten"}):
        assert pass_cache_key(gm, [x], ["input"], dataclasses.replace(base, **other)) != key, other
    assert pass_cache_key(gm, [torch.randn(3, 4)], ["input"], base) != key


def test_the_source_digest_reads_folders_that_exist():
    """Regression: after the move to a folder per floor the digest still named engine/, and every key (Inductor's
    included) raised FileNotFoundError."""
    from pathlib import Path

    from graphtrain.pipeline import cache

    root = Path(cache.__file__).resolve().parent.parent
    assert [name for name in cache._SOURCES if not (root / name).exists()] == []
    assert len(cache.source_digest()) == 64


def test_the_pass_cache_key_covers_the_dynamo_stage(monkeypatch):
    """hide_autograd_functions runs after the key is taken (on the graph the key digests): its code and its switch
    are in the key, as every pre-autodiff pass's are."""
    import dataclasses

    import torch
    import torch.fx as fx

    from graphtrain.config.sections import EngineConfig
    from graphtrain.passes import manager
    from graphtrain.pipeline.cache import pass_cache_key

    gm = fx.symbolic_trace(torch.nn.Linear(4, 3))
    x = torch.randn(2, 4)
    base = EngineConfig()
    key = pass_cache_key(gm, [x], ["input"], base)
    off = dataclasses.replace(base, passes={"hide_autograd_functions": False})
    assert pass_cache_key(gm, [x], ["input"], off) != key

    def other_hide_autograd_functions_pass(gm, ctx):
        return gm

    monkeypatch.setattr(manager._REGISTRY["hide_autograd_functions"], "fn", other_hide_autograd_functions_pass)
    assert pass_cache_key(gm, [x], ["input"], base) != key


def test_inductors_keys_carry_graphtrain_sources(monkeypatch):
    """What keys Inductor's caches by graphtrain's sources (the end-to-end check below is slow): the uuid of the
    forward/backward passes Inductor runs, which its FX-graph and AOTAutograd cache keys include."""
    from graphtrain.config.sections import EngineConfig
    from graphtrain.pipeline import cache
    from graphtrain.runtime.providers import StagePasses

    passes = StagePasses(EngineConfig(provider="inductor"), rec=None, state=None)
    before = passes.uuid()
    assert passes.uuid() == before
    monkeypatch.setattr(cache, "_SOURCE_DIGEST", "graphtrain with another backward formula")
    assert passes.uuid() != before
    # and by the vector ISA Inductor generates C++ for (ATEN_CPU_CAPABILITY picks it): AVX2 code loaded by an AVX-512
    # process corrupted the heap
    other = passes.uuid()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # no vectorization: differs from every x86 machine's pick
    assert passes.uuid() != other


@pytest.mark.slow  # two Inductor compiles, ~11 s on a 2-core Zen 4: the uuid test above is the default suite's check
def test_inductor_caches_are_keyed_by_graphtrain_sources(tmp_path, monkeypatch):
    """Regression: Inductor's AOTAutograd cache keys a graph before autodiff, so a fused op whose backward formula
    changed (graphtrain::gemm's weight gradient, computed in the weight's layout since) ran the backward graph
    compiled with the old formula, loaded from the cache. graphtrain's sources are in Inductor's keys now."""
    import torch
    from torch._dynamo.utils import counters

    import graphtrain
    from graphtrain.pipeline import cache

    def compile_once() -> tuple[int, int]:
        torch._dynamo.reset()
        hits, misses = counters["aot_autograd"]["autograd_cache_hit"], counters["aot_autograd"]["autograd_cache_miss"]
        torch.manual_seed(0)
        model = graphtrain.accelerate(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)),
            provider="inductor",
            cache_dir=str(tmp_path / "cache"),
        )
        model(torch.randn(3, 8)).square().sum().backward()
        return (
            counters["aot_autograd"]["autograd_cache_hit"] - hits,
            counters["aot_autograd"]["autograd_cache_miss"] - misses,
        )

    first = compile_once()
    assert first[1] > 0, first
    # changed sources: compiled again, nothing stale loaded (unchanged ones hit: test_second_process_compiles_...)
    monkeypatch.setattr(cache, "_SOURCE_DIGEST", "graphtrain with another backward formula")
    assert compile_once() == (0, first[1])


AUTOCAST_RUN = r"""
import sys, torch
import graphtrain  # noqa: F401  (registers the backend)
from graphtrain.models import build_model
from graphtrain.config.sections import ModelConfig
torch.manual_seed(0)
model = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))
ref = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))
ref.load_state_dict(model.state_dict())
x = torch.randint(0, model.spec.vocab_size, (2, 32))
y = torch.randint(0, model.spec.vocab_size, (2, 32))
bf16 = sys.argv[1] == "bf16"
ctx = (lambda: torch.autocast("cpu", torch.bfloat16)) if bf16 else torch.enable_grad
step = torch.compile(model, backend="graphtrain")
with ctx():
    got = step(x, y)
    want = ref(x, y)
tol = 2e-2 if bf16 else 1e-5
assert abs(float(got) - float(want)) <= tol * abs(float(want)), (float(got), float(want))
print("ok", float(got), float(want))
"""


@pytest.mark.parametrize(
    "order",
    [
        ("bf16", "fp32"),  # the silent one stays in the default suite
        pytest.param(("fp32", "bf16"), marks=pytest.mark.slow),  # the loud one (a crash): 2 processes, ~12-20 s
    ],
    ids=["bf16-then-fp32", "fp32-then-bf16"],
)
def test_one_cache_keeps_fp32_and_bf16_autocast_graphs_apart(tmp_path, order):
    """The same model through the torch.compile backend, once in fp32 and once under bf16 autocast, in two processes
    sharing one cache, in either order: each matches eager under its own precision. The pass-cache key once left the
    ambient autocast out: the bf16 run after the fp32 one crashed on mixed dtypes, and the fp32 run after the bf16
    one silently trained the bf16 graph."""
    env = {**os.environ, "GRAPHTRAIN_CACHE": str(tmp_path / "-".join(order)), "PYTHONWARNINGS": "ignore"}
    for precision in order:
        r = subprocess.run(
            [sys.executable, "-c", AUTOCAST_RUN, precision], capture_output=True, text=True, env=env, timeout=600
        )
        assert r.returncode == 0 and "ok" in r.stdout, (order, precision, r.stderr[-3000:])
