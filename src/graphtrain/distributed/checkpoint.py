"""Sharded, reshardable, atomic checkpoints with `torch.distributed.checkpoint` (DCP).

Every rank writes only what it holds: DTensor shards (tensor parallel), its pipeline stage's
parameters, its ZeRO-1 share of the optimizer state. Replicated tensors (data-parallel copies)
are written once (DCP de-duplicates them). Keys are the *unsharded* model's parameter names and
shapes, so a checkpoint saved under one layout (dp, tp, pp, zero) loads under any other: DCP
reads, for each rank, exactly the slices that rank needs.

Layout of a checkpoint folder: DCP's `.metadata` and `__<rank>_*.distcp` files, `extra.pt` (small
state: step, config, RNG; tensors and plain values only, written by rank 0) and `SHA256SUMS` (the
SHA-256 of every other file, `sha256sum` format; graphtrain.checksums).

    model.<fqn>                     parameters and persistent buffers
    optim.<fqn>.<key>               per-parameter optimizer state (AdamW: step, exp_avg, exp_avg_sq)

Atomic: all ranks write into `<path>.tmp`; after a barrier rank 0 writes `SHA256SUMS` and renames the
folder to `<path>` (replacing an older checkpoint there through `<path>.old`), so `<path>` is either
the previous complete checkpoint or the new complete one, never a half-written one, and always has its
checksums. Multi-node jobs need `<path>` on a shared filesystem.

Loading runs no code from the folder. DCP's `.metadata` is a Python pickle, which torch's own reader
unpickles without restriction; `SafeFileSystemReader` reads it instead, allowing only DCP's metadata
classes, torch dtypes, `torch.Size` and paths (anything else is refused), every requested entry must be
a tensor (DCP would unpickle a "bytes" entry), tensors are read with `weights_only=True`, and so is
`extra.pt`. Folders written before SHA256SUMS existed load without the checksum check.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.tensor import DTensor, Shard

from graphtrain.checksums import SUMS_NAME, fsync_dir, sha256_file, verify_sums, write_sums
from graphtrain.distributed.tensor_parallel import FUSED_ATTR, FUSED_DIM_ATTR
from graphtrain.distributed.zero import local_optimizer


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _dist():
        dist.barrier()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _fused(model: nn.Module) -> dict[str, list[str]]:
    return getattr(model, FUSED_ATTR, {})


def _aliases(model: nn.Module) -> dict[str, str]:
    """Names this module's copy of a tied parameter may be stored under in other layouts."""
    if getattr(model, "is_last", False) and not getattr(model, "is_first", True):
        return {"lm_head.weight": "wte.weight"}  # pipeline last stage: copy of the tied embedding
    return {}


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _part_dim(model: nn.Module, prefix: str, tail: str) -> int:
    """The dim the q/k/v parts of fused entry `prefix` + `tail` are stacked on: 0, or the model's FUSED_DIM_ATTR
    for its weight (and the weight's optimizer state) where the layout is [in, out]."""
    if tail == ".weight" or tail.startswith(".weight."):
        return getattr(model, FUSED_DIM_ATTR, {}).get(prefix, 0)
    return 0


def _fuse(entries: dict[str, torch.Tensor], fused: dict[str, list[str]], model: nn.Module) -> dict[str, torch.Tensor]:
    """Replace q/k/v part entries by the unsharded model's fused entry (concatenated along dim 0, or the dim the
    model names)."""
    out = dict(entries)
    for prefix, parts in fused.items():
        for key in [k for k in entries if k.startswith(prefix + parts[0] + ".")]:
            rest = key[len(prefix + parts[0]) :]
            pieces = [_full(out.pop(prefix + p + rest)) for p in parts]
            dim = _part_dim(model, prefix.partition(".")[2], rest)
            out[prefix + rest] = torch.cat(pieces, dim) if pieces[0].dim() else pieces[0]  # 0-d: Adam's step
    return out


