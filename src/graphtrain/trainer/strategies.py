"""How one optimizer step runs: the step strategies behind `Trainer.fit`.

`fit()` is one loop for every mode; what differs is the strategy it calls:

    SingleProcessStep   one process: eager PyTorch, or the module compiled in place by the graph engine
                        (train.accelerate), with a torch optimizer and fp16 dynamic loss scaling
    WholeStepGraph      train.whole_step: forward, backward, clipping, AdamW and loss scaling as one graph
                        (graphtrain.compile_step); the graph owns the optimizer state
    DistributedStep     parallel.dp*tp*pp > 1 under torchrun: the model laid out by graphtrain.distributed
                        (DDP, ZeRO-1, tensor and pipeline parallel, their products); sharded checkpoints

Each owns what differs between the modes (`StepStrategy`): building and wrapping the model and
optimizer, one optimizer step over the train.grad_accum micro-batches, the validation loss, the
checkpoint state, and the whole model for sampling. Batches come from the Trainer, full-size and on
the device; the learning rate too (`lr_at(step)`).

Every strategy refuses a bad update before it is written (trainer/faults.py): a non-finite loss or
global gradient norm, or a loss above `max_loss` (the loss-spike guard), skips the optimizer step and
is reported in `StepResult.rejected`; the weights and optimizer moments stay as they were. fp16
overflows (finite loss) are skipped by the loss scaler as before, without counting as bad steps.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from graphtrain.config.sections import Config
from graphtrain.models import build_model
from graphtrain.optim import build_optimizer, make_loss_scaler, optimizer_step
from graphtrain.trainer import runtime
from graphtrain.trainer.checkpoint import (
    checkpoint_path,
    is_sharded,
    latest_checkpoint,
    load_checkpoint,
    load_sharded_meta,
    plain_state_dict,
    prune_checkpoints,
    rng_state,
    save_checkpoint,
    set_rng_state,
    to_module_keys,
)
from graphtrain.trainer.faults import rejection
from graphtrain.trainer.schedule import set_lr

# Imports inside functions: import cost: an eager run (train.accelerate=false, one process) never loads the
# engine (Dynamo, Inductor), torch.distributed or the tools; each is imported where a run needs it.

Batch = dict[str, torch.Tensor]


@dataclasses.dataclass
class StepResult:
    """What one optimizer step reports (the `train` records of metrics.jsonl)."""

    loss: torch.Tensor  # mean loss over the step's micro-batches (distributed: over dp ranks too)
    grad_norm: float  # global gradient norm before clipping (nan on a skipped step)
    skipped: bool = False  # the update was skipped (fp16 overflow, or `rejected`)
    scale: float | None = None  # fp16: the loss scale after the step
    rejected: str | None = None  # why the update was refused: non-finite loss or gradient norm, loss spike


class StepStrategy(Protocol):
    model: nn.Module  # what trains and evaluates: the (accelerated) module, DDP wrapper or pipeline stage
    module: nn.Module  # the user's module (this rank's part) without wrappers: its parameters, engine state
    optimizer: Any  # state_dict() / load_state_dict(); under WholeStepGraph the step graph itself

    def step(self, micro_batches: Iterable[Batch], lr: float, max_loss: float = math.inf) -> StepResult:
        """One optimizer step at learning rate `lr` over train.grad_accum micro-batches; gradients zeroed after.
        No update when the loss or gradient norm is not finite or the loss exceeds `max_loss`."""

    def eval_loss(self, batches: Iterable[Batch]) -> float:
        """Mean loss over `batches` (the caller sets eval mode and no_grad); distributed: over dp ranks."""

    def save(self, out_dir: Path, meta: dict[str, Any]) -> Path:
        """Write a checkpoint of `meta` (step, config, ...) with weights, optimizer and RNG; keep the last few."""

    def load(self, path: Path, model_spec: dict[str, Any]) -> int:
        """Restore a checkpoint `save` wrote, validated against the config and `model_spec`; returns its step."""

    def whole_model(self, out_dir: Path, vocab_size: int) -> nn.Module:
        """The whole model on this rank, for sampling."""


def build_strategy(
    model: nn.Module, config: Config, device: torch.device, env: Any, log: Callable[[str], None]
) -> StepStrategy:
    """The strategy for `config` (runtime.check_supported has refused the combinations none can run)."""
    if env is not None:
        return DistributedStep(model, config, env, log)
    if config.train.whole_step:
        return WholeStepGraph(model, config, device)
    return SingleProcessStep(model, config, device)


def engine_config(config: Config) -> Any:
    """The engine settings the run's graphs compile with: config.engine, except that train.deterministic also
    settles every graph's provider before the first step (engine.compile_in_background off). With provider auto
    a graph otherwise switches from aten to its winner at a later step (cold: when the background compile is
    done, a timing matter; warm: at the second step), so a run resumed at step k would run steps on other
    providers than the uninterrupted run did, whose results differ in the last bits."""
    import dataclasses

    if config.train.deterministic and config.engine.compile_in_background:
        return dataclasses.replace(config.engine, compile_in_background=False)
    return config.engine


def eager_autocast(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype eager PyTorch (train.accelerate=false) trains under for engine.precision: torch.autocast with bf16
    or fp16, the one line a user adds for mixed precision (the graph engine applies it as a pass instead); None
    for fp32. `auto` resolves as the engine resolves it (bf16 where the device computes it natively)."""
    if precision == "auto":
        from graphtrain.kernels.capability import resolve_precision  # loads the kernels: only for `auto`

        precision = resolve_precision(precision, device.type)
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


