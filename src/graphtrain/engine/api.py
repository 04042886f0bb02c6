"""``graphtrain.accelerate``: make an existing module train through the graph engine, in place.

We compile in place the way ``nn.Module.compile`` does (it sets ``module._compiled_call_impl``), so the
returned module *is* the original: same parameters, same ``state_dict()`` keys (no ``_orig_mod.``
prefix), same forward signature, and an ordinary ``loss.backward(); optimizer.step()`` loop works.
Our call wrapper around the compiled call measures time to first step, attributes Dynamo's graph breaks
to this module, and applies the fallback policy when capture itself fails.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from graphtrain.config import Config, EngineConfig, resolve_engine_config
from graphtrain.engine.fallback import GraphtrainCaptureError, report_fallback
from graphtrain.engine.state import EngineState


def accelerate(module: torch.nn.Module, config: Config | EngineConfig | dict | None = None,
               **overrides: Any) -> torch.nn.Module:
    """Compile `module` in place with the graphtrain engine and return it.

    `config` is a graphtrain Config, an EngineConfig, a dict of engine keys or None; keyword overrides win,
    e.g. ``accelerate(model, provider="aten", fallback="error")``."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"graphtrain.accelerate takes a torch.nn.Module, got {type(module).__name__}")
    cfg = resolve_engine_config(config, overrides)
    from graphtrain.engine.backend import make_backend
    from graphtrain.engine.cache import configure_cache
    from graphtrain.passes.manager import pipeline

    for stage in ("pre_autodiff", "forward", "backward"):
        pipeline(stage, cfg)  # validates engine.passes names now, not at the first step
    configure_cache(cfg)
    state = EngineState(cfg)
    module._graphtrain = state  # type: ignore[assignment]
    compiled = torch.compile(module._call_impl, backend=make_backend(cfg, state), dynamic=cfg.dynamic,
                             fullgraph=cfg.fallback == "error")
    module._compiled_call_impl = _CallWrapper(module, compiled, state)  # type: ignore[assignment]
    return module


def _graph_break_reasons() -> list[Any]:
    from torch._dynamo.utils import graph_break_reasons
    return graph_break_reasons


class _CallWrapper:
    """Runs the compiled call; records breaks and first-step time; falls back to eager if capture fails."""

    def __init__(self, module: torch.nn.Module, compiled: Any, state: EngineState) -> None:
        self.module, self.compiled, self.state = module, compiled, state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = self.state
        if state.eager_only:
            return self.module._call_impl(*args, **kwargs)
        reasons = _graph_break_reasons()
        n_before = len(reasons)
        t0 = time.perf_counter()
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            out = self._capture_failed(e, args, kwargs)
        for r in reasons[n_before:]:
            where = f" at {r.user_stack[-1].filename.rsplit('/', 1)[-1]}:{r.user_stack[-1].lineno}" if r.user_stack else ""
            msg = f"{' '.join(str(r.reason).split())[:300]}{where}"
            if msg not in state.graph_breaks:
                state.graph_breaks.append(msg)
        state.calls += 1
        if state.first_call_seconds is None:
            state.first_call_seconds = time.perf_counter() - t0
        return out

    def _capture_failed(self, e: Exception, args: tuple, kwargs: dict) -> Any:
        inner = e
        while not isinstance(inner, GraphtrainCaptureError):
            nxt = getattr(inner, "inner_exception", None) or inner.__cause__  # BackendCompilerFailed keeps it
            if nxt is None:
                break
            inner = nxt
        if isinstance(inner, GraphtrainCaptureError):
            raise inner from e
        import torch._dynamo.exc as dexc
        skipped = "found no compiled frames" in str(e)  # Dynamo gave up on the frame (recompile limit hit)
        if not (skipped or isinstance(e, dexc.TorchDynamoException) or isinstance(inner, dexc.TorchDynamoException)):
            raise e  # the user's own error (shape mismatch, ...): eager would raise it too
        if skipped:
            inner = RuntimeError(f"{e} Dynamo compiles one code object at most torch._dynamo.config.recompile_limit "
                                 f"times (all instances of a class count); raise it or use dynamic=True")
        name = type(self.module).__name__
        reason = " ".join(f"{type(inner).__name__}: {inner}".split())[:600]
        report_fallback(f"capture of {name}", reason, self.state.config, what="runs eagerly from now on",
                        sink=self.state.fallbacks)
        self.state.eager_only = True
        return self.module._call_impl(*args, **kwargs)
