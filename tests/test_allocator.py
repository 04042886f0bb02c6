"""engine.cpu_allocator: which glibc malloc setting the engine applies, and that `keep` really reuses a large
freed block's pages (minor page faults counted, not time); graphtrain's own CPU allocator (huge pages, the block
cache under `release`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from graphtrain.config.sections import EngineConfig
from graphtrain.runtime import allocator as policy


def test_auto_releases_under_recompute_and_keeps_otherwise():
    assert policy.allocator_mode(EngineConfig()) == "keep"
    assert policy.allocator_mode(EngineConfig(recompute="selective")) == "release"
    assert policy.allocator_mode(EngineConfig(recompute="none", memory_budget=0.5)) == "release"
    assert policy.allocator_mode(EngineConfig(cpu_allocator="default", recompute="full")) == "default"
    with pytest.raises(ValueError, match="cpu_allocator"):
        EngineConfig(cpu_allocator="fast")


def test_engine_sets_the_allocator_once_per_process(monkeypatch):
    from graphtrain.memory import allocator

    applied = []
    monkeypatch.setattr(allocator, "apply", lambda mode: applied.append(mode) or True)
    monkeypatch.setattr(allocator, "use_huge_pages", lambda on=True: applied.append(f"huge pages {on}") or on)
    monkeypatch.setattr(allocator, "use_block_cache", lambda on=True: applied.append(f"block cache {on}") or on)
    monkeypatch.setattr(allocator, "block_cache_stats", lambda: None)  # graphtrain's allocator never installed
    monkeypatch.setattr(policy, "_ALLOCATOR_SET", None)
    x = [torch.zeros(2)]
    policy.set_cpu_allocator_once(x, EngineConfig())
    policy.set_cpu_allocator_once(x, EngineConfig(recompute="full"))  # the process keeps its first setting
    assert applied == ["huge pages True", "keep"]
    for cfg, want in (
        (EngineConfig(recompute="full"), ["block cache True", "huge pages True", "release"]),
        (EngineConfig(recompute="full", cpu_block_cache=False), ["huge pages True", "release"]),
    ):
        applied.clear()
        monkeypatch.setattr(policy, "_ALLOCATOR_SET", None)
        policy.set_cpu_allocator_once(x, cfg)
        assert applied == want, cfg
    applied.clear()
    monkeypatch.setattr(policy, "_ALLOCATOR_SET", None)
    policy.set_cpu_allocator_once([torch.zeros(2, device="meta")], EngineConfig())  # not a CPU graph
    assert applied == [] and policy._ALLOCATOR_SET is None
    monkeypatch.setattr(allocator, "huge_pages_on", lambda: None)
    policy.set_cpu_allocator_once(x, EngineConfig(cpu_huge_pages=False))
    assert applied == ["keep"]  # huge pages off and never on: nothing to undo


def test_a_benchmark_gives_every_variant_the_huge_pages_graphtrain_chooses_for_its_model(monkeypatch):
    """huge_pages_as_graphtrain: under keep, a model under HUGE_PAGES_MIN_PARAM_BYTES of parameters runs without huge
    pages (and a process that had them is switched back), one at or over it with them; under release every model
    gets them; an explicit engine.cpu_huge_pages wins. Every benchmark harness calls it after building the model."""
    from graphtrain.memory import allocator

    state: dict[str, bool | None] = {"on": None}

    def use(on=True):
        state["on"] = bool(on)
        return bool(on)

    monkeypatch.setattr(allocator, "use_huge_pages", use)
    monkeypatch.setattr(allocator, "huge_pages_on", lambda: state["on"])
    small = torch.nn.Linear(8, 8)  # 288 bytes of parameters
    monkeypatch.setattr(policy, "_ALLOCATOR_SET", "keep")
    assert policy.huge_pages_as_graphtrain(small) is False and state["on"] is None  # never on: nothing applied
    state["on"] = True
    assert policy.huge_pages_as_graphtrain(small) is False and state["on"] is False  # switched back off
    monkeypatch.setattr(policy, "HUGE_PAGES_MIN_PARAM_BYTES", 288)
    assert policy.huge_pages_as_graphtrain(small) is True
    monkeypatch.setattr(policy, "HUGE_PAGES_MIN_PARAM_BYTES", 289)
    assert policy.huge_pages_as_graphtrain(small) is False
    assert policy.huge_pages_as_graphtrain(small, EngineConfig(cpu_huge_pages=True)) is True
    monkeypatch.setattr(policy, "_ALLOCATOR_SET", "release")
    assert policy.huge_pages_as_graphtrain(small) is True


_FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from graphtrain.memory import allocator
    def faults(warmup, rounds=6):  # minor page faults of allocating, touching and freeing a 64 MiB tensor, as
        for _ in range(warmup):    # steps do, after `warmup` such rounds
            torch.empty(16 * 2**20).fill_(1.0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(rounds):
            torch.empty(16 * 2**20).fill_(1.0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    default = faults(1)
    assert allocator.apply(sys.argv[1])
    print(default, faults(12))
""")


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
@pytest.mark.skipif(
    _thp_always(),
    reason="transparent huge pages always on: a fresh 64 MiB block faults in 2 MiB "
    "pages, so 4 KiB page counts do not apply",
)
def test_keep_reuses_a_large_blocks_pages_release_does_not():
    out = {}
    for mode in ("keep", "release"):
        r = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out[mode] = [int(v) for v in r.stdout.split()]
    pages = 64 * 2**20 // 4096
    # glibc's default mmaps a 64 MiB block (over its 32 MiB cap) afresh: every round faults every page in again
    assert out["keep"][0] > 5 * pages and out["release"][0] > 5 * pages, out
    assert out["release"][1] > 5 * pages, out
    # kept: once warm, the freed block's pages are reused. Warming up takes up to 6 rounds: posix_memalign's
    # alignment slack can leave a freed chunk a few bytes short of the next request, which then takes fresh heap
    # (measured: the heap grew by 1 to 5 blocks before every round reused one)
    assert out["keep"][1] <= 1.1 * pages, out