class SingleProcessStep:
    """One process: eager PyTorch, or with train.accelerate the module compiled in place by the graph engine."""

    def __init__(self, model: nn.Module, config: Config, device: torch.device) -> None:
        self.config, self.device = config, device
        model.to(device)
        if config.train.accelerate:
            from graphtrain.frontend.accelerate import accelerate  # loads Dynamo: only when the engine is used

            model = accelerate(model, engine_config(config))
        self.model = self.module = model
        self.optimizer = build_optimizer(model, config.optim)
        self.scaler = make_loss_scaler(config.engine)  # fp16 only: dynamic loss scaling
        self.autocast = None if config.train.accelerate else eager_autocast(config.engine.precision, device)

    def _forward(self, batch: Batch) -> torch.Tensor:
        if self.autocast is None:
            return self.model(**batch)
        with torch.autocast(self.device.type, dtype=self.autocast):
            return self.model(**batch)

    def step(self, micro_batches: Iterable[Batch], lr: float, max_loss: float = math.inf) -> StepResult:
        set_lr(self.optimizer, lr)
        accum = self.config.train.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        for batch in micro_batches:
            loss = self._forward(batch) / accum
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            loss_sum += loss.detach()
        loss_value = loss_sum.item()
        refused = rejection(loss_value, 0.0, max_loss, overflow_is_scalers=True)  # the loss, before any update
        if refused is not None:
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(
                loss_sum,
                math.nan,
                skipped=True,
                rejected=refused,
                scale=None if self.scaler is None else self.scaler.scale_value,
            )
        # unscale and skip on overflow (fp16) or a non-finite norm, clip to optim.grad_clip, optimizer.step()
        info = optimizer_step(self.optimizer, self.model.parameters(), self.scaler, self.config.optim.grad_clip)
        self.optimizer.zero_grad(set_to_none=True)
        refused = rejection(loss_value, info["grad_norm"], max_loss, overflow_is_scalers=self.scaler is not None)
        return StepResult(loss_sum, **info, rejected=refused)

    def eval_loss(self, batches: Iterable[Batch]) -> float:
        losses = [self._forward(batch).detach().float() for batch in batches]
        return torch.stack(losses).double().mean().item()

    def save(self, out_dir: Path, meta: dict[str, Any]) -> Path:
        """ckpt-{step}.pt, written atomically (trainer/checkpoint.py), with the plain model's keys."""
        state = {
            **meta,
            "model": plain_state_dict(self.model.state_dict()),
            "optimizer": self.optimizer.state_dict(),
            "rng": rng_state(),
            "loss_scaler": None if self.scaler is None else self.scaler.state_dict(),
        }
        path = save_checkpoint(checkpoint_path(out_dir, meta["step"]), state)
        prune_checkpoints(out_dir, keep=self.config.train.keep_last, protect=path)
        return path

    def load(self, path: Path, model_spec: dict[str, Any]) -> int:
        state = load_checkpoint(path, self.config, model_spec)
        try:
            self.model.load_state_dict(to_module_keys(state["model"], self.model))
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(
                f"checkpoint {str(path)!r} does not fit this model/optimizer ({str(e).splitlines()[0]}); "
                f"use the config it was trained with (saved in it and in out_dir/config.yaml), "
                f"or start fresh with a new out_dir"
            ) from None
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        set_rng_state(state["rng"])
        return int(state["step"])

    def whole_model(self, out_dir: Path, vocab_size: int) -> nn.Module:
        return self.module


