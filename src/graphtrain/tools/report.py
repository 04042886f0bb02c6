"""``graphtrain.report(module)``: what the engine captured, rewrote, saved and ran, and why.

    print(graphtrain.report(model))     # text
    graphtrain.report(model).to_dict()  # the same facts, machine-readable
    graphtrain.report(model, optimizer=opt).process_peak  # + the next step's predicted peak RSS of the process

The text opens with a one-screen summary (graphs and the provider each ran on, graph breaks, fallbacks and why,
predicted and measured memory), then the details graph by graph and pass by pass. Names are the model's own:
Dynamo's placeholder names (``l_self_modules_transformer_modules_wte_parameters_weight_``) are written back as the
parameter they stand for (``transformer.wte.weight``) wherever the engine quoted them.

This module gathers the facts into a ``Report``; tools/report_text.py writes them as text.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import sys
from dataclasses import dataclass
from typing import Any

import torch

from graphtrain.kernels import capabilities, op_descriptor
from graphtrain.memory import allocator
from graphtrain.memory.process import predict_process_peak
from graphtrain.pipeline.cache import cache_root
from graphtrain.pipeline.state import EngineState, GraphRecord, state_of
from graphtrain.runtime.allocator import cpu_allocator_set
from graphtrain.tools import report_text


def _param_stats(module: torch.nn.Module | None) -> dict[str, int]:
    out = dict(trained=0, trained_bytes=0, frozen=0, frozen_bytes=0, buffers=0, buffer_bytes=0)
    if module is None:
        return out
    for p in module.parameters():
        key = "trained" if p.requires_grad else "frozen"
        out[key] += p.numel()
        out[key + "_bytes"] += p.numel() * p.element_size()
    for b in module.buffers():
        out["buffers"] += b.numel()
        out["buffer_bytes"] += b.numel() * b.element_size()
    return out


def _latest(graphs: list[GraphRecord]) -> list[GraphRecord]:
    """The graphs of each frame's most recent compile (what the next step runs)."""
    last: dict[str, int] = {}
    for g in graphs:
        last[g.frame] = max(last.get(g.frame, 0), g.frame_compile)
    return [g for g in graphs if g.frame_compile == last[g.frame]]


