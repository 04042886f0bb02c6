"""``graphtrain.accelerate``: make an existing module train through the graph engine, in place.

We compile in place the way ``nn.Module.compile`` does (it sets ``module._compiled_call_impl``), so the
returned module *is* the original: same parameters, same ``state_dict()`` keys (no ``_orig_mod.``
prefix), same forward signature, and an ordinary ``loss.backward(); optimizer.step()`` loop works.
Our call wrapper around the compiled call measures time to first step, attributes Dynamo's graph breaks
to this module, and applies the fallback policy when capture itself fails.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch import nn

from graphtrain.config.fallback import GraphtrainCaptureError, report_fallback
from graphtrain.config.sections import Config, EngineConfig, resolve_engine_config
from graphtrain.config.torch_compat import isolated_compile_options, source_names_only_when_logged, user_dispatch_mode
from graphtrain.frontend.rewind import Rewind, Signatures
from graphtrain.kernels._common import KernelFallbackError
from graphtrain.memory import prefault
from graphtrain.models.hf_calls import call_adapter, trace_through_log_once
from graphtrain.passes.manager import pipeline
from graphtrain.pipeline.block_regions import (
    ReuseMisbound,
    mark_repeated_blocks,
    no_subgraph_reuse,
    region_refused,
    unmark_repeated_blocks,
    whole_model_reason,
)
from graphtrain.pipeline.cache import cache_root, configure_cache
from graphtrain.pipeline.state import EngineState, state_of
from graphtrain.runtime.allocator import set_cpu_allocator_once
from graphtrain.runtime.backend import make_backend
from graphtrain.runtime.workers import background_pending, cancel_background, preload_background, wait_background
from graphtrain.runtime.workers import load_pending as _load_pending


def accelerate(
    module: torch.nn.Module, config: Config | EngineConfig | dict | None = None, **overrides: Any
) -> torch.nn.Module:
    """Compile `module` in place with the graphtrain engine and return it.

    `config` is a graphtrain Config, an EngineConfig, a dict of engine keys or None; keyword overrides win,
    e.g. ``accelerate(model, provider="aten", fallback="error")``."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"graphtrain.accelerate takes a torch.nn.Module, got {type(module).__name__}")
    cfg = resolve_engine_config(config, overrides)
    state = new_state(cfg)
    module._graphtrain = state  # type: ignore[assignment]
    compile_in_place(module, state)
    return module


def wait_compiled(module: torch.nn.Module, timeout: float | None = None) -> bool:
    """Wait for the background compiles of an accelerated `module` (``provider: auto`` compiles Inductor in a
    background process from the second call; engine.compile_in_background), starting them now if they have not
    started. True once they finished; False after `timeout` seconds. Benchmarks call it after the first step so
    that they time what training settles on. Once they finished, each graph switches here to its winner
    (Inductor's code loaded and timed against aten on inputs shaped as its first call's), and so does a warm
    start's graph whose stored winner loads from the caches: the next call runs at full speed."""
    state, source = state_of(module)
    if source != "module":
        raise TypeError(
            f"graphtrain.wait_compiled takes a module returned by graphtrain.accelerate, got {type(module).__name__}"
        )
    if state.eager_only:  # its capture fell back: the graphs never run again, so nothing is worth compiling for them
        cancel_background(state, "the module runs eagerly (its capture fell back)")
        return True
    done = wait_background(state, timeout)
    if done:
        preload_background(state)
    return done


def cancel_compile(module: torch.nn.Module, why: str) -> int:
    """Give up an accelerated `module`'s background Inductor compiles: its graphs keep running on aten, with `why`
    in the report. Returns how many graphs were waiting for one (0 for a module that is not accelerated)."""
    state, source = state_of(module)
    return cancel_background(state, why) if source == "module" else 0


def switch_between_steps(module: torch.nn.Module) -> None:
    """Say that the caller calls wait_compiled after `module`'s first step (the trainer does): a warm start then
    does all its loading there, none inside the first step. No effect on a module that is not accelerated."""
    state, source = state_of(module)
    if source == "module":
        state.switch_between_steps = True


