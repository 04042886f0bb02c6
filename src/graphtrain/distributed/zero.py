"""ZeRO stage 1: optimizer state sharded across data-parallel ranks.

Built on `torch.distributed.optim.ZeroRedundancyOptimizer`: each dp rank owns a subset of whole
parameters (a sorted-greedy partition by size), keeps the optimizer state (AdamW: exp_avg,
exp_avg_sq, step) only for those, updates only those after DDP's all-reduce, then broadcasts
its updated parameters to the other dp ranks. Per-rank optimizer memory is therefore about
1/dp of the unsharded optimizer's; weights and gradients stay replicated (that is stage 1).

`shard_optimizer(opt, dp_group)` turns an optimizer made by `graphtrain.optim.build_optimizer`
(or any torch optimizer) into its ZeRO-1 twin: same class, same param groups, same hyper-
parameters. Call it before the first step (the original optimizer must hold no state yet).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

_GROUP_KEYS_SKIP = ("params",)


def shard_optimizer(optimizer: torch.optim.Optimizer, dp_group: dist.ProcessGroup) -> torch.optim.Optimizer:
    """The ZeRO-1 version of `optimizer` over `dp_group` (returned unchanged if the group has 1 rank)."""
    if dist.get_world_size(dp_group) == 1:
        return optimizer
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(
            "shard_optimizer must be called before the first optimizer step (the optimizer already "
            "holds state); build the optimizer, shard it, then train"
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            "parallel.zero_stage=1 with parallel.tp>1 is not supported (ZeroRedundancyOptimizer needs "
            "plain tensors, tensor parallelism makes DTensors): set parallel.zero_stage=0 when tp > 1"
        )
    groups = [{k: v for k, v in g.items()} for g in optimizer.param_groups]
    groups = [g for g in groups if g["params"]]  # ZeroRedundancyOptimizer rejects empty groups
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k not in _GROUP_KEYS_SKIP and k in accepted}
    # ZeroRedundancyOptimizer forwards **defaults to the local optimizer; per-group values (lr,
    # weight_decay, ...) ride along in the group dicts.
    zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer), process_group=dp_group, **defaults)
    return zero


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that actually holds this rank's state (ZeRO's `.optim`, else itself)."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state (tensors in `state`) held by this rank; DTensors count their local shard."""
    total = 0
    for state in local_optimizer(optimizer).state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                t = v.to_local() if isinstance(v, DTensor) else v
                total += t.numel() * t.element_size()
    return total


def owned_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters whose optimizer state this rank holds (all of them without ZeRO)."""
    return [p for g in local_optimizer(optimizer).param_groups for p in g["params"]]