@dataclass
class Report:
    source: str
    config: dict[str, Any]
    graphs: list[dict[str, Any]]
    graph_breaks: list[str]
    recompiles: list[dict[str, Any]]
    fallbacks: list[tuple[str, str]]
    passes: list[dict[str, Any]]
    params: dict[str, int]
    saved_activation_bytes: int | None
    saved_activation_bytes_per_sample: float | None
    first_step_seconds: float | None
    compile_seconds: float
    calls: int
    eager_only: bool
    machine: dict[str, Any] | None = None
    """graphtrain.kernels.capabilities(): the CPU, what each capability selected and why, and the fused ops
    that failed at run time and fell back to their reference implementation."""
    process_peak: dict[str, Any] | None = None
    """The next step's predicted peak resident memory of the whole process (bytes, a
    graphtrain.memory.process.ProcessPeak as a dict): the resident set measured now, less the trained
    parameters, gradients, optimizer state and batch measured in it, plus the largest predicted step peak of
    the latest graphs (``graph``: its name). None without a step prediction or off Linux."""
    cache: dict[str, Any] | None = None
    """Compile-cache hits and misses: graphtrain's pass results (this module's graphs), Inductor's FX graphs and
    AOTAutograd's entries (this process), and the cache folder."""
    blocks: list[str] | None = None
    """The repeated stacks compiled once per block (pipeline/blocks.py), e.g. "transformer.h (12 x GPT2Block)"."""
    notes: list[str] | None = None
    allocator: dict[str, Any] | None = None
    """This process's CPU allocator (set once, at the first CPU compile; runtime/allocator.py set_cpu_allocator):
    ``mode`` (keep, release or default), ``huge_pages`` and, under the block cache, its counters
    (memory/allocator.py block_cache_stats). None before any CPU compile."""
    first_step_memory: dict[str, Any] | None = None
    """The first step's CPU memory (memory/prefault.py): ``recorded_blocks``/``recorded_bytes`` (blocks of 2 MiB and
    more it asked for fresh, stored at ``path`` for the next process) and what priming did:
    ``primed_blocks`` faulted in ahead (of ``primed_bytes`` asked; ``primed_from``: ``record``, or ``gradients``
    without one), ``primed_taken`` by the step and ``returned_bytes`` given back unasked. Empty before the first
    step settles or with ``engine.cpu_prefault`` off."""
    step_peak: dict[str, Any] | None = None
    """The latest graphs' predicted step peak by component (``step_prediction``), None before a training graph."""
    measured_peak: dict[str, Any] | None = None
    """The peak memory measured so far, to hold against the predictions: ``bytes`` and ``what`` (the process's
    peak resident set on CPU, the CUDA allocator's peak on a GPU)."""
    fused_ops: list[dict[str, Any]] | None = None
    """The graphtrain ops the passes put into the graphs (``count``, summed over graphs), each with what its
    descriptor tells recompute, mixed precision and the memory predictor (kernels/registry.py)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """Two lines for the end of a run: what the engine ran, and on which machine."""
        return report_text.summary(self)

    def headline(self) -> list[str]:
        """The one-screen summary the text opens with: graphs and providers, breaks, fallbacks and why, memory."""
        return report_text.headline(self)

    def __str__(self) -> str:
        return report_text.text(self)


def report(
    module: torch.nn.Module | None = None, *, optimizer: torch.optim.Optimizer | None = None, batch: Any = ()
) -> Report:
    """The engine report for an accelerated module (or for the process-wide torch.compile backend).

    optimizer, batch: the training step's optimizer and batch tensors, for the predicted peak resident memory
    of the whole process (``Report.process_peak``): their tensors allocated now are measured and counted once.
    Call it between steps, after ``zero_grad``: it reads the resident set now (after gc and malloc_trim)."""
    state, source = state_of(module)
    agg: dict[tuple[str, str], dict[str, Any]] = collections.OrderedDict()
    runs = {g.name: g.calls_per_step for g in state.graphs}  # a block's graph: its rewrites apply to every layer
    for r in state.passes:
        a = agg.setdefault(
            (r.stage, r.name),
            dict(
                stage=r.stage,
                phase=r.phase,
                name=r.name,
                rewrites=0,
                seconds=0.0,
                ops_before=0,
                ops_after=0,
                error=None,
                left_to=r.left_to,
                notes=[],
            ),
        )
        if getattr(r, "note", None):  # records pickled by an older version have no note
            a["notes"].append(f"{r.graph}: {r.note}")
        a["rewrites"] += r.rewrites * runs.get(r.graph, 1)
        a["seconds"] += r.seconds
        a["ops_before"] += r.ops_before
        a["ops_after"] += r.ops_after
        a["error"] = a["error"] or r.error
    latest = _latest(state.graphs)
    saved = [g.saved_activation_bytes * g.calls_per_step for g in latest if g.saved_activation_bytes is not None]
    batches = {g.batch for g in latest if g.saved_activation_bytes is not None and g.batch}
    saved_total = sum(saved) if saved else None
    per_sample = saved_total / batches.pop() if saved_total is not None and len(batches) == 1 else None
    step, name = step_prediction(latest, module)
    process = None
    if step is not None:
        tensors = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else (batch,)
        try:
            pp = predict_process_peak(step, model=module, optimizer=optimizer, batch=tensors)
        except Exception:  # noqa: BLE001 - an estimate only (odd tensor subclasses): the report goes on without it
            pp = None
        process = {**pp.to_dict(), "graph": name, "step": step} if pp is not None else None
    rep = Report(
        source=source,
        config=dataclasses.asdict(state.config),
        graphs=[dataclasses.asdict(g) for g in state.graphs],
        graph_breaks=list(state.graph_breaks),
        recompiles=[
            dict(
                frame=g.frame,
                frame_compile=g.frame_compile,
                input_shapes=[s for s, k in zip(g.input_shapes, g.input_kinds) if k in ("input", "symint")],
            )
            for g in state.recompiles
        ],
        fallbacks=list(state.fallbacks),
        passes=list(agg.values()),
        params=_param_stats(module),
        saved_activation_bytes=saved_total,
        saved_activation_bytes_per_sample=per_sample,
        first_step_seconds=state.first_call_seconds,
        compile_seconds=sum(g.compile_seconds for g in state.graphs),
        calls=state.calls,
        eager_only=state.eager_only,
        machine=capabilities(),
        process_peak=process,
        blocks=list(state.blocks),
        notes=list(state.notes),
        cache=_cache_stats(state),
        allocator=_allocator_state(),
        first_step_memory=dict(state.first_step_memory),
        fused_ops=_fused_ops(state.passes, runs),
        step_peak=step,
        measured_peak=_measured_peak(module),
    )
    return _with_user_names(rep, module)


def _measured_peak(module: torch.nn.Module | None) -> dict[str, Any] | None:
    """The peak memory measured so far: the CUDA allocator's on the module's GPU, else the process's peak RSS."""
    device = next((p.device for p in module.parameters()), None) if module is not None else None
    if device is not None and device.type == "cuda":
        return dict(bytes=int(torch.cuda.max_memory_allocated(device)), what="CUDA peak allocated")
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dict(bytes=int(peak if sys.platform == "darwin" else peak * 1024), what="peak RSS of the process")