def load_pending(module: torch.nn.Module) -> bool:
    """Whether an accelerated `module` has graphs whose Inductor code is ready to load (wait_compiled switches them
    at once): a finished background compile's, or a warm start's stored winner; False for any other module."""
    state, source = state_of(module)
    return source == "module" and _load_pending(state)


def compile_pending(module: torch.nn.Module) -> bool:
    """Whether an accelerated `module` has a background Inductor compile queued or running (provider auto on a
    cold cache, after its first call); False for any other module."""
    state, source = state_of(module)
    return source == "module" and background_pending(state)


def new_state(cfg: EngineConfig) -> EngineState:
    """Validate `cfg`'s pass names (now, not at the first step), point the compile caches, and start a record."""

    for stage in ("pre_autodiff", "forward", "backward"):
        pipeline(stage, cfg)
    configure_cache(cfg)
    return EngineState(cfg)


def compile_in_place(
    modules: torch.nn.Module | list[torch.nn.Module], state: EngineState, *, hooks_outside: bool = False
) -> None:
    """Compile each module's call (hooks included) with the engine, recording into `state`.

    `hooks_outside`: compile `module.forward` only, so the module's own forward hooks run eagerly around the
    compiled code; for modules under FSDP2 `replicate` (its hooks are `torch._dynamo.disable`d and would
    break the graph), the way torchtitan compiles each transformer block under FSDP2. Modules of one class
    then share one compiled function (the class's forward, the module an argument): Dynamo guards on their
    structure, not their identity, so a model's blocks share one graph instead of compiling once each
    (and counting towards the recompile limit)."""

    cfg = state.config
    # Every recompute mode too. Under full/auto the break once stayed (a budgeted partition of HF GPT-2 saved a
    # random fused op's output tuple, fixed since: memory/recompute.py _no_tuples_saved), and it cost the loss its
    # fusion: the logits crossed into a graph of their own with an [N, V] gradient, and recompute auto's peak on
    # HF GPT-2 (4 layers, vocabulary 50257, batch 16 x 256) was above no recompute's (2623 against 2378 MiB).
    trace_through_log_once()
    source_names_only_when_logged()
    options = {
        "backend": make_backend(cfg, state),
        "dynamic": cfg.dynamic,
        "fullgraph": cfg.fallback == "error",
        **isolated_compile_options(),  # the 9th model of a class in one process no longer runs eagerly
    }
    shared: dict[Any, Any] = {}
    for module in modules if isinstance(modules, list) else [modules]:
        if cfg.compile_blocks and not hooks_outside:
            why = whole_model_reason(cfg)
            if why:
                state.notes.append(f"compiled as one graph, not block by block: {why}")
            else:
                state.blocks.extend(mark_repeated_blocks(module))
        if hooks_outside:
            forward = type(module).forward
            if forward not in shared:
                shared[forward] = torch.compile(forward, **options)
            eager = module.forward
            compiled = functools.partial(shared[forward], module)
            module.forward = _CallWrapper(module, compiled, state, eager=eager)  # type: ignore[method-assign]
        elif _forward_is_torchs(module):
            compiled = functools.partial(torch.compile(_call_module, **options), module)
            module._compiled_call_impl = _CallWrapper(module, compiled, state, eager=module._call_impl)
        else:
            compiled = torch.compile(module._call_impl, **options)
            module._compiled_call_impl = _CallWrapper(module, compiled, state, eager=module._call_impl)


