"""Training metrics: peak memory, step timing and throughput, and the `metrics.jsonl` log.

Each record in ``out_dir/metrics.jsonl`` is one JSON object per line, e.g.::

    {"kind": "train", "step": 10, "loss": 6.91, "lr": 0.0005, "tokens_per_s": 10342.1, "ms_per_step": 99.0,
     "peak_mem_bytes": 412000256, "time": 1732250000.1}
    {"kind": "eval", "step": 100, "val_loss": 5.12, "time": ...}

Throughput counts only training-step time (evaluation and checkpointing are excluded).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from graphtrain.memory.process import rss_bytes


def peak_memory_bytes(device: torch.device) -> int | None:
    """CUDA: the allocator's peak since start; CPU: the process's peak resident set size (Linux: ``VmHWM``, which
    the trainer restarts after a cold data preparation, runtime.data_preparation_peak; elsewhere ru_maxrss)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = rss_bytes("VmHWM")
    if hwm is not None:
        return hwm
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, Linux KiB


def format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Throughput:
    """Accumulates per-step wall time; reports ms/step and tokens/s per logging window and overall.

    The first step of a run (graph capture and compilation) is reported separately and kept out
    of the overall averages when there is more than one step.
    """

    def __init__(self, tokens_per_step: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.first_step_s: float | None = None
        self._total_s, self._total_steps = 0.0, 0
        self._window_s, self._window_steps = 0.0, 0

    def add(self, seconds: float) -> None:
        if self.first_step_s is None:
            self.first_step_s = seconds
        else:
            self._total_s += seconds
            self._total_steps += 1
        self._window_s += seconds
        self._window_steps += 1

    def window(self) -> tuple[float, float]:
        """(ms/step, tokens/s) since the previous call; resets the window."""
        ms, tps = _rates(self._window_s, self._window_steps, self.tokens_per_step)
        self._window_s, self._window_steps = 0.0, 0
        return ms, tps

    def overall(self) -> tuple[float, float]:
        """(ms/step, tokens/s) over the run, without the first step unless it was the only one."""
        if self._total_steps == 0 and self.first_step_s is not None:
            return _rates(self.first_step_s, 1, self.tokens_per_step)
        return _rates(self._total_s, self._total_steps, self.tokens_per_step)


def _rates(seconds: float, steps: int, tokens_per_step: int) -> tuple[float, float]:
    if steps == 0 or seconds <= 0:
        return math.nan, math.nan
    return 1000.0 * seconds / steps, tokens_per_step * steps / seconds


class MetricsLog:
    """Appends JSON records to `path`, one per line, flushed as written (safe to `tail -f`)."""

    def __init__(self, path: str | Path, sinks: list[Any] | None = None) -> None:
        self.path = Path(path)
        self.sinks = list(sinks or [])  # trainer/loggers.py: each gets every record too

    def truncate_after(self, step: int) -> None:
        """On resume: drop records past `step` (left by the run that stopped), atomically."""
        for sink in self.sinks:
            sink.purge_after(step)
        if not self.path.is_file():
            return
        _refuse_link(self.path)
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except (json.JSONDecodeError, AttributeError, TypeError, RecursionError):
                continue  # a torn last line from a crash, or a line that is not a record
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.unlink(missing_ok=True)  # a link planted there is removed, never written through
        with _open(tmp, os.O_CREAT | os.O_EXCL) as f:
            f.write("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def reset(self) -> None:
        """On a fresh run: start an empty log."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _open(self.path, os.O_CREAT | os.O_TRUNC):
            pass

    def write(self, kind: str, step: int, **values: Any) -> dict[str, Any]:
        record = {"kind": kind, "step": step, **{k: _jsonable(v) for k, v in values.items()}, "time": time.time()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with _open(self.path, os.O_CREAT | os.O_APPEND) as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.record(record)
        return record


def _refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise ValueError(
            f"{str(path)!r} is a symbolic link (to {os.readlink(path)!r}): graphtrain writes a run's "
            f"metrics only to a file of its own, never through a link (a file elsewhere would be "
            f"overwritten); remove the link, or use another --out"
        )


def _open(path: Path, flags: int) -> Any:
    """`path` opened for writing with `flags`, refusing a symbolic link (O_NOFOLLOW: a metrics.jsonl that was a link
    to another file once truncated that file)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | flags, 0o644)
    except OSError as e:
        if path.is_symlink():
            _refuse_link(path)
        raise e
    return os.fdopen(fd, "w")


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN/inf
    return v
