"""``out_dir/run.json``: where, when and from what code a run ran (`graphtrain plot` shows it beside the curves).

One entry per session of the run (the first start, then each resume), each written when the session starts and
completed when it finishes::

    {"format": 1, "sessions": [{"started": "2026-11-28T07:53:31Z", "started_unix": 1795852411.2,
      "finished_unix": 1795852415.7, "resumed_at_step": 0, "steps_done": 6, "host": "box", "cpu": "AMD EPYC ...",
      "gpu": null, "device": "cpu", "threads": 2, "world_size": 1, "accelerate": true, "provider": "aten",
      "providers_used": ["aten"], "precision": "fp32", "commit": "0e2a300... (dirty)", "graphtrain": "0.1.0",
      "graphtrain_commit": "...", "torch": "2.13.0", "python": "3.11.7", "command": ["graphtrain", "train", ...],
      "tokens_per_step": 64}]}

``commit`` is the git commit of the working directory the run was started in (the user's code; ``(dirty)`` with
uncommitted changes), ``graphtrain_commit`` that of graphtrain's source when it runs from a checkout; either is
null outside git. Reading it never fails a caller: a missing or unreadable file reads as no sessions.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

NAME = "run.json"


def _git(folder: Path) -> str | None:
    """HEAD of the git work tree holding `folder`, '(dirty)' appended with uncommitted changes; None outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return head.stdout.strip() + (" (dirty)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_name() -> str:
    """/proc/cpuinfo's model name (the platform's processor or machine elsewhere): what run.json and the bench
    record as the machine."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_run_info(out_dir: str | Path) -> dict[str, Any]:
    """The run's run.json ({"format": 1, "sessions": [...]}); {"sessions": []} when there is none or it is
    unreadable."""
    try:
        info = json.loads((Path(out_dir) / NAME).read_text())
    except (OSError, ValueError):
        return {"sessions": []}
    if not isinstance(info, dict) or not isinstance(info.get("sessions"), list):
        return {"sessions": []}
    info["sessions"] = [s for s in info["sessions"] if isinstance(s, dict)]
    return info


def _write(out_dir: Path, info: dict[str, Any]) -> None:
    tmp = out_dir / f".{NAME}.tmp"
    tmp.unlink(missing_ok=True)
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, out_dir / NAME)


def start_session(
    out_dir: Path, config: Any, device: torch.device, world_size: int, resumed_at: int, tokens_per_step: int | None
) -> None:
    """Append this session to run.json (a fresh run, resumed_at 0, starts a new file)."""
    now = time.time()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    session = {
        "started": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "started_unix": now,
        "finished_unix": None,
        "resumed_at_step": resumed_at,
        "steps_done": None,
        "host": platform.node(),
        "cpu": cpu_name(),
        "gpu": gpu,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "world_size": world_size,
        "accelerate": bool(config.train.accelerate),
        "provider": config.engine.provider if config.train.accelerate else "eager",
        "providers_used": None,
        "precision": config.engine.precision,
        "commit": _git(Path.cwd()),
        "graphtrain": _version(),
        "graphtrain_commit": _git(Path(__file__).resolve().parent),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": list(sys.argv),
        "tokens_per_step": tokens_per_step,
    }
    info = read_run_info(out_dir) if resumed_at > 0 else {"sessions": []}
    _write(out_dir, {"format": 1, "sessions": [*info["sessions"], session]})


def finish_session(out_dir: Path, steps_done: int, module: torch.nn.Module | None) -> None:
    """Complete the latest session: when it finished, the step reached and the providers the engine ran."""
    info = read_run_info(out_dir)
    if not info["sessions"]:
        return
    state = getattr(module, "_graphtrain", None) or getattr(getattr(module, "module", None), "_graphtrain", None)
    used = sorted({g.provider for g in getattr(state, "graphs", []) if g.provider}) or None
    info["sessions"][-1].update(finished_unix=time.time(), steps_done=steps_done, providers_used=used)
    _write(out_dir, {"format": 1, **info})


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("graphtrain")
    except PackageNotFoundError:
        return "unknown"
