"""engine.cpu_allocator: which glibc malloc setting the engine applies, and that `keep` really reuses a large
freed block's pages (minor page faults counted, not time)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from graphtrain.config import EngineConfig
from graphtrain.engine import backend


def test_auto_releases_under_recompute_and_keeps_otherwise():
    assert backend.allocator_mode(EngineConfig()) == "keep"
    assert backend.allocator_mode(EngineConfig(recompute="selective")) == "release"
    assert backend.allocator_mode(EngineConfig(recompute="none", memory_budget=0.5)) == "release"
    assert backend.allocator_mode(EngineConfig(cpu_allocator="default", recompute="full")) == "default"
    with pytest.raises(ValueError, match="cpu_allocator"):
        EngineConfig(cpu_allocator="fast")


def test_engine_sets_the_allocator_once_per_process(monkeypatch):
    from graphtrain.memory import allocator
    applied = []
    monkeypatch.setattr(allocator, "apply", lambda mode: applied.append(mode) or True)
    monkeypatch.setattr(backend, "_ALLOCATOR_SET", None)
    x = [torch.zeros(2)]
    backend._set_cpu_allocator_once(x, EngineConfig())
    backend._set_cpu_allocator_once(x, EngineConfig(recompute="full"))  # the process keeps its first setting
    assert applied == ["keep"]
    monkeypatch.setattr(backend, "_ALLOCATOR_SET", None)
    backend._set_cpu_allocator_once([torch.zeros(2, device="meta")], EngineConfig())  # not a CPU graph
    assert applied == ["keep"] and backend._ALLOCATOR_SET is None


_FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from graphtrain.memory import allocator
    def faults(rounds=6):  # minor page faults of allocating, touching and freeing a 64 MiB tensor, as steps do
        torch.empty(16 * 2**20).fill_(1.0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(rounds):
            torch.empty(16 * 2**20).fill_(1.0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    default = faults()
    assert allocator.apply(sys.argv[1])
    print(default, faults())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
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
    # kept: the freed block's pages are reused, in at least half the rounds: posix_memalign's alignment slack can
    # leave the freed chunk a few bytes short of the next request (measured: 0 or 3 of 6 rounds faulted, by run)
    assert out["keep"][1] <= 3.3 * pages, out