class WholeStepGraph(SingleProcessStep):
    """train.whole_step: the whole optimizer step compiled (graphtrain.compile_step, frontend/compile_step.py): a
    model with repeated blocks through its own graphs compiled block by block (the model compiled in place,
    so its evaluations go through the engine too) and one update graph; otherwise one graph of the whole step (the
    model itself then evaluated eagerly). The step holds the AdamW moments, step counts and loss-scale state, so it
    is this strategy's optimizer (its state_dict is the checkpoint's "optimizer"). AdamW, grad_accum 1 and
    train.accelerate only (runtime.check_supported); train.deterministic settles the providers as for
    SingleProcessStep (engine_config)."""

    def __init__(self, model: nn.Module, config: Config, device: torch.device) -> None:
        import dataclasses

        from graphtrain.frontend.compile_step import compile_step

        self.config, self.device = config, device
        self.model = self.module = model.to(device)
        self.optimizer = self.step_graph = compile_step(
            model, dataclasses.replace(config, engine=engine_config(config))
        )
        self.scaler = None  # fp16 loss scaling runs inside the graph
        self.autocast = None  # the engine's precision pass, not autocast

    def step(self, micro_batches: Iterable[Batch], lr: float, max_loss: float = math.inf) -> StepResult:
        (batch,) = micro_batches  # one micro-batch per step
        # gradients never leave the graph: nothing to zero; the graph skips non-finite and spiking steps itself
        out = self.step_graph(lr=lr, max_loss=max_loss, **batch)
        norm = float(out["grad_norm"])
        refused = rejection(out["loss"].item(), norm, max_loss, overflow_is_scalers=self.step_graph.fp16)
        return StepResult(out["loss"], norm, out["skipped"], out["scale"], refused)


