"""The compile pipeline: the stages every compile path runs, one plain function each.

    gm = trace(fn, example_inputs, rec)                            1. the pre-autodiff IR (pipeline/trace.py)
    gm = run_passes(gm, "pre_autodiff", config, state, rec)         2. fusions, mixed precision, cleanup
    fn = autodiff(gm, example_inputs, config, state, rec)           3. AOTAutograd, graphtrain's partitioner,
                                                                    4. the forward/backward passes, boxed graphs
    fn, provider = compile_with_fallback(order, compile_one, ...)   5. a provider, falling back down the chain

Three callers run them:

- the Dynamo backend (runtime/backend.py: ``accelerate`` and ``torch.compile(backend="graphtrain")``): 1, 2, then
  5 over the providers of runtime/providers.py, whose ``aten`` provider is 3-4 and whose ``inductor`` provider
  hands 4 and the partitioner to Inductor;
- a model's training step captured whole (frontend/capture.py: memory prediction and automatic batch size on
  fake tensors, ``compile_train_step`` for tests and benchmarks): 3-4 on the model as a function
  (pipeline/functional.py), which AOTAutograd traces itself, with the passes asked for;
- the whole optimizer step as one graph (frontend/compile_step.py): 1, 2, its own step trace, 5.

Every pass run and every fallback is recorded on the caller's ``EngineState`` (``graphtrain.report`` reads it):
run_passes hands ``state.fallbacks`` to the pass manager, so a pass that fails and is skipped lands there too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphtrain.config.fallback import GraphtrainCaptureError, report_fallback
from graphtrain.config.sections import EngineConfig
from graphtrain.memory.predict import param_bytes
from graphtrain.memory.recompute import make_partition_fn
from graphtrain.passes.graph_utils import materialize_symints, views_as_reshapes
from graphtrain.passes.manager import PassContext, PassFn, op_counts, registered_passes, run_pipeline
from graphtrain.pipeline.state import EngineState, GraphRecord
from graphtrain.pipeline.trace import trace_aten_forward


def new_record(
    name: str, frame: str, example_inputs: Sequence[Any], input_kinds: list[str], state: EngineState, **fields: Any
) -> GraphRecord:
    """Start the GraphRecord of one compiled graph on `state` (the report lists them in this order)."""

    def dim(d: Any) -> Any:
        return d if type(d) is int else str(d)

    shapes = [tuple(dim(d) for d in x.shape) if isinstance(x, torch.Tensor) else dim(x) for x in example_inputs]
    rec = GraphRecord(name=name, frame=frame, input_shapes=shapes, input_kinds=input_kinds, **fields)
    state.graphs.append(rec)
    return rec


# ------------------------------------------------------------------------------ 1. trace --


def trace(fn: Callable[..., Any], example_inputs: Sequence[Any], rec: GraphRecord | None = None) -> fx.GraphModule:
    """`fn(*example_inputs)` (a Dynamo graph, or a function such as pipeline/functional's module_as_function) as
    the pre-autodiff IR: a functional aten graph on fake tensors (pipeline/trace.py says what it guarantees)."""
    gm = trace_aten_forward(fn, example_inputs)
    if rec is not None:
        rec.ops_captured = sum(op_counts(gm).values())
    return gm


# ----------------------------------------------------------------------------- 2, 4. passes --


def run_passes(
    gm: fx.GraphModule,
    stage: str,
    config: EngineConfig,
    state: EngineState,
    rec: GraphRecord | None = None,
    *,
    example_inputs: Sequence[Any] = (),
    input_kinds: list[str] | None = None,
    only: Sequence[PassFn] | None = None,
) -> fx.GraphModule:
    """The `stage` pipeline of `config` on `gm` through the pass manager (timed, linted, output-checked; a failed
    pass is skipped and recorded on state.fallbacks, or raised under fallback=error). The pass records go to
    state.passes and the op counts to `rec`. `only`: run exactly these registered passes instead."""
    if only is not None:
        config = _only(config, stage, only)
    ctx = PassContext(
        config=config,
        stage=stage,
        graph_name=rec.name if rec is not None else f"{stage} graph",
        example_inputs=list(example_inputs),
        input_kinds=input_kinds,
        fallbacks=state.fallbacks,
        inference=rec is not None and rec.inference,
    )
    gm = run_pipeline(gm, ctx)
    materialize_symints(gm)  # a size a pass wrote as a raw SymInt (dynamic shapes) becomes graph nodes
    state.passes.extend(ctx.records)
    if rec is not None:
        n_ops = sum(op_counts(gm).values())
        if stage == "pre_autodiff":
            rec.ops_pre_autodiff = n_ops
        elif stage == "forward":
            rec.ops_forward = n_ops
        else:
            rec.ops_backward = n_ops
            _record_backward(gm, rec)
    return gm


def _only(config: EngineConfig, stage: str, passes: Sequence[PassFn]) -> EngineConfig:
    """`config` with exactly `passes` (registered pass functions) switched on at `stage`."""
    specs = registered_passes()
    by_fn = {s.fn: name for name, s in specs.items()}
    unknown = [getattr(p, "__name__", repr(p)) for p in passes if p not in by_fn]
    if unknown:
        raise ValueError(f"passes {unknown} are not registered: decorate them with graphtrain.passes.register_pass")
    chosen = {by_fn[p] for p in passes}
    switches = {name: name in chosen for name, s in specs.items() if stage in s.stages}
    return dataclasses.replace(config, passes={**config.passes, **switches})


def _record_backward(gm: fx.GraphModule, rec: GraphRecord) -> None:
    """Saved activations are the backward's non-tangent inputs that are not forward inputs (primals_*);
    gradients computed are its non-None outputs, aligned with the forward inputs."""
    saved_bytes, saved = 0, 0
    for n in gm.graph.nodes:
        if n.op != "placeholder" or n.name.startswith(("tangents_", "primals_")):
            continue
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            saved += 1
            numel = v.numel()
            saved_bytes += int(numel) * v.element_size() if isinstance(numel, int) else 0
    rec.saved_activation_bytes, rec.saved_tensors = saved_bytes, saved
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    grads = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    rec.grads_computed = sum(g is not None for g in grads)
    kinds = rec.input_kinds
    if rec.dtensor_inputs:
        # AOTAutograd returns a DTensor input's gradient as two outputs (its flattened inner tensor and a
        # second flattened entry), so outputs no longer line up with the inputs one to one.
        rec.grads_computed -= rec.dtensor_inputs
    elif len(grads) >= len(kinds):
        offset = len(grads) - len(kinds)  # folded constants (module buffers) come first
        rec.frozen_inputs_with_grad = sum(
            grads[offset + i] is not None for i, k in enumerate(kinds) if k in ("frozen", "buffer")
        )


# ------------------------------------------------------------------------------ 3. partition --


@dataclass
class StepLayout:
    """Where the parameters, buffers and batch sit among the partitioned forward graph's inputs.

    AOTAutograd (``aot_module_simplified``) lifts the graph module's own parameters and buffers (the
    constants fold_constants registered) in front of the graph's inputs, which Dynamo orders by first use,
    so the batch is not necessarily last."""

    n_params_bytes: int  # trainable parameter bytes (tied weights once)
    n_param_inputs: int  # parameters + buffers among the forward inputs
    batch_inputs: list[int]


def layout(forward: Callable[..., Any], example_inputs: Sequence[Any], kinds: Sequence[str]) -> StepLayout:
    n_lifted = 0
    if isinstance(forward, fx.GraphModule):
        n_lifted = len(dict(forward.named_parameters(remove_duplicate=False))) + len(
            dict(forward.named_buffers(remove_duplicate=False))
        )
    trained = [x for x, k in zip(example_inputs, kinds) if k == "param"]
    return StepLayout(
        param_bytes(trained),
        n_lifted + sum(k in ("param", "frozen", "buffer") for k in kinds),
        [n_lifted + i for i, k in enumerate(kinds) if k == "input"],
    )


def partition_fn(
    config: EngineConfig, state: EngineState, rec: GraphRecord, lay: StepLayout, *, optimizer: str = "adamw"
) -> Callable[..., tuple[fx.GraphModule, fx.GraphModule]]:
    """graphtrain.memory.recompute's partitioner for config.recompute; its decision record goes to
    state.recompute and `rec`.

    Every mode, `none` included, goes through it: on top of the mode's partition it drops the dead random
    ops AOTAutograd's partitioners copy into the backward (which would re-run work and consume RNG)."""
    inner = make_partition_fn(
        config,
        n_params_bytes=lay.n_params_bytes,
        n_param_inputs=lay.n_param_inputs,
        optimizer=optimizer,
        records=state.recompute,
        batch_inputs=lay.batch_inputs,
    )

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kw: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        n = len(state.recompute)
        fw, bw = inner(joint, joint_inputs, **kw)
        if len(state.recompute) > n:
            rec.recompute = state.recompute[-1]
        return fw, bw

    return partition


