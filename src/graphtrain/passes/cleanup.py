"""Cleanup passes: dead code, common subexpressions, constants, no-op views/casts/clones.

All four keep numerics bitwise: they delete or share work, never reorder arithmetic. Random ops
(``graph_utils.is_random``: any op tagged ``nondeterministic_seeded`` -- bernoulli, rand, dropout, ... -- and
graphtrain's fused ops whose descriptor says random) are never deleted, merged or folded, so the generator
is consumed exactly as in eager mode and dropout masks match eager bitwise.

Constant-folding rule: only values that depend on no graph input at all (iota/arange/full/triu masks,
tensors Dynamo lifted as constants). Frozen parameters and buffers are *not* folded: Dynamo does not guard
on tensor values, so a later ``load_state_dict``, an in-place update or unfreezing would silently leave a
stale constant in the compiled graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from graphtrain.passes.graph_utils import constant_value, is_random
from graphtrain.passes.manager import PassContext, register_pass

aten = torch.ops.aten

# Folded constants larger than this stay computed in the graph (memory held for the model's lifetime).
MAX_FOLD_NUMEL = 1 << 24


def _is_mutating(n: fx.Node) -> bool:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable
    return n.op == "call_function" and n.is_impure()


# Ops whose result is uninitialized memory: folding one would keep garbage alive as a buffer for nothing.
_UNINITIALIZED = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted")


def _is_pure_op(n: fx.Node) -> bool:
    """A call whose result depends only on its arguments and which has no side effect."""
    return n.op == "call_function" and not is_random(n) and not _is_mutating(n) and not n.is_impure()


def _graph_is_functional(gm: fx.GraphModule) -> bool:
    """No mutation other than the trailing copy_ into inputs that functionalization emits."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and _is_mutating(n):
            if not (n.target is aten.copy_.default and n.args[0].op == "placeholder"):
                return False
    return True


@register_pass(("pre_autodiff", "forward", "backward"), phase="cleanup")
def eliminate_dead_code_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Delete calls whose results nobody uses. Keeps impure and random calls (RNG stream as in eager)."""
    removed = 0
    for n in reversed(list(gm.graph.nodes)):
        if n.op == "call_function" and not n.users and _is_pure_op(n):
            gm.graph.erase_node(n)
            removed += 1
    ctx.count(removed)
    return gm


def _key(n: fx.Node, rep: dict[fx.Node, fx.Node]) -> Any:
    def norm(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return ("node", id(rep.get(a, a)))
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple(sorted((k, norm(v)) for k, v in a.items())))
        if isinstance(a, float) and a != a:  # NaN != NaN would stop a legitimate merge; keep it distinct
            return ("nan",)
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return ("sym", str(a))
        if isinstance(
            a, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
        ):
            return (type(a).__name__, a)
        raise TypeError("unhashable")

    return (n.target, norm(n.args), norm(n.kwargs))


@register_pass(("pre_autodiff", "forward", "backward"), phase="dedupe")
def eliminate_common_subexpressions_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Merge identical pure calls on identical arguments. Never merges random ops (two dropouts draw two
    masks) and does nothing on graphs with mutations (a value could change between two reads)."""
    if not _graph_is_functional(gm):
        return gm
    seen: dict[Any, fx.Node] = {}
    rep: dict[fx.Node, fx.Node] = {}
    merged = 0
    for n in list(gm.graph.nodes):
        if not _is_pure_op(n):
            continue
        try:
            k = _key(n, rep)
            hash(k)
        except TypeError:
            continue
        if k in seen:
            n.replace_all_uses_with(seen[k])
            rep[n] = seen[k]
            gm.graph.erase_node(n)
            merged += 1
        else:
            seen[k] = n
    ctx.count(merged)
    return gm


