"""The GPU check's scripts (scripts/gpu_smoke.py, scripts/gpu-check.sh), checked on the CPU: what they can get wrong
without a GPU is their own logic, such as calling a case that quietly ran eagerly a pass."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import graphtrain

ROOT = Path(__file__).resolve().parents[1]


def _smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_smoke_case_that_ran_eagerly_is_named_a_fallback(monkeypatch):
    """Its losses match eager exactly when it ran eagerly, so the smoke reads the engine's record: a model the
    engine never saw, and one whose compiled graph raised and fell back (the engine's real fallback path), are
    named; a model that ran compiled is not."""
    from graphtrain.frontend import accelerate as api

    smoke = _smoke()
    ours = lambda entries: [e for e in entries if not e.startswith("fused op")]  # noqa: E731 - earlier tests' kernels
    assert smoke._fallbacks("accelerate", nn.Linear(4, 4)) == [
        "accelerate left no engine state on the model: nothing was compiled"
    ]
    fine = graphtrain.accelerate(nn.Sequential(nn.Linear(8, 8), nn.GELU()), provider="aten")
    fine(torch.randn(2, 8)).sum().backward()
    assert ours(smoke._fallbacks("accelerate", fine)) == []

    def broken(self, args, kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(api._CallWrapper, "_run_compiled", broken)
    bad = graphtrain.accelerate(nn.Sequential(nn.Linear(8, 8), nn.GELU()), provider="aten")
    with pytest.warns(UserWarning, match="compiled graph raised where eager runs"):
        bad(torch.randn(2, 8)).sum().backward()
    got = ours(smoke._fallbacks("accelerate", bad))
    assert "capture failed: the model ran eagerly" in got and any("illegal memory access" in e for e in got), got


def test_the_gpu_check_refuses_an_unknown_part_in_one_line():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "bnech"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "unknown part 'bnech': choose tests, smoke, bench" in r.stderr


@pytest.mark.slow  # ~25 s on the 2-core AMX Xeon: two cases, each a process with a compile
def test_the_smoke_runs_its_cases_side_by_side_and_passes_on_the_cpu():
    pytest.importorskip("transformers")
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--device", "cpu", "--jobs", "2", "--cases"]
        + ["gpt2:accelerate:fp32,llama:torch.compile:bf16"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| gpt2 |") or ln.startswith("| llama |")]
    assert len(rows) == 4 and all("| ok |" in ln for ln in rows), rows  # each row printed, then the table
    assert "2 passed, 0 failed" in r.stdout
