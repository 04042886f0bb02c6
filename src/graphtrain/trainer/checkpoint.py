"""Checkpoints: atomic, checksummed saves, `latest` by scanning, verified and validated loads, keep-last-N pruning.

Layout of a run folder::

    out_dir/ckpt-0000100.pt         one file per saved step (zero-padded, so names sort by step)
    out_dir/ckpt-0000100.pt.sha256  its SHA-256 (`sha256sum` format: `sha256sum -c ckpt-0000100.pt.sha256`)
    out_dir/ckpt-0000200.pt         the latest is the highest step: found by scanning, no pointer file
    out_dir/ckpt-0000300/           distributed runs: a sharded checkpoint folder (graphtrain.distributed.checkpoint:
                                    DCP files, extra.pt holding the same metadata as a .pt file minus the tensors,
                                    SHA256SUMS listing every file)
    out_dir/ckpt-best.pt            train.keep_best: the checkpoint of the lowest validation loss, never pruned,
    out_dir/ckpt-best.pt.sha256     never `latest` (trainer/run_outputs.py)
    out_dir/hf/                     train.export_hf: the final checkpoint as a Hugging Face folder (run_outputs.py)

Pruning keeps the `train.keep_last` newest ckpt-N (0: all). The model state dict holds the keys of the plain
model: a model.hf run's are the transformers model's own (``model.layers.0...``, ``lm_head.weight``), so
``AutoModelForCausalLM.from_config(cfg).load_state_dict(torch.load(ckpt)["model"])`` works; checkpoints written
before that carry graphtrain's wrapper prefix ``hf.`` and still load (`to_module_keys`).

A checkpoint is a dict (see `FORMAT_VERSION`) holding the model and optimizer state dicts, the
number of completed optimizer steps, every RNG state (torch CPU, CUDA, python, numpy) and the
resolved config. It holds only tensors and plain Python values, so it loads with
``torch.load(weights_only=True)``: loading a checkpoint never runs pickled code (a file holding other
objects is refused, saying so).

Safety: a save writes a temporary file in the same folder and fsyncs it, writes its checksum file
(atomically), then renames the checkpoint into place (`os.replace` is atomic): a crash mid-save leaves
the previous checkpoints untouched, never a half-written `ckpt-*.pt`, and a visible checkpoint always
has its checksum file (a killed save may leave a temporary file, or a checksum file without its
checkpoint: the next start cleans them, trainer/resume.py). Every load verifies the checksum first and
names a file that differs, with the fix; `latest_valid_checkpoint` skips such files, saying why.
Checkpoints written before checksums existed load with one warning (checked against their zip CRC-32s
only). Pruning runs only after a save succeeded.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
import shutil
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphtrain.checksums import (
    ChecksumMismatch,
    digests_reused,
    fsync_dir,
    sha256_file,
    sidecar_path,
    verify_file,
    write_sums,
)

# Imports inside functions: import cost: an eager run (train.accelerate=false, one process) never loads the
# engine (Dynamo, Inductor), torch.distributed or the tools; each is imported where a run needs it.

FORMAT_VERSION = 1
KEEP_LAST = 3  # train.keep_last's default
_WRAPPER = "hf."  # graphtrain's wrapper around a transformers model (models/hf.py, HFLanguageModel.hf)
_NAME = re.compile(r"^ckpt-(\d{7,})(\.pt)?$")  # .pt: a file; no suffix: a sharded folder
REQUIRED_KEYS = ("format_version", "step", "model", "optimizer", "rng", "config")
# Config keys that decide the model's shapes or the meaning of its token ids: resuming across a
# change to any of them cannot work.
MODEL_KEYS = (
    ("model", "name"),
    ("model", "hf"),
    ("model", "objective"),
    ("model", "max_seq_len"),
    ("model", "vocab_size"),
    ("data", "vocab_size"),
)


def checkpoint_path(out_dir: str | Path, step: int, sharded: bool = False) -> Path:
    return Path(out_dir) / (f"ckpt-{step:07d}" if sharded else f"ckpt-{step:07d}.pt")


def is_sharded(path: str | Path) -> bool:
    """A sharded (distributed) checkpoint folder: DCP's .metadata inside."""
    return (Path(path) / ".metadata").is_file()