# after the views are simplified (as the numbered pipeline ran them)
@register_pass("pre_autodiff", phase="simplify", after="fold_view_chains")
def fold_constants_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Evaluate subgraphs that depend on no input once, at compile time, and keep the result as a buffer.

    Only the frontier (constants used by non-constant nodes) is materialized, and only when it took
    more than one op to build (a lone ``arange`` is cheaper to recompute than to keep)."""
    const: dict[fx.Node, torch.Tensor | Any] = {}
    size: dict[fx.Node, int] = {}  # ops behind each constant
    with unset_fake_temporarily():
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                v = getattr(gm, n.target, None)
                if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                    const[n], size[n] = v, 0
                continue
            if n.op != "call_function" or not _is_pure_op(n) or not isinstance(n.target, torch._ops.OpOverload):
                continue
            if n.target._opname in _UNINITIALIZED:
                continue
            deps = n.all_input_nodes
            if any(d not in const for d in deps):
                continue
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor) or any(not isinstance(s, int) for s in val.shape):
                continue
            if val.numel() > MAX_FOLD_NUMEL:
                continue
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: const[a])
            const[n] = n.target(*args, **kwargs)
            size[n] = 1 + sum(size[d] for d in deps)
    folded = 0
    for n in list(const):
        if n.op == "get_attr" or size[n] < 2:
            continue
        if all(u in const for u in n.users):
            continue  # an inner node of a bigger constant; the frontier replaces it
        name = f"_graphtrain_const_{len([k for k in dir(gm) if k.startswith('_graphtrain_const_')])}"
        gm.register_buffer(name, const[n].detach().clone())
        with gm.graph.inserting_before(n):
            attr = gm.graph.get_attr(name)
        attr.meta = dict(n.meta)
        n.replace_all_uses_with(attr)
        folded += size[n]
    if folded:
        for n in reversed(list(gm.graph.nodes)):
            if n in const and n.op == "call_function" and not n.users:
                gm.graph.erase_node(n)
    ctx.count(folded)
    return gm


def _same(a: Any, b: Any) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _layout(v: Any) -> tuple | None:
    if not isinstance(v, torch.Tensor):
        return None
    return v.dtype, v.device, tuple(v.shape), tuple(v.stride()), v.storage_offset()


def _same_layout(a: Any, b: Any, offset: bool = True) -> bool:
    """Same dtype, device, shape and strides (and storage offset unless `offset` is False)."""
    la, lb = _layout(a), _layout(b)
    return (
        la is not None
        and lb is not None
        and la[:2] == lb[:2]
        and _same(la[2], lb[2])
        and _same(la[3], lb[3])
        and (not offset or statically_known_true(la[4] == lb[4]))
    )


def _noop_source(n: fx.Node, functional: bool) -> fx.Node | None:
    """The node `n` can be replaced by, or None when `n` really does something."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    src = n.args[0]
    out, inp = n.meta.get("val"), src.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(inp, torch.Tensor):
        return None
    if not _same_layout(out, inp, offset=False):
        return None
    views = (
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.expand.default,
        aten.alias.default,
    )
    copies = (aten.clone.default, aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout)
    feeds_output = any(u.op == "output" for u in n.users)
    if n.target in views:
        # x.view(same shape) aliases x; returning x itself instead would change `out is x` for the caller.
        return None if (feeds_output and src.op == "placeholder") else src
    if n.target in copies:
        # A copy is invisible in a graph without mutation unless it is returned (then the caller may write
        # to it, and it must not alias anything else).
        return src if functional and not feeds_output else None
    return None