def _forward_is_torchs(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward is torch's own (nn.Sequential, nn.Linear, nn.TransformerEncoder, ...). Dynamo does
    not start tracing in torch.nn's files, it only inlines them: compiling such a module's call compiles no frame at
    all (measured with torch 2.13: `torch.compile(nn.Sequential(...), fullgraph=True)` raises "found no compiled
    frames"; without fullgraph the model ran eagerly, and graphtrain said nothing). torch.nn.modules only: wrappers
    such as DistributedDataParallel (torch.nn.parallel) keep the path Dynamo's DDPOptimizer expects."""
    return getattr(type(module).forward, "__module__", "").startswith("torch.nn.modules.")


def _call_module(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The frame Dynamo starts from for a module whose forward is torch's own (`_forward_is_torchs`); it inlines the
    module's call (hooks included) from here. `_call_impl`, not `module(...)`: the module's call is the wrapper."""
    return module._call_impl(*args, **kwargs)


def _why_no_graph(module: torch.nn.Module) -> str:
    """What in `module` Dynamo is known to skip, for the report of a call that compiled nothing ("" if nothing)."""
    rnns = [
        f"{type(m).__name__} at {n or '(the module)'}" for n, m in module.named_modules() if isinstance(m, nn.RNNBase)
    ]
    if rnns:  # graph-broken at each call (torch._dynamo.config.allow_rnn is off; on, torch 2.13's AOTAutograd raised)
        return f": Dynamo does not trace torch's recurrent modules ({', '.join(rnns[:3])}), so they run eagerly"
    return ""


def _caused_by(e: BaseException, kind: type) -> bool:
    while e is not None:
        if isinstance(e, kind):
            return True
        e = getattr(e, "inner_exception", None) or e.__cause__
    return False


def _graph_break_reasons() -> list[Any]:
    from torch._dynamo.utils import graph_break_reasons

    return graph_break_reasons


class _CallWrapper:
    """Runs the compiled call; records breaks and first-step time; falls back to eager if capture fails."""

    def __init__(self, module: torch.nn.Module, compiled: Any, state: EngineState, eager: Any) -> None:
        self.module, self.compiled, self.state, self.eager = module, compiled, state, eager
        self.adapter = call_adapter(module, state.config)  # a Hugging Face model's call adjustments, or None
        self.recompile_limit_hit = False
        self.prefault: Any = None  # memory/prefault.py's Session while the first step is recorded
        self.rewind: Rewind | None = None  # the module's state before the call in flight, where it may capture
        self.signatures = Signatures()  # the input signatures of the calls that ran compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.state
        if self.adapter is not None:
            self.adapter.before_call(kwargs)
        if state.eager_only:
            return self.eager(*args, **kwargs)
        mode = user_dispatch_mode()
        if mode is not None:
            return self._eager_under_mode(mode, args, kwargs)
        if self.adapter is not None:
            why = self.adapter.eager_call(kwargs)
            if why is not None:
                if why not in state.notes:
                    state.notes.append(why)
                return self.eager(*args, **kwargs)
            self.adapter.before_compiled_call(kwargs, state.notes)
        if self.prefault is not None:
            self.prefault.on_call()
        elif state.calls == 0:  # (a first call that raised leaves calls at 0: its session, if any, goes on)
            self._begin_prefault(args, kwargs)
        reasons = _graph_break_reasons()
        n_before = len(reasons)
        # A call that captures something (the first, or one with new inputs) is where a capture fails, and the
        # calls that retry it (blocks inlined, or eager) run it again from the start: its graphs before the failure
        # already ran once. They go back to where they began.
        sig = Signatures.of(self.module, args, kwargs)
        self.rewind = Rewind(self.module) if self.signatures.new(sig) else None  # (the first call's is new)
        t0 = time.perf_counter()
        try:
            out = self._run_compiled(args, kwargs)
            self.signatures.add(sig)
        except Exception as e:  # noqa: BLE001
            out = self._capture_failed(e, args, kwargs)
        self.rewind = None
        for r in reasons[n_before:]:
            where = (
                f" at {r.user_stack[-1].filename.rsplit('/', 1)[-1]}:{r.user_stack[-1].lineno}" if r.user_stack else ""
            )
            msg = f"{' '.join(str(r.reason).split())[:300]}{where}"
            if msg not in state.graph_breaks:
                state.graph_breaks.append(msg)
        state.calls += 1
        if state.first_call_seconds is None:
            state.first_call_seconds = time.perf_counter() - t0
            if not state.graphs and not state.fallbacks and not state.eager_only:
                report_fallback(
                    f"capture of {type(self.module).__name__}",
                    f"Dynamo compiled no graph of its call (every frame skipped or empty){_why_no_graph(self.module)}",
                    state.config,
                    what="runs eagerly",
                    sink=state.fallbacks,
                )
        return out

    def _eager_under_mode(self, mode: str, args: tuple, kwargs: dict) -> Any:
        """A call under a user's TorchDispatchMode (FlopCounterMode, a debug mode) runs the module's eager code, so
        the mode sees its ops, as Dynamo would run it. Not through Dynamo: torch up to 2.13 would then skip the
        model's code for every later call too (config/torch_compat.py user_dispatch_mode). Eager as the fallbacks
        run it (the model's own precision); the compiled graphs run again at the next call outside the mode."""
        state = self.state
        state.calls_under_mode += 1
        if state.calls_under_mode == 1:
            state.notes.append(
                f"calls under a TorchDispatchMode ({mode.lstrip('_')}) ran the module eagerly, in its own precision "
                f"(Dynamo compiles nothing under a dispatch mode); the calls after it run the compiled graphs"
            )
        return self.eager(*args, **kwargs)

    def _begin_prefault(self, args: tuple, kwargs: dict) -> None:
        """A training module's first call on CPU: install the process's CPU allocator now (not at the first compile,
        which comes after Dynamo's trace) and record this first step's memory, priming it from an earlier record
        (memory/prefault.py). Never stops the step: a failure is a note."""
        cfg = self.state.config
        if not (cfg.cpu_prefault and self.module.training and torch.is_grad_enabled()):
            return
        p = next(self.module.parameters(), None)
        if p is None or p.device.type != "cpu":
            return
        try:
            set_cpu_allocator_once([p], cfg, sum(q.numel() * q.element_size() for q in self.module.parameters()))
            self.prefault = prefault.begin(
                self.module, args, kwargs, cfg, cache_root(cfg), self.state.first_step_memory
            )
        except Exception as e:  # noqa: BLE001
            self.state.notes.append(f"first-step memory not recorded: {type(e).__name__}: {e}")

    def _run_compiled(self, args: tuple, kwargs: dict) -> Any:
        # Past its recompile limit Dynamo runs a frame's new variants eagerly without a word to the caller; told to
        # fail instead, it lets the call wrapper say so (_capture_failed) and still run the variants it compiled.
        # Dynamo's default guards no module hooks: a forward hook registered after the first call (an activation
        # probe, a feature extractor) was ignored without a word, and one removed kept running (torch 2.13: HF
        # GPT-2's loss with a hook that doubles a block's output came out as without it). With the guards, adding
        # or removing a hook compiles the call again; checking them costs microseconds a call.
        patch: dict[str, Any] = {"skip_nnmodule_hook_guards": False}
        if not self.recompile_limit_hit:  # reported once: Dynamo's own path from then on
            patch["fail_on_recompile_limit_hit"] = True
        if self.state.blocks:
            # Under DDP, Dynamo's DDPOptimizer would split the graph at DDP's gradient buckets and take one
            # AOTAutograd graph per bucket, with the blocks inlined (backend.py). Compiled block by block, each block
            # is an autograd node of its own: its weights' gradients are ready when its backward ends, DDP's reducer
            # all-reduces each bucket as it fills, overlapped with the blocks still to run (torchtitan's per-block
            # compile under data parallel). So the blocks keep their own graphs there too.
            patch["optimize_ddp"] = False
        if self.state.config.dynamic:
            # Dynamic shapes make sizes symbolic, and Dynamo then makes Python floats symbolic too (GELU's
            # sqrt(2/pi), a dropout's p): fusion patterns need them as constants, and AOTAutograd would ask for a
            # new trace to specialize them anyway (RestartAnalysis). Specialized, as under static shapes.
            patch["specialize_float"] = True
        with torch._dynamo.config.patch(**patch):
            return self._run_compiled_reusing(args, kwargs)

    def _run_compiled_reusing(self, args: tuple, kwargs: dict) -> Any:
        try:
            return self._run_compiled_blocks(args, kwargs)
        except Exception as e:  # noqa: BLE001
            # (the `error` policy's own errors are raised as they are: _capture_failed)
            why = region_refused(e) if self.state.blocks and not _caused_by(e, GraphtrainCaptureError) else None
            if why is None:
                raise
        # A graph break inside a repeated block: Dynamo fails the whole call where plain torch.compile splits its
        # graph (HF Wav2Vec2's output-capturing hooks, a data-dependent branch in a user's layer). The blocks are
        # then inlined, the model is compiled in graphs split at its breaks, and the call runs again: the failure
        # came while tracing, so no graph after the last break ran; the graphs before it ran once already, so
        # their buffer updates (BatchNorm's running statistics) and random draws (dropout) are undone first.
        if self.rewind is not None:
            self.rewind.restore()
        unmark_repeated_blocks(self.module)
        self.state.notes.append(
            f"compiled as whole graphs, not block by block ({', '.join(self.state.blocks)}): Dynamo cannot trace a "
            f"block's code as one region ({why})"
        )
        self.state.blocks.clear()
        return self._run_compiled_blocks(args, kwargs)

    def _run_compiled_blocks(self, args: tuple, kwargs: dict) -> Any:
        if not self.state.block_reuse:
            with no_subgraph_reuse():
                return self.compiled(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            if not _caused_by(e, ReuseMisbound):
                raise
        self.state.block_reuse = False  # nothing ran yet: the backend refused the graph before compiling it
        self.state.notes.append(
            "Dynamo's reuse of traced blocks bound the wrong weights: every block is traced (still compiled once)"
        )
        with no_subgraph_reuse():
            return self.compiled(*args, **kwargs)

    def _capture_failed(self, e: Exception, args: tuple, kwargs: dict) -> Any:
        policy_errors = (GraphtrainCaptureError, KernelFallbackError)  # the `error` policy speaking: raised as is
        inner = e
        while not isinstance(inner, policy_errors):
            nxt = getattr(inner, "inner_exception", None) or inner.__cause__  # BackendCompilerFailed keeps it
            if nxt is None:
                break
            inner = nxt
        if inner is e and isinstance(e, policy_errors):
            raise e
        if isinstance(inner, policy_errors):
            raise inner from e
        # The call failed under graphtrain. Either it is the user's own error (a shape mismatch, ...), which eager
        # raises too, or graphtrain's (Dynamo could not trace it, or a pass built a graph eager's code does not
        # compute): the same call, run eagerly, tells them apart. Its error, if any, is the one to show, and the
        # module stays compiled for the next call; if it runs, the module falls back.
        if self.rewind is not None:
            self.rewind.restore()
        try:
            out = self.eager(*args, **kwargs)
        except Exception as user_error:  # noqa: BLE001
            raise user_error from None
        import torch._dynamo.exc as dexc

        if _caused_by(e, dexc.FailOnRecompileLimitHit):
            # The module keeps its compiled variants; each new one runs eagerly, reported once (raised under `error`)
            limit = torch._dynamo.config.recompile_limit
            self.recompile_limit_hit = True
            shared = not isolated_compile_options()  # torch 2.11/2.12: one budget for every model of the class
            report_fallback(
                f"recompile limit of {type(self.module).__name__}",
                f"Dynamo compiled this code for {limit} variants and compiles no more (torch._dynamo."
                f"config.recompile_limit: with engine.dynamic=false each new input shape is a variant"
                f"{', and so is each other accelerated module of this process that runs the same code' if shared else ''}"
                f"). For changing shapes, pad batches to a few fixed lengths (each compiled once, the "
                f"fastest) or pass engine.dynamic=true (one compile for every length, done before "
                f"its first step)"
                f"{'; for many models in one process, call torch._dynamo.reset() between them' if shared else ''}",
                self.state.config,
                what="runs each new input shape eagerly (the shapes compiled so far stay compiled)",
                sink=self.state.fallbacks,
            )
            return out
        if "found no compiled frames" in str(e):  # Dynamo gave up on the frame (recompile limit hit)
            inner = RuntimeError(
                f"{e} Dynamo compiles one code object at most torch._dynamo.config.recompile_limit "
                f"times (all instances of a class count); raise it or use dynamic=True"
            )
        elif not (isinstance(e, dexc.TorchDynamoException) or isinstance(inner, dexc.TorchDynamoException)):
            inner = RuntimeError(f"its compiled graph raised where eager runs ({type(e).__name__}: {e})")
        name = type(self.module).__name__
        reason = " ".join(f"{type(inner).__name__}: {inner}".split())[:600]
        report_fallback(
            f"capture of {name}", reason, self.state.config, what="runs eagerly from now on", sink=self.state.fallbacks
        )
        self.state.eager_only = True
        return out