def _is_checkpoint(p: Path, m: re.Match) -> bool:
    return p.is_file() if m.group(2) else (p.is_dir() and is_sharded(p))


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint in `out_dir`, oldest first."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := _NAME.match(p.name)) and _is_checkpoint(p, m)]
    return sorted(found)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1][1] if found else None


# ------------------------------------------------------------------------------------ save ----


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write `state` to `path` atomically: temp file in the same folder, fsync, checksum file, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sums = sidecar_path(path)
    replacing = path.is_file()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp creates 0600; checkpoints are ordinary files
            try:
                torch.save(state, f)
            except RuntimeError as e:  # torch's writer turns a failed write into a RuntimeError: the OSError again
                raise _write_error(e, path) from None
            f.flush()
            os.fsync(f.fileno())
        digest = sha256_file(tmp)
        # The checksum file goes first, so a checkpoint is never visible without it. Replacing a file of the same
        # name, it lists the old digest too until the rename is done: either file verifies meanwhile.
        old = [(path.name, sha256_file(path))] if replacing else []
        write_sums(sums, [(path.name, digest), *old])
        os.replace(tmp, path)
        if old:
            write_sums(sums, [(path.name, digest)])
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        if not replacing:
            sums.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def _write_error(e: RuntimeError, path: Path) -> BaseException:
    """The OSError behind torch.save's RuntimeError (a full disk, a file-size limit, an I/O error), naming `path`.

    torch's zip writer reports a failed write of the file object as "[enforce fail at inline_container.cc]
    unexpected pos ..." with the file object's OSError only as the exception's context (torch 2.13; measured with
    RLIMIT_FSIZE: EFBIG). A RuntimeError with no OSError behind it is not an I/O failure and is returned as is."""
    seen: BaseException | None = e
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        if "PytorchStreamWriter failed" not in str(e) and "file write failed" not in str(e):
            return e
        return OSError(errno.EIO, f"write failed ({_first_line(e, 160)})", str(path))
    strerror = seen.strerror or str(seen)
    if seen.errno == errno.EFBIG:
        strerror += " (the file-size limit of this process, `ulimit -f`)"
    return OSError(seen.errno, strerror, str(path))


def prune_checkpoints(out_dir: str | Path, keep: int = KEEP_LAST, protect: Path | None = None) -> list[Path]:
    """Delete all but the `keep` highest-step checkpoints (0: none; never `protect`, never the best checkpoint,
    which has its own name); returns what was deleted."""
    found = list_checkpoints(out_dir)
    doomed = [p for _, p in found[:-keep]] if keep > 0 else []
    doomed = [p for p in doomed if protect is None or p.resolve() != Path(protect).resolve()]
    for p in doomed:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)  # the checkpoint first: a checksum file left alone is cleaned next start
            sidecar_path(p).unlink(missing_ok=True)
    return doomed


# ------------------------------------------------------------------------------ model keys ----


def plain_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A model state dict with the keys of the plain model: a model.hf model's without graphtrain's wrapper prefix
    `hf.` (they load into the transformers class as they are); other state dicts unchanged."""
    if state and all(k.startswith(_WRAPPER) for k in state):
        return {k[len(_WRAPPER) :]: v for k, v in state.items()}
    return state


def to_module_keys(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """A checkpoint's model state dict with the keys `model` (graphtrain's module) expects: plain keys get the
    wrapper prefix back for a model.hf model; checkpoints that carry it already (written before plain keys) pass
    unchanged."""
    wanted = model.state_dict().keys()
    if wanted and all(k.startswith(_WRAPPER) for k in wanted) and not any(k.startswith(_WRAPPER) for k in state):
        return {_WRAPPER + k: v for k, v in state.items()}
    return state


# ------------------------------------------------------------------------------------- RNG ----


def rng_state() -> dict[str, Any]:
    """Every RNG the training step may draw from, as tensors and plain values (weights_only-safe)."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------- verify ----

