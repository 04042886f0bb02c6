"""Laying a model out over the mesh: `parallelize` builds the layout, `Parallelized` is the model and optimizer laid
out, with the step helpers (forward/backward, clipping, save/load) that differ per layout. The package docstring
(graphtrain/distributed/__init__.py) shows the loop and lists the layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from graphtrain.config.sections import Config, ParallelConfig
from graphtrain.distributed import checkpoint as ckpt
from graphtrain.distributed.data_parallel import apply_data_parallel, apply_replicate, broadcast_parameters, grad_sync
from graphtrain.distributed.mesh import DistEnv, init_distributed
from graphtrain.distributed.tensor_parallel import split_mixed_param_groups
from graphtrain.distributed.tp_plans import apply_tensor_parallel
from graphtrain.distributed.zero import optimizer_state_bytes, shard_optimizer
from graphtrain.optim.functional import clip_coefficient
from graphtrain.pipeline.functional import loss_of

# Imports inside functions: import cost: a layout loads the engine and the other layouts' machinery only when
# a run asks for them.

__all__ = ["Parallelized", "check_engine_under_ddp", "parallelize"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


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

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        micro_step: int = 0,
        micro_steps: int = 1,
        **model_kwargs: Any,
    ) -> torch.Tensor:
        """Forward, loss and backward for one micro-batch of this dp rank; returns the detached loss.

        Gradients accumulate over micro-steps (loss / micro_steps); data-parallel all-reduce runs
        only on the last one (DDP no_sync before). With pp > 1 one call runs the whole pipeline
        schedule over parallel.microbatches; the loss is returned on every rank.
        """
        if self.schedule is not None:
            from graphtrain.distributed.pipeline import pipeline_step, sync_tied_grads

            self.schedule._loss_fn.set_accumulation(micro_steps)
            loss = pipeline_step(self.schedule, self.model, input_ids, labels, self.env.group("pp"))
            if micro_step == micro_steps - 1:  # once per optimizer step: the sum covers every accumulation step
                sync_tied_grads(self.model, self._tied_group)
            return loss
        with grad_sync(self.model, sync=micro_step == micro_steps - 1):
            loss = loss_of(self.model(input_ids, labels=labels, **model_kwargs))
            (loss / micro_steps).backward()
        return loss.detach()

    def accelerate(self, engine: Any = None) -> nn.Module:
        """Compile this rank's module with the graphtrain engine, composed with the layout; returns the module.

        `engine` is what `graphtrain.accelerate` takes (EngineConfig, dict, Config or None).

        * dp (DDP): the module inside DDP is accelerated (in place), not the DDP wrapper: DDP's forward calls
          `self.module(...)` inside `_inside_ddp_forward`, which Dynamo does not trace but which marks the DDP
          module active (accelerating the wrapper records a graph break at `_inside_ddp_forward` and fails under
          engine.fallback=error, measured with torch 2.13 on 2 gloo ranks). `no_sync()` keeps working. A model
          with repeated blocks is compiled block by block as in one process (frontend/accelerate.py bypasses Dynamo's
          DDPOptimizer for it): each block's backward is an autograd node of its own, so DDP's reducer
          all-reduces each bucket as soon as its gradients are ready. Any other model (or compile_blocks false,
          recompute full/auto) goes through DDPOptimizer, as `torch.compile(ddp_model)` does: the graph is split
          at DDP's bucket boundaries, each piece compiled whole by Inductor (provider auto does not time aten
          there: runtime/provider_auto.py measurable).
        * tp: the whole module; its DTensor parameters are traced on their local shards (pipeline/trace.localize),
          so every pass sees the rank's local attention, GELU and LayerNorm, with the tp collectives as nodes.
        * pp: this rank's stage module, in place, so the pipeline schedule runs the compiled stage.
        * dp composed with tp or pp (FSDP2 `replicate`): each transformer block's forward, with replicate's
          hooks (which Dynamo cannot trace) running eagerly between blocks, as torchtitan compiles per block
          under FSDP2; the embeddings, head and loss run eagerly. `graphtrain.report(par.module)` covers all."""
        from graphtrain.config.sections import resolve_engine_config
        from graphtrain.distributed.data_parallel import is_replicated, transformer_blocks
        from graphtrain.frontend.accelerate import accelerate, compile_in_place, new_state

        cfg = resolve_engine_config(engine, {})
        module = self.module
        if not is_replicated(module):
            if isinstance(self.model, nn.parallel.DistributedDataParallel):  # only DDP splits the graph at buckets
                check_engine_under_ddp(cfg, module)
            return accelerate(module, cfg)
        state = new_state(cfg)
        module._graphtrain = state
        compile_in_place(transformer_blocks(module), state, hooks_outside=True)
        return module

    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor, **model_kwargs: Any) -> torch.Tensor:
        """Forward only (call under torch.no_grad()): this dp rank's mean loss, a plain tensor on every rank.

        With pp > 1 it runs the pipeline schedule's forward-only `eval` over parallel.microbatches."""
        if self.schedule is not None:
            from graphtrain.distributed.pipeline import pipeline_eval

            return pipeline_eval(self.schedule, self.model, input_ids, labels, self.env.group("pp"))
        return loss_of(self.model(input_ids, labels=labels, **model_kwargs)).detach()

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """Clip by the global gradient norm across tp shards and pp stages; returns the norm before clipping."""
        inner = self.module
        # The last pipeline stage's copy of the tied embedding holds the same (summed) gradient as stage 0's
        # matrix after sync_tied_grads: it is counted once, on stage 0.
        copy = (
            inner.lm_head.weight if getattr(inner, "is_last", False) and not getattr(inner, "is_first", True) else None
        )
        params = [p for p in inner.parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=self.env.device)
        sharded = torch.zeros_like(sq)
        for p in params:
            if p is copy:
                continue
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
            dist.all_reduce(sq, group=self.env.group("pp"))
        norm = sq.sqrt()
        if max_norm is not None:
            coef = clip_coefficient(norm, max_norm)
            for p in params:
                _local(p.grad).mul_(coef)  # in place on the local shard (DTensor grads under tp / replicate)
        return norm

    def optimizer_state_bytes(self) -> int:
        return optimizer_state_bytes(self.optimizer)

    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        return ckpt.save_checkpoint(path, self.model, self.optimizer, extra)

    def load(self, path: str | Path) -> dict:
        return ckpt.load_checkpoint(path, self.model, self.optimizer)


