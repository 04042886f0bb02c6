"""What one graph's compile works on, as one value: ``CompileJob``.

The Dynamo backend (runtime/backend.py) makes one per graph, after resolving the provider and the precision for the
graph's device (runtime/providers.py resolve_runtime): past that point neither is ``auto``, so every pass and
provider sees what runs the graph. A variant is ``dataclasses.replace`` of it (``for_provider``: one job per
candidate of provider auto; the optimized graph in place of the Dynamo graph for the provider; fake inputs for a
compile from data). The pass-cache key (pipeline/cache.py) is computed once per job, or given: the background
compile process (runtime/background.py) uses the key the training process computed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch.fx as fx

from graphtrain.config.sections import EngineConfig
from graphtrain.pipeline.cache import pass_cache_key
from graphtrain.pipeline.state import EngineState, GraphRecord


@dataclass(frozen=True)
class CompileJob:
    """One graph's compile: the graph, its example inputs and their kinds (param | frozen | buffer | input | symint |
    activation), the resolved engine config, the state it records into and its GraphRecord, and the pass-cache key
    when it is given rather than computed."""

    gm: fx.GraphModule
    example_inputs: Sequence[Any]
    kinds: list[str]
    config: EngineConfig
    state: EngineState
    rec: GraphRecord
    key: str | None = None

    def __post_init__(self) -> None:
        if "auto" in (self.config.provider, self.config.precision):
            raise ValueError(
                f"CompileJob for {self.rec.name}: provider {self.config.provider!r} and precision "
                f"{self.config.precision!r} must be resolved where the job is made "
                f"(runtime/providers.py resolve_runtime)"
            )

    @functools.cached_property
    def pass_key(self) -> str | None:
        """The key of this job's pre-autodiff result in the pass cache: the one given, else computed (once per job);
        None where an input is one the key cannot describe (no caching for this graph)."""
        if self.key is not None:
            return self.key
        try:
            return pass_cache_key(self.gm, self.example_inputs, self.kinds, self.config, self.rec.inference)
        except Exception:  # noqa: BLE001 - an input the key cannot describe
            return None

    def for_provider(self, provider: Literal["aten", "inductor"]) -> CompileJob:
        """This job compiled by `provider` (its own passes, so its own pass-cache key)."""
        return dataclasses.replace(self, config=dataclasses.replace(self.config, provider=provider), key=None)
