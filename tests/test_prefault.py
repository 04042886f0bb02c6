"""memory/prefault.py: a first step's fresh CPU memory is recorded, and a later process with the same model primes
it (faults it in on a background thread) while Dynamo traces. Page faults and counters are checked, never time;
each case runs in a fresh process (the allocator is per process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

MIB = 2**20


def _needs_cpp() -> None:
    from graphtrain.kernels import _cpu_ext

    if _cpu_ext.load() is None:
        pytest.skip(f"graphtrain's C++ kernels do not build here: {_cpu_ext.build_error()}")


def _run(code: str, *args: str, env: dict[str, str] | None = None) -> dict:
    import os

    r = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


_ALLOCATOR = textwrap.dedent("""
    import json, resource, time, torch
    from graphtrain.runtime.allocator import set_cpu_allocator
    from graphtrain.memory import allocator

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    MIB = 2**20
    set_cpu_allocator("keep", huge_pages=False)
    from graphtrain.kernels import _cpu_ext
    mod = _cpu_ext.load()
    mod.block_allocator(True, False, False)  # graphtrain's allocator: 4 KiB pages (to count), no cache
    KEYS = ("in_use_bytes", "cached_bytes", "high_water_bytes", "hits", "misses", "evictions", "missed_bytes",
            "primed_bytes")
    stats = lambda: dict(zip(KEYS, mod.block_cache_stats()))
    out = {}
    allocator.record_requests(True)
    a = torch.empty(3 * MIB // 4)
    b = torch.empty(5 * MIB // 4)
    del a
    a2 = torch.empty(3 * MIB // 4)       # a freed block of its size came first: not fresh memory
    small = torch.empty(MIB // 4)        # under 2 MiB: not recorded
    out["recorded"] = allocator.record_requests(False)
    del a2, b, small

    allocator.record_requests(True)      # the next "first step", primed from that record plus a size never asked
    allocator.prime([4 * MIB, 6 * MIB])
    deadline = time.time() + 60
    while stats()["primed_bytes"] < 10 * MIB and time.time() < deadline:
        time.sleep(0.01)
    f0 = faults()
    x = torch.empty(4 * MIB // 4).fill_(1.0)   # primed: its pages are in already
    out["primed_faults"] = faults() - f0
    del x                                       # cache off, yet the primed block stays for the next request
    hits = stats()["hits"]
    f0 = faults()
    y = torch.empty(4 * MIB // 4).fill_(2.0)
    out["again_faults"], out["again_hits"] = faults() - f0, stats()["hits"] - hits
    f0 = faults()
    z = torch.empty(40 * MIB // 4).fill_(3.0)   # never primed (nor freed before): faulted in page by page
    out["fresh_faults"] = faults() - f0
    out["settled"] = allocator.settle_priming()
    out["recorded_primed"] = allocator.record_requests(False)
    out["after"] = stats()
    out["values"] = [float(y.sum()), float(z.sum())]
    print(json.dumps(out))
""")


def test_record_and_prime_in_the_allocator():
    """The recorder lists the fresh requests of 2 MiB and more (not the ones a freed block of their size could
    serve); a primed block serves its request without page faults and stays with the allocator when freed, cache
    off; settling gives back the primed block nobody asked for."""
    _needs_cpp()
    out = _run(_ALLOCATOR)
    assert out["recorded"] == [3 * MIB, 5 * MIB], out
    pages = 4 * MIB // 4096
    assert out["primed_faults"] < pages // 10, out  # without priming: every 4 KiB page
    assert out["again_faults"] < pages // 10 and out["again_hits"] == 1, out
    assert out["fresh_faults"] >= 40 * MIB // 4096 // 2, out  # the check above can fail: fresh pages do fault
    assert out["settled"] == {"primed": 2, "taken": 1, "returned_bytes": 6 * MIB}, out
    assert out["recorded_primed"] == [4 * MIB, 40 * MIB], out  # a primed request is still the step's fresh memory
    assert out["after"]["primed_bytes"] == 0, out
    assert out["values"] == [2.0 * MIB, 3.0 * 40 * MIB // 4], out


_TRAIN = textwrap.dedent("""
    import json, sys, torch
    import graphtrain
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024))
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    # huge pages on: priming needs graphtrain's allocator, which engine.cpu_huge_pages auto leaves off for a model
    # this small under the keep allocator
    model = graphtrain.accelerate(model, provider="aten", cpu_huge_pages=True, **json.loads(sys.argv[1]))
    losses = []
    for step in range(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 0:
            first = dict(graphtrain.report(model).first_step_memory or {})
    rep = graphtrain.report(model)
    print(json.dumps({"losses": losses, "first": first, "text": str(rep),
                      "weights": [float(p.double().sum()) for p in model.parameters()]}))
""")


def test_a_second_process_primes_the_first_step_and_trains_the_same(tmp_path):
    """Process 1 has no record: it primes the two 4 MiB weights' gradients and records its first step's fresh
    memory (those gradients and AdamW's two moments of each: six blocks) at its optimizer step; process 2, same
    model and inputs, primes them and takes them, and trains bit for bit as process 1 and as a process with
    priming off."""
    _needs_cpp()
    env = {"GRAPHTRAIN_CACHE": str(tmp_path)}
    first = _run(_TRAIN, "{}", env=env)
    rec = first["first"]
    assert rec["recorded_blocks"] >= 6 and rec["recorded_bytes"] >= 6 * 4 * MIB, rec
    assert rec["primed_from"] == "gradients" and rec["primed_bytes"] == 2 * 4 * MIB, rec  # no record yet
    assert (tmp_path / "compile" / "first-step").is_dir()
    second = _run(_TRAIN, "{}", env=env)
    primed = second["first"]
    assert primed["primed_from"] == "record" and primed["primed_bytes"] == rec["recorded_bytes"], (rec, primed)
    assert primed["primed_taken"] >= 1 and primed["primed_taken"] <= primed["primed_blocks"], primed
    assert "primed from the last run's record" in second["text"], second["text"]
    off = _run(_TRAIN, json.dumps({"cpu_prefault": False}), env=env)
    assert off["first"] == {} and "first step's fresh CPU memory" not in off["text"]
    assert first["losses"] == second["losses"] == off["losses"]
    assert first["weights"] == second["weights"] == off["weights"]


def test_a_corrupt_record_is_recorded_again(tmp_path):
    """An unreadable record (a crash while writing, a hand edit) costs the next process its priming, not its run:
    it records afresh and replaces it."""
    _needs_cpp()
    env = {"GRAPHTRAIN_CACHE": str(tmp_path)}
    _run(_TRAIN, "{}", env=env)
    (record,) = (tmp_path / "compile" / "first-step").glob("*.json")
    record.write_text('{"sizes": [1, 2')
    again = _run(_TRAIN, "{}", env=env)
    assert again["first"]["primed_from"] == "gradients" and again["first"]["recorded_blocks"] >= 6, again["first"]
    assert json.loads(record.read_text())["bytes"] == again["first"]["recorded_bytes"]


_NO_OPTIMIZER = textwrap.dedent("""
    import json, torch
    import graphtrain
    torch.manual_seed(0)
    model = graphtrain.accelerate(torch.nn.Linear(1024, 1024), provider="aten", cpu_huge_pages=True)
    x = torch.randn(8, 1024)
    settled = []
    for call in range(10):                      # a hand-written SGD update: no torch optimizer, no step hook
        model(x).square().mean().backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-3 * p.grad
                p.grad = None
        settled.append(bool(graphtrain.report(model).first_step_memory))
    print(json.dumps(settled))
""")


def test_without_a_torch_optimizer_the_record_settles_after_a_few_calls(tmp_path):
    """A loop that updates the weights by hand never fires torch's optimizer-step hook: the first step's record
    settles at the module's SETTLE_CALLS-th call after the first."""
    _needs_cpp()
    from graphtrain.memory.prefault import SETTLE_CALLS

    settled = _run(_NO_OPTIMIZER, env={"GRAPHTRAIN_CACHE": str(tmp_path)})
    assert settled.index(True) == SETTLE_CALLS and all(settled[SETTLE_CALLS:]), settled
