"""Helpers shared by the fuse_* passes: node predicates, dropout matching, view stripping, new-node meta."""

from __future__ import annotations

import operator
from typing import Any, TypeGuard

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.fx.node import Argument

from graphtrain.passes.graph_utils import symints_as_nodes

aten = torch.ops.aten
VIEWS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.clone.default,
    aten.expand.default,
    aten.alias.default,
}


def is_op(n: Any, *targets: Any) -> TypeGuard[fx.Node]:
    """`n` is a call_function node of one of `targets` (an OpOverload, or an OpOverloadPacket for any of its
    overloads); narrows `n` to a node for the type checker."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return False
    t = n.target
    return t in targets or getattr(t, "overloadpacket", None) in targets


def val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def shape(n: Any) -> tuple[int, ...] | None:
    v = val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def known_shape(n: Any) -> tuple[int, ...]:
    """shape(n) of a node known to hold a tensor (one strip_views found, one call() built); raises if it does not."""
    s = shape(n)
    if s is None:
        raise TypeError(f"{n} has no tensor value")
    return s


def number(a: Any) -> float | None:
    return float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else None


def only_user(n: fx.Node) -> fx.Node | None:
    us = list(n.users)
    return us[0] if len(us) == 1 else None


def scalar_operand(n: Argument) -> tuple[fx.Node, float] | None:
    """For mul(x, c) / mul(c, x): (x, c) with c a Python number."""
    if not is_op(n, aten.mul) or len(n.args) != 2:
        return None
    a, b = n.args
    if (c := number(b)) is not None and isinstance(a, fx.Node):
        return a, c
    if (c := number(a)) is not None and isinstance(b, fx.Node):
        return b, c
    return None


def match_dropout(n: fx.Node) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """n = x * (bernoulli(keep) / keep) in any of the spellings the tracer emits -> (x, p, mask nodes)."""
    if is_op(n, operator.getitem) and n.args[1] == 0 and is_op(nd := n.args[0], aten.native_dropout):
        # native_dropout's output (the tracer's spelling under dynamic shapes, where dropout takes its Python
        # decomposition); its mask output must be unused
        x, p = nd.args[0], nd.args[1]
        if (
            isinstance(x, fx.Node)
            and isinstance(p, (int, float, torch.SymFloat))
            and (len(nd.args) < 3 or nd.args[2] is not False)
            and all(u.args[1] == 0 for u in nd.users)
        ):
            return x, float(p), [nd]
        return None
    if not is_op(n, aten.mul) or len(n.args) != 2:
        return None
    for x, m in (n.args, n.args[::-1]):
        if not (isinstance(x, fx.Node) and is_op(m, aten.div, aten.div_) and len(m.users) == 1):
            continue
        bern, keep = m.args[0], number(m.args[1])
        if keep is None or not is_op(bern, aten.bernoulli, aten.bernoulli_) or len(bern.users) != 1:
            continue
        bp = number(bern.args[1]) if len(bern.args) > 1 else None
        if bp is None or abs(bp - keep) > 1e-12 or shape(bern) != shape(n):
            continue
        return x, 1.0 - keep, [m, bern]
    return None


def strip_views(n: Argument, want_last2: tuple[int, ...]) -> tuple[fx.Node, float] | None:
    """Walk up views/expands/clones and scalar multiplies from a bmm operand to the topmost 3-D/4-D tensor
    whose last two dims are `want_last2`; returns (node, product of scalars passed on the way)."""
    scale, best = 1.0, None
    cur = n
    while isinstance(cur, fx.Node):
        s = shape(cur)
        if s is not None and len(s) in (3, 4) and s[-2:] == want_last2:
            best = (cur, scale)
        if is_op(cur, *VIEWS):
            cur = cur.args[0]
            continue
        so = scalar_operand(cur)
        if so is not None:
            scale *= so[1]
            cur = so[0]
            continue
        divisor = number(cur.args[1]) if is_op(cur, aten.div) else None
        if divisor is not None:
            scale /= divisor
            cur = cur.args[0]
            continue
        break
    return best


def set_meta(node: fx.Node) -> None:
    """Fill node.meta['val'] by running its target on the fake values of its inputs."""

    def v(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    args = torch.utils._pytree.tree_map(v, node.args)
    kwargs = torch.utils._pytree.tree_map(v, node.kwargs)
    fake_mode = detect_fake_mode(torch.utils._pytree.tree_leaves((args, kwargs)))
    if fake_mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    target = node.target
    if not callable(target):
        raise TypeError(f"set_meta: {node.format_node()} calls no function")
    with fake_mode, torch.no_grad():
        node.meta["val"] = target(*args, **kwargs)


def call(graph: fx.Graph, target, *args, **kwargs) -> fx.Node:
    args, kwargs = symints_as_nodes(graph, (args, kwargs))  # sizes read from symbolic shapes, as graph nodes
    n = graph.call_function(target, tuple(args), kwargs)
    set_meta(n)
    return n


def getitem(graph: fx.Graph, n: fx.Node, i: int) -> fx.Node:
    g = graph.call_function(operator.getitem, (n, i))
    g.meta["val"] = n.meta["val"][i]
    return g


_SHAPE_ONLY = {torch.ops.aten.zeros_like, torch.ops.aten.ones_like, torch.ops.aten.empty_like, torch.ops.aten.full_like}


def needs_gradient(
    n: fx.Node, gm: fx.GraphModule, input_kinds: list[str] | None, example_inputs: list[Any] | None = None
) -> bool:
    """Whether n is computed from a trainable parameter placeholder, or from an input whose example value requires
    grad (an activation from the graph before: in a block graph, T5's position bias, which the first block
    computes from its learned embedding and hands to every later block). Then n needs a gradient.

    `*_like` factories read only their argument's shape and dtype, so the walk does not pass through them."""
    if input_kinds is None:
        return False
    phs = [p for p in gm.graph.nodes if p.op == "placeholder"]
    examples = list(example_inputs or []) + [None] * len(phs)
    grads = {
        p
        for p, k, x in zip(phs, input_kinds, examples)
        if k == "param" or (k != "buffer" and isinstance(x, torch.Tensor) and x.requires_grad)
    }
    seen, stack = set(), [n]
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        if c in grads:
            return True
        if c.op == "call_function" and getattr(c.target, "overloadpacket", None) in _SHAPE_ONLY:
            continue
        stack.extend(a for a in c.all_input_nodes)
    return False


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm


