"""provider auto's tiered compile (runtime/tiered.py Tiered, runtime/background.py): aten runs a graph from the first
step, a background process compiles Inductor into the caches from the second, and the graph switches to the
measured winner loaded from those caches. Checked against eager PyTorch like every provider."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

import graphtrain
from graphtrain.config.sections import ModelConfig
from graphtrain.models import build_model
from graphtrain.testing import assert_grads_close


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 512, (2, 32), generator=g), torch.randint(0, 512, (2, 32), generator=g)


def _step(model: nn.Module, step: int) -> None:
    torch.manual_seed(100 + step)
    model(*_batch(step)).backward()


def test_aten_first_then_the_measured_winner_loaded_from_the_background_compile(monkeypatch):
    from torch._dynamo.utils import counters

    import graphtrain.runtime.measured as measured
    import graphtrain.runtime.workers as workers
    from graphtrain.frontend.accelerate import load_pending

    timed = []
    real_time_step = measured.time_step

    def spy(fn, args, **kw):
        timed.append(kw.get("warmed", False))
        return real_time_step(fn, args, **kw)

    monkeypatch.setattr(measured, "time_step", spy)
    torch.manual_seed(0)
    ref = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0)).train()
    m = graphtrain.accelerate(copy.deepcopy(ref), fallback="error")
    _step(m, 0)
    rep = graphtrain.report(m)
    assert rep.graphs and all(g["provider"].startswith("aten (provider auto: Inductor compiles") for g in rep.graphs)
    _step(m, 1)  # the second call starts the background process
    hits = counters["inductor"]["fxgraph_cache_hit"]
    # and switches every graph: Inductor's code loaded from the caches, both timed on inputs shaped as the last
    # call's, the faster kept, before the next step
    assert graphtrain.wait_compiled(m, timeout=600)
    loaded = counters["inductor"]["fxgraph_cache_hit"] - hits
    assert timed and all(g["provider"] in ("aten", "inductor") for g in graphtrain.report(m).graphs)
    assert not load_pending(m)
    for p in m.parameters():
        p.grad = None
    _step(m, 2)  # the winners run; nothing is timed or loaded inside the step
    assert counters["inductor"]["fxgraph_cache_hit"] - hits == loaded, "the switch loaded Inductor again"
    _step(ref, 2)
    assert_grads_close(m, ref, rtol=1e-4, atol=1e-5)
    rep = graphtrain.report(m)
    assert not rep.fallbacks, rep.fallbacks
    for g in rep.graphs:
        assert g["provider"] in ("aten", "inductor"), g["provider"]
        assert set(g["provider_times"]) == {"aten", "inductor"}
        assert any(n.startswith("tiered compile: aten ran the first") for n in g["notes"]), g["notes"]
    # loaded, not compiled again: the training process's Inductor compiles were cache hits
    assert counters["inductor"]["fxgraph_cache_hit"] - hits >= len(rep.graphs)

    # per graph, aten (it ran the earlier calls) is timed without a warm-up call, Inductor with one
    assert timed == [True, False] * len(rep.graphs), timed

    # A later process whose predecessor's background compile finished but never got to time both (it exited
    # first): the decisions are missing, the compile's marks are there. No child this time: the graphs switch at
    # the second step, loading Inductor from the caches, and store the decision.
    import torch._dynamo as dynamo

    from graphtrain.config.sections import EngineConfig
    from graphtrain.pipeline.cache import cache_root

    decisions = list((cache_root(EngineConfig()) / "providers").glob("*.json"))
    assert len(decisions) == len(rep.graphs)
    for d in decisions:
        d.unlink()
    dynamo.reset()
    again = graphtrain.accelerate(copy.deepcopy(ref), fallback="error")
    _step(again, 3)
    assert all(
        g["provider"].startswith("aten (provider auto: Inductor is in the caches")
        for g in graphtrain.report(again).graphs
    )
    for p in [*again.parameters(), *ref.parameters()]:
        p.grad = None
    _step(again, 4)
    _step(ref, 4)
    assert_grads_close(again, ref, rtol=1e-4, atol=1e-5)
    rep = graphtrain.report(again)
    assert not rep.fallbacks and workers._CHILDREN == [] and getattr(again._graphtrain.background, "proc", None) is None
    for g in rep.graphs:
        assert set(g["provider_times"]) == {"aten", "inductor"}, g
        assert any("Inductor compiled by an earlier process's background compile" in n for n in g["notes"]), g
    assert len(list((cache_root(EngineConfig()) / "providers").glob("*.json"))) == len(rep.graphs)


def test_a_graph_inductor_refuses_stays_on_aten_with_a_note():
    class Net(nn.Module):  # a plain dropout between two linears, graphtrain's dropout fusion off: ATen's bernoulli
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.drop = nn.Linear(8, 16), nn.Linear(16, 4), nn.Dropout(0.1)

        def forward(self, x):
            return self.b(self.drop(torch.relu(self.a(x))))

    m = graphtrain.accelerate(
        Net().train(), compile_blocks=False, fallback="error", passes={"fuse_bias_dropout_add": False}
    )
    x = torch.randn(4, 8)
    for _ in range(2):
        m(x).sum().backward()
    assert graphtrain.wait_compiled(m, timeout=600)
    m(x).sum().backward()
    rep = graphtrain.report(m)
    g = rep.graphs[0]
    assert g["provider"] == "aten" and not rep.fallbacks
    assert any("inductor is not a candidate" in n and "ATen random ops" in n for n in g["notes"]), g["notes"]


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def test_off_switch_and_bad_input():
    m = graphtrain.accelerate(_Tiny(), compile_in_background=False, fallback="error")
    m(torch.randn(2, 4)).sum().backward()
    assert graphtrain.report(m).graphs[0]["provider"] in ("aten", "inductor")  # measured before the first step
    assert graphtrain.wait_compiled(m, timeout=1)  # nothing queued
    with pytest.raises(TypeError, match="graphtrain.accelerate"):
        graphtrain.wait_compiled(nn.Linear(2, 2))


class _NoGradRegion(nn.Module):
    """Computes a constant under no_grad inside its forward, as Llama's rotary embedding does (cos/sin)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        with torch.no_grad():
            scale = torch.cos(torch.arange(16, dtype=x.dtype))
        return self.b(torch.relu(self.a(x)) * scale)


