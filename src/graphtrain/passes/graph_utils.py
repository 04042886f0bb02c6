"""Node predicates every pass (and the recompute partitioner) shares. Pass modules import helpers from here or
from fuse_utils.py, never from each other."""

from __future__ import annotations

import hashlib
import operator
from typing import Any, TypeGuard

import torch
import torch.fx as fx
from torch.fx.node import Argument

from graphtrain.kernels.registry import is_random_op


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` with a graph of its own (new nodes, meta copied; attributes shared), to rewrite while `gm`
    stays as it is."""
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, g)


def is_random(n: fx.Node) -> bool:
    """`n` draws random numbers: an ATen op tagged nondeterministic_seeded (dropout, bernoulli, rand, ...) or a
    graphtrain op whose descriptor says random (fused dropout and attention draw their seed inside). Such a call
    is never merged, duplicated, recomputed or deleted: the RNG stream must advance as in eager. A call with a
    `dropout_p` argument of 0 (aten's SDPA kernels, tagged for their dropout) draws nothing."""
    return n.op == "call_function" and is_random_op(n.target) and not zero_dropout(n)


def has_random_tag(n: fx.Node) -> bool:
    """`n`'s schema is tagged nondeterministic_seeded (and it is not a call with dropout_p 0): ATen's random ops
    (which Inductor lowers itself) and graphtrain::dropout_seed, but not graphtrain's fused ops that draw their
    seed inside (see `is_random`)."""
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags and not zero_dropout(n)


def zero_dropout(n: fx.Node) -> bool:
    """`n` calls an op with a `dropout_p` argument (aten's SDPA kernels) with the value 0: it samples nothing."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    for i, a in enumerate(t._schema.arguments):
        if a.name == "dropout_p":
            p = n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", a.default_value)
            return isinstance(p, (int, float)) and p == 0
    return False


# ----------------------------------------------------------- constants of a graph, attention masks --

# Evaluating a mask materializes it once at compile time; bigger ones (2**26 bools = 64 MiB) are left as they are.
MAX_CONSTANT_ELEMENTS = 1 << 26
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial", "poisson", "exponential")


def example_value(n: Any) -> Any:
    """A node's example tensor: Dynamo's ``example_value`` or the aten IR's ``val`` (None for a non-node)."""
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None


# F.scaled_dot_product_attention as Dynamo records it (before the trace to aten)
_SDPA = tuple(
    f
    for f in (
        getattr(torch._C._nn, "scaled_dot_product_attention", None),
        torch.nn.functional.scaled_dot_product_attention,
    )
    if f is not None
)


def is_cast(node: Argument) -> TypeGuard[fx.Node]:
    """A node that only changes dtype: ``_to_copy(x, dtype=...)`` or ``prims.convert_element_type``."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is torch.ops.prims.convert_element_type.default:
        return True
    return (
        node.target is torch.ops.aten._to_copy.default
        and "dtype" in node.kwargs
        and set(node.kwargs) <= {"dtype", "layout", "memory_format"}
        and node.kwargs.get("memory_format") in (None, torch.preserve_format)
    )


def is_sdpa_call(n: fx.Node) -> bool:
    """`n` is a Dynamo graph's call of F.scaled_dot_product_attention."""
    return n.op == "call_function" and n.target in _SDPA


def arg_node(n: fx.Node, i: int) -> fx.Node | None:
    """`n`'s i-th positional argument when it is a node; None when it is a constant or `n` has fewer arguments."""
    a = n.args[i] if -len(n.args) <= i < len(n.args) else None
    return a if isinstance(a, fx.Node) else None


def call_arg(n: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """A call's argument given positionally at `index` or by keyword `name`."""
    return n.args[index] if len(n.args) > index else n.kwargs.get(name, default)


def static_shape(t: Any) -> tuple[int, ...] | None:
    """`t`'s shape when it is a tensor whose sizes are all plain ints (not symbolic), else None."""
    if not isinstance(t, torch.Tensor) or not all(type(d) is int for d in t.shape):
        return None
    return tuple(t.shape)


def _name(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else str(getattr(n.target, "__name__", n.target))


def _mutates(n: fx.Node) -> bool:
    """An in-place op: ``operator.setitem`` or ``+=`` and kin, a torch function or tensor method named ``*_``
    (``operator.and_`` is ``&``, not in-place)."""
    if getattr(n.target, "__module__", None) in ("_operator", "operator"):
        return n.target is operator.setitem or n.target in _INPLACE_OPERATORS
    name = _name(n)
    return name.endswith("_") and not name.endswith("__")


_INPLACE_OPERATORS = {
    getattr(operator, f)
    for f in (
        "iadd",
        "iand",
        "iconcat",
        "ifloordiv",
        "ilshift",
        "imatmul",
        "imod",
        "imul",
        "ior",
        "ipow",
        "irshift",
        "isub",
        "itruediv",
        "ixor",
    )
}


def constant_ancestors(node: fx.Node) -> set[fx.Node] | None:
    """`node` and everything it reads, or None when any of it is a graph input, a module call or a random op, or
    when anything mutates one of them (a value computed before an in-place op is not the value read after)."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op in ("placeholder", "call_module", "output"):
            return None
        if n.op != "get_attr" and (any(r in _name(n).lower() for r in _RANDOM) or _mutates(n)):
            return None
        if any(_mutates(u) for u in n.users):
            return None
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def constant_value(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The value of `node` when it is a constant of `gm` (reads no input), else None."""
    shape = static_shape(example_value(node))
    if shape is None or torch.Size(shape).numel() > MAX_CONSTANT_ELEMENTS:
        return None
    nodes = constant_ancestors(node)
    if nodes is None:
        return None
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:  # in graph (topological) order
        if n in nodes:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(env[node])
    try:
        with torch.no_grad():
            value = fx.GraphModule(gm, g)()
    except Exception:  # noqa: BLE001 - not evaluable here (e.g. another device): the mask stays a tensor
        return None
    return value if isinstance(value, torch.Tensor) else None


def mask_kind(mask: torch.Tensor, q_len: int | None, k_len: int | None) -> str | None:
    """ "causal" when `mask` (as SDPA's attn_mask: bool, True attends; or additive float, 0 attends) is exactly
    ``is_causal``'s pattern for q_len queries and k_len keys in every batch and head; "full" when it attends
    everywhere; None otherwise (an additive mask must hold only 0 and -inf or the dtype's lowest value)."""
    if mask.dim() < 2:
        return None
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        lowest = torch.finfo(mask.dtype).min
        if not bool(((mask == 0) | (mask <= lowest)).all()):
            return None
        keep = mask == 0
    else:
        return None
    if bool(keep.all()):
        return "full"
    if q_len is None or k_len is None or tuple(keep.shape[-2:]) != (q_len, k_len):
        return None
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=keep.device).tril()
    return "causal" if bool((keep == causal).all()) else None


def constant_mask_kind(gm: fx.GraphModule, mask: fx.Node, q_len: int, k_len: int) -> str | None:
    """mask_kind of `mask` when it is a constant of `gm` (fuse_attention: the mask SDPA's decomposition builds for
    ``is_causal``, ``where(tril(ones), 0, -inf)``, becomes the fused op's is_causal again)."""
    value = constant_value(gm, mask)
    return None if value is None else mask_kind(value, q_len, k_len)


def is_symbolic(v: Any) -> bool:
    """Whether `v` is a SymInt or a tensor with a symbolic size (Dynamo's dynamic shapes)."""
    return isinstance(v, torch.SymInt) or (
        isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)
    )


def symints_as_nodes(graph: fx.Graph, args: Any) -> Any:
    """`args` with every SymInt (a symbolic size a pass read from a fake value under dynamic shapes) replaced by
    nodes that compute it from the graph's inputs (torch.fx.Graph.materialize_symints), inserted at the graph's
    insertion point. A raw SymInt in a node's arguments stands for one trace's symbol, not graph data: FX warns
    about it, and the graph would not survive pickling into the pass cache or another trace."""
    from torch.utils import _pytree as pytree

    raw = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.SymInt)]
    if not raw:
        return args
    nodes = graph.materialize_symints(raw) if hasattr(graph, "materialize_symints") else _materialize(graph, raw)
    made = dict(zip(map(id, raw), nodes))
    return pytree.tree_map(lambda a: made.get(id(a), a) if isinstance(a, torch.SymInt) else a, args)


def _materialize(graph: fx.Graph, raw: list[torch.SymInt]) -> list[Any]:
    """``fx.Graph.materialize_symints`` for torch 2.11, which lacks it (2.13 has it): each size's sympy expression
    computed from the graph's inputs, its symbols read off a SymInt placeholder or a tensor placeholder's size
    (``aten.sym_size.int``), its operations interpreted by torch's own Python reference analysis. Only what a
    dynamic-shape graph of graphtrain's passes holds (sizes of its inputs and arithmetic on them); anything else
    raises, and the pass that asked falls back as any failing pass does."""
    import sympy
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    tracer = fx.proxy.GraphAppendingTracer(graph)
    env: dict[Any, Any] = {}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        val = example_value(node)
        if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
            env.setdefault(val.node.expr, fx.Proxy(node, tracer))
        elif isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    if size.node.expr not in env:
                        read = graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
                        read.meta["val"] = size
                        env[size.node.expr] = fx.Proxy(read, tracer)
    out: list[Any] = []
    for s in raw:
        expr = s.node.expr
        missing = expr.free_symbols - set(env)
        if missing:
            raise ValueError(f"size {expr} names symbols no graph input carries: {sorted(map(str, missing))}")
        before = set(graph.nodes)
        value = sympy_interp(PythonReferenceAnalysis, env, expr)
        for new in [n for n in graph.nodes if n not in before]:  # the arithmetic's nodes, in order: their values
            new.meta["val"] = new.target(*(example_value(a) if isinstance(a, fx.Node) else a for a in new.args))
        out.append(value.node if isinstance(value, fx.Proxy) else int(value))
    return out


def materialize_symints(gm: fx.GraphModule) -> int:
    """symints_as_nodes for every node of `gm` (the backstop after the passes, for nodes they did not build
    through fuse_utils.call); returns how many nodes changed."""
    from torch.utils import _pytree as pytree

    g, changed = gm.graph, 0
    if not any(is_symbolic(example_value(n)) for n in g.nodes if n.op == "placeholder"):
        return 0  # static shapes: nothing symbolic to find
    for node in list(g.nodes):
        if any(isinstance(a, torch.SymInt) for a in pytree.tree_leaves((node.args, node.kwargs))):
            with g.inserting_before(node):
                node.args, node.kwargs = symints_as_nodes(g, (node.args, node.kwargs))
            changed += 1
    if changed:
        gm.recompile()
    return changed


def digest_graph_into(h: Any, gm: fx.GraphModule) -> None:
    """Feed `gm`'s code and the constants it only names into `h`: tensors by value, graphs a node calls (an
    autograd.Function's forward and backward bodies) by their own code and constants."""
    h.update(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor):
                h.update(f"{node.target} {tuple(value.shape)} {value.dtype}".encode())
                h.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            elif isinstance(value, fx.GraphModule):
                h.update(f"{node.target} graph\n".encode())
                digest_graph_into(h, value)


def graph_digest(gm: fx.GraphModule) -> str:
    """A hex digest of `gm`'s code and constants (nested graphs included)."""
    h = hashlib.sha256()
    digest_graph_into(h, gm)
    return h.hexdigest()


def views_as_reshapes(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with every ``aten.view`` / ``aten._unsafe_view`` given as ``aten.reshape``, on a copy of its graph (the
    module's attributes are shared; `gm` itself is left as the other providers and passes see it).

    A graph traced to aten before Inductor holds views that were valid for the strides eager produced when it was
    traced. compile_fx traces it again through Inductor's decompositions, which may give an intermediate other
    strides: ``cat`` with an empty input becomes a clone of the other input, which keeps that input's strides
    where eager's cat returned a contiguous tensor. A view recorded against the contiguous layout then fails
    ("Cannot view a tensor with shape ... and strides ...") and the graph fell back to aten: HF T5 under
    compile_step, whose decoder concatenates its keys to an empty cache. ``reshape`` is the same view wherever the
    strides allow one and copies where they do not. A view written through (an in-place op on it or on a view of
    it: compile_step's graph is not functionalized) stays a view: a copy would take the write away from its base,
    where a failed view falls back, named.

    The aten provider runs its forward and backward graphs through it as well (pipeline/stages.py autodiff): a view
    AOTAutograd recorded against a fake tensor's strides failed on the real tensor when a kernel laid its output out
    otherwise than its fake did. HF Qwen3-Next's backward (a cat of gate gradients viewed as rows) raised "view size
    is not compatible" in ``loss.backward()``, where no fallback can run."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen  # the calling convention (pytree in/out specs) stays the module's
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    aten = torch.ops.aten
    for node in graph.nodes:
        if node.op == "call_function" and node.target in (aten.view.default, aten._unsafe_view.default):
            if not _written_through(node):
                node.target = aten.reshape.default
    return fx.GraphModule(gm, graph)


def _written_through(node: fx.Node) -> bool:
    """Whether an op writes `node`'s value in place, directly or through a view of it (schema alias annotations)."""
    for user in node.users:
        schema = getattr(user.target, "_schema", None) if user.op == "call_function" else None
        if schema is None:
            continue
        named = dict(zip((a.name for a in schema.arguments), user.args)) | dict(user.kwargs)
        for arg in schema.arguments:
            if named.get(arg.name) is node and arg.alias_info is not None and arg.alias_info.is_write:
                return True
        if any(r.alias_info is not None for r in schema.returns) and _written_through(user):
            return True
    return False
