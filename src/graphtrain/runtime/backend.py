"""The "graphtrain" torch.compile backend: one Dynamo graph in, a trainable compiled callable out.

Per Dynamo graph, the stages of pipeline.py:  ``dynamo`` passes (the Dynamo graph's own rewrites)  ->  trace to the
pre-autodiff aten IR (trace.py)  ->  ``pre_autodiff`` passes  ->  AOTAutograd (gradient graph, partition)  ->
``forward``/``backward`` passes  ->  provider.
Each stage that fails falls back to the stage before it (no pre-autodiff passes; aten instead of
inductor; the Dynamo graph run eagerly) and says so once, or raises under ``fallback: error``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from graphtrain.config.fallback import GraphtrainCaptureError, report_fallback, set_policy
from graphtrain.config.sections import EngineConfig, resolve_engine_config
from graphtrain.config.torch_compat import parse_version, skip_dispatch_mode_calls_only
from graphtrain.memory.prefault import compiled as first_graph_compiled
from graphtrain.passes import autograd_functions
from graphtrain.passes.manager import PassContext, run_pipeline
from graphtrain.passes.returned_heads import reattach
from graphtrain.pipeline.block_regions import ReuseMisbound
from graphtrain.pipeline.blocks import check_bindings, compile_by_blocks, has_block_calls, inline_blocks
from graphtrain.pipeline.cache import configure_cache, load_pass_result, save_pass_result
from graphtrain.pipeline.job import CompileJob
from graphtrain.pipeline.stages import DYNAMO_RESTARTS, compile_with_fallback, new_record, run_passes, trace
from graphtrain.pipeline.state import GLOBAL_STATE, EngineState
from graphtrain.pipeline.trace import delocalize, dtensor_inputs, localize
from graphtrain.runtime.allocator import set_cpu_allocator_once
from graphtrain.runtime.provider_auto import choose_provider, measurable, under_ddp_optimizer
from graphtrain.runtime.providers import PROVIDERS, resolve_runtime

if TYPE_CHECKING:
    from graphtrain.passes.manager import PassContext


def _input_kinds(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[str]:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = []
    for name, x in zip(names, example_inputs):
        if isinstance(x, torch.nn.Parameter):
            kinds.append("param" if x.requires_grad else "frozen")
        elif not isinstance(x, torch.Tensor):
            kinds.append("symint")
        elif "_buffers_" in name:
            kinds.append("buffer")
        else:
            kinds.append("input")
    return kinds


def has_grad_mode_changes(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target is torch._C._set_grad_enabled for n in gm.graph.nodes)


def _frame_info(gm: fx.GraphModule) -> tuple[str, int]:
    """(the captured Python function, how many times Dynamo compiled this frame before)."""
    cid = torch._guards.CompileContext.current_compile_id()
    frame = "?"
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        co = InstructionTranslator.current_tx().output.co_fields
        frame = f"{co['co_name']} ({co['co_filename'].rsplit('/', 1)[-1]}:{co['co_firstlineno']})"
    except Exception:  # noqa: BLE001 - only a label; called outside Dynamo (tests) there is no tx
        pass
    return frame, (cid.frame_compile_id or 0) if cid is not None else 0


def compile_graph(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: EngineConfig, state: EngineState
) -> Callable[..., Any]:
    """Compile one Dynamo graph (the backend body) through the pipeline; records a GraphRecord on `state` per
    graph compiled. A graph with repeated-block calls (pipeline/blocks.py) is compiled piece by piece, each
    distinct block once."""

    set_policy(config.fallback)  # fused ops that fail at run time follow it (process-wide: the last wins)
    set_cpu_allocator_once(example_inputs, config)
    # the dynamo stage's passes on the whole Dynamo graph (static and learned masks, the no_grad lift, returned
    # heads); their records join state.passes once the graph compiled (a graph Dynamo restarts never runs)
    n_records = len(state.passes)
    gm, dynamo = dynamo_passes(
        gm, example_inputs, config, state, f"Dynamo graph {_frame_info(gm)[0]}", state.notes, ("masks", "grad")
    )
    heads, n_out = dynamo.results.get("detach_returned_heads", ([], 0))
    if has_block_calls(gm) and under_ddp_optimizer():
        # Dynamo's DDPOptimizer compiles a DDP model's graph bucket by bucket and expects one AOTAutograd graph per
        # bucket (it runs each on fake inputs through AOTAutograd's first-call fakification), which per-block
        # pieces are not: a bucket's blocks are inlined and compiled with it as one graph. (accelerate's own calls
        # bypass DDPOptimizer for a model with blocks, frontend/accelerate.py _run_compiled; this is for compiles that come
        # through it anyway, e.g. torch.compile of a DDP wrapper around blocks accelerate marked.)
        kinds = _input_kinds(gm, example_inputs)
        check_bindings(gm, kinds)  # Dynamo's reuse bound the first block's weights?
        _note_once(
            state.notes,
            "under DDP each bucket's graph is compiled whole, its repeated blocks inlined "
            "(Dynamo's DDPOptimizer takes one AOTAutograd graph per bucket)",
        )
        compiled = _compile_one(inline_blocks(gm), example_inputs, config, state, kinds=kinds)
    elif has_block_calls(gm):
        compiled = _compile_by_blocks(gm, example_inputs, config, state)
    else:
        compiled = _compile_one(gm, example_inputs, config, state)
    first_graph_compiled()
    state.passes[n_records:n_records] = dynamo.records
    return reattach(compiled, heads, n_out) if heads else compiled


def dynamo_passes(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: EngineConfig,
    state: EngineState,
    name: str,
    notes: list[str],
    phases: tuple[str, ...],
) -> tuple[fx.GraphModule, PassContext]:
    """The passes of the "dynamo" stage in `phases` on `gm` (passes/manager.py): (the graph, their PassContext,
    whose records the caller adds to state.passes). Their lines for the report go to `notes`."""
    ctx = PassContext(
        config=config,
        stage="dynamo",
        graph_name=name,
        example_inputs=list(example_inputs),
        fallbacks=state.fallbacks,
        caller_notes=notes,
    )
    return run_pipeline(gm, ctx, phases), ctx


def _note_once(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)


def _compile_by_blocks(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: EngineConfig, state: EngineState
) -> Callable[..., Any]:

    frame, _ = _frame_info(gm)

    def piece(g: fx.GraphModule, inputs: list[Any], kinds: list[str], label: str, calls: int) -> Callable[..., Any]:
        return _compile_one(g, inputs, config, state, kinds=kinds, frame=f"{frame}: {label}", calls=calls)

    kinds = _input_kinds(gm, example_inputs)
    check_bindings(gm, kinds)  # raises ReuseMisbound: the call wrapper (frontend/accelerate.py) captures again
    try:
        return compile_by_blocks(gm, example_inputs, kinds, piece)
    except (GraphtrainCaptureError, ReuseMisbound, *DYNAMO_RESTARTS):
        raise
    except Exception as e:  # noqa: BLE001 - the Dynamo graph still runs, eagerly
        report_fallback(
            f"per-block compile of {frame}",
            f"{type(e).__name__}: {str(e)[:500]}",
            config,
            what="runs eagerly (engine.compile_blocks=false compiles it whole)",
            sink=state.fallbacks,
        )
        return inline_blocks(gm).forward


def _compile_one(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: EngineConfig,
    state: EngineState,
    *,
    kinds: list[str] | None = None,
    frame: str | None = None,
    calls: int = 1,
) -> Callable[..., Any]:
    """One graph's CompileJob (the provider and precision resolved for its device), compiled: by provider auto's
    choice, or down the fallback chain from the provider asked for."""

    t0 = time.perf_counter()
    measure = config.provider == "auto" and measurable(example_inputs)
    # Passes see the provider and precision that run the graph, never "auto" (fusions Inductor does itself run
    # for aten only; mixed precision needs a dtype). Under a measured auto each candidate gets its own passes.
    auto_config = config
    config = resolve_runtime(config, example_inputs)
    dynamo_frame, raw_compile_id = _frame_info(gm)
    frame = frame or dynamo_frame
    # Dynamo counts compiles per code object across all instances; count this module's own compiles.
    ids = sorted({g.notes_compile_id for g in state.graphs if g.frame == frame} | {raw_compile_id})
    frame_compile = ids.index(raw_compile_id)
    kinds = kinds or _input_kinds(gm, example_inputs)
    rec = new_record(
        f"graph{len(state.graphs)}",
        frame,
        example_inputs,
        kinds,
        state,
        frame_compile=frame_compile,
        compile_reason=str(getattr(gm, "compile_subgraph_reason", "") or ""),
        calls_per_step=calls,
    )
    user = [x for x, k in zip(example_inputs, kinds) if k in ("input", "activation") and x.dim() > 0]
    rec.batch = int(user[0].shape[0]) if user and isinstance(user[0].shape[0], int) else None
    rec.precision = config.precision
    rec.notes_compile_id = raw_compile_id
    rec.inference = not torch.is_grad_enabled()  # Dynamo calls the backend in the frame's grad mode

    job = CompileJob(gm, example_inputs, kinds, config, state, rec)

    def compile_one(p: str) -> Callable[..., Any]:
        return compile_stages(job.for_provider(p))

    n_passes = len(state.passes)
    try:
        if measure:
            compiled = choose_provider(job, compile_stages, auto_config, eager=gm.forward)
        else:  # falling back inductor -> aten -> eager
            order = [config.provider] + (["aten"] if config.provider != "aten" else [])
            compiled, rec.provider = compile_with_fallback(
                order, compile_one, part=f"{rec.name} ({frame})", config=config, state=state, eager=gm.forward
            )
    except DYNAMO_RESTARTS:  # Dynamo traces the frame again and hands over a new graph: this one never runs
        state.graphs.remove(rec)
        del state.passes[n_passes:]
        raise
    rec.compile_seconds = time.perf_counter() - t0
    return compiled


def compile_stages(job: CompileJob) -> Callable[..., Any]:
    """Stages 1-5 for the job's provider: the pre-autodiff IR and its passes for that provider, autodiff, the
    provider itself (runtime/providers.py PROVIDERS), which gets the job with the optimized graph in place."""
    return PROVIDERS[job.config.provider](dataclasses.replace(job, gm=_pre_autodiff(job)))


def _pre_autodiff(job: CompileJob) -> fx.GraphModule:
    """Stages 1-2: the job's graph as the optimized pre-autodiff aten graph for its provider (from the pass cache when
    an identical graph was optimized before); the Dynamo graph itself where tracing fails (reported)."""
    gm, example_inputs, kinds, config, state, rec = (
        job.gm,
        job.example_inputs,
        job.kinds,
        job.config,
        job.state,
        job.rec,
    )

    # Tensor-parallel DTensor parameters: trace and optimize the graph on their local shards, then hand the
    # provider a graph that takes the DTensors again (trace.localize / delocalize).
    sharded = dtensor_inputs(example_inputs)
    rec.dtensor_inputs = len(sharded)
    if has_grad_mode_changes(gm):
        _note_once(rec.notes, "graph switches grad mode inside (no_grad region): pre-autodiff passes skipped")
        return gm
    if not sharded and (cached := _cached_passes(job)) is not None:
        return cached
    n_records = len(state.passes)  # from here, what a cached result replays
    try:
        local, trace_inputs = localize(gm, example_inputs, sharded) if sharded else (gm, list(example_inputs))
        # the dynamo stage's passes on the graph traced (hide_autograd_functions: on a copy; gm, which the eager
        # fallback runs, keeps its autograd.Function calls)
        local, dynamo = dynamo_passes(local, trace_inputs, config, state, rec.name, rec.notes, ("opaque",))
        state.passes.extend(dynamo.records)
        traced = trace(local, trace_inputs, rec)
    except Exception as e:  # noqa: BLE001 - any tracing failure degrades to the Dynamo graph
        report_fallback(
            f"tracing {rec.name} ({rec.frame}) to aten",
            f"{type(e).__name__}: {e}",
            config,
            what="is compiled without pre-autodiff passes",
            sink=state.fallbacks,
        )
        return gm
    traced = run_passes(traced, "pre_autodiff", config, state, rec, example_inputs=trace_inputs, input_kinds=kinds)
    autograd_functions.restore(traced)  # hide_autograd_functions' other half: always, whatever the passes were
    if not sharded and rec.pass_cache == "miss":
        traced = save_pass_result(
            config, rec.pass_cache_key, traced, state.passes[n_records:], rec.ops_captured, rec.ops_pre_autodiff
        )
    if sharded:
        rec.notes.append(f"{len(sharded)} DTensor parameters traced on their local shards")
        return delocalize(traced, sharded)
    return traced


def _cached_passes(job: CompileJob) -> fx.GraphModule | None:
    """The pre-autodiff result of an identical graph compiled before (pipeline/cache.py), its pass records added to
    the job's state as if the passes had run; None on a miss (`rec.pass_cache` says which)."""
    config, state, rec = job.config, job.state, job.rec
    if job.pass_key is None:  # an input the key cannot describe: no caching for this graph
        rec.pass_cache = "off"
        return None
    rec.pass_cache_key = job.pass_key
    hit = load_pass_result(config, rec.pass_cache_key)
    if hit is None:
        rec.pass_cache = "miss"
        return None
    graph, records, rec.ops_captured, rec.ops_pre_autodiff = hit
    state.passes.extend(dataclasses.replace(r, graph=rec.name) for r in records)
    for r in records:  # a cached result must not hide what the passes' run reported: replay each fallback
        if r.error is not None:
            report_fallback(
                f"pass {r.name}",
                r.error,
                config,
                what=f"{rec.name} keeps the graph from before the pass",
                sink=state.fallbacks,
            )
    rec.pass_cache = "hit"
    return graph


