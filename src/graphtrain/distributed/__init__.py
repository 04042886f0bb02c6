"""Distributed training on torch.distributed: one entry point for the Trainer.

    env = init_distributed(cfg.parallel)                      # torchrun env -> process group + mesh
    model = build_model(cfg.model, vocab_size)                # same seed on every rank
    par = parallelize(model, lambda m: build_optimizer(m, cfg.optim), cfg.parallel, env)
    for step ...:
        for i, micro in enumerate(micro_batches):             # this dp rank's share of the batch
            loss = par.forward_backward(micro["input_ids"], micro["labels"], micro_step=i, micro_steps=n)
        par.clip_grad_norm_(cfg.optim.grad_clip); par.optimizer.step(); par.optimizer.zero_grad()
    par.save(path, extra) / par.load(path)

Layouts: dp (DDP), dp + zero_stage=1 (ZeroRedundancyOptimizer), tp (DTensor Megatron plan; with
dp via DDP), pp (pipelining 1F1B/GPipe; with dp and ZeRO-1). Not supported yet: tp with pp,
dp with tp or pp, ZeRO-1 with tp (clear ValueError).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from graphtrain.config import Config, ParallelConfig
from graphtrain.distributed import checkpoint as ckpt
from graphtrain.distributed.data_parallel import apply_data_parallel, broadcast_parameters, grad_sync
from graphtrain.distributed.mesh import DistEnv, check_layout, init_distributed, shutdown
from graphtrain.distributed.tensor_parallel import (apply_tensor_parallel, local_loss, loss_context,
                                                   split_mixed_param_groups)
from graphtrain.distributed.zero import optimizer_state_bytes, shard_optimizer

__all__ = ["DistEnv", "Parallelized", "check_layout", "init_distributed", "parallelize", "shutdown",
           "optimizer_state_bytes"]


@dataclass
class Parallelized:
    """A model and optimizer laid out over the mesh, with the step helpers that differ per layout."""

    model: nn.Module  # DDP wrapper / TP-sharded module / pipeline stage: compile and train this
    optimizer: torch.optim.Optimizer
    env: DistEnv
    schedule: Any = None  # pipeline schedule when pp > 1
    _tied_group: Any = None
    _extra: dict = field(default_factory=dict)

    @property
    def module(self) -> nn.Module:
        """The user's module (or this rank's stage) without DDP / compile wrappers."""
        return ckpt.unwrap(self.model)

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor, *, micro_step: int = 0,
                         micro_steps: int = 1, **model_kwargs: Any) -> torch.Tensor:
        """Forward, loss and backward for one micro-batch of this dp rank; returns the detached loss.

        Gradients accumulate over micro-steps (loss / micro_steps); data-parallel all-reduce runs
        only on the last one (DDP no_sync before). With pp > 1 one call runs the whole pipeline
        schedule over parallel.microbatches; the loss is returned on every rank.
        """
        if self.schedule is not None:
            from graphtrain.distributed.pipeline import pipeline_step, sync_tied_grads
            self.schedule._loss_fn.scale = 1.0 / micro_steps
            loss = pipeline_step(self.schedule, self.model, input_ids, labels, self.env.group("pp"))
            sync_tied_grads(self.model, self._tied_group)
            return loss
        with grad_sync(self.model, sync=micro_step == micro_steps - 1), loss_context(self.model):
            loss = self.model(input_ids, labels=labels, **model_kwargs)
            (loss / micro_steps).backward()
        return local_loss(loss.detach())

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Clip by the global gradient norm across tp shards and pp stages; returns the norm before clipping."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=self.env.device)
        sharded = torch.zeros_like(sq)
        for p in params:
            g = p.grad
            if isinstance(g, DTensor):
                local = g.to_local().float().pow(2).sum()
                if any(pl.is_shard() for pl in g.placements):
                    sharded += local
                    continue
                sq += local
            else:
                sq += g.float().pow(2).sum()
        if self.env.parallel.tp > 1:
            dist.all_reduce(sharded, group=self.env.group("tp"))
        sq += sharded
        if self.env.parallel.pp > 1:
            inner = self.module
            if getattr(inner, "is_last", False) and not getattr(inner, "is_first", True):
                sq -= inner.lm_head.weight.grad.float().pow(2).sum()  # the tied copy is counted on stage 0
            dist.all_reduce(sq, group=self.env.group("pp"))
        norm = sq.sqrt()
        if max_norm is not None:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for p in params:
                p.grad.mul_(coef)
        return norm

    def optimizer_state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)

    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        return ckpt.save_checkpoint(path, self.model, self.optimizer, extra)

    def load(self, path: str | Path) -> dict:
        return ckpt.load_checkpoint(path, self.model, self.optimizer)


def parallelize(model: nn.Module, optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
                parallel: ParallelConfig | Config, env: DistEnv | None = None) -> Parallelized:
    """Lay `model` out over the mesh and build its optimizer. Collective: every rank calls it.

    `model` is the full model built on every rank (weights are broadcast from rank 0, so they need
    not be seeded identically). `optimizer_factory(module)` builds the optimizer for this rank's
    module (e.g. `lambda m: build_optimizer(m, cfg.optim)`); with zero_stage=1 it is sharded.
    """
    parallel = parallel.parallel if isinstance(parallel, Config) else parallel
    env = env or init_distributed(parallel)
    if parallel.tp > 1 and parallel.pp > 1:
        raise ValueError("parallel.tp>1 together with parallel.pp>1 is not supported yet: use tp or pp (each with dp)")
    if parallel.dp > 1 and (parallel.tp > 1 or parallel.pp > 1):
        # Measured on 4 gloo ranks: DDP cannot wrap DTensor (tensor-parallel) parameters, and its reducer
        # asserts when a pipeline stage runs several micro-batch forwards before backward. Composing dp with
        # tp/pp needs FSDP2/replicate over the dp mesh dimension, which is not built yet.
        raise ValueError(f"parallel.dp>1 together with parallel.{'tp' if parallel.tp > 1 else 'pp'}>1 is not "
                         f"supported yet: use dp (optionally with zero_stage=1), tp or pp on its own")
    model = model.to(env.device)
    if env.mesh is None:
        return Parallelized(model, optimizer_factory(model), env)
    broadcast_parameters(model, dist.group.WORLD)
    schedule = tied = None
    module = model
    if parallel.pp > 1:
        from graphtrain.distributed.pipeline import build_stage_module, tied_group
        module = build_stage_module(model, env.pp_rank, parallel.pp)
        tied = tied_group(env.mesh)
    module = apply_tensor_parallel(module, env.mesh["tp"])
    optimizer = optimizer_factory(module)
    if parallel.tp > 1:
        split_mixed_param_groups(optimizer)
    wrapped = apply_data_parallel(module, env.mesh["dp"], env.device)
    if parallel.zero_stage == 1:
        optimizer = shard_optimizer(optimizer, env.group("dp"))
    if parallel.pp > 1:
        from graphtrain.distributed.pipeline import build_schedule
        schedule = build_schedule(wrapped, env.pp_rank, parallel.pp, env.group("pp"), env.device,
                                  parallel.microbatches, parallel.schedule)
    return Parallelized(wrapped, optimizer, env, schedule, tied)
