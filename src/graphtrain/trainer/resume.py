"""What resuming does to a run folder, besides loading the checkpoint (trainer/checkpoint.py).

- `lock_run_folder`: one run per folder. `graphtrain train` takes an exclusive `flock` on `out_dir/.graphtrain.lock`
  before anything else touches the folder and holds it until the process ends (the kernel releases it, however
  the process ends: no stale lock). A second run on the same folder is refused (a usage error) with the PID,
  host and start time of the run that holds it, before it removes, writes or truncates anything.
- `clean_orphans`: at every start, remove what killed saves left behind. Only graphtrain's own temporary
  names are touched: `.ckpt-NNNNNNN.pt.*.tmp` (a checkpoint file or its checksum file being written),
  `ckpt-NNNNNNN.tmp/` (a sharded folder being written), `ckpt-NNNNNNN.old/` (the previous folder of that
  step, restored when the new one never took its place), `ckpt-NNNNNNN.pt.sha256` without its checkpoint
  (a save killed between the two renames, or a prune between the two deletes), the same for ckpt-best
  (trainer/run_outputs.py), the temporary files of config.yaml and metrics.jsonl, and `.hf.tmp/`, `.hf.old/`
  (train.export_hf).
- `config_changes` / `check_config_changes`: a resumed run must be the same run. Every config key that
  differs from the checkpoint's is listed (key: checkpoint value -> current value) and the resume is
  refused unless each is named in `allow_config_change` (CLI: --allow-config-change KEY[,KEY]), except
  the keys of `is_free` (how long, where and how fast the run goes, what it logs, its guards): none
  changes what a step computes beyond floating-point reordering. Keys the checkpoint's config does not
  have (added to graphtrain after it was written) are not compared. The model-defining keys
  (checkpoint.MODEL_KEYS) are refused by `check_compatible` first, whatever is allowed.
- `supersede_later`: resuming from step s, checkpoints of later steps belong to another history; they
  move into `out_dir/superseded-<s>-<time>/` (never deleted), so the next --resume does not pick them up.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from graphtrain.checksums import fsync_dir, sidecar_path
from graphtrain.trainer.checkpoint import MODEL_KEYS, is_sharded, list_checkpoints
from graphtrain.trainer.run_outputs import best_info

_TMP_FILE = re.compile(r"^\.ckpt-(\d{7,}|best)\.pt(\.sha256)?\..+\.tmp$")
_TMP_DIR = re.compile(r"^(ckpt-(?:\d{7,}|best))\.(tmp|old)$")
_SIDECAR = re.compile(r"^(ckpt-(?:\d{7,}|best)\.pt)\.sha256$")
_RUN_TMP_FILES = (".config.yaml.tmp", "metrics.jsonl.tmp")  # runtime.write_text_atomic, MetricsLog.truncate_after
_RUN_TMP_DIRS = (".hf.tmp", ".hf.old")  # run_outputs.write_hf_folder

# Keys a resumed run may change without being named: length and place of the run, logging, evaluation,
# checkpoint cadence, threads and execution path (eager, engine, whole-step graph), the fault guards.
FREE_KEYS = frozenset(
    {
        "train.steps",
        "train.out_dir",
        "train.eval_every",
        "train.eval_batches",
        "train.log_every",
        "train.ckpt_every",
        "train.threads",
        "train.progress",
        "train.sample_prompt",
        "train.sample_tokens",
        "train.init_from",
        "train.accelerate",
        "train.whole_step",
        "train.deterministic",
        "train.preempt_grace_s",
        "train.max_bad_steps",
        "train.loss_spike_factor",
        "train.trust_checkpoint",
        "train.keep_last",
        "train.keep_best",
        "train.export_hf",
        "data.cache_dir",
        "model.attention",
        "optim.fused",
    }
)


def is_free(key: str) -> bool:
    """May `key` differ from the checkpoint's on resume without --allow-config-change? FREE_KEYS, every
    parallel.* key (checkpoints load under any layout; every layout draws the same global batch) and every
    engine.* key but precision and the fp16 loss-scale settings (the engine computes what eager does)."""
    section, _, name = key.partition(".")
    return (
        key in FREE_KEYS
        or section == "parallel"
        or (section == "engine" and name != "precision" and not name.startswith("loss_scale"))
    )


# ------------------------------------------------------------------------------------ lock ----

LOCK_NAME = ".graphtrain.lock"
_held: dict[str, int] = {}  # folder (resolved) -> the open lock file of this process


def lock_run_folder(out_dir: str | Path) -> Path:
    """Take the run folder's exclusive lock for the rest of this process (created if missing); returns the lock
    file. Taking it again in the process that holds it does nothing. Raises ValueError naming the process that
    holds it. The lock file is never deleted (deleting a lock file lets two processes hold "the" lock)."""
    folder = Path(out_dir).expanduser().resolve()
    path = folder / LOCK_NAME
    if str(folder) in _held:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    try:  # O_NOFOLLOW: a symlink planted under the lock's name is not followed (and not truncated below)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise ValueError(
            f"cannot open the run folder's lock file {str(path)!r} ({e.strerror or e}): choose a folder "
            f"you can write with --out DIR"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):  # NFS without lockd, FUSE
            print(
                f"warning: the file system of {str(folder)!r} cannot lock files ({e.strerror}): a second run started "
                f"on this folder would not be refused",
                file=sys.stderr,
            )
            _held[str(folder)] = -1
            return path
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise ValueError(
            f"train.out_dir {str(folder)!r} is in use by another graphtrain run ({holder}); two runs in "
            f"one folder would overwrite each other's checkpoints: wait for it to end (or stop it), "
            f"or choose another folder with --out DIR"
        ) from None
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "argv": sys.argv,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _held[str(folder)] = fd
    return path


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the lock file (best effort: it may be writing it right now)."""
    try:
        record = json.loads(os.pread(fd, 65536, 0) or b"{}")
        pid, host, started = record["pid"], record["host"], record["started"]
    except (OSError, ValueError, KeyError, TypeError):
        return "its PID is not recorded yet"
    alive = ""
    if host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            alive = "; that process has ended, a child process it started still holds the lock"
        except (OSError, ValueError):
            pass
    return f"PID {pid} on {host}, started {started}{alive}"


