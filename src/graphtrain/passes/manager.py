"""The pass manager: named graph passes with one signature, run as ordered pipelines per stage.

A pass is ``<verb>_<object>_pass(gm, ctx) -> gm``. It rewrites an FX ``GraphModule`` (in place
or by returning a new one), adds the number of rewrites it made with ``ctx.count(n)``, and must
keep the graph's inputs and outputs (count, order, shapes, dtypes) unchanged (a pass registered with
``adds_outputs=True`` may append outputs after the graph's own; it hands its caller what they are in
``ctx.results``). Passes are
registered by name with the stages they run in and their phase (``PHASES``):

- ``dynamo``: the Dynamo FX graph before the trace to aten (``torch`` calls, ``example_value`` metas): attention
  masks, grad-mode regions, returned heads, ``autograd.Function`` calls. The backend runs its ``masks`` and
  ``grad`` phases once on the whole Dynamo graph and its ``opaque`` phase on each graph it traces
  (``run_pipeline(..., phases=)``).
- ``pre_autodiff``: the captured forward graph (aten ops, parameters as inputs) before AOTAutograd
  builds the gradient graph; fusions here give the backward graph the fused ops' own gradients.
- ``forward`` / ``backward``: the partitioned graphs after autodiff, before the provider lowers them.

Within a stage passes run phase by phase; inside a phase, in an order that keeps every ``after=`` /
``before=`` constraint, other ties by name (`pass_order`). The driver times each pass, counts ops before and
after, lints the graph and checks the output signature. A pass that raises is skipped under
``fallback: warn|silent`` (the graph from before it is kept) and re-raised under ``fallback: error``.
"""

from __future__ import annotations

import collections
import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from graphtrain.config.fallback import report_fallback
from graphtrain.config.sections import EngineConfig

STAGES = ("dynamo", "pre_autodiff", "forward", "backward")

PHASES: dict[str, str] = {  # in the order they run; a pass names one, and orders itself inside it with after/before
    "masks": "attention masks as SDPA should take them: constants as is_causal or none, learned ones on aten's math",
    "grad": "no_grad regions lifted, returned LM-head logits detached (their gradient given outside the graph)",
    "opaque": "autograd.Function calls held opaque through the trace (restored after the pre-autodiff passes)",
    "fuse": "fusions matched on the graph as traced: normalizations, attention, GELU",
    "simplify": "no-op views, casts and clones removed, view chains collapsed, constant subgraphs folded",
    "fuse_epilogue": "fusions matched on the simplified graph: bias + dropout + residual, the LM head and its loss",
    "dedupe": "identical pure calls merged (common subexpressions)",
    "fuse_loss": "the softmax cross-entropy left unfused; fused LM heads told to skip unlabelled rows",
    "cleanup": "dead code removed",
    "precision": "mixed precision",
    "lower": "ops moved to a faster implementation of the same math (GELU's tanh form in C++ on CPU, oneDNN GEMMs)",
    "memory": "buffers reused in place",
}

PassFn = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]


@dataclass
class PassSpec:
    name: str
    fn: PassFn
    stages: tuple[str, ...]
    default: bool
    changes_numerics: bool
    phase: str
    after: tuple[str, ...] = ()  # passes of the same phase (in a stage where both run) this one runs after
    before: tuple[str, ...] = ()
    providers: tuple[str, ...] | None = None  # on by default only under these providers (None: all)
    adds_outputs: bool = False  # may append outputs after the graph's own (the driver checks those are kept)

    def on_by_default(self, provider: str) -> bool:
        return self.default and (self.providers is None or provider in self.providers)


@dataclass
class PassRecord:
    """What one pass did to one graph: shown by ``graphtrain.report``."""

    name: str
    stage: str
    graph: str
    rewrites: int
    seconds: float
    ops_before: int
    ops_after: int
    op_diff: dict[str, int]
    error: str | None = None
    left_to: str | None = None
    """Set when the pass only looked: its patterns were found (``rewrites``) and left to this provider,
    whose own code generation fuses them (the graph was not changed)."""
    phase: str = ""
    """The pass's phase (``PHASES``)."""
    note: str | None = None
    """What the pass measured or decided on this graph, in words (the report prints it under the graph)."""


