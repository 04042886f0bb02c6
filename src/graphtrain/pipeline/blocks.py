"""Compile each repeated block once: a model's N identical transformer blocks cost one block's compile.

Two halves, one on each side of Dynamo:

- before capture, pipeline/block_regions.py marks each block of a repeated stack as a nested compile region, so
  Dynamo traces the block once and calls one shared body per layer (``invoke_subgraph``);
- ``compile_by_blocks(gm, ...)`` (the backend, runtime/backend.py) splits the Dynamo graph at its
  ``invoke_subgraph`` calls: each distinct block body is compiled once through the whole pipeline (trace,
  passes, autodiff with graphtrain's partitioner, provider) with the block's weights as inputs, and so is each
  stretch of graph between them (the embeddings before the first block; the final norm, head and loss after the
  last), so Inductor generates and compiles one block's kernels instead of N. The pieces run in order from a
  small FX graph; each is an autograd function, so the backward runs through them in reverse as it would
  through one graph. The price: no fusion across a block boundary (the reference models fuse nothing across
  one) and a few microseconds of Python per block per step.

We split here rather than hand ``invoke_subgraph`` to AOTAutograd and Inductor (which support it) because
graphtrain's passes, recompute policy and memory prediction work on one flat graph: each piece is such a graph,
so every stage applies to a block exactly as to a whole model. Dynamic shapes (``engine.dynamic``) split the same
way: Dynamo traces the block with symbolic sizes, and each piece is compiled once for every length.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from graphtrain.pipeline.block_regions import ReuseMisbound


def has_block_calls(gm: fx.GraphModule) -> bool:
    return any(_is_block_call(n) for n in gm.graph.nodes)


def _is_block_call(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is getattr(torch.ops.higher_order, "invoke_subgraph", None)


# ------------------------------------------------------------------------------------ splitting --

CompilePiece = Callable[[fx.GraphModule, list[Any], list[str], str, int], Callable[..., Any]]


def compile_by_blocks(
    gm: fx.GraphModule, example_inputs: Sequence[Any], input_kinds: list[str], compile_piece: CompilePiece
) -> fx.GraphModule:
    """`gm` (a Dynamo graph with invoke_subgraph calls) as a graph of compiled pieces, each compiled once.

    compile_piece(graph, example_inputs, input_kinds, label, calls_per_step) compiles one piece (the backend
    runs the pipeline on it). Returns a GraphModule with `gm`'s signature that calls the pieces in order."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    value: dict[fx.Node, Any] = dict(zip(placeholders, example_inputs))
    # A piece's inputs are the model's (param, buffer, the batch: input, ...) or another piece's outputs
    # ("activation": not the batch, for the memory predictor and the recompute budget).
    kind_of: dict[fx.Node, str] = dict(zip(placeholders, input_kinds))

    def example(n: fx.Node) -> Any:
        return value[n] if n in value else n.meta["example_value"]

    units = _units(gm)
    compiled: dict[Any, Callable[..., Any]] = {}
    uses: dict[Any, int] = {}
    for unit in units:  # one compile per distinct body: calls with the same body and input kinds share it
        if unit.kind == "block":
            unit.key = _body_key(unit, kind_of, example)
            uses[unit.key] = uses.get(unit.key, 0) + 1
    n_glue = 0
    for unit in units:
        assert unit.graph is not None  # glue and block units carry their graph (_units)
        if unit.kind == "glue":
            kinds = [kind_of.get(i, "activation") for i in unit.inputs]
            label = (
                "before the first block"
                if n_glue == 0
                else ("after the last block" if unit is units[-1] else f"between blocks {n_glue}")
            )
            n_glue += 1
            examples = [example(i) for i in unit.inputs]
            unit.fn = _conforming(compile_piece(unit.graph, examples, kinds, label, 1), examples, kinds)
        elif unit.key not in compiled:
            kinds = [kind_of.get(i, "activation") for i in unit.inputs]
            n = uses[unit.key]
            examples = [example(i) for i in unit.inputs]
            compiled[unit.key] = _conforming(
                compile_piece(unit.graph, examples, kinds, f"block {unit.calls[0].args[1]} x{n}", n), examples, kinds
            )
    return _assemble(gm, placeholders, units, compiled)