_warned_unverified: set[str] = set()


def verify_checkpoint(path: str | Path) -> bool:
    """Check a checkpoint (file or sharded folder) against its recorded SHA-256s: True when verified, False when it
    has no checksum file (written before graphtrain recorded them, or copied without it: a file is then checked
    against its zip CRC-32s). Raises ValueError naming the file that differs, and the fix."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {str(path)!r} does not exist{_alternatives(path)}")
    try:
        return _verify(path)
    except ChecksumMismatch as e:
        what = "corrupt" if is_sharded(path) or sidecar_path(path).is_file() else "unreadable or corrupt"
        raise ValueError(f"checkpoint {str(path)!r} is {what}: {e}{_alternatives(path)}") from None


def _verify(path: Path) -> bool:
    if is_sharded(path):
        from graphtrain.distributed.checkpoint import verify_folder

        return verify_folder(path)
    if sidecar_path(path).is_file():
        verify_file(sidecar_path(path), path)
        return True
    _check_zip(path)
    return False


def _check_zip(path: Path) -> None:
    """A checkpoint without a checksum file: the CRC-32 of every member of its zip container (torch.load checks none)."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ChecksumMismatch(path, f"it is not a complete zip container ({type(e).__name__})") from None
    if bad is not None:
        raise ChecksumMismatch(path, f"its member {bad} fails its CRC-32 check (the file changed after it was written)")


def _warn_unverified(path: Path) -> None:
    key = str(path.resolve())
    if key in _warned_unverified:
        return
    _warned_unverified.add(key)
    what = f"{path.name}/SHA256SUMS" if is_sharded(path) else sidecar_path(path).name
    warnings.warn(
        f"checkpoint {str(path)!r} has no checksum file ({what}): it was written before graphtrain recorded "
        f"checksums, or copied without it, so it loads unverified",
        UserWarning,
        stacklevel=3,
    )