def _state_entries(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    entries = {f"model.{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        names = _param_names(model)
        for p, state in local_optimizer(optimizer).state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    entries[f"optim.{names[id(p)]}.{k}"] = v
    fused = {f"{pre}.{p}": parts for p, parts in _fused(model).items() for pre in ("model", "optim")}
    return _fuse(entries, fused, model)


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Collective: every rank calls it. Writes `<path>` atomically; returns the final path."""
    model = unwrap(model)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    rank = dist.get_rank() if _dist() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_state_entries(model, optimizer), checkpoint_id=str(tmp))
    if rank == 0:
        torch.save(extra or {}, tmp / "extra.pt")
        _fsync_file(tmp / "extra.pt")
    _barrier()
    if rank == 0:  # every rank's files are complete: checksum them, then make the folder visible
        write_sums(
            tmp / SUMS_NAME,
            [
                (f.relative_to(tmp).as_posix(), sha256_file(f))
                for f in sorted(tmp.rglob("*"))
                if f.is_file() and f.name != SUMS_NAME
            ],
        )
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
        fsync_dir(path.parent)
    _barrier()
    return path


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_folder(path: str | os.PathLike) -> bool:
    """Check every file of a checkpoint folder against its SHA256SUMS: True when verified, False when the folder
    has none (written before graphtrain recorded checksums). Raises checksums.ChecksumMismatch naming the file."""
    path = Path(path)
    if not (path / SUMS_NAME).is_file():
        return False
    verify_sums(path / SUMS_NAME, path)
    return True


def _check_integrity(path: Path) -> None:
    try:
        verify_folder(path)
    except ValueError as e:
        raise ValueError(f"checkpoint {str(path)!r} is corrupt: {e}; resume from an earlier checkpoint") from None


# ------------------------------------------------------------------------------ safe reading ----


class _Refused(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list."""


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What a DCP .metadata pickle may name: DCP's metadata classes (dataclasses and an enum), torch dtypes,
    torch.Size, the layout lookup and pathlib paths. Constructing any of them runs no code of the file's."""
    allowed: dict[tuple[str, str], Any] = {
        (dcp_metadata.__name__, n): obj
        for n, obj in vars(dcp_metadata).items()
        if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__
    }
    allowed[(_StorageInfo.__module__, _StorageInfo.__name__)] = _StorageInfo
    allowed.update({("torch", n): getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)})
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed.update(
        {
            ("pathlib", n): getattr(pathlib, n)
            for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
        }
    )
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _allowed_globals()
        obj = _MetadataUnpickler._allowed.get((module, name))
        if obj is None:
            raise _Refused(f"{module}.{name}")
        return obj


def read_metadata(path: str | os.PathLike, file: str = ".metadata") -> dcp_metadata.Metadata:
    """A checkpoint folder's DCP metadata, unpickled with the allow-list only. Raises ValueError when the file
    names anything else (a crafted pickle: nothing of it runs) or is unreadable."""
    path = Path(path)
    try:
        with open(path / file, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise ValueError(
            f"checkpoint {str(path)!r}: its DCP {file} names {e}, which is not part of DCP's checkpoint "
            f"metadata; graphtrain refuses to unpickle it (a pickle can run code): load only "
            f"checkpoints graphtrain wrote"
        ) from None
    except Exception as e:  # truncated or not a pickle: EOFError, UnpicklingError, ...
        raise ValueError(
            f"checkpoint {str(path)!r}: its DCP {file} is unreadable or corrupt ({type(e).__name__}); "
            f"resume from an earlier checkpoint instead"
        ) from None
    if not isinstance(meta, dcp_metadata.Metadata):
        raise ValueError(f"checkpoint {str(path)!r}: its DCP {file} holds a {type(meta).__name__}, not DCP metadata")
    return meta


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with `.metadata` read by `read_metadata` (the allow-list) instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        meta = read_metadata(Path(str(self.path)), ".metadata" if rank is None else f"__{rank}.metadata")
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = dcp_metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


def read_extra(path: str | os.PathLike) -> dict[str, Any]:
    """`extra.pt` of a checkpoint folder ({} when absent), read with weights_only=True: tensors and plain values.
    Raises ValueError when it holds other objects; other read errors propagate."""
    file = Path(path) / "extra.pt"
    if not file.is_file():
        return {}
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise
        raise ValueError(
            f"checkpoint {str(Path(path))!r}: extra.pt holds Python objects other than tensors and plain "
            f"values ({_first_line(e)}); graphtrain does not unpickle those (a pickle can run code): "
            f"load only checkpoints graphtrain wrote"
        ) from None


def _first_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:160]


def _tensor_entries(path: Path, meta: dict[str, Any], keys: list[str]) -> None:
    """DCP unpickles an entry stored as bytes, without torch.load's weights-only restriction: every entry read
    must be a tensor."""
    for key in keys:
        if not isinstance(meta.get(key), dcp_metadata.TensorStorageMetadata):
            raise ValueError(
                f"checkpoint {str(path)!r}: entry {key!r} is stored as "
                f"{type(meta.get(key)).__name__}, not a tensor; graphtrain reads only tensors from "
                f"sharded checkpoints (other entries are pickles, which can run code)"
            )


def _shard_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's local piece of `full` for a tensor laid out like `like` (plain, or DTensor Shard(0)/Replicate)."""
    if not isinstance(like, DTensor):
        return full
    for mesh_dim, pl in enumerate(like.placements):
        if isinstance(pl, Shard):
            full = full.chunk(like.device_mesh.size(mesh_dim), dim=pl.dim)[like.device_mesh.get_local_rank(mesh_dim)]
    return full


def _canonical(name: str, model: nn.Module) -> list[str]:
    """Names a parameter of this module may be stored under: its own, its tied alias, its fused parent."""
    for prefix, parts in _fused(model).items():
        for part in parts:
            if name.startswith(prefix + part + "."):
                return [prefix + name[len(prefix + part) :]]
    alias = _aliases(model).get(name)
    return [name] + ([alias] if alias else [])


def _allocate_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> None:
    """A fresh optimizer holds no state yet: create zero tensors for every entry the checkpoint has."""
    opt = local_optimizer(optimizer)
    names = _param_names(model)
    for p in [p for g in opt.param_groups for p in g["params"]]:
        state = opt.state[p]
        for stored in _canonical(names[id(p)], model):
            for key, m in meta.items():
                k = key[len(f"optim.{stored}.") :]
                if not key.startswith(f"optim.{stored}.") or "." in k or k in state or not hasattr(m, "size"):
                    continue
                state[k] = (
                    torch.zeros_like(p)
                    if p.dim() and len(m.size) == p.dim()
                    else torch.zeros(m.size, dtype=m.properties.dtype)
                )


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Collective: load `<path>` (saved under any layout) into this rank's model/optimizer; returns `extra`."""
    model = unwrap(model)
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(
            f"{path} is not a complete graphtrain checkpoint (no .metadata): pass the folder "
            f"save_checkpoint wrote (an interrupted save leaves only {path.name}.tmp)"
        )
    _check_integrity(path)
    meta = read_metadata(path).state_dict_metadata
    if optimizer is not None:
        _allocate_optimizer_state(model, optimizer, meta)
    request: dict[str, torch.Tensor] = {}
    for key, t in _state_entries(model, optimizer).items():
        kind, _, rest = key.partition(".")
        if key not in meta:  # a pipeline stage's copy of the tied matrix, saved by a pp=1 run under its alias
            for name, alt in _aliases(model).items():
                if rest.startswith(name + "."):
                    key = f"{kind}.{alt}{rest[len(name) :]}"
        if key not in meta:
            raise ValueError(f"checkpoint {path} has no entry {key!r}: it was saved from a different model")
        request[key] = t
    _tensor_entries(path, meta, list(request))
    dcp.load(request, storage_reader=SafeFileSystemReader(str(path)))
    _scatter_fused(model, optimizer, request)
    return read_extra(path)


def _scatter_fused(model: nn.Module, optimizer: torch.optim.Optimizer | None, loaded: dict[str, torch.Tensor]) -> None:
    """Copy loaded fused q/k/v entries (fresh full tensors) into the module's split, sharded tensors."""
    if not _fused(model):
        return
    own = {f"model.{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        names = _param_names(model)
        for p, state in local_optimizer(optimizer).state.items():
            own.update({f"optim.{names[id(p)]}.{k}": v for k, v in state.items() if isinstance(v, torch.Tensor)})
    with torch.no_grad():
        for key, full in loaded.items():
            kind, _, rest = key.partition(".")
            for prefix, parts in _fused(model).items():
                if not rest.startswith(prefix + "."):
                    continue
                tail = rest[len(prefix) :]
                dim = _part_dim(model, prefix, tail)
                pieces = full.chunk(len(parts), dim) if full.dim() else [full] * len(parts)
                for part, piece in zip(parts, pieces):
                    dst = own[f"{kind}.{prefix}{part}{tail}"]
                    local = dst.to_local() if isinstance(dst, DTensor) else dst
                    local.copy_(_shard_of(piece, dst))


def load_model_weights_local(path: str | os.PathLike, model: nn.Module) -> None:
    """Read the model weights of `<path>` (saved under any layout) into an unsharded `model`, on this process
    alone: no collective, so one rank can call it while the others do something else (sampling under pp)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a complete graphtrain checkpoint (no .metadata)")
    _check_integrity(path)
    request = {f"model.{k}": v for k, v in model.state_dict().items()}
    _tensor_entries(path, read_metadata(path).state_dict_metadata, list(request))
    import warnings

    with warnings.catch_warnings():  # DCP says it assumes a single process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(request, storage_reader=SafeFileSystemReader(str(path)), no_dist=True)