@dataclass
class PassContext:
    """What a pass may read (config, stage, example inputs) and where it reports its rewrites."""

    config: EngineConfig
    stage: str
    graph_name: str = "graph"
    example_inputs: list[Any] = field(default_factory=list)
    records: list[PassRecord] = field(default_factory=list)
    # Set by the engine for pre_autodiff graphs: which placeholder indices are trainable parameters,
    # frozen parameters or buffers, and user inputs. Constant folding reads this.
    input_kinds: list[str] | None = None
    inference: bool = False
    """Whether the graph is compiled under no_grad (an evaluation graph: it has no backward)."""
    fallbacks: list[tuple[str, str]] | None = None
    """Where a failed pass's fallback is recorded (the module's EngineState.fallbacks: the report reads it)."""
    rewrites: int = 0
    notes: list[str] = field(default_factory=list)
    caller_notes: list[str] | None = None
    """Where the caller keeps the notes the report prints for the module or the graph (the backend: EngineState.notes
    for the Dynamo graph's passes, the GraphRecord's notes for a graph it traces); ``tell`` adds to it."""
    results: dict[str, Any] = field(default_factory=dict)
    """What a pass hands its caller besides the graph, under the pass's name (detach_returned_heads: the heads the
    caller reattaches); dropped when the pass fails."""
    told: list[str] = field(default_factory=list)
    """The running pass's ``tell`` lines: added to ``caller_notes`` once it succeeded."""

    def count(self, n: int = 1) -> None:
        self.rewrites += n

    def note(self, text: str) -> None:
        """Say what the pass measured or decided (kept in its PassRecord, shown by the report)."""
        self.notes.append(text)

    def tell(self, text: str) -> None:
        """A line for the caller's notes (``caller_notes``), once, if the pass succeeds: what the user should read
        about the rewrite."""
        self.told.append(text)


_REGISTRY: dict[str, PassSpec] = {}


def register_pass(
    stages: str | tuple[str, ...],
    *,
    phase: str,
    after: str | tuple[str, ...] = (),
    before: str | tuple[str, ...] = (),
    default: bool = True,
    changes_numerics: bool = False,
    providers: tuple[str, ...] | None = None,
    adds_outputs: bool = False,
) -> Callable[[PassFn], PassFn]:
    """Register a pass; its name is the function's name without the trailing ``_pass``.
    It runs in `phase` (one of ``PHASES``); ``after`` / ``before`` name passes it must follow or precede where
    the order inside the phase matters. ``providers`` limits where the pass is on by default (e.g. a fusion
    Inductor already does better itself); ``engine.passes`` overrides it either way. ``adds_outputs``: the pass
    may append outputs after the graph's own (which stay as they were)."""
    stages = (stages,) if isinstance(stages, str) else tuple(stages)
    for s in stages:
        assert s in STAGES, s
    if phase not in PHASES:
        raise ValueError(f"unknown pass phase {phase!r}; phases, in order: {', '.join(PHASES)}")
    after = (after,) if isinstance(after, str) else tuple(after)
    before = (before,) if isinstance(before, str) else tuple(before)

    def deco(fn: PassFn) -> PassFn:
        assert fn.__name__.endswith("_pass"), f"pass functions end in _pass: {fn.__name__}"
        name = fn.__name__[: -len("_pass")]
        assert name not in _REGISTRY or _REGISTRY[name].fn.__qualname__ == fn.__qualname__, f"duplicate pass {name}"
        _REGISTRY[name] = PassSpec(
            name, fn, stages, default, changes_numerics, phase, after, before, providers, adds_outputs
        )
        return fn

    return deco


def registered_passes() -> dict[str, PassSpec]:
    _load_builtin_passes()
    return dict(_REGISTRY)


