"""Sharded, reshardable, atomic checkpoints with `torch.distributed.checkpoint` (DCP).

Every rank writes only what it holds: DTensor shards (tensor parallel), its pipeline stage's
parameters, its ZeRO-1 share of the optimizer state. Replicated tensors (data-parallel copies)
are written once (DCP de-duplicates them). Keys are the *unsharded* model's parameter names and
shapes, so a checkpoint saved under one layout (dp, tp, pp, zero) loads under any other: DCP
reads, for each rank, exactly the slices that rank needs.

Layout of a checkpoint folder: DCP's `.metadata` and `__<rank>_*.distcp` files, plus `extra.pt`
(small Python state: step, LR schedule, config; written by rank 0).

    model.<fqn>                     parameters and persistent buffers
    optim.<fqn>.<key>               per-parameter optimizer state (AdamW: step, exp_avg, exp_avg_sq)

Atomic: all ranks write into `<path>.tmp`; after a barrier rank 0 renames it to `<path>`
(replacing an older checkpoint there), so `<path>` is either the previous complete checkpoint or
the new complete one, never a half-written one. Multi-node jobs need `<path>` on a shared filesystem.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from graphtrain.distributed.tensor_parallel import FUSED_ATTR
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


def _fuse(entries: dict[str, torch.Tensor], fused: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """Replace q/k/v part entries by the unsharded model's fused entry (concatenated along dim 0)."""
    out = dict(entries)
    for prefix, parts in fused.items():
        for key in [k for k in entries if k.startswith(prefix + parts[0] + ".")]:
            rest = key[len(prefix + parts[0]):]
            pieces = [_full(out.pop(prefix + p + rest)) for p in parts]
            out[prefix + rest] = torch.cat(pieces) if pieces[0].dim() else pieces[0]  # 0-d: Adam's step
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
    return _fuse(entries, fused)


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict[str, Any] | None = None) -> Path:
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
    _barrier()
    if rank == 0:
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def _shard_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's local piece of `full` for a tensor laid out like `like` (plain, or DTensor Shard(0)/Replicate)."""
    if not isinstance(like, DTensor):
        return full
    for mesh_dim, pl in enumerate(like.placements):
        if isinstance(pl, Shard):
            assert pl.dim == 0, "fused tensor-parallel entries are sharded on dim 0"
            full = full.chunk(like.device_mesh.size(mesh_dim))[like.device_mesh.get_local_rank(mesh_dim)]
    return full


def _canonical(name: str, model: nn.Module) -> list[str]:
    """Names a parameter of this module may be stored under: its own, its tied alias, its fused parent."""
    for prefix, parts in _fused(model).items():
        for part in parts:
            if name.startswith(prefix + part + "."):
                return [prefix + name[len(prefix + part):]]
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
                k = key[len(f"optim.{stored}."):]
                if not key.startswith(f"optim.{stored}.") or "." in k or k in state or not hasattr(m, "size"):
                    continue
                state[k] = (torch.zeros_like(p) if p.dim() and len(m.size) == p.dim()
                            else torch.zeros(m.size, dtype=m.properties.dtype))


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Collective: load `<path>` (saved under any layout) into this rank's model/optimizer; returns `extra`."""
    model = unwrap(model)
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path} is not a complete graphtrain checkpoint (no .metadata): pass the folder "
                         f"save_checkpoint wrote (an interrupted save leaves only {path.name}.tmp)")
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    if optimizer is not None:
        _allocate_optimizer_state(model, optimizer, meta)
    request: dict[str, torch.Tensor] = {}
    for key, t in _state_entries(model, optimizer).items():
        kind, _, rest = key.partition(".")
        if key not in meta:  # a pipeline stage's copy of the tied matrix, saved by a pp=1 run under its alias
            for name, alt in _aliases(model).items():
                if rest.startswith(name + "."):
                    key = f"{kind}.{alt}{rest[len(name):]}"
        if key not in meta:
            raise ValueError(f"checkpoint {path} has no entry {key!r}: it was saved from a different model")
        request[key] = t
    dcp.load(request, checkpoint_id=str(path))
    _scatter_fused(model, optimizer, request)
    return torch.load(path / "extra.pt", weights_only=False) if (path / "extra.pt").is_file() else {}


def _scatter_fused(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                   loaded: dict[str, torch.Tensor]) -> None:
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
                tail = rest[len(prefix):]
                pieces = full.chunk(len(parts)) if full.dim() else [full] * len(parts)
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
    request = {f"model.{k}": v for k, v in model.state_dict().items()}
    import warnings
    with warnings.catch_warnings():  # DCP says it assumes a single process: that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(request, checkpoint_id=str(path), no_dist=True)