def split_linear_bias(g: fx.Graph, x: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """x = view(addmm(b, a, W)) or addmm(...) with single users -> (view(mm(a, W)), b); else (x, None)."""
    if is_op(x, aten.add):
        a, b = x.args[0], x.args[1]
        xs, bs = shape(x), shape(b)
        if (
            isinstance(a, fx.Node)
            and isinstance(b, fx.Node)
            and bs is not None
            and len(bs) == 1
            and xs is not None
            and bs[0] == xs[-1]
            and shape(a) == xs
        ):
            return a, b
    v = x if is_op(x, aten.view, aten._unsafe_view) else None
    mm = v.args[0] if v is not None else x
    if not is_op(mm, aten.addmm) or len(mm.users) != 1 or (v is not None and len(v.users) != 1):
        return x, None
    b, a, w = mm.args[:3]
    if (
        mm.kwargs.get("beta", 1) != 1
        or mm.kwargs.get("alpha", 1) != 1
        or not isinstance(b, fx.Node)
        or len(shape(b) or ()) != 1
    ):
        return x, None
    with g.inserting_before(mm):
        new = call(g, aten.mm.default, a, w)
        if v is not None:
            new = call(g, v.target, new, *v.args[1:])
    return new, b


_ERASABLE = VIEWS | {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.bernoulli.p,
    aten.bernoulli_.float,
    aten.div.Scalar,
    aten.div_.Scalar,
    aten.div.Tensor,
    aten.mul.Tensor,
}


def erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase `nodes` and their now-unused producers (views, empties, RNG ops): eliminate_dead_code keeps
    in-place ops such as bernoulli_, which would still draw random numbers."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if getattr(n, "_erased", False) or n.op != "call_function" or n.users:
            continue
        if not (n in nodes or n.target in _ERASABLE or is_op(n, aten.bernoulli, aten.bernoulli_)):
            continue
        ins = list(n.all_input_nodes)
        graph.erase_node(n)
        stack.extend(ins)