def check_engine_under_ddp(engine: Any, module: nn.Module) -> None:
    """Refuse engine.provider=aten under DDP when Dynamo's DDPOptimizer will split the graph (a model not compiled
    block by block, gradients over DDP's 1 MiB first bucket): the split pieces' backward, compiled lazily, then
    fails inside torch (measured, torch 2.13:
    "expected same # of fw and bw compiles, but found bucket -1"), because the aten provider calls AOTAutograd
    directly and DDPOptimizer only stashes a piece's forward metadata when torch's `aot_autograd` backend wrapper
    counted the call. Inductor goes through that wrapper and works; provider auto (the default) uses it alone for
    those pieces (runtime/provider_auto.py measurable)."""
    if getattr(engine, "provider", None) != "aten":
        return
    from graphtrain.pipeline.block_regions import splits_into_blocks

    if splits_into_blocks(engine, module):
        return  # compiled block by block, without DDPOptimizer (frontend/accelerate.py _run_compiled)
    grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    if grad_bytes > dist._DEFAULT_FIRST_BUCKET_BYTES:
        raise ValueError(
            f"engine.provider=aten does not compose with DDP for a model whose gradients "
            f"({grad_bytes / 2**20:.1f} MiB) span several DDP buckets (Dynamo's DDPOptimizer splits the "
            f"graph there and torch cannot compile the aten pieces' backward): use engine.provider=auto "
            f"(Inductor), engine.compile_blocks=true with engine.recompute none or selective for a "
            f"model with repeated blocks (compiled block by block, no split), or train.accelerate=false"
        )


def parallelize(
    model: nn.Module,
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
    parallel: ParallelConfig | Config,
    env: DistEnv | None = None,
) -> Parallelized:
    """Lay `model` out over the mesh and build its optimizer. Collective: every rank calls it.

    `model` is the full model built on every rank (weights are broadcast from rank 0, so they need
    not be seeded identically). `optimizer_factory(module)` builds the optimizer for this rank's
    module (e.g. `lambda m: build_optimizer(m, cfg.optim)`); with zero_stage=1 it is sharded.
    """
    parallel = parallel.parallel if isinstance(parallel, Config) else parallel
    env = env or init_distributed(parallel)
    composed = parallel.dp > 1 and (parallel.tp > 1 or parallel.pp > 1)
    if composed and parallel.zero_stage == 1:
        # dp with tp/pp runs through FSDP2 replicate, whose parameters are DTensors; ZeroRedundancyOptimizer
        # partitions plain tensors only (it raises on DTensors).
        raise ValueError(
            f"parallel.zero_stage=1 with parallel.dp>1 and parallel.{'tp' if parallel.tp > 1 else 'pp'}>1 "
            f"is not supported (ZeroRedundancyOptimizer needs plain tensors; dp composed with tp/pp uses "
            f"FSDP2 replicate, whose parameters are DTensors): set parallel.zero_stage=0, or use "
            f"zero_stage=1 with dp alone"
        )
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
    if composed:  # FSDP2 replicate over dp (DDP takes neither DTensor params nor pipelined micro-batches)
        wrapped = apply_replicate(module, env.mesh["dp"])
        optimizer = optimizer_factory(wrapped)  # replicate swapped the parameters for DTensors: optimizer after
    else:
        optimizer = optimizer_factory(module)
        wrapped = apply_data_parallel(module, env.mesh["dp"], env.device)
    if parallel.tp > 1 or composed:
        split_mixed_param_groups(optimizer)
    if parallel.zero_stage == 1:
        optimizer = shard_optimizer(optimizer, env.group("dp"))
    if parallel.pp > 1:
        from graphtrain.distributed.pipeline import build_schedule

        schedule = build_schedule(
            wrapped, env.pp_rank, parallel.pp, env.group("pp"), env.device, parallel.microbatches, parallel.schedule
        )
    return Parallelized(wrapped, optimizer, env, schedule, tied)