def latest_valid_checkpoint(out_dir: str | Path, log: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint in `out_dir` that verifies (see `verify_checkpoint`; one without a checksum file counts,
    unverified), or None; each newer one skipped is logged with the reason, one line each."""
    for _, path in reversed(list_checkpoints(out_dir)):
        try:
            _verify(path)
        except ChecksumMismatch as e:
            if log is not None:
                log(f"skipping checkpoint {path}: it is corrupt ({e})")
            continue
        return path
    return None


# ------------------------------------------------------------------------------------ load ----


def load_checkpoint(
    path: str | Path, config: Any = None, model_spec: dict[str, Any] | None = None, mmap: bool = False
) -> dict[str, Any]:
    """Verify, read and validate a checkpoint; with `config` (a Config) and/or `model_spec` (the built model's
    spec as a dict), also check the checkpoint was trained for the same model. `mmap`: map the tensors instead
    of reading them (to look at the metadata).

    Raises ValueError naming the file and the fix when it is missing, corrupt (its checksum differs),
    unreadable, truncated, holds objects other than tensors and plain values, is not a graphtrain
    checkpoint, is from another format version, or was built for a different model.
    """
    path = Path(path)
    if is_sharded(path):
        raise ValueError(
            f"checkpoint {str(path)!r} is a sharded checkpoint folder written by a distributed run: "
            f"resume it with a distributed launch (graphtrain train --nproc N parallel.dp=N ...), or "
            f"start from its weights with train.init_from"
        )
    if not verify_checkpoint(path):
        _warn_unverified(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise _unreadable(path, e) from None
        raise ValueError(
            f"{str(path)!r} holds Python objects other than tensors and plain values "
            f"({_first_line(e, 160)}); graphtrain never unpickles those (a pickle can run code), and "
            f"its own checkpoints hold none, so this file was not written by graphtrain"
            f"{_alternatives(path)}"
        ) from None
    except Exception as e:  # torch raises RuntimeError, EOFError, zipfile errors...
        raise _unreadable(path, e) from None
    if not isinstance(state, dict) or "format_version" not in state:
        raise ValueError(f"{str(path)!r} is not a graphtrain checkpoint (no format_version){_alternatives(path)}")
    if state["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {str(path)!r} has format version {state['format_version']}, this graphtrain "
            f"reads version {FORMAT_VERSION}: use the graphtrain release that wrote it, or start fresh "
            f"with a new out_dir"
        )
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} is incomplete (missing {', '.join(missing)}){_alternatives(path)}")
    if config is not None or model_spec is not None:
        check_compatible(state, config, model_spec, path)
    return state


def _unreadable(path: Path, e: BaseException) -> ValueError:
    return ValueError(
        f"checkpoint {str(path)!r} is unreadable or corrupt ({type(e).__name__}: {_first_line(e, 200)})"
        f"{_alternatives(path)}"
    )


def _first_line(e: BaseException, limit: int) -> str:
    return " ".join(str(e).split())[:limit] or type(e).__name__


def load_sharded_meta(path: str | Path, config: Any = None, model_spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metadata (`extra.pt`: step, RNG, config, model spec) of a sharded checkpoint folder, verified and
    validated like `load_checkpoint` does for a file; the tensors are read by `Parallelized.load` / DCP."""
    path = Path(path)
    if not is_sharded(path):
        raise ValueError(f"{str(path)!r} is not a sharded checkpoint folder (no .metadata){_alternatives(path)}")
    if not verify_checkpoint(path):
        _warn_unverified(path)
    from graphtrain.distributed.checkpoint import read_extra

    if not (path / "extra.pt").is_file():
        raise ValueError(f"checkpoint {str(path)!r}: extra.pt is missing{_alternatives(path)}")
    try:
        state = read_extra(path)
    except ValueError as e:  # objects other than tensors and plain values
        raise ValueError(f"{e}{_alternatives(path)}") from None
    except Exception as e:
        raise ValueError(
            f"checkpoint {str(path)!r}: extra.pt is unreadable ({type(e).__name__}){_alternatives(path)}"
        ) from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {str(path)!r} is not a graphtrain trainer checkpoint of format version "
            f"{FORMAT_VERSION}{_alternatives(path)}"
        )
    if config is not None or model_spec is not None:
        check_compatible(state, config, model_spec, path)
    return state


