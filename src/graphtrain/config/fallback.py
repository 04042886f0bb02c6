"""The fallback policy, shared by every layer: what runs when something graphtrain chose cannot run.

- Capture, tracing, a pass or a provider fails while compiling: that part runs eagerly or unoptimized
  (`report_fallback`, called by the engine and the pass manager).
- A fused op's fast path fails at run time: the op's reference implementation runs
  (graphtrain.kernels._common.guarded reads `policy()`).

``engine.fallback`` chooses: ``warn`` (default: one warning per distinct part and reason), ``silent``,
or ``error`` (raise, naming the part and the fix). The engine sets the process-wide run-time policy
from its config when it compiles (`set_policy`), since fused ops run inside compiled graphs that carry
no config. This module sits at the bottom of the import graph (it needs only the standard library).
"""

from __future__ import annotations

import warnings
from typing import Any

_POLICIES = ("warn", "silent", "error")


class GraphtrainFallbackWarning(UserWarning):
    """Part of a model ran eagerly, unoptimized, or on a fused op's reference because something failed."""


class GraphtrainCaptureError(RuntimeError):
    """Raised under `fallback: error` when part of a model cannot be captured or optimized."""


_policy = "warn"
_WARNED: set[tuple[str, str]] = set()


def set_policy(policy: str) -> None:
    """The run-time policy for fused ops (warn | silent | error); process-wide, the last engine compiled wins."""
    global _policy
    if policy not in _POLICIES:
        raise ValueError(f"fallback policy must be one of {', '.join(_POLICIES)}, got {policy!r}")
    _policy = policy


def policy() -> str:
    return _policy


def report_fallback(
    part: str, reason: str, config: Any, what: str = "runs eagerly", sink: list[tuple[str, str]] | None = None
) -> None:
    """Record that `part` fell back (into `sink`, a module's ``EngineState.fallbacks``, which the report
    reads); warn once per (part, reason) or raise, per ``config.fallback``."""
    if sink is not None:
        sink.append((part, reason))
    if config.fallback == "error":
        raise GraphtrainCaptureError(
            f"graphtrain could not optimize {part}: {reason}. Set engine.fallback=warn to run it eagerly instead."
        )
    if config.fallback == "warn" and (part, reason) not in _WARNED:
        _WARNED.add((part, reason))
        warnings.warn(f"graphtrain: {part} {what}: {reason}", GraphtrainFallbackWarning, stacklevel=3)