def make_backend(config: EngineConfig, state: EngineState) -> Callable[..., Any]:
    def graphtrain_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return compile_graph(gm, example_inputs, config, state)

    return graphtrain_backend


def graphtrain_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """The backend registered as "graphtrain" (default EngineConfig; `options` are EngineConfig keys, as in
    ``torch.compile(m, backend="graphtrain", options={"provider": "aten"})``). Records into GLOBAL_STATE."""
    config = resolve_engine_config(None, options) if options else GLOBAL_STATE.config
    configure_cache(config)
    part = f"Dynamo graph {_frame_info(gm)[0]}"
    eager = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # as Dynamo gave it: the dynamo-stage passes rewrite gm
    return _first_call_checked(compile_graph(gm, example_inputs, config, GLOBAL_STATE), eager, part, config)


def _first_call_checked(
    compiled: Callable[..., Any], eager: fx.GraphModule, part: str, config: EngineConfig
) -> Callable[..., Any]:
    """`compiled`, except that when its first call raises and the Dynamo graph run eagerly on the same inputs does
    not, the graph runs eagerly from then on, said as a fallback (raised under engine.fallback=error). What
    accelerate's call wrapper does for a module (frontend/accelerate.py), for ``torch.compile(backend="graphtrain")``,
    which has no wrapper of its own: a graph graphtrain got wrong (an op put in bf16 that has no bf16 kernel) no
    longer raises at the user. When eager raises too, the error is the user's, raised as eager raises it. Only the
    first call is checked (where a graph's own error shows); the later ones go to what it settled on."""
    current: Callable[..., Any] | None = None

    def run(*args: Any) -> Any:
        nonlocal current
        if current is not None:
            return current(*args)
        try:
            out = compiled(*args)
        except GraphtrainCaptureError:
            raise
        except Exception as e:  # noqa: BLE001 - eager's run of the same inputs tells graphtrain's error from the user's
            try:
                out = eager(*args)
            except Exception as user_error:  # noqa: BLE001
                raise user_error from None
            reason = " ".join(f"its compiled graph raised where eager runs ({type(e).__name__}: {e})".split())
            report_fallback(part, reason[:600], config, what="runs eagerly from now on", sink=GLOBAL_STATE.fallbacks)
            current = eager
            return out
        current = compiled
        return out

    return run


@functools.cache
def register_backend() -> None:
    """Make ``torch.compile(model, backend="graphtrain")`` work (called by ``import graphtrain``)."""
    from torch._dynamo.backends.registry import _COMPILER_FNS
    from torch._dynamo.backends.registry import register_backend as register

    if "graphtrain" not in _COMPILER_FNS:
        register(graphtrain_backend, name="graphtrain")


def _is_graphtrain_backend(backend: Any) -> bool:
    return getattr(backend, "__module__", None) == __name__  # graphtrain_backend, or make_backend's for accelerate


# On torch 2.11 to 2.13, a call under a user's TorchDispatchMode (FlopCounterMode) made Dynamo run the model eagerly
# for every later call too, without a word; done when this module loads, which Dynamo's lookup of the backend's name
# does before the first call (config/torch_compat.py skip_dispatch_mode_calls_only). False only on a torch before
# 2.14 whose Dynamo lacks the pieces changed: there such a call leaves the model eager, as under torch.compile.
DISPATCH_MODE_SKIPS_ONE_CALL = skip_dispatch_mode_calls_only(_is_graphtrain_backend) or parse_version(
    torch.__version__
) >= (2, 14)