def test_a_graph_with_a_no_grad_region_runs_on_aten_while_inductor_compiles_in_the_background():
    """A graph that switches grad mode inside used to be compiled by both providers before the first step (HF
    Llama, 6 layers, width 512: first step 19.5 s cold, against 6.1 s tiered; 2-core AVX2 EPYC). Now it is tiered
    like any other graph. The switch itself is checked by the slow test below."""
    torch.manual_seed(0)
    ref = _NoGradRegion().train()
    m = graphtrain.accelerate(copy.deepcopy(ref), compile_blocks=False, fallback="error")
    x = torch.randn(4, 8)
    m(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_close(m, ref, rtol=0, atol=0)
    rep = graphtrain.report(m)
    g = rep.graphs[0]
    assert g["provider"].startswith("aten (provider auto: Inductor compiles"), g["provider"]
    assert any("no_grad region in a graph: lifted" in n for n in rep.notes), rep.notes  # passes/no_grad_regions.py


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


def test_an_evaluation_graph_of_a_module_that_trains_runs_on_aten_without_a_background_compile():
    """The default job's evaluation at step 200 used to queue a background compile of its no_grad graph, which
    slowed the next ~30 training steps about 2.5x on 2 cores. A module used only for inference is still tiered."""
    from graphtrain.runtime import workers

    torch.manual_seed(0)
    ref = _TwoLayers()
    m = graphtrain.accelerate(copy.deepcopy(ref), compile_blocks=False, fallback="error")
    x = torch.randn(4, 8)
    m(x).sum().backward()
    with torch.no_grad():
        out, expected = m(x), ref(x)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    train, evaluation = graphtrain.report(m).graphs
    assert not train["inference"] and evaluation["inference"]
    assert train["provider"].startswith("aten (provider auto: Inductor compiles"), train["provider"]
    assert evaluation["provider"] == "aten" and any("without a background compile" in n for n in evaluation["notes"])
    worker = workers.worker(m._graphtrain)
    assert len(worker.queued) + len(worker.running) == 1  # the training graph's job only
    only_eval = graphtrain.accelerate(copy.deepcopy(ref), compile_blocks=False, fallback="error")
    with torch.no_grad():
        only_eval(x)
    g = graphtrain.report(only_eval).graphs[0]
    assert g["inference"] and g["provider"].startswith("aten (provider auto: Inductor compiles"), g["provider"]


@pytest.mark.slow
def test_a_graph_with_a_no_grad_region_switches_to_the_measured_winner():
    torch.manual_seed(0)
    ref = _NoGradRegion().train()
    m = graphtrain.accelerate(copy.deepcopy(ref), compile_blocks=False, fallback="error")
    x = torch.randn(4, 8)
    for _ in range(2):
        m(x).sum().backward()
    assert graphtrain.wait_compiled(m, timeout=600)
    for p in m.parameters():
        p.grad = None
    m(x).sum().backward()  # loads Inductor from the caches, times both and keeps the faster
    ref(x).sum().backward()
    assert_grads_close(m, ref, rtol=1e-5, atol=1e-6)
    rep = graphtrain.report(m)
    assert not rep.fallbacks and set(rep.graphs[0]["provider_times"]) == {"aten", "inductor"}, rep.graphs[0]
    assert any(n.startswith("tiered compile: aten ran the first") for n in rep.graphs[0]["notes"])


@pytest.mark.parametrize("between_steps", [False, True])
def test_warm_start_runs_aten_first_then_loads_the_stored_inductor_winner(monkeypatch, between_steps):
    """A process that finds Inductor stored as a graph's winner (a warm cache) runs the first step on aten and
    loads Inductor from the caches at the second call, or between the steps (wait_compiled), without timing
    again; gradients match eager at every step."""
    import torch._dynamo

    import graphtrain.runtime.measured as measured
    from graphtrain.frontend.accelerate import load_pending, switch_between_steps

    monkeypatch.setattr(measured, "decide", lambda times: "inductor")  # the stored winner, whatever the timing
    torch.manual_seed(0)
    ref = _NoGradRegion().train()
    x = torch.randn(4, 8)
    cold = graphtrain.accelerate(
        copy.deepcopy(ref), compile_blocks=False, compile_in_background=False, fallback="error"
    )
    cold(x).sum().backward()  # both compiled and timed now; the decision is stored
    assert graphtrain.report(cold).graphs[0]["provider"] == "inductor"
    torch._dynamo.reset()

    def no_timing(*a, **k):
        raise AssertionError("a stored decision is not timed again")

    monkeypatch.setattr(measured, "time_step", no_timing)
    warm = graphtrain.accelerate(copy.deepcopy(ref), compile_blocks=False, fallback="error")
    if between_steps:
        switch_between_steps(warm)  # as the trainer says before its first step
    warm(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_close(warm, ref, rtol=0, atol=0)  # aten: bitwise
    g = graphtrain.report(warm).graphs[0]
    assert g["provider"].startswith("aten (provider auto: the stored winner, Inductor"), g["provider"]
    assert load_pending(warm)
    for p in [*warm.parameters(), *ref.parameters()]:
        p.grad = None
    if between_steps:  # the trainer loads it after the first step (trainer/compile_wait.py)
        assert graphtrain.wait_compiled(warm, timeout=0)
        assert graphtrain.report(warm).graphs[0]["provider"] == "inductor" and not load_pending(warm)
    warm(x).sum().backward()  # else the second call loads Inductor
    ref(x).sum().backward()
    assert_grads_close(warm, ref, rtol=1e-5, atol=1e-6)
    rep = graphtrain.report(warm)
    g = rep.graphs[0]
    assert g["provider"] == "inductor" and not rep.fallbacks, (g, rep.fallbacks)
    assert any(n.startswith("warm start: aten ran the first 1 call(s)") for n in g["notes"]), g["notes"]
    assert any("decided by an earlier process" in n for n in g["notes"]), g["notes"]
    # aten's pass records were dropped with it: the graph's records are the loaded winner's, each pass once
    from collections import Counter

    counts = Counter((r.stage, r.name) for r in warm._graphtrain.passes)
    assert counts and set(counts.values()) == {1}, counts


def test_the_prefetched_inductor_setup_gives_the_keys_inductor_computes_itself(monkeypatch):
    import torch._inductor.codecache as codecache

    from graphtrain.runtime import workers

    if not hasattr(codecache.torch_key, "prefetch"):
        pytest.skip("this torch's torch_key cannot be prefetched")
    monkeypatch.setattr(workers, "_PREFETCHED", False)
    codecache.torch_key.clear()
    workers.prefetch_inductor_setup()
    workers.prefetch_inductor_setup()  # once per process: a second call starts nothing
    prefetched = codecache.torch_key()
    codecache.torch_key.clear()
    assert codecache.torch_key() == prefetched


def test_at_exit_a_running_compile_finishes_at_low_priority_or_is_stopped(monkeypatch, tmp_path, capsys):
    """engine.background_at_exit: at the training process's exit a child whose engine says finish keeps running,
    reniced, with its folder (it removes that itself); one that says stop is killed and its folder removed."""
    import subprocess
    import sys

    import graphtrain.runtime.workers as workers
    from graphtrain.config.sections import EngineConfig

    monkeypatch.delenv(workers.AT_EXIT_ENV, raising=False)
    # the default ends the child with the run (issue #50); finish is the opt-in
    assert not workers.finish_at_exit(EngineConfig()) and workers.finish_at_exit(
        EngineConfig(background_at_exit="finish")
    )
    monkeypatch.setenv(workers.AT_EXIT_ENV, "stop")
    assert not workers.finish_at_exit(EngineConfig())
    monkeypatch.setenv(workers.AT_EXIT_ENV, "finish")
    assert workers.finish_at_exit(EngineConfig(background_at_exit="stop"))
    monkeypatch.setenv(workers.AT_EXIT_ENV, "later")
    with pytest.warns(UserWarning, match="GRAPHTRAIN_BACKGROUND_AT_EXIT='later' is ignored: set it to finish or stop"):
        assert not workers.finish_at_exit(EngineConfig(background_at_exit="stop"))
    with pytest.raises(ValueError, match="background_at_exit"):
        EngineConfig(background_at_exit="wait")

    children = []
    for name, finish in (("finishing", True), ("stopped", False)):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        proc.graphtrain_folder, proc.graphtrain_finish = tmp_path / name, finish
        proc.graphtrain_folder.mkdir()
        children.append(proc)
    monkeypatch.setattr(workers, "_CHILDREN", list(children))
    finishing, stopped = children
    try:
        workers._at_exit()
        assert workers._CHILDREN == []
        assert stopped.poll() is not None and not stopped.graphtrain_folder.exists()
        assert finishing.poll() is None and finishing.graphtrain_folder.exists()
        assert os.getpriority(os.PRIO_PROCESS, finishing.pid) >= workers.FINISH_NICE
        err = capsys.readouterr().err
        assert f"(pid {finishing.pid}) finishes after this process" in err and "graphtrain cache stop" in err
    finally:
        finishing.kill()
        finishing.wait()


_SHORT_RUN = """
import sys, torch, graphtrain
import graphtrain.runtime.tiered as tiered
import graphtrain.runtime.workers as workers
from graphtrain.config.sections import ModelConfig
from graphtrain.models import build_model
torch.manual_seed(0)
m = graphtrain.accelerate(build_model(ModelConfig(name="gpt2-tiny", dropout=0.0)), fallback="error")
x = torch.randint(0, 512, (2, 32))
for _ in range(2):  # the second call starts the background compile; the process then exits at once
    m(x, x).backward()
(proc,) = workers._CHILDREN
print(proc.pid, proc.graphtrain_folder)
"""


@pytest.mark.slow  # a real Inductor compile of gpt2-tiny's graphs in the background process (~30 s on 2 cores)
def test_a_run_shorter_than_its_background_compile_leaves_the_caches_filled(tmp_path):
    """The first run exits two steps in, long before its background compile is done; that compile finishes on its
    own and cleans up after itself, and the next process finds every graph's Inductor code in the caches."""
    import subprocess
    import sys
    import time

    import graphtrain.runtime.workers as workers

    env = {**os.environ, "GRAPHTRAIN_CACHE": str(tmp_path / "cache")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env[workers.AT_EXIT_ENV] = "finish"
    run = subprocess.run([sys.executable, "-c", _SHORT_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    pid, folder = run.stdout.split()
    assert f"(pid {pid}) finishes after this process" in run.stderr, run.stderr[-2000:]
    deadline = time.monotonic() + 600
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not os.path.exists(f"/proc/{pid}"), "the background compile did not finish"
    assert not os.path.exists(folder), "the orphaned background compile left its folder"

    # the next process: no background compile of its own; every graph loads Inductor from the caches at the
    # second step, times both providers and stores the decision
    check = """
import torch, graphtrain
import graphtrain.runtime.tiered as tiered
import graphtrain.runtime.workers as workers
from torch._dynamo.utils import counters
from graphtrain.config.sections import ModelConfig
from graphtrain.models import build_model
torch.manual_seed(0)
m = graphtrain.accelerate(build_model(ModelConfig(name="gpt2-tiny", dropout=0.0)), fallback="error")
x = torch.randint(0, 512, (2, 32))
for _ in range(3):
    m(x, x).backward()
rep = graphtrain.report(m)
assert not workers._CHILDREN and getattr(m._graphtrain.background, "proc", None) is None
assert all(set(g["provider_times"]) == {"aten", "inductor"} for g in rep.graphs), rep.graphs
print(len(rep.graphs), counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"])
"""
    again = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    graphs, hits, misses = (int(v) for v in again.stdout.split()[-3:])
    assert misses == 0 and hits >= graphs > 0, again.stdout
    assert len(list((tmp_path / "cache" / "compile" / "providers").glob("*.json"))) == graphs


_LOWERED_RUN = """
import os, threading, torch, graphtrain
import graphtrain.runtime.workers as workers
from graphtrain.config.sections import ModelConfig
from graphtrain.models import build_model
torch.manual_seed(0)
m = graphtrain.accelerate(build_model(ModelConfig(name="gpt2-tiny", dropout=0.0)), fallback="error")
x = torch.randint(0, 512, (2, 32))
for _ in range(2):  # the second call starts the background compile
    m(x, x).backward()
(proc,) = workers._CHILDREN
setup = [t for t in threading.enumerate() if t.name == "graphtrain-inductor-setup"]
print(os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, proc.pid),
      [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in setup if t.is_alive()])
"""


@pytest.mark.slow  # 16 s: a real background compile for an opt-in setting (the default changes nothing)
def test_the_background_compile_runs_at_the_priority_asked_for_from_its_start(tmp_path):
    """GRAPHTRAIN_BACKGROUND_NICE lowers the background compile from its start (the training process renices it as
    it spawns it, before its interpreter imports torch) and the training process's Inductor setup thread with it;
    the training process itself keeps its priority. A real child process, its priority read from the kernel."""
    import ast
    import subprocess
    import sys

    env = {**os.environ, "GRAPHTRAIN_CACHE": str(tmp_path / "cache"), "GRAPHTRAIN_BACKGROUND_NICE": "7"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    run = subprocess.run([sys.executable, "-c", _LOWERED_RUN], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    own, child, setup = run.stdout.strip().splitlines()[-1].split(" ", 2)
    assert int(own) == os.getpriority(os.PRIO_PROCESS, 0), run.stdout  # the training process: as started
    assert int(child) == min(19, int(own) + 7), run.stdout
    assert all(n == min(19, int(own) + 7) for n in ast.literal_eval(setup)), run.stdout  # (it may have finished)


def test_pieces_of_a_ddp_bucket_split_are_not_timed_on_aten():
    """Under Dynamo's DDPOptimizer (which marks the tracing context while it compiles a DDP model's buckets) provider
    auto keeps Inductor alone: the aten provider's pieces have no backward torch can compile there (the 2-rank run
    is tests/test_distributed_dp.py, marked slow)."""
    from torch._dynamo.backends.distributed import DDPOptimizerContext
    from torch._guards import TracingContext, tracing

    from graphtrain.runtime.provider_auto import measurable, under_ddp_optimizer

    inputs = [torch.randn(2, 3)]
    assert not under_ddp_optimizer() and measurable(inputs)
    ctx = TracingContext(None)
    with tracing(ctx):
        assert measurable(inputs)
        ctx.ddp_optimizer_ctx = DDPOptimizerContext()
        assert under_ddp_optimizer() and not measurable(inputs)
    assert measurable(inputs)


def test_size_check_of_a_symbolic_graph_compiled_from_data():
    """Inductor's code for a symbolic graph is compiled in a ShapeEnv of its own (tiered.compile_inductor_from):
    the guards that compile adds (Inductor's C++ codegen bounds a reduction's size at 4096, for one) never reach
    Dynamo's guards for the frame, so the calls whose sizes break them run on aten (tiered.size_checked)."""
    from graphtrain.pipeline.graph_data import SizeChecked, input_metas, rebuild_sizes, size_check
    from graphtrain.runtime.tiered import size_checked

    f32 = torch.float32
    metas = [
        ("tensor", ("s52", "s27", 64), ("64*s27", 64, 1), f32, "cpu", True, {"s52": 4, "s27": 32}),
        ("symint", "s27", {"s27": 32}),
        ("value", 0.1),
    ]
    env, size = rebuild_sizes(metas)
    b, t = size("s52"), size("s27")
    assert isinstance(t, torch.SymInt) and size("64*s27").node.hint == 64 * 32 and size(7) == 7
    assert size_check(env, metas, size) is None  # no guard yet
    assert b * t <= 4096  # what Inductor asks while it compiles: a guard on the fresh symbols
    check = size_check(env, metas, size)
    assert check.guards == "(s27*s52 <= 4096)"
    big, small = (torch.empty(64, 65, 64), 65, 0.1), (torch.empty(4, 1024, 64), 1024, 0.1)
    assert check(small) and not check(big)
    routed = size_checked(SizeChecked(lambda *a: "inductor", check), lambda *a: "aten")
    assert routed[0](*small) == "inductor" and routed[0](*big) == "aten"
    assert "calls of other sizes run on aten" in routed[1][0]
    assert size_checked(len, lambda *a: "aten") == (len, [])
    # guards printed with Python's builtins (Max as max): HF Bloom's and GPT-J's heads
    env, size = rebuild_sizes(metas)
    assert torch.sym_max(size("s52"), size("s27")) <= 64
    check = size_check(env, metas, size)
    assert "max(" in check.guards and check((torch.empty(4, 32, 64), 32, 0.1)) and not check(small)
    # two symbols with the same value at capture stay two (no duck sizing): batch 32, length 32
    env, size = rebuild_sizes([("tensor", ("s0", "s1"), ("s1", 1), f32, "cpu", False, {"s0": 32, "s1": 32})])
    assert size("s0").node.expr != size("s1").node.expr
    # a symbol that was 1 at capture stays a symbol (a fresh shape environment would make it the constant 1)
    env, size = rebuild_sizes([("symint", "s9", {"s9": 1})])
    assert isinstance(size("s9"), torch.SymInt)
    # what input_metas makes of a real tensor and of a fake one with symbolic sizes
    assert input_metas([torch.ones(2, 3), 5]) == [("tensor", (2, 3), (3, 1), f32, "cpu", False, {}), ("value", 5)]
    from torch._subclasses.fake_tensor import FakeTensorMode

    env, size = rebuild_sizes(metas)
    with FakeTensorMode(shape_env=env):
        x = torch.empty_strided([size(d) for d in metas[0][1]], [size(d) for d in metas[0][2]])
    (meta,) = input_metas([x])
    assert meta[1][2] == 64 and meta[2][1:] == (64, 1) and sorted(meta[6].values()) == [4, 32]


@pytest.mark.slow  # Inductor compiles gpt2-tiny's three symbolic graphs in the background (~40 s on 2 cores)
def test_dynamic_shapes_start_on_aten_and_switch_to_inductor_for_every_length():
    """engine.dynamic: the symbolic graphs run on aten from the first step while Inductor compiles them in the
    background from data (symbolic sizes included), then switch to the measured winner, every length matching
    eager, with no recompile."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    ref = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0)).train()
    m = graphtrain.accelerate(copy.deepcopy(ref), dynamic=True, fallback="error")

    def step(model, length, seed, batch=2):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 512, (batch, length), generator=g)
        for p in model.parameters():
            p.grad = None
        model(ids, torch.randint(0, 512, (batch, length), generator=g)).backward()

    step(m, 32, 0)
    rep = graphtrain.report(m)
    assert len(rep.graphs) == 3 and all(
        g["provider"].startswith("aten (provider auto: Inductor compiles") for g in rep.graphs
    ), rep.graphs
    step(m, 48, 1)  # the second call starts the background process
    assert graphtrain.wait_compiled(m, timeout=900)
    # the last: 4480 rows, beyond the 4096 Inductor's C++ codegen bounded the row reductions at (its guard): aten
    for i, (batch, length) in enumerate(((2, 17), (2, 64), (2, 40), (70, 64))):
        step(m, length, 2 + i, batch)
        step(ref, length, 2 + i, batch)
        assert_grads_close(m, ref, rtol=1e-4, atol=1e-5)
    rep = graphtrain.report(m)
    assert not rep.fallbacks and not rep.recompiles and len(rep.graphs) == 3, rep
    for g in rep.graphs:
        assert set(g["provider_times"]) == {"aten", "inductor"}, g
        assert any(n.startswith("tiered compile: aten ran the first") for n in g["notes"]), g["notes"]
    assert any(
        "<= 4096)" in n and "(the guards of its compile): calls of other sizes run on aten" in n
        for g in rep.graphs
        for n in g["notes"]
    ), [g["notes"] for g in rep.graphs]
    assert counters["inductor"]["fxgraph_cache_hit"] >= 3


class _TwoBlocks(nn.Module):
    """A stem, two identical blocks and a head: three graphs block by block (widths no other test uses, so the
    session's caches hold none of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Linear(6, 13), nn.Linear(13, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(13, 13), nn.Tanh()) for _ in range(2))

    def forward(self, x):
        h = torch.relu(self.stem(x))
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


@pytest.mark.slow  # ~30 s: the child restarts once per graph (an import of Inductor each); an opt-in setting
def test_a_background_compile_past_its_time_limit_leaves_aten_and_is_not_retried():
    from graphtrain.config.sections import EngineConfig
    from graphtrain.pipeline.cache import cache_root
    from graphtrain.runtime import workers

    torch.manual_seed(0)
    ref = _TwoBlocks().train()
    x = torch.randn(5, 6)
    m = graphtrain.accelerate(copy.deepcopy(ref), fallback="error", background_timeout=0.001)
    for _ in range(2):
        m(x).sum().backward()
    assert graphtrain.wait_compiled(m, timeout=600)  # each graph's compile stopped at once: the child restarts
    for p in [*m.parameters(), *ref.parameters()]:  # itself for the next one (runtime/background.py)
        p.grad = None
    m(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_close(m, ref, rtol=1e-5, atol=1e-6)
    rep = graphtrain.report(m)
    assert len(rep.graphs) >= 2 and not rep.fallbacks, rep.fallbacks
    for g in rep.graphs:
        assert g["provider"] == "aten", g["provider"]
        assert any("took more than 0.001 s (engine.background_timeout)" in n for n in g["notes"]), g["notes"]
    marks = list((cache_root(EngineConfig()) / "providers").glob("*.inductor-timeout"))
    assert len(marks) >= len(rep.graphs)

    # A later process with the same limit spawns no child for these graphs; a higher limit compiles them again.
    import torch._dynamo as dynamo

    dynamo.reset()
    again = graphtrain.accelerate(copy.deepcopy(ref), fallback="error", background_timeout=0.001)
    for _ in range(2):
        again(x).sum().backward()
    assert getattr(again._graphtrain.background, "proc", None) is None and workers._CHILDREN == []
    for g in graphtrain.report(again).graphs:
        assert g["provider"] == "aten" and any(
            "an earlier background compile of this graph took more than 0.001 s" in n for n in g["notes"]
        ), g
    dynamo.reset()
    later = graphtrain.accelerate(copy.deepcopy(ref), fallback="error", background_timeout=600)
    later(x).sum().backward()
    assert all(
        g["provider"].startswith("aten (provider auto: Inductor compiles") for g in graphtrain.report(later).graphs
    )
    with pytest.raises(ValueError, match="engine.background_timeout must be seconds >= 0"):
        graphtrain.accelerate(_Tiny(), background_timeout=-1)


class _Erfcx(nn.Module):
    """erfcx after a linear: under bf16 the linear runs in bf16 and erfcx follows its input's dtype, as under
    autocast, but aten has no bf16 CPU kernel for it ("erfcx_cpu" not implemented for 'BFloat16'): graphtrain's graph
    raises where eager fp32 runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.erfcx(self.lin(x)).sum()


def test_a_module_that_fell_back_starts_no_background_compile():
    """Regression (HF DeBERTa-v2 in bf16 on a cold cache): the first call raised under graphtrain, eager ran it and
    the module fell back; graphtrain.wait_compiled then compiled, loaded and timed its graphs' Inductor code anyway,
    and the error they raised reached the user. A module that runs eagerly has nothing to compile: wait_compiled
    gives its background compile up at once."""
    torch.manual_seed(0)
    ref = _Erfcx()
    model = graphtrain.accelerate(copy.deepcopy(ref), precision="bf16", provider="auto", fallback="warn")
    x = torch.randn(4, 8)
    with pytest.warns(UserWarning, match="compiled graph raised where eager runs"):
        loss = model(x)
    assert graphtrain.wait_compiled(model, timeout=600)
    loss.backward()
    ref(x).backward()
    assert_grads_close(model, ref, bitwise=True)
    assert graphtrain.report(model).eager_only
    model(x).backward()  # and it goes on eagerly