_HUGE = textwrap.dedent("""
    import torch
    from graphtrain.memory import allocator

    def huge_mib():
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages"):
                return int(line.split()[1]) // 1024

    before = huge_mib()
    assert allocator.use_huge_pages(True) and allocator.huge_pages_on()
    x = torch.full((16 << 20,), 3.0)                 # 64 MiB, touched by the fill
    assert x.data_ptr() % (2 << 20) == 0, x.data_ptr()
    grown = huge_mib() - before
    small = torch.ones(100)                          # below 2 MiB: the replaced allocator's
    y = x * 2
    assert not allocator.use_huge_pages(False) and allocator.huge_pages_on() is False
    del x                                            # a huge-page block freed after the switch back
    z = torch.full((16 << 20,), 1.0)
    print(grown, float(y[123]), float(small.sum()), float(z.sum()))
""")


def test_huge_page_allocator_backs_large_blocks_with_huge_pages():
    """Fresh process (the allocator is per process): a 64 MiB tensor is 2 MiB-aligned and faults in as huge pages
    (AnonHugePages grows by its size), small and later blocks still work, and switching back leaves no block
    without its deleter."""
    from graphtrain.kernels import _cpu_ext
    from graphtrain.memory import allocator

    ok, why = allocator.huge_pages_available()
    if not ok:
        pytest.skip(why)
    if _cpu_ext.load() is None:
        pytest.skip(f"graphtrain's C++ kernels do not build here: {_cpu_ext.build_error()}")
    out = subprocess.run([sys.executable, "-c", _HUGE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    grown, y, small, z = out.stdout.split()
    assert (float(y), float(small), float(z)) == (6.0, 100.0, float(16 << 20))
    assert int(grown) >= 60, f"only {grown} MiB of the 64 MiB block on huge pages"


def test_measure_harness_allocator_flags():
    """The memory harness's process allocator: one setting for every mode (glibc's default, what a user's eager loop
    gets) unless a flag says otherwise, so a comparison never pits two allocator settings against each other."""
    from graphtrain.tools.measure import _allocator, _parser

    parse = _parser().parse_args
    assert _allocator(parse(["--mode", "eager"])) == "default"
    assert _allocator(parse(["--mode", "accelerate", "--recompute", "selective"])) == "default"
    assert _allocator(parse(["--mode", "accelerate", "--recompute", "auto", "--allocator", "release"])) == "release"
    assert _allocator(parse(["--mode", "eager", "--allocator", "release"])) == "release"
    assert _allocator(parse(["--mode", "accelerate", "--recompute", "selective", "--keep-malloc"])) == "keep"
    assert _allocator(parse(["--mode", "eager", "--no-pin-malloc"])) == "default"
    assert _allocator(parse(["--mode", "eager", "--pin-malloc"])) == "release"


def test_the_memory_harness_gives_every_mode_the_huge_pages_of_its_allocator_setting():
    """tools/measure.py, for real in its own process: under glibc's default (a user's eager loop) no huge pages;
    under keep graphtrain's choice for the model (none for a tiny one); `--huge-pages on` where the machine has them.
    Recorded in the JSON line, whatever the mode."""
    from graphtrain.kernels import _cpu_ext
    from graphtrain.memory import allocator
    from graphtrain.tools.measure import measure

    runs = {
        "default": measure(model="gpt2-tiny", seq=32, batch=2, mode="eager", steps=1, warmup=1, timeout=300),
        "keep": measure(
            model="gpt2-tiny", seq=32, batch=2, mode="eager", allocator="keep", steps=1, warmup=1, timeout=300
        ),
        "on": measure(
            model="gpt2-tiny", seq=32, batch=2, mode="eager", huge_pages="on", steps=1, warmup=1, timeout=300
        ),
    }
    for name, r in runs.items():
        assert "error" not in r, (name, r.get("error"))
    assert runs["default"]["huge_pages"] is False and runs["default"]["allocator"] == "default"
    assert runs["keep"]["huge_pages"] is False and runs["keep"]["allocator"] == "keep"
    assert runs["on"]["huge_pages"] is (allocator.huge_pages_available()[0] and _cpu_ext.load() is not None)


_CACHE = textwrap.dedent("""
    import json, os, resource, torch
    from graphtrain.runtime.allocator import set_cpu_allocator
    from graphtrain.memory import allocator

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    MIB = 2**20
    set_cpu_allocator("release", huge_pages=False)  # the block cache comes with release; 4 KiB pages to count
    torch.empty(16 * MIB // 4).fill_(1.0)            # 16 MiB in use, freed: kept
    f0 = faults()
    for _ in range(6):                               # the same request again: its pages are reused
        torch.empty(16 * MIB // 4).fill_(1.0)
    reuse_faults = faults() - f0
    warm = allocator.block_cache_stats()
    a = torch.empty(8 * MIB // 4).fill_(2.0)         # another size: 16 kept + 8 > 16 ever in use, so evicted
    evicted = allocator.block_cache_stats()
    b = torch.zeros(16 * MIB // 4)                   # 8 + 16 in use: a fresh block, the bound grows to 24
    total = float(a.sum() + b.sum())
    del a, b
    both = allocator.block_cache_stats()
    c = torch.ones(MIB // 4)                         # 1 MiB: counted; the 8 MiB block makes room
    mid = allocator.block_cache_stats()
    del c                                            # kept too: from 128 KiB up, what release would unmap
    f1, h1 = faults(), allocator.block_cache_stats()["hits"]
    for _ in range(6):                               # the same 1 MiB request again: its pages are reused
        torch.empty(MIB // 4).fill_(1.0)
    small = {"faults": faults() - f1, "hits": allocator.block_cache_stats()["hits"] - h1}
    m1 = allocator.block_cache_stats()["misses"]
    d = torch.ones(MIB // 8)                         # 512 KiB, a size never asked for: a miss, counted as one
    small["misses"] = allocator.block_cache_stats()["misses"] - m1
    del d
    pid = os.fork()                                  # a forked child allocates through the cache it inherited
    if pid == 0:                                     # one thread, as DataLoader workers: OpenMP's pool does not
        torch.set_num_threads(1)                     # survive a fork (torch alone hangs there too)
        os._exit(0 if float(torch.ones(4 * MIB).sum()) == 4 * MIB else 1)
    child_ok = os.waitpid(pid, 0)[1] == 0
    allocator.trim()
    print(json.dumps({"reuse_faults": reuse_faults, "warm": warm, "evicted": evicted, "both": both, "total": total,
                      "mid": mid, "small": small, "child_ok": child_ok, "trimmed": allocator.block_cache_stats()}))
""")


def test_block_cache_reuses_freed_blocks_within_the_most_ever_in_use():
    """Fresh process: under release, a freed 16 MiB block serves the next request of its size without page faults;
    a request of another size evicts it rather than pass the most bytes ever in use, and so does a smaller block
    (1 MiB), which is kept in turn and serves its size without faults; a forked child allocates through it; trim()
    empties the cache."""
    from graphtrain.kernels import _cpu_ext

    if _cpu_ext.load() is None:
        pytest.skip(f"graphtrain's C++ kernels do not build here: {_cpu_ext.build_error()}")
    r = subprocess.run([sys.executable, "-c", _CACHE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert out["reuse_faults"] < 16 * mib // 4096 // 10, out  # without the cache: every 4 KiB page, 6 times
    warm, evicted, both = out["warm"], out["evicted"], out["both"]
    assert warm["hits"] >= 6 and warm["cached_bytes"] == 16 * mib and warm["high_water_bytes"] == 16 * mib, warm
    assert evicted["evictions"] == warm["evictions"] + 1 and evicted["cached_bytes"] == 0, evicted
    assert evicted["in_use_bytes"] == 8 * mib, evicted
    assert both["in_use_bytes"] == 0 and both["cached_bytes"] == both["high_water_bytes"] == 24 * mib, both
    assert out["total"] == 2.0 * 2 * mib  # the reused and fresh blocks hold what was written
    # blocks from 128 KiB count towards the bound (release would give them back too): 1 + 16 cached <= 24
    assert out["mid"]["in_use_bytes"] == mib and out["mid"]["cached_bytes"] == 16 * mib, out["mid"]
    # and kept (release maps each such block afresh: 256 faults a time with 4 KiB pages, 1536 for the six)
    assert out["small"]["hits"] == 6 and out["small"]["faults"] < 256 and out["small"]["misses"] == 1, out["small"]
    assert out["child_ok"], out
    assert out["trimmed"]["cached_bytes"] == 0, out


_CACHE_TRAINING = textwrap.dedent("""
    import copy, json, torch
    from graphtrain.runtime.allocator import set_cpu_allocator
    from graphtrain.memory import allocator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 10))
    x, y = torch.randn(768, 1024), torch.randint(0, 10, (768,))  # activations of 3 MiB: blocks the cache serves

    def train(m, steps=4):
        m = copy.deepcopy(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
        torch.manual_seed(1)
        losses = []
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, [p.detach().clone() for p in m.parameters()]

    plain_losses, plain_params = train(model)        # torch's own allocator
    set_cpu_allocator("release", huge_pages=False)   # graphtrain's, with the block cache
    cached_losses, cached_params = train(model)
    stats = allocator.block_cache_stats()
    print(json.dumps({"same_losses": plain_losses == cached_losses,
                      "same_params": all(torch.equal(a, b) for a, b in zip(plain_params, cached_params)),
                      "hits": stats["hits"]}))
""")


def test_training_through_the_block_cache_matches_torchs_allocator_bitwise():
    """Fresh process: eager training with fused AdamW and dropout gives the same losses and weights, bit for bit,
    under torch's allocator and under graphtrain's with the block cache serving reused blocks (a block handed out
    while still in use would change them)."""
    from graphtrain.kernels import _cpu_ext

    if _cpu_ext.load() is None:
        pytest.skip(f"graphtrain's C++ kernels do not build here: {_cpu_ext.build_error()}")
    r = subprocess.run([sys.executable, "-c", _CACHE_TRAINING], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["hits"] > 0, out
    assert out["same_losses"] and out["same_params"], out


_REPORT = textwrap.dedent("""
    import torch, graphtrain
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    step = graphtrain.accelerate(model, provider="aten", recompute="full")
    x = torch.randn(1024, 512)                      # 2 MiB activations: blocks the cache serves
    for _ in range(3):
        step(x).square().mean().backward()
    rep = graphtrain.report(step)
    print(rep.allocator["mode"], rep.allocator["block_cache"]["hits"] > 0)
    print([line for line in str(rep).splitlines() if line.startswith("CPU allocator")][0])
""")


def test_report_shows_the_cpu_allocator_and_the_block_cache():
    """Fresh process (the allocator is set once per process): under recompute the report names the release mode
    and the block cache's counters."""
    from graphtrain.kernels import _cpu_ext

    if _cpu_ext.load() is None:
        pytest.skip(f"graphtrain's C++ kernels do not build here: {_cpu_ext.build_error()}")
    r = subprocess.run([sys.executable, "-c", _REPORT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    first, line = r.stdout.strip().splitlines()[-2:]
    assert first == "release True", r.stdout
    assert line.startswith("CPU allocator: release, huge pages ") and " hits, " in line, line


def test_report_goes_on_when_the_block_cache_counters_fail(monkeypatch):
    """A failing C++ extension (tests/test_capability.py breaks every function of it) must not take the report down
    with the allocator line: the line says the counters are unavailable."""
    from graphtrain.memory import allocator
    from graphtrain.tools import report, report_text

    def broken():
        raise RuntimeError("simulated failure of block_cache_stats")

    monkeypatch.setattr(report, "cpu_allocator_set", lambda: "release")  # where the report looks it up
    monkeypatch.setattr(allocator, "block_cache_on", lambda: True)
    monkeypatch.setattr(allocator, "block_cache_stats", broken)
    state = report._allocator_state()
    assert state["mode"] == "release" and state["block_cache"] is None
    assert "counters unavailable: RuntimeError: simulated failure" in report_text.allocator_line(state)