def pipeline(stage: str, config: EngineConfig) -> list[PassSpec]:
    """The ordered passes that run at `stage` under `config` (defaults, switched by config.passes).

    Provider-limited defaults apply once the provider is resolved; under `auto` they count as on."""
    specs = registered_passes()
    unknown = [n for n in config.passes if n not in specs]
    if unknown:
        import difflib

        hints = [difflib.get_close_matches(n, specs, n=1) for n in unknown]
        msg = ", ".join(f"{n!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for n, h in zip(unknown, hints))
        raise ValueError(f"engine.passes names unknown passes: {msg}; known passes: {', '.join(sorted(specs))}")
    provider = config.provider

    def on(s: PassSpec) -> bool:
        return config.passes.get(s.name, s.default if provider == "auto" else s.on_by_default(provider))

    return [s for s in pass_order(stage) if on(s)]


def pass_order(stage: str) -> list[PassSpec]:
    """Every registered pass of `stage` in the order they run (switched on or not): phase by phase (``PHASES``),
    and inside a phase in an order that keeps each ``after``/``before`` constraint between two passes of the
    stage, other ties broken by name. Raises ValueError for a constraint naming an unknown pass, one that
    contradicts the phase order, or constraints that form a cycle."""
    everything = registered_passes()
    specs = {n: s for n, s in everything.items() if stage in s.stages}
    rank = {p: i for i, p in enumerate(PHASES)}
    preds: dict[str, set[str]] = {n: set() for n in specs}  # pass -> passes that must run before it
    for s in everything.values():
        for other in (*s.after, *s.before):
            if other not in everything:
                raise ValueError(
                    f"pass {s.name!r} is ordered against {other!r}, which is not a registered pass; "
                    f"known passes: {', '.join(sorted(everything))}"
                )
        if s.name not in specs:
            continue
        preds[s.name].update(a for a in s.after if a in specs)
        for b in s.before:
            if b in specs:
                preds[b].add(s.name)
    for n, ps in preds.items():
        for p in ps:
            if rank[specs[p].phase] > rank[specs[n].phase]:
                raise ValueError(
                    f"pass {n!r} (phase {specs[n].phase!r}) is constrained to run after {p!r} (phase "
                    f"{specs[p].phase!r}), but phases run in the order {', '.join(PHASES)}"
                )
    order: list[PassSpec] = []
    for phase in PHASES:
        todo = {n: {p for p in preds[n] if specs[p].phase == phase} for n, s in specs.items() if s.phase == phase}
        while todo:
            ready = sorted(n for n, ps in todo.items() if not ps)
            if not ready:
                raise ValueError(
                    f"the after/before constraints of passes {', '.join(sorted(todo))} (phase "
                    f"{phase!r}, stage {stage!r}) form a cycle"
                )
            order.append(specs[ready[0]])
            del todo[ready[0]]
            for ps in todo.values():
                ps.discard(ready[0])
    return order


def op_counts(gm: fx.GraphModule) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            c[_target_name(n)] += 1
    return c


def _target_name(n: fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t
    return str(getattr(t, "__name__", t)) if not isinstance(t, torch._ops.OpOverload) else str(t.overloadpacket)


def _output_signature(gm: fx.GraphModule) -> list[Any]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    sig: list[tuple[tuple[int, ...], torch.dtype] | str] = []
    for a in torch.utils._pytree.tree_leaves(out.args[0]):
        # the aten IR's fake values, or the Dynamo graph's (dynamo stage)
        v = a.meta.get("val", a.meta.get("example_value")) if isinstance(a, fx.Node) else a
        if isinstance(v, torch.Tensor):
            sig.append((tuple(v.shape), v.dtype))
        else:
            sig.append(type(v).__name__)
    return sig


def _backup(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of gm's graph to restore if a pass fails. The nodes are copied (meta dicts shallowly: fake
    tensors and SymInts cannot be deep-copied) and module attributes are shared."""
    graph = fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    val_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, val_map, return_output_node=True)
    graph.output(out[0] if isinstance(out, tuple) else out)
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    # gm's own class: Dynamo and AOTAutograd hand over lazy graph modules, which generate their Python code at the
    # first call. A plain fx.GraphModule generates it here, for a backup that is almost never used: that was 0.4 of
    # the 1.1 s the passes took on a cold first step of Llama mini (85 backups, cProfile).
    # (an instance's class is fx's per-instance GraphModuleImpl: called, it would skip __init__; its base is called)
    cls = next(c for c in type(gm).__mro__ if c.__qualname__.rsplit(".", 1)[-1] != "GraphModuleImpl")
    new = cls(gm, graph, class_name=type(gm).__name__)
    new.meta = dict(gm.meta)
    for k, v in vars(gm).items():  # what the graph's maker set on it (Dynamo: compile_subgraph_reason)
        new.__dict__.setdefault(k, v)
    return new


def run_pipeline(gm: fx.GraphModule, ctx: PassContext, phases: tuple[str, ...] | None = None) -> fx.GraphModule:
    """Run every enabled pass of ctx.stage on gm (only those of `phases` if given), checking and recording each."""
    unknown = [p for p in phases or () if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown pass phases {unknown}; phases, in order: {', '.join(PHASES)}")
    for spec in pipeline(ctx.stage, ctx.config):
        if phases is not None and spec.phase not in phases:
            continue
        before_counts = op_counts(gm)
        before_sig = _output_signature(gm)
        backup = _backup(gm) if ctx.config.fallback != "error" else None
        ctx.rewrites, ctx.notes, ctx.told = 0, [], []
        t0 = time.perf_counter()
        error = None
        try:
            gm = spec.fn(gm, ctx)
            gm.graph.lint()
            gm.recompile()
            after_sig = _output_signature(gm)
            if (after_sig[: len(before_sig)] if spec.adds_outputs else after_sig) != before_sig:
                raise AssertionError(f"pass {spec.name} changed the graph outputs: {before_sig} -> {after_sig}")
            if ctx.caller_notes is not None:
                ctx.caller_notes.extend(line for line in dict.fromkeys(ctx.told) if line not in ctx.caller_notes)
        except Exception as e:  # a broken pass must never give a silently wrong graph
            if ctx.config.fallback == "error":
                raise RuntimeError(
                    f"graphtrain pass {spec.name!r} failed on {ctx.graph_name} ({ctx.stage}): {e}. "
                    f"Switch it off with engine.passes.{spec.name}=false"
                ) from e
            error = f"{type(e).__name__}: {e}"
            gm = backup  # type: ignore[assignment]
            ctx.rewrites = 0
            ctx.results.pop(spec.name, None)
            report_fallback(
                f"pass {spec.name}",
                error,
                ctx.config,
                what=f"{ctx.graph_name} keeps the graph from before the pass",
                sink=ctx.fallbacks,
            )
        dt = time.perf_counter() - t0
        after_counts = op_counts(gm)
        diff = {
            k: after_counts[k] - before_counts[k]
            for k in set(before_counts) | set(after_counts)
            if after_counts[k] != before_counts[k]
        }
        rec = PassRecord(
            spec.name,
            ctx.stage,
            ctx.graph_name,
            ctx.rewrites,
            dt,
            sum(before_counts.values()),
            sum(after_counts.values()),
            diff,
            error,
            phase=spec.phase,
            note="; ".join(ctx.notes) or None,
        )
        ctx.records.append(rec)
        if ctx.config.debug:
            warnings.warn(
                f"[graphtrain] {ctx.stage}/{spec.name} on {ctx.graph_name}: {rec.rewrites} rewrites, "
                f"{dt * 1e3:.1f} ms, ops {rec.ops_before} -> {rec.ops_after} {diff}",
                stacklevel=2,
            )
    _detect_provider_fusions(gm, ctx)
    return gm


def _detect_provider_fusions(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Fusion passes that are off because the provider fuses those patterns itself (e.g. LayerNorm and
    GELU under Inductor, whose generated kernels beat an opaque fused op there) still run, on a copy
    that is then discarded, so the report shows how many patterns the provider was left to fuse."""
    provider = ctx.config.provider
    if provider == "auto":
        return
    for spec in registered_passes().values():
        if (
            ctx.stage not in spec.stages
            or not spec.default
            or spec.on_by_default(provider)
            or spec.name in ctx.config.passes
            or not spec.name.startswith("fuse_")
        ):
            continue
        ctx.rewrites = 0
        t0 = time.perf_counter()
        try:
            spec.fn(_backup(gm), ctx)
        except Exception:  # detection only: never affects the graph
            continue
        n = sum(op_counts(gm).values())
        ctx.records.append(
            PassRecord(
                spec.name,
                ctx.stage,
                ctx.graph_name,
                ctx.rewrites,
                time.perf_counter() - t0,
                n,
                n,
                {},
                None,
                left_to=provider,
                phase=spec.phase,
            )
        )
    ctx.rewrites = 0


_LOADED = False


def _load_builtin_passes() -> None:
    """Import the modules that register graphtrain's passes (once)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib
    import os
    import pkgutil

    package = __name__.rpartition(".")[0]  # this folder's modules (not `import graphtrain.passes`: its parent)
    for m in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if m.name != "manager" and not m.name.startswith("_"):
            importlib.import_module(f"{package}.{m.name}")
