"""The whole training step compiled: forward, loss, backward, unscale + overflow check, clipping and the AdamW
update.

    step = graphtrain.compile_step(model, config)          # a graphtrain Config (engine + optim)
    for batch in batches:
        out = step(lr=schedule(i), **batch)                # {"loss", "grad_norm", "skipped", "scale"}

A model with repeated blocks (engine.compile_blocks, the default), and any model under engine.recompute (its
partitioner splits a forward from its backward, which one step graph does not have), trains through its own graphs
(``CompiledStep._build_through_model``): the model in place as ``accelerate`` compiles it, then one update graph on
the gradients (items 2-4 below, on aten with torch's fused AdamW kernel). Any other model, or compile_blocks false,
gets the whole step as one graph, built (``CompiledStep._build``) on the stages of pipeline/stages.py:

1. The model's forward (``module_as_function(model, loss=True)``) is captured by Dynamo as one graph and goes
   through the dynamo stage's passes, as in ``accelerate`` (no_grad blocks, autograd.Functions, learned masks),
   then is traced to graphtrain's pre-autodiff IR and optimized by the same pass pipeline (fusions, mixed
   precision), so the gradient graph is built from the fused ops.
2. A step function is traced (pipeline/trace.py ``trace_step``) on fake tensors into one FX graph: that forward,
   ``torch.autograd.grad`` of the (fp16: scaled) loss w.r.t. the trainable parameters, one
   ``_foreach_norm`` reduction over all gradients (it is both the global norm for clipping and the
   inf/nan check: a non-finite gradient makes the norm non-finite), ``torch._fused_adamw_`` with
   ``grad_scale = loss_scale * max(1, norm / max_norm)`` (unscale and clip folded into the update
   kernel's one pass over p, g, m, v) and ``found_inf`` (the kernel skips the update on overflow),
   and the dynamic loss-scale update with hysteresis as tensor arithmetic. In every precision
   ``found_inf`` is also set by a non-finite loss and by a loss above ``max_loss`` (the Trainer's
   loss-spike guard; +inf when off), so a NaN never reaches the weights or the moments and a skipped
   step does not advance AdamW's step counts.
3. The graph is compiled by Inductor (or run op by op by the aten provider; a failed Inductor compile
   falls back to it), through runtime/providers.py ``compile_step_graph`` and its checks. Parameters, moments, step counters and the loss-scale state are graph inputs
   updated in place: the update works on buffers the graph owns, no parameter copy is made and nothing
   returns to Python until the loss.

Passes, fallbacks and compiles are recorded like ``accelerate``'s, on an EngineState set as the model's
``_graphtrain``: ``graphtrain.report(model)`` shows them.

The design keeps sharding open: gradients are graph values, so a ZeRO-1 step would insert a
reduce-scatter after the gradients and an all-gather after the update (not built here).

Limits ("where the model allows"; clear errors otherwise): AdamW; one micro-batch per step (no
gradient accumulation); as one graph, fixed input shapes per compile (a new shape traces again; by blocks,
``engine.dynamic`` compiles the model's graphs once for every length, as ``accelerate`` does); the forward
returns the loss (a tensor, or an object with ``.loss`` such as Hugging Face outputs); one graph: a forward with a
graph break is traced directly, without Dynamo (and runs eagerly if it has a no_grad block, which that trace cannot
see); by blocks, breaks run as in ``accelerate``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from graphtrain.config.fallback import GraphtrainCaptureError, report_fallback, set_policy
from graphtrain.config.sections import Config, EngineConfig, OptimConfig
from graphtrain.config.torch_compat import user_dispatch_mode
from graphtrain.frontend.accelerate import compile_in_place, new_state
from graphtrain.frontend.step_forward import trace_forward
from graphtrain.optim.functional import like_param, step_update
from graphtrain.passes import autograd_functions
from graphtrain.pipeline.block_regions import splits_into_blocks
from graphtrain.pipeline.functional import loss_of, module_as_function
from graphtrain.pipeline.stages import compile_with_fallback, new_record, run_passes
from graphtrain.pipeline.trace import trace_step
from graphtrain.runtime.providers import compile_step_graph, resolve_runtime


class CompiledStep:
    """One optimizer step of `model` as one compiled graph; call it with the batch as keyword arguments."""

    def __init__(self, model: nn.Module, config: Config | None = None, **engine_overrides: Any) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"compile_step takes an nn.Module, got {type(model).__name__}")
        config = config if config is not None else Config()
        if not isinstance(config, Config):
            raise TypeError(f"compile_step takes a graphtrain Config, got {type(config).__name__}")
        if engine_overrides:
            config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, **engine_overrides))
        if config.optim.name != "adamw":
            raise ValueError(
                f"compile_step builds AdamW into the step graph; optim.name={config.optim.name!r} "
                f"is not supported there: use graphtrain.accelerate + graphtrain.optim.build_optimizer"
            )
        self.model, self.engine, self.optim = model, config.engine, config.optim
        _, self._tensors, self._kinds = module_as_function(model)
        self._train_idx = [i for i, k in enumerate(self._kinds) if k == "param"]
        self._train_names = [n for n, p in model.named_parameters() if p.requires_grad]  # same order
        if not self._train_idx:
            raise ValueError("compile_step: the model has no trainable parameters (requires_grad=True)")
        params = [self._tensors[i] for i in self._train_idx]
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
        self.state_steps = [torch.zeros((), dtype=torch.float32, device=p.device) for p in params]
        self._decay = [p.dim() >= 2 for p in params]  # matrices decay; biases and norm weights do not
        dev = params[0].device
        self.fp16 = self.engine.precision == "fp16"
        self.lr = torch.zeros((), dtype=torch.float32, device=dev)
        self.max_loss = torch.full((), float("inf"), dtype=torch.float32, device=dev)
        self.scale = torch.full((), self.engine.loss_scale_init if self.fp16 else 1.0, dtype=torch.float32, device=dev)
        self.growth_tracker = torch.zeros((), dtype=torch.int64, device=dev)
        self.hysteresis_left = torch.full((), self.engine.loss_scale_hysteresis, dtype=torch.int64, device=dev)
        self._compiled: Any = None
        self._key: Any = None
        self._under_mode: tuple[list[str], Any] | None = None  # (batch names, the uncompiled step) under a mode
        self._batch_names: list[str] = []
        self._provider: str | None = None
        # What graphtrain.report(model) shows: the step graph's passes, fallbacks and compiles; the compile
        # caches are pointed where accelerate points them.
        self.state = new_state(self.engine)
        model._graphtrain = self.state  # type: ignore[assignment]
        self.pass_records: list[Any] = []
        self.compile_seconds = 0.0
        self.steps = 0
        self.skipped_steps = 0
        # A model with repeated blocks trains through its own graphs, compiled block by block (pipeline/blocks.py);
        # the update after the backward is then a graph of its own (see _build_through_model). Under engine.dynamic the
        # model's graphs are symbolic in the batch's sizes (one compile for every length); the update graph does not
        # depend on them. So does any model under engine.recompute: recompute is a partition of the gradient graph
        # into a forward and a backward (memory/recompute.py), which a step graph holding both never has (its
        # setting was ignored there: graphtrain's gpt2-mini, recompute full or auto, peaked as recompute none).
        self.by_blocks = splits_into_blocks(self.engine, model)
        self.through_model = self.by_blocks or self.engine.recompute != "none"

    # ----------------------------------------------------------------------------------- build --
    def _build_through_model(self, batch: dict[str, Tensor]) -> None:
        """The step through the model's own graphs: its forward and backward as ``accelerate`` compiles them (the
        model is compiled in place: with repeated blocks, each distinct block once, the embeddings and the head and
        loss in graphs of their own, with provider auto's tiered compile; under recompute, with its partitioner),
        and the step after the backward (global norm, clipping, the skip decision, torch's fused AdamW, the fp16
        loss-scale update) one aten graph on the gradients. One graph of the whole step is what Inductor compiled
        before: its compile grew with the depth (HF GPT-2 width 256: 38 s cold at 4 layers, 80-91 s at 12 on a
        2-core Zen 4), and ``engine.compile_blocks: false`` still builds it."""
        t0 = time.perf_counter()
        set_policy(self.engine.fallback)
        if self._compiled is None:
            compile_in_place(self.model, self.state)
            params = [self._tensors[i] for i in self._train_idx]
            args = [
                params,
                [torch.empty_like(p) for p in params],
                self.exp_avg,
                self.exp_avg_sq,
                self.state_steps,
                self.lr,
                self.max_loss,
                self.scale,
                self.growth_tracker,
                self.hysteresis_left,
                torch.zeros((), device=self.lr.device),
            ]  # stand-ins for the gradients and the loss
            update = self._update_fn(fused_kernel=True)
            flat, spec = torch.utils._pytree.tree_flatten(args)

            def flat_update(*xs: Tensor):
                return update(*torch.utils._pytree.tree_unflatten(list(xs), spec))

            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)  # no shape env: the fused kernel has no fake impl
            graph = trace_step(flat_update, [fake_mode.from_tensor(x) for x in flat], fake_mode)
            ops = sum(n.op == "call_function" for n in graph.graph.nodes)
            how = (
                "compiled block by block where Dynamo can trace a block whole"
                if self.by_blocks
                else f"compiled with engine.recompute={self.engine.recompute}"
            )
            self.state.notes.append(
                f"compile_step({type(self.model).__name__}): forward and backward through the "
                f"model's graphs ({how}, below); then the update graph on aten "
                f"({ops} ops: gradient norm, clipping, the skip decision, torch's fused AdamW"
                f"{', loss scaling' if self.fp16 else ''})"
            )
            self._compiled, self.graph = graph, graph
        self._batch_names = list(batch)
        self.compile_seconds += time.perf_counter() - t0

    @property
    def provider(self) -> str | None:
        """What runs the step: the single graph's provider; through the model, those of the model's graphs (the
        update graph runs on aten)."""
        if self.through_model:
            return ", ".join(sorted({g.provider.split(" ")[0] for g in self.state.graphs})) or None
        return self._provider

    def _step_through_model(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        params = [self._tensors[i] for i in self._train_idx]
        with torch.enable_grad():
            loss = loss_of(self.model(**batch))
            grads = torch.autograd.grad(loss * self.scale if self.fp16 else loss, params, allow_unused=True)
        # in each parameter's layout here, at run time: the update graph was traced with stand-ins that had it
        grads = [torch.zeros_like(p) if g is None else like_param(g, p) for p, g in zip(params, grads)]
        args = [
            params,
            grads,
            self.exp_avg,
            self.exp_avg_sq,
            self.state_steps,
            self.lr,
            self.max_loss,
            self.scale,
            self.growth_tracker,
            self.hysteresis_left,
            loss.detach(),
        ]
        with torch.no_grad():
            return self._compiled(*torch.utils._pytree.tree_flatten(args)[0])

    def _step_under_mode(self, mode: str, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """A step under a user's TorchDispatchMode (FlopCounterMode, a debug mode): the step uncompiled, as its
        fallback runs it (the model, autograd and AdamW op by op, in the model's own precision), so the mode sees
        every op of it, as it would in eager PyTorch. Nothing is built or traced under the mode (a trace would show
        the mode its own ops; Dynamo captures nothing under one); the next call outside it builds or runs the
        compiled step, with the same optimizer state."""
        names = list(batch)
        if self._under_mode is None or self._under_mode[0] != names:
            fn, _, _ = module_as_function(self.model, input_names=names, loss=True)
            self._under_mode = (names, self._step_fn(fn, len(names), fused_kernel=True))
            self.state.notes.append(
                f"steps under a TorchDispatchMode ({mode.lstrip('_')}) ran uncompiled, op by op in the model's own "
                f"precision (the mode sees every op, as in eager); the steps after it run compiled"
            )
        with torch.no_grad():
            return self._under_mode[1](*self._args([batch[k] for k in names]))

    def _build(self, batch: dict[str, Tensor]) -> None:
        t0 = time.perf_counter()
        names = list(batch)
        inputs = [batch[k] for k in names]
        example = self._tensors + inputs
        set_policy(self.engine.fallback)
        cfg = resolve_runtime(self.engine, example)
        provider = cfg.provider
        kinds = self._kinds + ["input"] * len(inputs)
        rec = new_record(
            "step",
            f"compile_step({type(self.model).__name__})",
            example,
            kinds,
            self.state,
            frame_compile=sum(g.name == "step" for g in self.state.graphs),
            precision=cfg.precision,
        )
        fn, _, _ = module_as_function(self.model, input_names=names, loss=True)
        try:
            graph, fake_args = self._trace_step(fn, names, example, kinds, inputs, cfg, rec, provider)
        except GraphtrainCaptureError:
            raise
        except Exception as e:  # noqa: BLE001 - the step runs, uncompiled, and says why (or raises under error)
            # A forward that reads a tensor's value (a branch on it; HF BART's mask helper before trace.py set
            # is_compiling) cannot be traced whole on fake tensors (DataDependentOutputException); accelerate's
            # Dynamo capture breaks the graph there, a whole-step graph cannot. The same step runs op by op on the
            # real tensors: the model, autograd and the AdamW update, nothing skipped.
            what = "runs uncompiled (the model, autograd and AdamW op by op" + (
                ", in fp32)" if cfg.precision != "fp32" else ")"
            )  # precision is one of the passes it skips
            report_fallback(
                f"the step graph of {rec.name} ({rec.frame})",
                f"{type(e).__name__}: {str(e)[:300]}",
                cfg,
                what=what,
                sink=self.state.fallbacks,
            )
            self._compiled, self._provider = self._step_fn(fn, len(inputs), fused_kernel=True), "eager"
            rec.provider, self._batch_names, self.graph = "eager", names, None
            rec.compile_seconds = time.perf_counter() - t0
            self.compile_seconds += rec.compile_seconds
            return
        self._compiled, self._provider = compile_with_fallback(
            ["inductor", "aten"] if provider == "inductor" else ["aten"],
            lambda p: self._compile(graph, fake_args, p),
            part=f"{rec.name} ({rec.frame})",
            config=cfg,
            state=self.state,
        )
        rec.provider = self._provider
        self._batch_names = names
        self.graph = graph
        rec.compile_seconds = time.perf_counter() - t0
        self.compile_seconds += rec.compile_seconds

    def _trace_step(
        self,
        fn: Any,
        names: list[str],
        example: list[Tensor],
        kinds: list[str],
        inputs: list[Tensor],
        cfg: EngineConfig,
        rec: Any,
        provider: str,
    ) -> tuple[torch.fx.GraphModule, list[Tensor]]:
        """The whole step as one graph: the forward traced and optimized by the pre-autodiff passes, then forward,
        autograd and the update traced together on fake tensors. Returns the graph and its fake arguments."""
        n_records = len(self.state.passes)
        fwd = trace_forward(self.model, self.state, fn, names, example, cfg, rec)
        fwd = run_passes(fwd, "pre_autodiff", cfg, self.state, rec, example_inputs=example, input_kinds=kinds)
        autograd_functions.restore(fwd)  # hide_autograd_functions' other half, as in the backend
        self.pass_records = self.state.passes[n_records:]
        # aten runs torch's fused AdamW kernel in the graph; Inductor cannot trace that kernel's
        # tensor-lr overload (no fake implementation in torch 2.13), so it gets the same update as
        # elementwise math, which it fuses into one kernel per parameter.
        step_fn = self._step_fn(fwd, len(inputs), fused_kernel=provider != "inductor")
        args = self._args(inputs)
        # Fake tensors: tracing must not run the update on the real weights. Non-fake inputs are allowed
        # because the forward graph may hold constant tensors (folded masks) as attributes.
        # Inductor compiles from these fake inputs too: their shape environment (static shapes all the same) is what
        # its FX-graph cache keys a graph's guards on. Compiled from the real inputs it bypassed the cache ("No shape
        # env"), and every process compiled the step anew (HF GPT-2, 4 layers, width 256: a second process's first
        # step took 22 s against 38 s cold, 2-core Zen 4). The aten graph goes without: its fused AdamW kernel has no
        # fake implementation, which a fake mode runs (on meta tensors) only without a shape environment.
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv() if provider == "inductor" else None)
        fake_args = [fake_mode.from_tensor(a, static_shapes=True) for a in args]
        return trace_step(step_fn, fake_args, fake_mode), fake_args

    def _args(self, inputs: list[Tensor]) -> list[Tensor]:
        return [
            *self._tensors,
            *inputs,
            *self.exp_avg,
            *self.exp_avg_sq,
            *self.state_steps,
            self.lr,
            self.max_loss,
            self.scale,
            self.growth_tracker,
            self.hysteresis_left,
        ]

    def _step_fn(self, fwd: torch.fx.GraphModule, n_inputs: int, fused_kernel: bool):
        n_t, train_idx, n_p = len(self._tensors), list(self._train_idx), len(self._train_idx)
        fp16 = self.fp16
        update = self._update_fn(fused_kernel)

        def step(*args: Tensor):
            tensors, rest = list(args[:n_t]), args[n_t:]
            inputs, rest = rest[:n_inputs], rest[n_inputs:]
            m, v, steps = rest[:n_p], rest[n_p : 2 * n_p], rest[2 * n_p : 3 * n_p]
            lr, max_loss, scale, tracker, hyst = rest[3 * n_p :]
            params = [tensors[i] for i in train_idx]
            with torch.enable_grad():
                leaves = [p.detach().requires_grad_(True) for p in params]
                for i, leaf in zip(train_idx, leaves):
                    tensors[i] = leaf
                loss = fwd(*tensors, *inputs)
                grads = torch.autograd.grad(loss * scale if fp16 else loss, leaves, allow_unused=True)
            return update(params, list(grads), m, v, steps, lr, max_loss, scale, tracker, hyst, loss.detach())

        return step

    def _update_fn(self, fused_kernel: bool):
        """The step after the gradients (optim/functional.py step_update) for this step's parameters."""
        return step_update(self.optim, self.engine, list(self._decay), self.fp16, fused_kernel)

    @staticmethod
    def _compile(graph: torch.fx.GraphModule, args: list[Tensor], provider: str) -> Any:
        """The step graph as `provider` runs it: Inductor's code (eager's RNG kept, the provider's checks first), or
        the FX graph op by op."""
        return compile_step_graph(graph, args, provider)

    # ------------------------------------------------------------------------------------ call --
    def __call__(self, lr: float | None = None, max_loss: float | None = None, **batch: Tensor) -> dict[str, Any]:
        """One step; `max_loss` (default: none) skips the update when the loss exceeds it."""
        if not batch:
            raise TypeError("call the step with the batch as keyword arguments, e.g. step(input_ids=x, labels=y)")
        bad = [k for k, v in batch.items() if not isinstance(v, Tensor)]
        if bad:
            raise TypeError(f"compile_step: batch values must be tensors; {bad} are not")
        mode = user_dispatch_mode()
        key = tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in batch.items())
        if key != self._key and mode is None:
            (self._build_through_model if self.through_model else self._build)(batch)
            self._key = key
        self.lr.fill_(self.optim.lr if lr is None else float(lr))
        self.max_loss.fill_(float("inf") if max_loss is None else float(max_loss))
        if mode is not None:
            loss, norm, found_inf = self._step_under_mode(mode, batch)
        elif self.through_model:
            loss, norm, found_inf = self._step_through_model(batch)
        else:
            with torch.no_grad():
                loss, norm, found_inf = self._compiled(*self._args([batch[k] for k in self._batch_names]))
        skipped = bool(found_inf.item())
        self.steps += 1
        self.skipped_steps += skipped
        return {"loss": loss, "grad_norm": norm, "skipped": skipped, "scale": float(self.scale) if self.fp16 else None}

    # ------------------------------------------------------------------------------ state I/O --
    def state_dict(self) -> dict[str, Any]:
        """Optimizer and loss-scale state (the model's weights are in model.state_dict())."""
        names = self._train_names
        return {
            "exp_avg": dict(zip(names, self.exp_avg)),
            "exp_avg_sq": dict(zip(names, self.exp_avg_sq)),
            "step": dict(zip(names, self.state_steps)),
            "scale": self.scale.clone(),
            "growth_tracker": self.growth_tracker.clone(),
            "hysteresis_left": self.hysteresis_left.clone(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = self._train_names
        for key in ("exp_avg", "exp_avg_sq", "step"):
            missing = [n for n in names if n not in state.get(key, {})]
            if missing:
                raise ValueError(
                    f"step state {key!r} lacks parameters {missing[:3]}: not a CompiledStep.state_dict() of this model"
                )
        with torch.no_grad():  # in place: the compiled graph holds these tensors
            for dst, key in ((self.exp_avg, "exp_avg"), (self.exp_avg_sq, "exp_avg_sq"), (self.state_steps, "step")):
                for t, n in zip(dst, names):
                    t.copy_(state[key][n])
            self.scale.copy_(state["scale"])
            self.growth_tracker.copy_(state["growth_tracker"])
            self.hysteresis_left.copy_(state["hysteresis_left"])
        self.steps, self.skipped_steps = int(state.get("steps", 0)), int(state.get("skipped_steps", 0))


def compile_step(model: nn.Module, config: Config | None = None, **engine_overrides: Any) -> CompiledStep:
    """The whole training step (forward, loss, backward, clip, AdamW, loss scaling) as one graph."""
    return CompiledStep(model, config, **engine_overrides)


__all__ = ["CompiledStep", "compile_step", "EngineConfig", "OptimConfig"]
