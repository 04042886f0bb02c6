"""The largest batch whose training step stays under a memory cap, per variant.

How the cap is enforced -- by measurement, not by a kernel limit:

* ``resource.setrlimit(RLIMIT_AS)`` limits *virtual* address space. PyTorch, oneDNN/OpenMP thread
  stacks, the allocator's arenas and mmapped shared libraries reserve far more address space than
  they ever touch, so a process fails under RLIMIT_AS long before its resident memory reaches the
  cap, at a point that depends on the thread count and the allocator rather than on the model.
* A memory cgroup enforces resident memory, but needs root and differs between cgroup v1 and v2 and
  between hosts and containers; and the OOM killer's SIGKILL tells us only "too big", never by how
  much, which makes the search slow.

So every trial batch runs in a fresh worker process (setup, first step, two more steps) and reports
its whole-process peak: peak RSS (VmHWM) on CPU, ``torch.cuda.max_memory_allocated`` on GPU. The
whole-process peak includes compile-time transients, because a capped process would die at those
too. Peak memory is close to linear in the batch (weights, gradients and AdamW state are fixed;
activations grow with the batch), so the search fits a line through the two measurements nearest
the cap, jumps to the predicted largest batch, and bisects by measurement until the boundary is
pinned (``hi == lo + 1``) or the trial budget runs out (then ``exact`` is false and the answer is a
measured lower bound). No trial whose predicted peak exceeds the memory currently available runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from graphtrain.bench.suites import Case, Variant
from graphtrain.bench.worker import SETUP_TIMEOUT_S, STEP_TIMEOUT_S, WorkerProc

MAX_TRIALS = 5
TRIAL_STEPS = 2


def available_mib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def measure_peak(
    case: Case, variant: Variant, batch: int, device: str, log_dir: Path, pin_mmap: bool = False
) -> tuple[float | None, str]:
    """(whole-process peak MiB, "") for one trial batch, or (None, reason) when the trial failed."""
    w = WorkerProc(
        dataclasses.replace(case, batch=batch),
        variant,
        device,
        log_dir / f"maxbatch.{case.model}.s{case.seq}.b{batch}.{variant.name}.log",
        pin_mmap=pin_mmap,
    )
    try:
        for op, args, timeout in (
            ("setup", {}, SETUP_TIMEOUT_S),
            ("steps", {"n": TRIAL_STEPS}, 60 + STEP_TIMEOUT_S * TRIAL_STEPS),
            ("finish", {}, 120.0),
        ):
            reply = w.call(op, timeout, **args)
            if not reply.get("ok"):
                return None, reply.get("skipped") or reply.get("error", "failed")
        return float(reply["peak_mem_mib"]), ""
    finally:
        w.close()


def fit_line(points: dict[int, float], cap_mib: float) -> tuple[float, float]:
    """(base MiB, MiB per sample) through the two measured batches nearest the cap."""
    if len(points) < 2:
        raise ValueError("need two measured batches to fit peak memory against batch")
    below = sorted(b for b, p in points.items() if p <= cap_mib)
    above = sorted(b for b, p in points.items() if p > cap_mib)
    pair = (below[-1:] + above[:1]) if below and above else (below[-2:] if len(below) >= 2 else above[:2])
    b1, b2 = pair
    per_sample = (points[b2] - points[b1]) / (b2 - b1)
    return points[b1] - per_sample * b1, per_sample


def predict(points: dict[int, float], cap_mib: float) -> int:
    base, per_sample = fit_line(points, cap_mib)
    if per_sample <= 0:  # measurement noise swamped the activations; double instead of extrapolating
        return 2 * max(points)
    return max(1, math.floor((cap_mib - base) / per_sample))


def search(
    case: Case,
    variant: Variant,
    cap_gib: float,
    device: str,
    log_dir: Path,
    known: dict[int, float] | None = None,
    tick: Callable[[str], None] = lambda s: None,
    max_trials: int = MAX_TRIALS,
    pin_mmap: bool = False,
) -> dict[str, Any]:
    """Largest batch (at case.seq) with peak memory <= cap_gib, by measure, extrapolate, bisect."""
    cap = cap_gib * 1024
    points: dict[int, float] = {b: p for b, p in (known or {}).items() if p is not None}
    trials: list[dict[str, Any]] = []
    note = ""

    def trial(b: int) -> bool:
        tick(f"{case.model} s{case.seq} | {variant.name} | max batch: trying {b}")
        peak, why = measure_peak(case, variant, b, device, log_dir, pin_mmap=pin_mmap)
        trials.append({"batch": b, "peak_mib": peak, **({"failed": why} if why else {})})
        points[b] = peak if peak is not None else math.inf  # a trial that died counts as over the cap
        return peak is not None

    if not points and not trial(case.batch):
        return {
            "cap_gib": cap_gib,
            "max_batch": None,
            "exact": False,
            "trials": trials,
            "note": f"batch {case.batch} failed: {trials[0].get('failed')}",
        }
    while len(trials) < max_trials:
        lo, hi = _bounds(points, cap)
        if hi is not None and hi <= lo + 1:
            break
        finite = {b: p for b, p in points.items() if math.isfinite(p)}
        nxt = predict(finite, cap) if len(finite) >= 2 else 2 * lo if hi is None else None
        if hi is not None and (nxt is None or not lo < nxt < hi):  # no usable prediction: bisect
            nxt = (lo + hi) // 2 if lo else max(1, hi // 2)
        nxt = max(nxt, lo + 1)
        if nxt in points:
            break
        free = available_mib()
        if len(finite) >= 2 and free is not None:
            base, per_sample = fit_line(finite, cap)
            if base + per_sample * nxt > 0.9 * free:
                note = f"stopped: batch {nxt} is predicted to need more than the {free:.0f} MiB available"
                break
        trial(nxt)
    lo, hi = _bounds(points, cap)
    finite = {b: p for b, p in points.items() if math.isfinite(p)}
    result: dict[str, Any] = {
        "cap_gib": cap_gib,
        "max_batch": lo or None,
        "exact": hi is not None and hi == lo + 1,
        "trials": trials,
    }
    if len(finite) >= 2:
        base, per_sample = fit_line(finite, cap)
        result.update(base_mib=round(base, 1), per_sample_mib=round(per_sample, 2))
    if note:
        result["note"] = note
    return result


def _bounds(points: dict[int, float], cap: float) -> tuple[int, int | None]:
    """(largest measured batch under the cap or 0, smallest measured batch over it or None)."""
    lo = max((b for b, p in points.items() if p <= cap), default=0)
    hi = min((b for b, p in points.items() if p > cap), default=None)
    return lo, hi