# Dynamo's names for a module's tensors: placeholders (l_self_modules_h_modules_0_modules_attn_parameters_weight_)
# and guard sources (L['self']._modules['h']._modules['0']._parameters['weight']).
_PLACEHOLDER = re.compile(
    r"\b[lL]_self_((?:modules_[A-Za-z0-9_]+?_)*(?:parameters|buffers)_[A-Za-z0-9_]+?)_?"
    r"(?![A-Za-z0-9_])"
)
_SOURCE = re.compile(r"L\['self'\]((?:\._modules\['[^']+'\])*)\._(?:parameters|buffers)\['([^']+)'\]")


def user_name(mangled: str) -> str:
    """transformer.wte.weight for l_self_modules_transformer_modules_wte_parameters_weight_ (a placeholder name of
    the module's tensor); anything else unchanged."""
    m = _PLACEHOLDER.fullmatch(mangled)
    if m is None:
        return mangled
    parts = re.split(r"(?:^|_)(?:modules|parameters|buffers)_", m.group(1))
    return ".".join(p for p in parts if p)


def _rename(text: str, known: set[str]) -> str:
    def placeholder(m: re.Match) -> str:
        name = user_name(m.group(0))
        return name if not known or name in known else m.group(0)

    def source(m: re.Match) -> str:
        return ".".join([*re.findall(r"\['([^']+)'\]", m.group(1)), m.group(2)])

    return _SOURCE.sub(source, _PLACEHOLDER.sub(placeholder, text))


def _with_user_names(rep: Report, module: torch.nn.Module | None) -> Report:
    """`rep` with every Dynamo placeholder name in its text (notes, breaks, fallbacks, pass notes) written as the
    model's own name for that tensor. Names are checked against the module's parameters and buffers (those of a
    block, named from the block, count too); without a module every name that parses is rewritten."""
    known: set[str] = set()

    def names() -> set[str]:  # built once, at the first quoted name
        if not known and module is not None:
            for _, sub in module.named_modules(remove_duplicate=False):
                known.update(n for n, _ in sub.named_parameters(remove_duplicate=False))
                known.update(n for n, _ in sub.named_buffers(remove_duplicate=False))
        return known

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            return _rename(v, names()) if ("_self_" in v or "L['self']" in v) else v
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    return dataclasses.replace(
        rep,
        **{
            f.name: walk(getattr(rep, f.name))
            for f in dataclasses.fields(rep)
            if f.name not in ("config", "machine", "params")
        },
    )


def _allocator_state() -> dict[str, Any] | None:
    if (mode := cpu_allocator_set()) is None:
        return None
    cache, error = None, None
    if allocator.block_cache_on():
        try:
            cache = allocator.block_cache_stats()
        except Exception as e:  # noqa: BLE001 - counters for a report line: the report goes on without them
            error = f"{type(e).__name__}: {e}"
    return dict(mode=mode, huge_pages=bool(allocator.huge_pages_on()), block_cache=cache, block_cache_error=error)


