"""Data parallelism: `torch.nn.parallel.DistributedDataParallel` over the mesh's dp dim.

DDP buckets gradients (`bucket_cap_mb`) and launches each bucket's all-reduce as soon as the
bucket's last gradient is produced, so communication overlaps the rest of backward. It composes
with torch.compile (and so with graphtrain's "graphtrain" backend): Dynamo's DDPOptimizer splits
the captured graph at bucket boundaries so the all-reduces still overlap. Compile the DDP
wrapper, not the inner module: `graphtrain.accelerate(ddp_model)` / `torch.compile(ddp_model, ...)`.

Gradient accumulation: `grad_sync(model, sync=False)` wraps DDP's `no_sync()`, so non-final
micro-steps only accumulate locally; the final micro-step's backward all-reduces the sum once.
DDP averages over dp ranks, so the loss per micro-step is divided by grad_accum by the caller
exactly as in single-process accumulation.

Combined with tensor or pipeline parallelism, dp is not DDP but FSDP2's composable `replicate`
(`torch.distributed._composable.replicate_with_fsdp`, `apply_replicate`) over the mesh's dp dim:
DDP cannot wrap DTensor (tensor-parallel) parameters and its C++ reducer is not built for a
pipeline stage's several micro-batch forwards before backward, while `replicate` is FSDP2 with
one replica per dp rank: it keeps DTensor parameters (placement Replicate on dp, plus the tp
placement), all-reduces each block's gradients as soon as that block's backward is done (one
group per transformer block, so communication overlaps the rest of backward), and
`torch.distributed.pipelining` knows it (no all-reduce until a stage's last micro-batch).
`replicate` replaces the parameters: build the optimizer after it.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_data_parallel(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    device: torch.device,
    *,
    bucket_cap_mb: float = 25.0,
    find_unused_parameters: bool = False,
) -> nn.Module:
    """Wrap `model` in DDP over `dp_mesh` (1-D). dp == 1 returns the model unchanged."""
    if dp_mesh.size() == 1:
        return model
    if any(isinstance(p, DTensor) for p in model.parameters()):
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

        _pre_dp_module_transform(model)
    device_ids = [device.index] if device.type == "cuda" else None
    # Buffers (the causal mask) are identical by construction: skip DDP's per-forward buffer broadcast
    # (the keyword was renamed forward_sync_buffers in recent torch).
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP).parameters
        else {"broadcast_buffers": False}
    )
    return DDP(
        model,
        device_ids=device_ids,
        process_group=dp_mesh.get_group(),
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        **no_buffer_sync,
    )


def apply_replicate(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """FSDP2 `replicate` over the 1-D `dp_mesh`: each transformer block its own gradient all-reduce group, then
    the root (embeddings, final norm, head). Works on modules whose parameters are already tensor-parallel
    DTensors (the 2-D dp x tp layout) and on pipeline stages. dp == 1 returns the model unchanged."""
    if dp_mesh.size() == 1:
        return model
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in transformer_blocks(model):
        replicate(block, mesh=dp_mesh)
    return replicate(model, mesh=dp_mesh)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the children of its longest ModuleList / ModuleDict of one module type
    (graphtrain's `blocks` / `layers`, a pipeline stage's `blocks`, Hugging Face's `encoder.layer` or `h`)."""
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            kids = list(m.values() if isinstance(m, nn.ModuleDict) else m)
            if len(kids) > len(best) and len({type(k) for k in kids}) == 1:
                best = kids
    return best


def is_replicated(model: nn.Module) -> bool:
    """True for a module data-parallel through FSDP2 (`replicate` / `fully_shard`)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def _fsdp_sync(model: nn.Module, sync: bool):
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def grad_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Context for one micro-step's forward+backward: no gradient all-reduce unless `sync` (the last micro-step).

    DDP: `no_sync()`; FSDP2 `replicate`: `set_requires_gradient_sync(False)` (restored afterwards)."""
    if sync:
        return contextlib.nullcontext()
    if isinstance(model, DDP):
        return model.no_sync()
    if is_replicated(model):
        return _fsdp_sync(model, False)
    return contextlib.nullcontext()


def broadcast_parameters(model: nn.Module, group: dist.ProcessGroup | None, src_rank_in_group: int = 0) -> None:
    """Make every rank of `group` hold rank `src`'s weights (plain tensors and DTensor local shards)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, src_rank_in_group)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            local = t.to_local() if isinstance(t, DTensor) else t
            dist.broadcast(local, src=src, group=group)


def gradient_bytes(model: nn.Module) -> int:
    """Bytes all-reduced per optimizer step by data parallelism (each rank's local gradient shard)."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return total
