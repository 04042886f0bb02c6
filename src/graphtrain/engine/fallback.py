"""The engine's side of the fallback policy (graphtrain.fallback): hand the config's policy to the kernels."""
from __future__ import annotations

from graphtrain.config import EngineConfig
from graphtrain.fallback import GraphtrainCaptureError, GraphtrainFallbackWarning, report_fallback, set_policy

__all__ = ["GraphtrainCaptureError", "GraphtrainFallbackWarning", "apply_policy", "report_fallback"]


def apply_policy(config: EngineConfig) -> None:
    """Fused ops that fail at run time follow `config.fallback` (process-wide: the last engine configured wins)."""
    set_policy(config.fallback)