class DistributedStep:
    """parallel.dp*tp*pp > 1: the `Parallelized` model of graphtrain.distributed.parallelize, with train.accelerate
    through the graph engine per layout (`Parallelized.accelerate`). Every rank gets the same full batch and keeps
    its data-parallel rank's rows; losses are averaged over dp ranks. Checkpoints are sharded folders
    (`ckpt-NNNNNNN/`, written atomically by `Parallelized.save`) that load under any layout."""

    def __init__(self, model: nn.Module, config: Config, env: Any, log: Callable[[str], None]) -> None:
        from graphtrain.distributed import parallelize

        self.config, self.env, self.log = config, env, log
        self.par = parallelize(model, lambda m: build_optimizer(m, config.optim), config.parallel, env)
        self.model, self.optimizer, self.module = self.par.model, self.par.optimizer, self.par.module
        if config.train.accelerate:  # per layout (Parallelized.accelerate says how)
            self.par.accelerate(engine_config(config))
        # Each data-parallel replica and each pipeline stage draws its own dropout (runtime.rank_seed); the
        # first stage of replica 0 keeps a single process's stream. Tensor-parallel ranks of one stage share
        # theirs: dropout on replicated activations (after a row-parallel all-reduce) must drop the same
        # elements on every tp rank. Attention dropout, on each rank's own heads, salts that shared stream with
        # the tp rank (docs/design/distributed.md, "Dropout under tensor parallelism").
        if env.dp_rank or env.pp_rank:
            runtime.seed_everything(runtime.rank_seed(config.train.seed, env.dp_rank, env.pp_rank))
        self._capture_checked = False

    def step(self, micro_batches: Iterable[Batch], lr: float, max_loss: float = math.inf) -> StepResult:
        """Forward/backward every micro-batch (gradients all-reduced on the last), clip by the global norm, step.
        The norm (reduced over tp and pp, equal on dp ranks) and the dp-mean loss are the same on every rank,
        so every rank takes or skips the update alike."""
        set_lr(self.optimizer, lr)
        accum = self.config.train.grad_accum
        loss_sum = torch.zeros((), device=self.env.device)
        for micro, batch in enumerate(micro_batches):
            batch = self._shard(batch)
            ids, labels = batch.pop("input_ids"), batch.pop("labels")
            loss = self.par.forward_backward(ids, labels, micro_step=micro, micro_steps=accum, **batch)
            loss_sum += loss.float() / accum
        norm = float(self.par.clip_grad_norm_(self.config.optim.grad_clip))
        loss_sum = self._dp_mean(loss_sum)
        refused = rejection(loss_sum.item(), norm, max_loss, overflow_is_scalers=False)
        if refused is None:
            self.optimizer.step()
        if not self._capture_checked:
            self._capture_checked = True
            if runtime.is_accelerated(self.module):
                self.log(self._check_capture())
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum, norm, skipped=refused is not None, rejected=refused)

    def eval_loss(self, batches: Iterable[Batch]) -> float:
        """Each dp rank evaluates its rows of every batch (pp > 1: the pipeline's forward-only schedule)."""
        losses = []
        for batch in batches:
            batch = self._shard(batch)
            losses.append(self.par.eval_loss(batch.pop("input_ids"), batch.pop("labels"), **batch).float())
        return self._dp_mean(torch.stack(losses).double().mean()).item()

    def save(self, out_dir: Path, meta: dict[str, Any]) -> Path:
        """Collective: every rank writes its shards; rank 0 writes the metadata (with every rank's RNG)."""
        import torch.distributed as dist

        rngs: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(rngs, rng_state())
        extra = {**meta, "rng": rngs, "parallel": dataclasses.asdict(self.config.parallel)}
        path = self.par.save(checkpoint_path(out_dir, meta["step"], sharded=True), extra=extra)
        if self.env.is_main:
            prune_checkpoints(out_dir, keep=self.config.train.keep_last, protect=path)
        dist.barrier()
        return path

    def load(self, path: Path, model_spec: dict[str, Any]) -> int:
        """A sharded folder saved under any layout; the RNG continues only when the layout is the same."""
        if not is_sharded(path):
            raise ValueError(
                f"checkpoint {str(path)!r} is a single-process checkpoint: a distributed run resumes "
                f"only sharded checkpoint folders (ckpt-NNNNNNN/); to start from its weights, set "
                f"train.init_from={path} with a new out_dir"
            )
        extra = load_sharded_meta(path, self.config, model_spec)
        try:
            self.par.load(path)
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(
                f"checkpoint {str(path)!r} does not fit this model/optimizer ({str(e).splitlines()[0]}); "
                f"use the config it was trained with, or a new out_dir"
            ) from None
        rngs = extra.get("rng") or []
        step = int(extra["step"])
        saved_layout = {k: (extra.get("config") or {}).get("parallel", {}).get(k) for k in ("dp", "tp", "pp")}
        layout = {k: getattr(self.config.parallel, k) for k in ("dp", "tp", "pp")}
        if len(rngs) == self.env.world_size and saved_layout == layout:
            set_rng_state(rngs[self.env.rank])
        else:  # another layout: every rank reseeds from (seed, step, its replica and stage), tp ranks alike
            runtime.seed_everything(
                runtime.rank_seed(self.config.train.seed, self.env.dp_rank, self.env.pp_rank) + (1 << 31) * step
            )
        return step

    def whole_model(self, out_dir: Path, vocab_size: int) -> nn.Module:
        """tp > 1: refused. pp > 1: every rank holds one stage, so the whole model is read from the latest sharded
        checkpoint, on this rank alone (no collective: rank 0 samples while the others have finished)."""
        par = self.config.parallel
        if par.tp > 1:
            raise ValueError("sample() needs the whole model on one rank: not with parallel.tp>1")
        if par.pp == 1:
            return self.module
        from graphtrain.distributed.checkpoint import load_model_weights_local

        path = latest_checkpoint(out_dir)
        if path is None:
            raise ValueError(
                "sample() with parallel.pp>1 reads the whole model from the run's latest checkpoint, and "
                f"{str(out_dir)!r} has none yet: call it after fit() (which saves at the end)"
            )
        with torch.random.fork_rng(devices=[]):
            model = build_model(self.config.model, vocab_size=vocab_size)
        load_model_weights_local(path, model)
        return model.to(self.env.device).eval()

    def _shard(self, batch: Batch) -> Batch:
        """This data-parallel rank's rows of a full batch (every rank drew the same one)."""
        dp = self.config.parallel.dp
        if dp == 1:
            return batch
        n = next(iter(batch.values())).size(0) // dp
        r = self.env.dp_rank
        return {k: v[r * n : (r + 1) * n] for k, v in batch.items()}

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` over the data-parallel ranks (in place)."""
        dp = self.config.parallel.dp
        if dp > 1:
            import torch.distributed as dist

            dist.all_reduce(value, group=self.env.group("dp"))
            value /= dp
        return value

    def _check_capture(self) -> str:
        """After the first step: did the engine capture graphs on every rank (no silent eager run)?

        Collective. Returns the line rank 0 logs; a rank that fell back to eager raises under
        engine.fallback=error and warns otherwise."""
        import torch.distributed as dist

        from graphtrain.tools.report import report

        rep = report(self.module)
        mine = (len(rep.graphs), bool(rep.eager_only), len(rep.fallbacks))
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        graphs = sorted({g for g, _, _ in every})
        bucket = getattr(self.model, "bucket_bytes_cap", None)
        why = ([f"repeated blocks compiled once: {', '.join(rep.blocks)}"] if rep.blocks else []) + (
            [f"Dynamo's DDPOptimizer splits at DDP's {bucket / 2**20:g} MiB gradient buckets"] if bucket else []
        )
        split = f" ({'; '.join(why)})" if why else ""
        line = (
            f"graphtrain engine, distributed: {'/'.join(map(str, graphs))} graph(s) captured per rank{split}"
            f", eager fallbacks on {sum(1 for _, e, f in every if e or f)} of {len(every)} ranks"
        )
        if any(g == 0 or e for g, e, _ in every):
            msg = f"{line}: the distributed model is not running through the graph engine"
            if self.config.engine.fallback == "error":
                raise ValueError(msg)
            if self.config.engine.fallback == "warn" and dist.get_rank() == 0:
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return line
