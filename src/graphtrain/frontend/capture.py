"""A model's training step (forward, loss, backward) captured whole through the pipeline, without Dynamo.

Two users: ``predict_for_model`` / ``pick_batch_size`` capture on fake tensors (``capture_graphs``: no
activation is allocated, so a batch of any size can be predicted), and tests/benchmarks run the captured
step for real (``compile_train_step``) the way the engine's aten provider runs a Dynamo graph. Both are the
pipeline's autodiff stage (pipeline/stages.py) on ``module_as_function(model, loss=True)``: AOTAutograd traces
the function itself (no pre-autodiff IR: its graphs keep AOTAutograd's decompositions, e.g. dropout as
``native_dropout``, which the recompute partitioner saves as a 1-byte mask), ``make_partition_fn``'s partition,
the forward/backward passes asked for (none by default: the memory optimizer alone), and each graph compiled to
the *boxed* calling convention (``pipeline.to_boxed``), so the backward frees every saved activation right after
its last use instead of holding all of them until it returns.

Calling convention (AOTAutograd): forward inputs are (*parameters, *buffers, *batch); forward outputs are
(loss, *saved for backward); backward inputs are (*saved, tangent) and its outputs are one gradient per
forward input (None for the batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from graphtrain.config.sections import EngineConfig
from graphtrain.memory.predict import MemoryEstimate, param_bytes, predict_peak, storage_bytes
from graphtrain.memory.recompute import RecomputeRecord
from graphtrain.passes.manager import PassFn
from graphtrain.pipeline.functional import module_as_function
from graphtrain.pipeline.stages import autodiff, new_record, user_outputs
from graphtrain.pipeline.state import EngineState


@dataclass
class Captured:
    fw_gm: fx.GraphModule
    bw_gm: fx.GraphModule
    param_bytes: int
    n_state_inputs: int  # leading forward inputs that are parameters or buffers
    num_fwd_outputs: int
    records: list[RecomputeRecord] = field(default_factory=list)
    state: EngineState | None = None  # the passes run and fallbacks taken (what graphtrain.report shows)


class _StepCapture:
    """`model`'s step as the pipeline compiles it: module_as_function(model, loss=True) on (*state, *batch)."""

    def __init__(
        self,
        model: torch.nn.Module,
        engine_cfg: EngineConfig | None,
        optimizer: str,
        only: dict[str, Sequence[PassFn]],
        records: list[RecomputeRecord] | None = None,
    ) -> None:
        self.name = type(model).__name__
        self.fn, self.tensors, self.kinds = module_as_function(model, loss=True)
        self.config = engine_cfg if engine_cfg is not None else EngineConfig()
        self.state = EngineState(self.config, recompute=records if records is not None else [])
        self.optimizer, self.only = optimizer, only

    def compile(self, example: list[Any], **autodiff_kw: Any) -> Callable[..., Any]:
        """The autodiff stage on the model's function, with the requested passes; AOTAutograd traces it at the
        first call (make that call under fx.traceback.preserve_node_meta, so the layer annotations
        recompute=full reads survive)."""
        kinds = self.kinds + ["input"] * (len(example) - len(self.tensors))
        rec = new_record("train step", self.name, example, kinds, self.state, frame_compile=0)
        return autodiff(
            self.fn, example, self.config, self.state, rec, only=self.only, optimizer=self.optimizer, **autodiff_kw
        )


def capture_graphs(
    model: torch.nn.Module,
    example_batch: Sequence[Any],
    engine_cfg: EngineConfig | None = None,
    *,
    optimizer: str = "adamw",
    fw_passes: Sequence[PassFn] = (),
    bw_passes: Sequence[PassFn] = (),
) -> Captured:
    """Trace forward+loss+backward of `model(*example_batch)` on fake tensors and partition it with
    engine_cfg's recompute mode; `fw_passes`/`bw_passes` (registered passes) run on the graphs. Nothing is
    executed for real."""
    cap = _StepCapture(model, engine_cfg, optimizer, {"forward": fw_passes, "backward": bw_passes})
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    example = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in [*cap.tensors, *example_batch]]
    graphs: dict[str, fx.GraphModule] = {}
    compiled = cap.compile(
        example, backward_passes_at_partition=True, on_graphs=lambda fw, bw, _: graphs.update(fw=fw, bw=bw)
    )
    with fake_mode, fx.traceback.preserve_node_meta():
        compiled(*example)  # the forward on fake tensors: traces, partitions and compiles both graphs
    fw, bw = graphs["fw"], graphs["bw"]
    return Captured(
        fw, bw, param_bytes(cap.tensors), len(cap.tensors), user_outputs(fw, bw), cap.state.recompute, cap.state
    )


def compile_train_step(
    model: torch.nn.Module,
    engine_cfg: EngineConfig | None = None,
    *,
    fw_passes: Sequence[PassFn] = (),
    bw_passes: Sequence[PassFn] = (),
    boxed: bool = True,
    optimizer: str = "adamw",
    records: list[RecomputeRecord] | None = None,
    rewrites: dict[str, int] | None = None,
    graphs: list[fx.GraphModule] | None = None,
) -> Callable[..., torch.Tensor]:
    """loss = step(*batch); loss.backward() fills the parameters' .grad. One fixed input shape: the step is
    compiled at its first call and does not guard shapes, so build a new step for a new shape.

    records: the recompute decisions are appended here. rewrites: "<stage>/<pass function>" -> rewrites.
    graphs: the forward and backward graphs after their passes are appended here."""
    cap = _StepCapture(model, engine_cfg, optimizer, {"forward": fw_passes, "backward": bw_passes}, records)
    compiled: list[Callable[..., Any]] = []
    counted = [0]  # pass records already added to `rewrites`

    def after_passes(stage: str, gm: fx.GraphModule) -> None:
        for r in cap.state.passes[counted[0] :]:
            if rewrites is not None and r.left_to is None:
                key = f"{r.stage}/{r.name}_pass"
                rewrites[key] = rewrites.get(key, 0) + r.rewrites
        counted[0] = len(cap.state.passes)
        if graphs is not None:
            graphs.append(gm)

    def step(*batch: Any) -> torch.Tensor:
        example = [*cap.tensors, *batch]
        if not compiled:
            compiled.append(cap.compile(example, boxed=boxed, on_stage=after_passes))
        with fx.traceback.preserve_node_meta():  # the first call traces: keep the layer annotations
            return compiled[0](*example)

    step.state = cap.state  # type: ignore[attr-defined]
    return step


def predict_for_model(
    model: torch.nn.Module,
    example_batch: tuple,
    engine_cfg: EngineConfig | None = None,
    *,
    optimizer: str = "adamw",
    **kw: Any,
) -> MemoryEstimate:
    """Capture `model(*example_batch) -> loss` with AOTAutograd on fake tensors (nothing runs, no
    activation memory is used) under engine_cfg's recompute mode, and predict the step's peak."""
    cap = capture_graphs(model, example_batch, engine_cfg)
    opt_temp = kw.pop("optimizer_temp_bytes", max((storage_bytes(p) for p in model.parameters()), default=0))
    return predict_peak(
        cap.fw_gm,
        cap.bw_gm,
        cap.param_bytes,
        optimizer=optimizer,
        n_param_inputs=cap.n_state_inputs,
        optimizer_temp_bytes=opt_temp,
        **kw,
    )