def _cache_stats(state: EngineState) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    return dict(
        folder=str(cache_root(state.config)),
        passes_hit=sum(g.pass_cache == "hit" for g in state.graphs),
        passes_miss=sum(g.pass_cache == "miss" for g in state.graphs),
        fxgraph_hit=counters["inductor"]["fxgraph_cache_hit"],
        fxgraph_miss=counters["inductor"]["fxgraph_cache_miss"],
        aot_hit=counters["aot_autograd"]["autograd_cache_hit"],
        aot_miss=counters["aot_autograd"]["autograd_cache_miss"],
    )


def step_prediction(
    graphs: list[GraphRecord],
    module: torch.nn.Module | None = None,
) -> tuple[dict[str, Any] | None, str]:
    """(the predicted step peak by component, the graph it comes from) over the latest graphs: composed over the
    pieces of a model compiled block by block, else the graph with the largest prediction."""
    predicted = [g for g in _latest(graphs) if g.predicted_memory]
    if not predicted:
        return None, ""
    trained = (
        None if module is None else sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    )
    step = composed_prediction(predicted, trained)
    if step is not None:
        return step, "all pieces"
    top = max(predicted, key=lambda g: g.predicted_memory["peak"])
    return top.predicted_memory, top.name


def composed_prediction(graphs: list[Any], trained_bytes: int | None = None) -> dict[str, Any] | None:
    """One step's predicted peak over a model compiled block by block (pipeline/blocks.py), from each piece's own
    prediction (memory/predict.py), None for a model compiled whole. The pieces run in compile order, a block's
    graph once per layer: the forward holds every earlier piece's saved activations beside the running piece's
    peak; the backward runs the pieces in reverse, holding the saved activations of the pieces not yet reached
    and the gradients already produced. `trained_bytes`: the model's trained parameters (counted once; without it
    a weight two pieces read, such as tied embeddings, counts once per piece)."""
    if not any(g.calls_per_step > 1 for g in graphs):
        return None
    seq = [g.predicted_memory for g in graphs for _ in range(g.calls_per_step)]
    params = sum(m["params"] for m in seq) if trained_bytes is None else trained_bytes
    opt_state = int(params * sum(m["optimizer_state"] for m in seq) / max(sum(m["params"] for m in seq), 1))
    batch = sum(m["batch_inputs"] for m in seq)
    held = fw_peak = 0
    for m in seq:
        fw_peak = max(fw_peak, held + m["forward_graph_peak"])
        held += m["saved_activations"]
    saved_total, grads_done, bw_peak = held, 0, 0
    for m in reversed(seq):
        held -= m["saved_activations"]
        bw_peak = max(bw_peak, held + grads_done + m["backward_graph_peak"])
        grads_done += m["grads"]
    opt_temp = sum(m["optimizer_temp"] for m in seq)
    base = params + opt_state + batch
    totals = {"forward": base + fw_peak, "backward": base + bw_peak, "optimizer": base + params + opt_temp}
    phase = max(totals, key=totals.get)
    return dict(
        peak=totals[phase],
        peak_phase=phase,
        params=params,
        grads=params,
        optimizer_state=opt_state,
        batch_inputs=batch,
        saved_activations=saved_total,
        forward_graph_peak=fw_peak,
        backward_graph_peak=bw_peak,
        optimizer_temp=opt_temp,
        phase_totals=totals,
        peak_node={},
        optimizer=seq[0].get("optimizer", "adamw"),
    )


def _fused_ops(records: list[Any], runs: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """The graphtrain ops the passes added (net over every pass and graph; a block's graph counts once per layer
    it runs for, `runs`), with their descriptors' facts."""
    counts: collections.Counter = collections.Counter()
    for r in records:
        for op, n in r.op_diff.items():
            if op.startswith("graphtrain."):
                counts[op.removeprefix("graphtrain.")] += n * (runs or {}).get(r.graph, 1)
    out = []
    for name, n in sorted(counts.items()):
        d = op_descriptor(name) if n > 0 else None
        if d is not None:
            out.append(
                dict(name=name, count=n, random=d.random, recompute=d.recompute, precision=d.precision, cpp=list(d.cpp))
            )
    return out