@register_pass(("pre_autodiff", "forward", "backward"), phase="simplify")
def remove_noop_ops_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Drop views/reshapes/expands to the same shape, casts to the same dtype and device, and clones whose
    removal cannot change what aliases a graph input or output."""
    functional = _graph_is_functional(gm)
    removed = 0
    for n in list(gm.graph.nodes):
        src = _noop_source(n, functional)
        if src is not None:
            n.replace_all_uses_with(src)
            gm.graph.erase_node(n)
            removed += 1
    ctx.count(removed)
    return gm


def _as_slice(gm: fx.GraphModule, n: fx.Node) -> tuple[int, int, int] | None:
    """(dim, start, end) when `n` is aten.index.Tensor with one index, a constant 1-D run of consecutive integers,
    and None before it (``x[..., [-2], :]``, ``x[:, [3, 4, 5]]``): the same elements as ``x.narrow``."""
    if n.target is not aten.index.Tensor or len(n.args) != 2 or n.kwargs:
        return None
    x, indices = n.args
    if not isinstance(indices, (list, tuple)):
        return None
    given = [i for i, t in enumerate(indices) if t is not None]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if len(given) != 1 or not isinstance(val, torch.Tensor):
        return None
    dim = given[0]
    size = val.shape[dim]
    arg = indices[dim]
    t = constant_value(gm, arg) if isinstance(arg, fx.Node) else None
    if (
        t is None
        or t.dim() != 1
        or t.numel() == 0
        or t.dtype not in (torch.int64, torch.int32)
        or type(size) is not int
    ):
        return None
    with unset_fake_temporarily():
        idx = [int(i) + size if int(i) < 0 else int(i) for i in t.tolist()]
    if not all(0 <= i < size for i in idx) or idx != list(range(idx[0], idx[0] + len(idx))):
        return None
    return dim, idx[0], idx[0] + len(idx)


@register_pass("pre_autodiff", phase="simplify", after="fold_view_chains")
def index_as_slice_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Indexing with a constant list of consecutive integers (``x[..., [-2], :]``, HF Falcon's multi-query key and
    value) becomes a slice: the same elements as a view instead of a gather, and a slice's backward instead of an
    accumulating index_put. Why it is a pass: under Inductor's vectorized CPU code (torch 2.13, AVX-512) that
    index_put, fed by the key's gradient summed over the query heads, gave Falcon's key/value projection a gradient
    1.4% off eager's in fp32 (`graphtrain conformance --rows falcon --cols accelerate/fp32/inductor` failed;
    torch.compile alone gives the same error); as a slice it matches. Only in a graph without mutation (a view
    there can take no write from its base); bitwise the same values."""
    if not _graph_is_functional(gm):
        return gm
    rewritten = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or (found := _as_slice(gm, n)) is None:
            continue
        dim, start, end = found
        with gm.graph.inserting_before(n):
            sl = gm.graph.call_function(aten.slice.Tensor, (n.args[0], dim, start, end))
        sl.meta["val"] = aten.slice.Tensor(n.args[0].meta["val"], dim, start, end)  # the view's own strides
        n.replace_all_uses_with(sl)
        gm.graph.erase_node(n)  # its index constant goes with eliminate_dead_code
        rewritten += 1
    if rewritten:
        gm.recompile()
    ctx.count(rewritten)
    return gm


# Ops that only reinterpret their input's storage (no data movement).
_VIEW_OPS = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.alias.default,
)
_RESHAPES = (aten.view.default, aten._unsafe_view.default)


# on the views remove_noop_ops left (as the numbered pipeline ran them)
@register_pass(("pre_autodiff", "forward", "backward"), phase="simplify", after="remove_noop_ops")
def fold_view_chains_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Collapse chains of views (transpose, permute, view, squeeze, ...): a chain that ends where it started
    (``t(t(x))``, a transpose of a transposed gradient, a view back to the input's shape) is replaced by its
    root; a chain of reshapes (``view(view(x))``) becomes one view of the root. AOTAutograd's backward graphs
    are full of both (the gradient of ``x @ w.t()`` transposes twice). Views move no data, so numerics are
    bitwise unchanged; each node removed is one less dispatch on the aten provider."""
    folded = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _VIEW_OPS or not n.args or not isinstance(n.args[0], fx.Node):
            continue
        src = n.args[0]
        if not (src.op == "call_function" and src.target in _VIEW_OPS and isinstance(src.args[0], fx.Node)):
            continue  # not a chain
        root = src
        while root.op == "call_function" and root.target in _VIEW_OPS and isinstance(root.args[0], fx.Node):
            root = root.args[0]
            if _same_layout(n.meta.get("val"), root.meta.get("val")):
                break
        out = n.meta.get("val")
        if _same_layout(out, root.meta.get("val")):
            if any(u.op == "output" for u in n.users) and root.op == "placeholder":
                continue  # returning the input itself would change what aliases what for the caller
            n.replace_all_uses_with(root)
            gm.graph.erase_node(n)
            folded += 1
        elif n.target in _RESHAPES and src.target in _RESHAPES:
            # view(view(x, a), b) == view(x, b): both views of one contiguous buffer
            n.args = (src.args[0],) + tuple(n.args[1:])
            folded += 1
    if folded:
        gm.graph.eliminate_dead_code()
    ctx.count(folded)
    return gm
