"""The fallback policy: a part that cannot be captured or optimized runs eagerly, and we say so once."""
from __future__ import annotations

import warnings

from graphtrain.config import EngineConfig


class GraphtrainFallbackWarning(UserWarning):
    """Part of a model ran eagerly (or unoptimized) because capture or a pass failed."""


class GraphtrainCaptureError(RuntimeError):
    """Raised under `fallback: error` when part of a model cannot be captured or optimized."""


# Every fallback seen in this process, in order: (part, reason). The report reads it.
FALLBACKS: list[tuple[str, str]] = []
_WARNED: set[tuple[str, str]] = set()


def report_fallback(part: str, reason: str, config: EngineConfig, what: str = "runs eagerly",
                    sink: list[tuple[str, str]] | None = None) -> None:
    """Record that `part` fell back; warn once per (part, reason) or raise, per config.fallback.

    `sink` (a module's ``EngineState.fallbacks``) also receives the record, for ``graphtrain.report``."""
    FALLBACKS.append((part, reason))
    if sink is not None:
        sink.append((part, reason))
    if config.fallback == "error":
        raise GraphtrainCaptureError(f"graphtrain could not optimize {part}: {reason}. "
                                     f"Set engine.fallback=warn to run it eagerly instead.")
    if config.fallback == "warn" and (part, reason) not in _WARNED:
        _WARNED.add((part, reason))
        warnings.warn(f"graphtrain: {part} {what}: {reason}", GraphtrainFallbackWarning, stacklevel=3)
