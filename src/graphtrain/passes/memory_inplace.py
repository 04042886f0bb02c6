"""Memory passes on the partitioned forward/backward graphs: elementwise ops written in place.

``inplace_elementwise_pass`` rewrites ``y = op(x, ...)`` to ``y = op_(x, ...)`` (``relu`` ->
``relu_``, ``add.Tensor`` -> ``add_.Tensor`` ...) so ``y`` reuses ``x``'s buffer instead of
allocating a new one. Safe when, and only when:

- ``x`` is produced inside this graph (not a parameter, batch input or saved activation coming
  in: those are owned by the caller or by autograd);
- ``x`` is read by this node only, and no other node holds a view of ``x``'s storage (so nothing
  can observe the overwrite);
- ``x`` is not returned by the graph (a saved activation or user output);
- the result has ``x``'s exact shape, strides and dtype (no broadcasting into ``x``, no type
  promotion).

The in-place kernels compute the same values as the out-of-place ones (bitwise; tests check every
gradient). Runs for the ``aten`` provider only: Inductor plans its own buffers, so the pass does
nothing when ``engine.provider`` is not ``aten``. The rewritten node's ``meta['val']`` becomes
``x``'s fake tensor, so ``graphtrain.memory.predict`` sees the alias.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from graphtrain.passes.manager import PassContext, register_pass

aten = torch.ops.aten

# out-of-place overload -> in-place overload with the same argument list.
_INPLACE_OR_NONE: dict[torch._ops.OpOverload, torch._ops.OpOverload | None] = {
    aten.relu.default: aten.relu_.default,
    aten.gelu.default: aten.gelu_.default,
    aten.silu.default: aten.silu_.default,
    aten.tanh.default: aten.tanh_.default,
    aten.sigmoid.default: aten.sigmoid_.default,
    aten.neg.default: aten.neg_.default,
    aten.exp.default: aten.exp_.default,
    aten.add.Tensor: aten.add_.Tensor,
    aten.sub.Tensor: aten.sub_.Tensor,
    aten.mul.Tensor: aten.mul_.Tensor,
    aten.div.Tensor: aten.div_.Tensor,
    aten.add.Scalar: aten.add_.Scalar,
    aten.mul.Scalar: aten.mul_.Scalar,
    aten.masked_fill.Scalar: aten.masked_fill_.Scalar,
    aten.threshold_backward.default: None,  # no in-place overload: listed so nobody adds a wrong one
}
INPLACE: dict[torch._ops.OpOverload, torch._ops.OpOverload] = {
    k: v for k, v in _INPLACE_OR_NONE.items() if v is not None
}


def _storages(n: fx.Node) -> list[int]:
    return [t.untyped_storage()._cdata for t in pytree.tree_leaves(n.meta.get("val")) if isinstance(t, torch.Tensor)]


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.storage_offset() == b.storage_offset()
        and a.device == b.device
    )


def inplace_candidates(gm: fx.GraphModule) -> list[fx.Node]:
    """Nodes `inplace_elementwise_pass` would rewrite, without changing anything."""
    holders: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        for k in set(_storages(n)):
            holders[k] = holders.get(k, 0) + 1
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = {a for a in pytree.tree_leaves(out.args[0]) if isinstance(a, fx.Node)}
    chosen: list[fx.Node] = []
    claimed: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in INPLACE or not n.args:
            continue
        x = n.args[0]
        if not isinstance(x, fx.Node) or x.op != "call_function" or x in returned or x in claimed:
            continue
        if x.target is operator.getitem and not isinstance(x.meta.get("val"), torch.Tensor):
            continue
        if len(x.users) != 1 or sum(a is x for a in pytree.tree_leaves((n.args, n.kwargs))) != 1:
            continue
        xv, yv = x.meta.get("val"), n.meta.get("val")
        if not isinstance(xv, torch.Tensor) or not isinstance(yv, torch.Tensor) or not _same_layout(xv, yv):
            continue
        keys = _storages(x)
        if len(keys) != 1 or holders.get(keys[0], 0) != 1:  # a view of x (or x a view) exists elsewhere
            continue
        if getattr(x.target, "is_view", False):
            continue
        chosen.append(n)
        claimed.add(x)
    return chosen


@register_pass(("forward", "backward"), phase="memory")
def inplace_elementwise_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Write elementwise ops into their dead input's buffer (aten provider only; see module doc)."""
    if getattr(ctx.config, "provider", "aten") != "aten":
        return gm
    for n in inplace_candidates(gm):
        x, target = n.args[0], n.target
        if not isinstance(x, fx.Node) or not isinstance(target, torch._ops.OpOverload):
            continue  # never: a candidate calls one of INPLACE's overloads on a node
        n.target = INPLACE[target]
        n.meta["val"] = x.meta["val"]  # the result is x's storage now
        ctx.count()
    gm.recompile()
    return gm