def _conforming(
    fn: Callable[..., Any], examples: Sequence[Any], kinds: Sequence[str] | None = None
) -> Callable[..., Any]:
    """`fn` called with each tensor laid out as the example it was compiled for. A piece is compiled on Dynamo's
    example values, and Inductor's code asserts their strides, but the piece before it may return a tensor of
    the same values in another layout: ModernBERT's mask, an expand in Dynamo's trace, reached its first
    repeated block dense, and the block raised (the module then ran eagerly). Same layout (every call of the
    models measured but that one): one stride comparison per tensor."""
    # weights and buffers come from the module as they are: only the batch and other pieces' outputs are checked
    likes = [
        (i, x)
        for i, x in enumerate(examples)
        if isinstance(x, torch.Tensor) and (kinds is None or kinds[i] not in ("param", "frozen", "buffer"))
    ]

    def call(*args: Any) -> Any:
        for i, like in likes:
            x = args[i]
            if isinstance(x, torch.Tensor) and x.stride() != like.stride() and x.shape == like.shape:
                args = (*args[:i], laid_out_as(x, like), *args[i + 1 :])
        return fn(*args)

    return call


def laid_out_as(x: torch.Tensor, like: Any) -> torch.Tensor:
    """`x` with `like`'s strides (same shape): a piece's inputs (_conforming) and the copies provider auto times a
    candidate on (runtime/measured.py real_input). A stride-0 dimension of `like` is an expand in the traced program, so every
    slice of `x` along it holds the same values: the first is kept and expanded again. Other dimensions are
    copied into `like`'s layout. `x` itself when that layout cannot be built (the piece then raises as before)."""
    shape, stride = tuple(like.shape), tuple(like.stride())
    base = x
    for d, (n, s) in enumerate(zip(shape, stride)):
        if s == 0 and n > 1:
            base = base.narrow(d, 0, 1)
    try:
        out = torch.empty_strided(
            tuple(base.shape), tuple(s if s else 1 for s in stride), dtype=x.dtype, device=x.device
        )
    except RuntimeError:
        return x
    out = out.copy_(base).expand(shape)
    return out if out.stride() == stride else x


@dataclass
class _Unit:
    kind: str
    graph: fx.GraphModule | None = None
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    calls: list[fx.Node] = field(default_factory=list)
    nodes: list[fx.Node] = field(default_factory=list)
    key: Any = None
    fn: Callable[..., Any] | None = None


def _units(gm: fx.GraphModule) -> list[_Unit]:
    """`gm`'s nodes as an ordered list of glue stretches and block calls (getitems of a call stay with it)."""
    units: list[_Unit] = []
    body_attrs = {n.args[0].target for n in gm.graph.nodes if _is_block_call(n)}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output") or (n.op == "get_attr" and n.target in body_attrs):
            continue
        if _is_block_call(n):
            body = getattr(gm, n.args[0].target)
            units.append(_Unit("block", graph=body, inputs=list(n.args[2:]), calls=[n]))
        elif n.op == "call_function" and n.target is operator.getitem and _is_block_call(n.args[0]):
            next(u for u in reversed(units) if u.kind == "block" and u.calls[0] is n.args[0]).nodes.append(n)
        else:
            if not units or units[-1].kind != "glue":
                units.append(_Unit("glue"))
            units[-1].nodes.append(n)
    for u in units:
        if u.kind == "glue":
            _close_glue(gm, u)
    return units


