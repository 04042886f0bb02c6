"""What a run keeps besides its rolling checkpoints (trainer/checkpoint.py): the best one and a Hugging Face folder.

- train.keep_best: ``out_dir/ckpt-best.pt`` (a sharded run: ``ckpt-best/``), the checkpoint of the lowest
  validation loss among the saves whose step was evaluated. It is a hard link to that ``ckpt-N.pt`` where the file
  system allows (no copy; pruning ``ckpt-N.pt`` later leaves it whole), a copy otherwise, with its own checksum
  file ``ckpt-best.pt.sha256``. Its name is not a ``ckpt-NNNNNNN``, so pruning, ``latest`` and ``--resume auto``
  never see it; ``--resume-from out_dir/ckpt-best.pt``, ``train.init_from`` and ``graphtrain export RUN
  --checkpoint best`` take it. A resume from an earlier step moves a best of a later step aside with the other
  later checkpoints (trainer/resume.py, `supersede_later`).
- train.export_hf: ``out_dir/hf/``, the final checkpoint as a Hugging Face folder (models/hf_export.py).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from graphtrain.checksums import fsync_dir, read_sums, sha256_file, sidecar_path, write_sums
from graphtrain.trainer.checkpoint import (
    checkpoint_meta,
    is_sharded,
    latest_valid_checkpoint,
    load_checkpoint,
    to_module_keys,
)
from graphtrain.trainer.console import quiet_libraries

# Imports inside functions: import cost: an eager run (train.accelerate=false, one process) never loads the
# engine (Dynamo, Inductor), torch.distributed or the tools; each is imported where a run needs it.

BEST = "ckpt-best"  # train.keep_best: ckpt-best.pt, or the sharded folder ckpt-best/


# ------------------------------------------------------------------------------------ best ----

_best_cache: dict[str, tuple[tuple[int, int], int, float]] = {}  # best path -> ((inode, mtime), step, val_loss)


def best_checkpoint(out_dir: str | Path) -> Path | None:
    """train.keep_best's checkpoint of `out_dir` (ckpt-best.pt or ckpt-best/), or None."""
    for p in (Path(out_dir) / f"{BEST}.pt", Path(out_dir) / BEST):
        if p.is_file() or is_sharded(p):
            return p
    return None


def best_info(out_dir: str | Path) -> tuple[Path, int, float] | None:
    """(path, step, validation loss) of the best checkpoint, or None when there is none or it does not verify."""
    path = best_checkpoint(out_dir)
    if path is None:
        return None
    st = path.stat()
    key, stamp = str(path.resolve()), (st.st_ino, st.st_mtime_ns)
    if key in _best_cache and _best_cache[key][0] == stamp:
        return path, *_best_cache[key][1:]
    try:
        meta = checkpoint_meta(path)
    except ValueError:
        return None
    loss = (meta.get("metrics") or {}).get("val_loss")
    loss = float(loss) if isinstance(loss, (int, float)) else math.nan
    _best_cache[key] = (stamp, int(meta["step"]), loss)
    return path, int(meta["step"]), loss


def update_best(out_dir: str | Path, saved: str | Path, val_loss: float) -> bool:
    """Make the checkpoint `saved` (a ckpt-N file or sharded folder of `out_dir`) the best one when `val_loss` is
    finite and below the current best's (or there is none, or it does not verify); returns whether it did.

    A file becomes ckpt-best.pt through a hard link (no copy; pruning ckpt-N later leaves it whole) made under a
    temporary name and renamed into place after its checksum file (the same order as `save_checkpoint`), so a
    crash leaves the previous best or the new one; a folder is linked file by file into ckpt-best.tmp/ and swapped
    in through ckpt-best.old/ (both cleaned or restored at the next start, trainer/resume.py)."""
    if not math.isfinite(val_loss):
        return False
    out, saved = Path(out_dir), Path(saved)
    current = best_info(out)
    if current is not None and math.isfinite(current[2]) and current[2] <= val_loss:
        return False
    if is_sharded(saved):
        _swap_best_folder(out, saved)
    else:
        _swap_best_file(out, saved)
    fsync_dir(out)
    return True


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


def _swap_best_file(out: Path, saved: Path) -> None:
    best = out / f"{BEST}.pt"
    tmp = out / f".{best.name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    try:
        _link_or_copy(str(saved), str(tmp))
        recorded = read_sums(sidecar_path(saved)).get(saved.name, set()) if sidecar_path(saved).is_file() else set()
        digest = next(iter(recorded)) if len(recorded) == 1 else sha256_file(tmp)
        sums = sidecar_path(best)
        old = [(best.name, sha256_file(best))] if best.is_file() else []
        write_sums(sums, [(best.name, digest), *old])  # either file verifies until the rename is done
        os.replace(tmp, best)
        if old:
            write_sums(sums, [(best.name, digest)])
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if (out / BEST).is_dir():  # an earlier best of another kind (a run resumed under another layout)
        shutil.rmtree(out / BEST, ignore_errors=True)


def _swap_best_folder(out: Path, saved: Path) -> None:
    tmp, old, best = out / f"{BEST}.tmp", out / f"{BEST}.old", out / BEST
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(saved, tmp, copy_function=_link_or_copy)
    if best.is_dir():
        os.replace(best, old)
    os.replace(tmp, best)
    shutil.rmtree(old, ignore_errors=True)
    for p in (out / f"{BEST}.pt", sidecar_path(out / f"{BEST}.pt")):
        p.unlink(missing_ok=True)


# ------------------------------------------------------------------------------ HF folder ----


@quiet_libraries()  # transformers' bars would land in the run's log (trainer/console.py)
def write_hf_folder(out_dir: str | Path, config: Any, tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """train.export_hf: the latest checkpoint of `out_dir` as a Hugging Face folder `out_dir/hf` (what
    `graphtrain export RUN --format hf` writes, models/hf_export.py), loaded back by transformers and its logits
    compared with the checkpoint's model. Written in `out_dir/.hf.tmp/` and swapped in, so the folder is always a
    whole export (the previous one until the new one is complete). Returns {out, checkpoint, class, max_abs_diff,
    special_tokens}."""
    from graphtrain.models import build_model
    from graphtrain.models.hf_export import write_hf_folder as write

    out = Path(out_dir)
    path = latest_valid_checkpoint(out)
    if path is None:
        raise ValueError(f"train.export_hf: {str(out)!r} has no valid checkpoint to export")
    with torch.random.fork_rng(devices=[]):
        model = build_model(config.model, vocab_size=vocab_size)
    if is_sharded(path):
        from graphtrain.distributed.checkpoint import load_model_weights_local

        load_model_weights_local(path, model)
    else:
        model.load_state_dict(to_module_keys(load_checkpoint(path)["model"], model))
    model.eval()
    sample = torch.randint(
        0, model.spec.vocab_size, (2, min(16, model.max_seq_len)), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        ref = model(sample)
    tmp, old, final = out / ".hf.tmp", out / ".hf.old", out / "hf"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        result = write(model, tokenizer, tmp, sample, ref)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return {"out": str(final), "checkpoint": str(path), **result}
