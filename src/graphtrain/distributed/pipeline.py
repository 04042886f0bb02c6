"""Pipeline parallelism for the reference GPT-2 with `torch.distributed.pipelining`.

`build_stage_module(model, stage, n_stages)` keeps only one stage's part of a graphtrain GPT-2:
stage 0 the token/position embeddings, every stage a contiguous slice of the blocks (earlier
stages take the remainder), the last stage the final LayerNorm and the LM head. Parameter names
(FQNs) are those of the full model (`blocks` becomes a ModuleDict keyed by the original index),
so checkpoints written under any pp load under any other.

The tied embedding / LM-head matrix lives on two stages when pp > 1 (Megatron's approach): the
last stage holds a copy, and after backward `sync_tied_grads` all-reduces the two gradients over
a {first, last} stage group, so both copies take the same update and stay equal.

`build_schedule` wraps the stage in `PipelineStage` and `Schedule1F1B` (parallel.schedule=1f1b:
one forward, one backward in steady state; at most pp micro-batches of activations alive) or
`ScheduleGPipe` (all forwards, then all backwards; `microbatches` activations alive). The loss
is the mean cross-entropy per micro-batch times 1/(microbatches x accumulation steps) (`ScaledLMLoss`;
the schedule's own scale_grads is off), so with equal-size micro-batches (and no -100 labels) the
step equals the full-batch step, with or without gradient accumulation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from graphtrain.models.layers import language_model_loss


def stage_layers(n_layer: int, n_stages: int) -> list[range]:
    """Contiguous block ranges per stage; the first `n_layer % n_stages` stages take one extra block."""
    if n_layer < n_stages:
        raise ValueError(
            f"parallel.pp={n_stages} stages need at least {n_stages} transformer blocks, the model has "
            f"{n_layer}: use parallel.pp<={n_layer} or a deeper model"
        )
    base, extra = divmod(n_layer, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        n = base + (1 if s < extra else 0)
        ranges.append(range(start, start + n))
        start += n
    return ranges


class GPT2Stage(nn.Module):
    """One pipeline stage of graphtrain's GPT-2; FQNs match the full model's. `loss_fn` is the loss the
    pipeline schedule applies to the last stage's logits (the vocab-parallel one under tensor parallelism)."""

    family = "gpt2"

    def __init__(self, model: nn.Module, stage: int, n_stages: int) -> None:
        super().__init__()
        if getattr(model, "family", None) != "gpt2":
            raise ValueError(
                f"pipeline parallelism has a split for graphtrain's reference GPT-2 only, not "
                f"{type(model).__name__}: use parallel.pp=1 for this model"
            )
        self.spec, self.loss_fn = model.spec, model.loss_fn
        self.stage, self.n_stages = stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in stage_layers(len(model.blocks), n_stages)[stage]})
        if self.is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        if self.is_last:
            self.ln_f = model.ln_f
            self.lm_head = model.lm_head
            if not self.is_first:  # own copy of the tied matrix, kept equal by sync_tied_grads
                self.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))
        return x


def build_stage_module(model: nn.Module, stage: int, n_stages: int) -> GPT2Stage:
    return GPT2Stage(model, stage, n_stages)


def tied_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The {first stage, last stage} group of this rank's (dp, tp) coordinate (None if pp == 1).

    Every rank creates every such group (new_group is collective), in the same order.
    """
    ranks = mesh.mesh  # [pp, dp, tp] global ranks
    pp = ranks.shape[0]
    if pp == 1:
        return None
    mine = None
    me = dist.get_rank()
    for d in range(ranks.shape[1]):
        for t in range(ranks.shape[2]):
            members = [int(ranks[0, d, t]), int(ranks[pp - 1, d, t])]
            g = dist.new_group(members)
            if me in members:
                mine = g
    return mine


def sync_tied_grads(stage_module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum the embedding gradient (first stage) and LM-head gradient (last stage) across the two stages."""
    inner = getattr(stage_module, "module", stage_module)
    if group is None or (inner.is_first and inner.is_last):
        return
    if inner.is_first:
        p = inner.wte.weight
    elif inner.is_last:
        p = inner.lm_head.weight
    else:
        return
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # DTensor under dp x pp (replicate)
    dist.all_reduce(grad, group=group)