def checkpoint_meta(path: str | Path, config: Any = None, model_spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """A checkpoint's step, config, model spec, metrics (all but its tensors), verified and validated like a load."""
    if is_sharded(path):
        return load_sharded_meta(path, config, model_spec)
    state = load_checkpoint(path, config, model_spec, mmap=True)
    return {k: v for k, v in state.items() if k not in ("model", "optimizer")}


def load_weights(
    model: torch.nn.Module,
    init_from: str,
    config: Any,
    model_spec: dict[str, Any],
    log: Callable[[str], None] | None = None,
) -> tuple[Path, int]:
    """train.init_from: load only the model weights of a checkpoint file, sharded folder or run folder (its
    latest valid one) into `model` (shapes must match; seq_len may differ). Returns the checkpoint and its step.
    A sharded folder outside train.out_dir needs train.trust_checkpoint (trainer/resume.py, `check_trusted`)."""
    source = Path(init_from).expanduser()
    if source.is_dir() and not is_sharded(source):
        found = latest_valid_checkpoint(source, log)
        if found is None:
            what = "no valid checkpoint" if list_checkpoints(source) else "no checkpoint (ckpt-*)"
            raise ValueError(
                f"train.init_from={init_from!r}: {what} in that folder; point it at a finished run's "
                f"out_dir or a checkpoint file"
            )
        source = found
    elif not source.exists():
        raise ValueError(
            f"train.init_from={init_from!r} does not exist: point it at a checkpoint file or a "
            f"finished run's out_dir (e.g. the previous phase's train.out_dir)"
        )
    check_trusted(source, config, "train.init_from")
    try:
        with digests_reused():
            if is_sharded(source):
                from graphtrain.distributed.checkpoint import load_checkpoint as load_sharded

                step = load_sharded_meta(source, config, model_spec)["step"]
                load_sharded(source, model, None)
            else:
                state = load_checkpoint(source, config, model_spec)
                step = state["step"]
                model.load_state_dict(to_module_keys(state["model"], model))
    except RuntimeError as e:
        raise ValueError(
            f"train.init_from={init_from!r}: the checkpoint's weights do not fit this model ({str(e).splitlines()[0]})"
        ) from None
    return source, step


def check_trusted(path: str | Path, config: Any, what: str) -> None:
    """A sharded checkpoint folder from outside this run's train.out_dir loads only with train.trust_checkpoint.

    Its DCP `.metadata` is a Python pickle. graphtrain reads it with an allow-list of DCP's own metadata classes
    (distributed/checkpoint.py, `read_metadata`) and reads only tensors from the shards, so nothing of the folder
    runs; a folder someone else made is refused all the same unless the user says it is trusted."""
    path = Path(path)
    if not is_sharded(path) or getattr(config.train, "trust_checkpoint", False):
        return
    if path.resolve().is_relative_to(Path(config.train.out_dir).expanduser().resolve()):
        return
    raise ValueError(
        f"{what}: {str(path)!r} is a sharded checkpoint folder outside this run's train.out_dir "
        f"({config.train.out_dir!r}); its DCP .metadata is a Python pickle, which could run code if "
        f"someone crafted it. If you trust the folder (your own run's), set train.trust_checkpoint=true; "
        f"otherwise do not load it"
    )


def checkpoint_tokenizer(path: str | Path) -> Any:
    """The tokenizer a checkpoint was trained with (a CodeTokenizer), or None for checkpoints that hold none."""
    from tokenizers import Tokenizer

    from graphtrain.data.tokenizer import CodeTokenizer

    saved = checkpoint_meta(path).get("tokenizer")
    if not saved:
        return None
    return CodeTokenizer(Tokenizer.from_str(saved["json"]), saved.get("specials"))


def check_compatible(
    state: dict[str, Any], config: Any = None, model_spec: dict[str, Any] | None = None, path: str | Path = "checkpoint"
) -> None:
    """Raise ValueError listing every model-defining key that differs between checkpoint and config.

    Config keys are compared first (they name the fix); then the built model's spec (family and
    sizes, including the tokenizer's actual vocabulary), except dropout, which changes no shapes.
    """
    diffs, fixable = [], []
    if config is not None:
        saved, current = state["config"], config.to_dict()
        for section, key in MODEL_KEYS:
            a, b = saved.get(section, {}).get(key), current[section][key]
            if a != b:
                diffs.append((f"{section}.{key}", a, b))
                fixable.append(f"{section}.{key}={_yaml_scalar(a)}")
    if model_spec is not None and state.get("model_spec") is not None:
        saved_spec = state["model_spec"]
        for key in sorted(set(saved_spec) | set(model_spec)):
            a, b = saved_spec.get(key), model_spec.get(key)
            if key != "dropout" and a != b:
                diffs.append((f"model {key}", a, b))
    if not diffs:
        return
    listing = "; ".join(f"{k}: checkpoint {a!r}, current {b!r}" for k, a, b in diffs)
    fix = f"set {' '.join(fixable)}" if fixable else "use the model and data settings it was trained with"
    raise ValueError(
        f"checkpoint {str(path)!r} was trained for a different model ({listing}). To resume it, {fix}; "
        f"to train the new model instead, use a new out_dir (--out DIR)"
    )


def _yaml_scalar(v: Any) -> str:
    return "null" if v is None else str(v)


def _alternatives(path: Path) -> str:
    """The fix for a bad checkpoint: name earlier ones in the same folder, or starting fresh."""
    m = _NAME.match(path.name)
    step = int(m.group(1)) if m else None
    earlier = [p for s, p in list_checkpoints(path.parent) if p.name != path.name and (step is None or s < step)]
    hint = f"; resume from an earlier checkpoint instead (--resume-from {earlier[-1]})" if earlier else ""
    return f"{hint}; or start fresh with a new out_dir (--out DIR)"
