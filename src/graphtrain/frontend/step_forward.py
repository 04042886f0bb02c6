"""The forward of compile_step's one step graph (frontend/compile_step.py ``CompiledStep._build``): the model's
forward with its loss, captured by Dynamo and put through the dynamo stage's passes as ``accelerate``'s forward is,
then traced to the pre-autodiff IR that the step graph is built from."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from graphtrain.config.sections import EngineConfig
from graphtrain.pipeline.functional import module_as_function
from graphtrain.pipeline.stages import trace
from graphtrain.pipeline.state import EngineState
from graphtrain.pipeline.trace import capture_whole, switches_grad_mode
from graphtrain.runtime.backend import dynamo_passes, has_grad_mode_changes


def trace_forward(
    model: nn.Module,
    state: EngineState,
    fn: Any,
    names: list[str],
    example: list[Tensor],
    cfg: EngineConfig,
    rec: Any,
) -> torch.fx.GraphModule:
    """The forward with its loss as the pre-autodiff IR, captured through Dynamo as ``accelerate`` captures it:
    the dynamo stage's passes see the graph first (a no_grad region lifted, a user's autograd.Function held
    whole until autodiff, an SDPA mask that needs a gradient sent to aten's math kernel). A forward Dynamo
    cannot capture whole (a graph break) is traced directly, as before, and the record says so; unless it has a
    no_grad block, which the direct trace cannot see: that raises (the step runs eagerly, reported)."""
    plain, _, _ = module_as_function(model, input_names=names, loss=True, annotate=False)
    try:
        dynamo_graph = capture_whole(plain, example)
    except Exception as e:  # noqa: BLE001 - the direct trace below is the step graph's older route
        why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
        if switches_grad_mode(plain, example):  # the direct trace would differentiate through the block
            raise RuntimeError(
                f"the forward has a no_grad block and Dynamo could not capture it whole ({why}); traced "
                f"directly, the step graph would differentiate through the block"
            ) from e
        rec.notes.append(f"the forward is traced without Dynamo ({why})")
        return trace(fn, example, rec)
    out = next(n for n in dynamo_graph.graph.nodes if n.op == "output")
    if not (isinstance(out.args[0], (tuple, list)) and len(out.args[0]) == 1):
        raise RuntimeError("the Dynamo graph of the forward does not return the loss alone")
    out.args = (out.args[0][0],)
    dynamo_graph.recompile()
    with torch.enable_grad():  # the passes of the grad phase act on a graph that trains
        dynamo_graph, ctx = dynamo_passes(
            dynamo_graph, example, cfg, state, rec.name, rec.notes, ("masks", "grad", "opaque")
        )
    state.passes.extend(ctx.records)
    if has_grad_mode_changes(dynamo_graph):
        # a region the lift refused (it mutates, nests, calls a module) would be differentiated through
        raise RuntimeError(
            "the forward switches grad mode in a way graphtrain cannot lift (a no_grad region that writes in "
            "place, nests or calls a module): the step graph would differentiate through it"
        )
    return trace(dynamo_graph, example, rec)