def check_bindings(gm: fx.GraphModule, input_kinds: list[str]) -> None:
    """Each block call reads its own weights: two calls handed the same parameter or buffer means Dynamo reused a
    traced body with the wrong bindings (raises ReuseMisbound; blocks that really share a weight land here too,
    and are then traced one by one, which is only slower)."""
    kind_of = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], input_kinds))
    seen: set[fx.Node] = set()
    for call in (n for n in gm.graph.nodes if _is_block_call(n)):
        weights = {i for i in call.args[2:] if kind_of.get(i) in ("param", "frozen", "buffer")}
        if weights & seen:
            raise ReuseMisbound(f"block calls share {len(weights & seen)} weight inputs")
        seen |= weights


def _close_glue(gm: fx.GraphModule, unit: _Unit) -> None:
    """The glue stretch's own graph: placeholders for what it reads from outside, outputs for what is read later."""
    inside = set(unit.nodes)
    for n in unit.nodes:
        for i in n.all_input_nodes:
            if i not in inside and i not in unit.inputs:
                unit.inputs.append(i)
        if any(u not in inside for u in n.users):
            unit.outputs.append(n)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i in unit.inputs:
        env[i] = graph.placeholder(i.name)
        env[i].meta = dict(i.meta)
    for n in unit.nodes:
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(tuple(env[o] for o in unit.outputs))
    unit.graph = fx.GraphModule(gm, graph)  # copies the get_attr targets (constants) it uses from gm


def _body_key(unit: _Unit, kind_of: dict[fx.Node, str], example: Callable[[fx.Node], Any]) -> Any:
    """Calls share a compile when they share the body (Dynamo's identifier: the graph attribute holding it may
    differ per call), their inputs' kinds (frozen vs trained weights) and their inputs' layouts: calls Dynamo lets
    share a body may still differ in their inputs' strides, which a compiled graph asserts, so each layout gets a
    compile of its own (_conforming then has nothing to copy)."""
    kinds = tuple(kind_of.get(i, "activation") for i in unit.inputs)
    layouts = tuple(
        (tuple(v.shape), v.stride(), v.dtype) if isinstance(v := example(i), torch.Tensor) else type(v).__name__
        for i in unit.inputs
    )
    return unit.calls[0].args[1], hashlib.sha1(repr((kinds, layouts)).encode()).hexdigest()


class _Compiled(torch.nn.Module):
    """A compiled piece as a submodule of the assembled graph (FX code calls submodules by name)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)  # as Dynamo calls what a backend returns


def inline_blocks(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with each invoke_subgraph call replaced by a plain call of its body: the Dynamo graph run eagerly
    (the eager fallback; invoke_subgraph's own backward only runs under a compiler's fake mode)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if _is_block_call(n):
            env[n] = graph.call_module(n.args[0].target, tuple(env[a] for a in n.args[2:]))
        else:
            env[n] = graph.node_copy(n, lambda x: env[x])
    return fx.GraphModule(gm, graph)


def _assemble(
    gm: fx.GraphModule, placeholders: list[fx.Node], units: list[_Unit], compiled: dict[Any, Callable[..., Any]]
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    pieces: dict[str, torch.nn.Module] = {}
    for p in placeholders:
        env[p] = graph.placeholder(p.name)
        env[p].meta = dict(p.meta)
    for unit in units:
        fn = unit.fn if unit.kind == "glue" else compiled[unit.key]
        assert fn is not None  # every glue unit was compiled above
        name = next((k for k, m in pieces.items() if m.fn is fn), f"piece{len(pieces)}")
        pieces.setdefault(name, _Compiled(fn))
        call = graph.call_module(name, tuple(env[i] for i in unit.inputs))
        if unit.kind == "glue":
            for k, out in enumerate(unit.outputs):
                env[out] = graph.call_function(operator.getitem, (call, k))
        else:
            env[unit.calls[0]] = call
            for n in unit.nodes:
                env[n] = graph.node_copy(n, lambda x: env[x])
    out = next(n for n in gm.graph.nodes if n.op == "output")
    graph.output(fx.map_arg(out.args[0], lambda x: env[x]))
    return fx.GraphModule(pieces, graph)