class ScaledLMLoss:
    """The GPT-2 loss times `scale` = 1 / (micro-batches x grad-accumulation steps), so gradients average.

    The schedule is built with scale_grads=False and the loss carries the whole scale: the schedule's own
    scale_grads divides every `.grad` by the micro-batch count after each step, which also rescales the
    gradients accumulated by earlier accumulation steps (measured: pp=2 with 2 accumulation steps drifted
    from the single-process run from the second step on)."""

    def __init__(
        self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = language_model_loss, microbatches: int = 1
    ) -> None:
        self.loss, self.microbatches = loss, microbatches
        self.scale = 1.0 / microbatches

    def set_accumulation(self, micro_steps: int) -> None:
        self.scale = 1.0 / (self.microbatches * micro_steps)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(logits, labels) * self.scale


def build_schedule(
    stage_module: nn.Module,
    stage: int,
    n_stages: int,
    pp_group: dist.ProcessGroup,
    device: torch.device,
    microbatches: int,
    schedule: str,
    loss_fn: ScaledLMLoss | None = None,
):
    """PipelineStage + Schedule1F1B / ScheduleGPipe over `pp_group` (stage_module may be DDP-wrapped)."""
    if schedule == "1f1b" and microbatches < n_stages:
        raise ValueError(
            f"parallel.schedule=1f1b needs parallel.microbatches >= parallel.pp ({n_stages}), got "
            f"{microbatches}: raise parallel.microbatches or use parallel.schedule=gpipe"
        )
    pipe_stage = PipelineStage(stage_module, stage, n_stages, device, group=pp_group)
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    inner = getattr(stage_module, "module", stage_module)
    loss_fn = loss_fn or ScaledLMLoss(getattr(inner, "loss_fn", language_model_loss), microbatches=microbatches)
    return cls(pipe_stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def pipeline_step(
    schedule, stage_module: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, pp_group: dist.ProcessGroup
) -> torch.Tensor:
    """One forward+backward over all micro-batches; returns the mean micro-batch loss on every stage."""
    inner = getattr(stage_module, "module", stage_module)
    if input_ids.size(0) % schedule._n_microbatches:
        raise ValueError(
            f"the batch size {input_ids.size(0)} must divide by parallel.microbatches="
            f"{schedule._n_microbatches}: change train.batch_size or parallel.microbatches"
        )
    losses: list[torch.Tensor] = []
    args = (input_ids,) if inner.is_first else ()
    schedule.step(
        *args, target=labels if inner.is_last else None, losses=losses if inner.is_last else None, return_outputs=False
    )
    scale = getattr(schedule._loss_fn, "scale", 1.0)
    loss = torch.stack([x.detach().float() for x in losses]).mean() / scale if inner.is_last else torch.zeros(())
    loss = loss.to(input_ids.device)
    last = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)
    dist.broadcast(loss, src=last, group=pp_group)
    return loss


def pipeline_eval(
    schedule, stage_module: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, pp_group: dist.ProcessGroup
) -> torch.Tensor:
    """Forward only (the schedule's `eval`) over all micro-batches; the mean micro-batch loss on every stage."""
    inner = getattr(stage_module, "module", stage_module)
    if input_ids.size(0) % schedule._n_microbatches:
        raise ValueError(
            f"the evaluation batch size {input_ids.size(0)} must divide by parallel.microbatches="
            f"{schedule._n_microbatches}: change train.batch_size or parallel.microbatches"
        )
    losses: list[torch.Tensor] = []
    schedule.eval(
        *((input_ids,) if inner.is_first else ()),
        target=labels if inner.is_last else None,
        losses=losses if inner.is_last else None,
    )
    scale = getattr(schedule._loss_fn, "scale", 1.0)
    loss = torch.stack([x.detach().float() for x in losses]).mean() / scale if inner.is_last else torch.zeros(())
    loss = loss.to(input_ids.device)
    dist.broadcast(loss, src=dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1), group=pp_group)
    return loss