# --------------------------------------------------------------------------------- orphans ----


def clean_orphans(out_dir: str | Path) -> list[str]:
    """Remove the leftovers of killed saves in `out_dir` (see the module docstring); returns what was done."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    done = []
    for p in sorted(out.iterdir()):  # sorted: ckpt-N.old is restored before ckpt-N.tmp is removed
        name = p.name
        if (_TMP_FILE.match(name) or name in _RUN_TMP_FILES) and p.is_file():
            p.unlink(missing_ok=True)
            done.append(name)
        elif name in _RUN_TMP_DIRS and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"{name}/")
        elif (m := _TMP_DIR.match(name)) and p.is_dir():
            target = out / m.group(1)
            if m.group(2) == "old" and not target.exists() and is_sharded(p):  # ckpt-best.old/ too
                p.rename(target)  # killed between moving the old folder aside and the new one into place
                done.append(f"{name}/ (restored as {target.name}/)")
            else:
                shutil.rmtree(p, ignore_errors=True)
                done.append(f"{name}/")
        elif (m := _SIDECAR.match(name)) and p.is_file() and not (out / m.group(1)).exists():
            p.unlink(missing_ok=True)
            done.append(name)
    if done:
        fsync_dir(out)
    return done


# ---------------------------------------------------------------------------- config changes ----


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(section.key, checkpoint value, current value) for every key that differs, model-defining keys excluded
    (check_compatible reports those) and keys the checkpoint does not know skipped."""
    model_keys = {f"{s}.{k}" for s, k in MODEL_KEYS}
    out = []
    for section, values in current.items():
        for name, value in values.items():
            key = f"{section}.{name}"
            old_section = saved.get(section)
            if key in model_keys or not isinstance(old_section, dict) or name not in old_section:
                continue
            if _plain(old_section[name]) != _plain(value):
                out.append((key, old_section[name], value))
    return out


def check_config_changes(
    saved: dict[str, Any], config: Any, allowed: Iterable[str], path: Path, log: Callable[[str], None] | None = None
) -> None:
    """Refuse a resume whose config differs from the checkpoint's in a key neither free nor `allowed`; log the
    accepted differences (one line)."""
    changes = config_changes(saved, config.to_dict())
    allowed = set(allowed)
    refused = [c for c in changes if not is_free(c[0]) and c[0] not in allowed]
    if refused:
        listing = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in refused)
        keys = ",".join(k for k, _, _ in refused)
        back = " ".join(f"{k}={_show(a)}" for k, a, _ in refused)
        raise ValueError(
            f"resume: the config differs from the one checkpoint {str(path)!r} was trained with "
            f"({listing}); continuing would mix two runs in one. To accept the change, name it: "
            f"--allow-config-change {keys} (Trainer(..., allow_config_change=[...])); to continue the "
            f"run as it was, set {back}; or start a new run in a new out_dir (--out DIR)"
        )
    if changes and log is not None:
        log(
            "resume: config changes from the checkpoint's: "
            + "; ".join(f"{k}: {_show(a)} -> {_show(b)}{'' if is_free(k) else ' (allowed)'}" for k, a, b in changes)
        )


def allowed_keys(keys: str | Iterable[str], config: Any) -> tuple[str, ...]:
    """`allow_config_change` as a tuple of section.key names ("a.b,c.d" or an iterable); unknown keys raise."""
    if isinstance(keys, str):
        keys = keys.split(",")
    out = tuple(k.strip() for k in keys if k.strip())
    known = config.to_dict()
    for key in out:
        section, _, name = key.partition(".")
        if section not in known or name not in known[section]:
            raise ValueError(
                f"allow_config_change: unknown config key {key!r}; name keys as section.key, e.g. "
                f"optim.lr (`graphtrain config` lists them)"
            )
    return out


def _plain(v: Any) -> Any:
    return [_plain(x) for x in v] if isinstance(v, (list, tuple)) else v


def _show(v: Any) -> str:
    return "null" if v is None else str(list(v) if isinstance(v, tuple) else v)


# ------------------------------------------------------------------------------ supersede ----


def supersede_later(out_dir: str | Path, step: int) -> tuple[Path | None, list[str]]:
    """Move every checkpoint of `out_dir` past `step` (and its checksum file), the best checkpoint too when it is
    of a later step, into a new folder `superseded-<step>-<YYYYmmdd-HHMMSS>/`; returns the folder (None: nothing
    to move) and the names moved."""
    out = Path(out_dir)
    later = [p for s, p in list_checkpoints(out) if s > step]
    best = best_info(out)
    if best is not None and best[1] > step:
        later.append(best[0])
    if not later:
        return None, []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder = out / f"superseded-{step}-{stamp}"
    n = 1
    while folder.exists():
        n += 1
        folder = out / f"superseded-{step}-{stamp}-{n}"
    folder.mkdir()
    for p in later:  # the checkpoint first: killed in between, a checksum file left alone is cleaned next start
        p.rename(folder / p.name)
        if not is_sharded(folder / p.name) and sidecar_path(p).is_file():
            sidecar_path(p).rename(folder / sidecar_path(p).name)
    fsync_dir(out)
    return folder, [p.name for p in later]
