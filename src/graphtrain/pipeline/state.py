"""What the engine records about one accelerated module: graphs, breaks, recompiles, passes, providers.

One ``EngineState`` lives on each accelerated module as ``module._graphtrain`` (graphs compiled through
``torch.compile(m, backend="graphtrain")`` record into a process-wide ``GLOBAL_STATE``). The backend fills
one ``GraphRecord`` per Dynamo graph; ``graphtrain.report`` turns the state into text and a dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphtrain.config.sections import EngineConfig
from graphtrain.passes.manager import PassRecord


@dataclass
class GraphRecord:
    """One Dynamo graph as the engine compiled it."""

    name: str
    frame: str  # the Python function Dynamo captured
    frame_compile: int  # 0 for the first compile of this frame, n for its n-th recompile
    input_shapes: list[Any]
    input_kinds: list[str]  # per placeholder: param | frozen | buffer | input | symint | activation
    # (activation: another piece's output, pipeline/blocks.py)
    ops_captured: int = 0  # aten ops right after tracing, before any pass
    ops_pre_autodiff: int = 0  # aten ops after the pre_autodiff passes
    ops_forward: int | None = None  # ops of the partitioned forward / backward graphs after their passes
    ops_backward: int | None = None
    provider: str = ""  # what ran the fw/bw graphs (aten | inductor | eager)
    precision: str = ""  # the compute precision the graph ran in (`auto` resolved)
    partitioner: str = ""
    grads_computed: int | None = None  # backward outputs that are real gradients
    frozen_inputs_with_grad: int | None = None  # must be 0: frozen params/buffers get no gradient work
    saved_activation_bytes: int | None = None  # forward outputs kept for backward that are not parameters
    saved_tensors: int | None = None
    batch: int | None = None  # leading dim of the first user input (for per-sample figures)
    dtensor_inputs: int = 0  # tensor-parallel DTensor parameters among the inputs
    # The recompute decision of this graph's partition (a graphtrain.memory.recompute.RecomputeRecord: mode,
    # every candidate tried with bytes saved and FLOPs added, the one kept); None when Inductor's own
    # partitioner ran (recompute none under the inductor provider).
    recompute: Any = None
    # Peak-memory prediction of one training step through this graph, by component (bytes; see
    # graphtrain.memory.predict.predict_peak), from the partitioned fw/bw graphs after their passes.
    predicted_memory: dict[str, Any] | None = None
    compile_seconds: float = 0.0
    calls_per_step: int = 1  # a repeated block's graph runs once per layer (pipeline/blocks.py)
    inference: bool = False  # compiled under no_grad (an evaluation graph): no backward
    provider_times: dict[str, float] | None = None  # provider auto: fw+bw seconds per candidate (measured.py)
    pass_cache: str = ""  # graphtrain's pass-result cache (pipeline/cache.py): hit | miss | off
    pass_cache_key: str = ""
    compile_reason: str = ""  # why Dynamo ended this graph (graph break or end of frame)
    notes_compile_id: int = 0  # Dynamo's per-code-object compile counter (shared across instances)
    notes: list[str] = field(default_factory=list)


@dataclass
class EngineState:
    config: EngineConfig
    graphs: list[GraphRecord] = field(default_factory=list)
    passes: list[PassRecord] = field(default_factory=list)
    graph_breaks: list[str] = field(default_factory=list)
    fallbacks: list[tuple[str, str]] = field(default_factory=list)
    recompute: list[Any] = field(default_factory=list)  # every RecomputeRecord, in compile order
    blocks: list[str] = field(default_factory=list)  # repeated stacks compiled once per block (pipeline/blocks.py)
    block_reuse: bool = True  # Dynamo may stamp out a traced block (false once it bound the wrong weights)
    notes: list[str] = field(default_factory=list)
    calls: int = 0
    calls_under_mode: int = 0  # calls under a user's TorchDispatchMode: run eagerly, not counted in `calls`
    first_call_seconds: float | None = None
    first_step_memory: dict[str, Any] = field(default_factory=dict)  # memory/prefault.py: recorded, primed
    eager_only: bool = False  # capture failed; the module runs eagerly from now on
    background: Any = field(default=None, repr=False, compare=False)  # provider auto's worker (workers.py)
    switch_between_steps: bool = False  # the caller switches graphs after the first step (wait_compiled)

    @property
    def recompiles(self) -> list[GraphRecord]:
        return [g for g in self.graphs if g.frame_compile > 0]


GLOBAL_STATE = EngineState(EngineConfig())


def state_of(module: Any) -> tuple[EngineState, str]:
    """The EngineState of an accelerated `module` (or of its torch.compile wrapper's original), and where it came
    from: "module", or the process-wide state of ``torch.compile(backend="graphtrain")`` when it has none."""
    for m in (module, getattr(module, "_orig_mod", None)):
        st = getattr(m, "_graphtrain", None)
        if isinstance(st, EngineState):
            return st, "module"
    return GLOBAL_STATE, "process (torch.compile backend='graphtrain')"