def partitioner_name(config: EngineConfig) -> str:
    return "default" if config.recompute == "none" else f"min_cut (recompute={config.recompute})"


# ------------------------------------------------------------------------- 3-4. autodiff --


def to_boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """Compile `gm` to the boxed calling convention: it takes the argument list and clears it, so
    an input is released after its last use (FX code already drops each intermediate after its
    last use with ``x = None``). Without this the backward keeps every saved activation alive
    until it returns."""
    gm.graph.set_codegen(fx.graph._BoxedCodeGen())
    gm.recompile()
    assert gm._boxed_call  # a property of the codegen: AOTAutograd then hands over the argument list
    return gm


GraphsHook = Callable[[fx.GraphModule, fx.GraphModule, StepLayout], None]


def autodiff(
    forward: Callable[..., Any],
    example_inputs: Sequence[Any],
    config: EngineConfig,
    state: EngineState,
    rec: GraphRecord,
    *,
    only: dict[str, Sequence[PassFn]] | None = None,
    boxed: bool = True,
    optimizer: str = "adamw",
    backward_passes_at_partition: bool = False,
    on_graphs: GraphsHook | None = None,
    on_stage: Callable[[str, fx.GraphModule], None] | None = None,
) -> Callable[..., Any]:
    """AOTAutograd on `forward`, as the aten provider runs it: no decompositions (the graphs hold the aten ops
    eager autograd would run), `partition_fn`'s partition, then each graph's stage passes, and each graph
    compiled to FX code, boxed (the backward frees each saved activation after its last use).

    forward: the pre-autodiff graph (``aot_module_simplified``, compiled now: its own parameters and buffers are
    lifted in front of `example_inputs`), or a function of `example_inputs` (``aot_function``, compiled at the
    first call, which traces it: frontend/capture.py's model step).

    only: {"forward": [...], "backward": [...]}: run exactly these passes instead of the configured pipeline.
    backward_passes_at_partition: run the backward's passes as the partitioner hands the graph over (AOTAutograd
    compiles the backward lazily, at its first call: a capture on fake tensors never calls it).
    on_graphs(fw, bw, layout): once both graphs went through their passes. on_stage(stage, gm): after each."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function, aot_module_simplified

    lay = layout(forward, example_inputs, rec.input_kinds)
    inner = partition_fn(config, state, rec, lay, optimizer=optimizer)
    done: dict[str, fx.GraphModule] = {}

    def passes(stage: str, g: fx.GraphModule, ins: Sequence[Any]) -> fx.GraphModule:
        g = run_passes(g, stage, config, state, rec, example_inputs=ins, only=None if only is None else only[stage])
        if on_stage is not None:
            on_stage(stage, g)
        done[stage] = g
        if (
            on_graphs is not None and len(done) == 2
        ):  # AOTAutograd compiles the forward first, the backward maybe lazily
            on_graphs(done.pop("forward"), done.pop("backward"), lay)
        return g

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kw: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        fw, bw = inner(joint, joint_inputs, **kw)
        return fw, (passes("backward", bw, []) if backward_passes_at_partition else bw)

    def compiler(stage: str) -> Callable[..., Any]:
        def compile_fn(g: fx.GraphModule, ins: Sequence[Any]) -> Any:
            if stage == "forward" or not backward_passes_at_partition:
                g = passes(stage, g, ins)
            # A view recorded against a fake's strides, as a reshape: the same view wherever the real strides allow
            # one (passes/graph_utils.py views_as_reshapes: a backward that raised there could not fall back)
            g = views_as_reshapes(g)
            # Boxed: the backward takes its argument list and clears it, so each saved activation is freed after
            # its last use instead of when the backward returns (FX code drops intermediates the same way).
            return to_boxed(g) if boxed else make_boxed_func(g.forward)

        return compile_fn

    rec.partitioner = partitioner_name(config)
    aot: dict[str, Any] = dict(
        fw_compiler=compiler("forward"), bw_compiler=compiler("backward"), partition_fn=partition, decompositions={}
    )
    if isinstance(forward, fx.GraphModule):
        return aot_module_simplified(forward, list(example_inputs), **aot)
    return aot_function(forward, **aot)


def user_outputs(fw: fx.GraphModule, bw: fx.GraphModule) -> int:
    """How many of the partitioned forward's outputs are the graph's own (it returns (*user outputs, *saved))."""
    fw_out = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
    n_saved = sum(n.op == "placeholder" and not n.name.startswith("tangents_") for n in bw.graph.nodes)
    return len(torch.utils._pytree.tree_leaves(fw_out)) - n_saved


# --------------------------------------------------------------------------- 5. provider --

DYNAMO_RESTARTS: tuple[type[BaseException], ...] = (torch._dynamo.exc.RestartAnalysis,)
"""Exceptions by which Dynamo asks to trace the frame again (AOTAutograd's float-scalar pass raises one under
dynamic shapes): they pass through every fallback of the backend, which would otherwise take them for a failed
compile and run the graph eagerly."""
# raised as they are by compile_with_fallback, never degraded to the next provider
_NOT_DEGRADED: tuple[type[BaseException], ...] = (GraphtrainCaptureError, *DYNAMO_RESTARTS)


def compile_with_fallback(
    order: Sequence[str],
    compile_one: Callable[[str], Any],
    *,
    part: str,
    config: EngineConfig,
    state: EngineState,
    eager: Any = None,
) -> tuple[Any, str]:
    """compile_one(provider) for the first provider in `order` that compiles; returns (compiled, provider).

    A provider that fails is reported through the fallback policy (recorded on state.fallbacks; warned once,
    or raised under fallback=error) and the next one is tried; after the last, `eager` runs (provider
    "eager"), or, without one, the last failure is raised."""
    for i, provider in enumerate(order):
        nxt = order[i + 1] if i + 1 < len(order) else "eager" if eager is not None else None
        try:
            return compile_one(provider), provider
        except _NOT_DEGRADED:
            raise
        except Exception as e:  # noqa: BLE001 - degrade to the next provider, loudly
            if nxt is None:
                raise
            report_fallback(
                f"provider {provider} on {part}",
                f"{type(e).__name__}: {str(e)[:500]}",
                config,
                what=f"runs on {nxt} instead",
                sink=state.fallbacks,
            )
    return eager, "eager"
