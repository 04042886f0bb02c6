"""fuse_bias_dropout_add: [bias +] dropout [+ residual] -> graphtrain::bias_dropout_add.

Matches every dropout the tracer emits (x * bernoulli(keep) / keep, SDPA's in-place bernoulli_,
native_dropout) that fuse_attention left, absorbing a bias from the producing linear
(view(addmm(b, x, W)) -> view(mm(x, W)) + b, or an explicit add of a 1-D bias) and a following
residual add of the same shape. Examples: GPT-2/BERT embedding dropout, attention-output and MLP
dropouts with their residual adds. The fused op draws its mask from a hash RNG (same keep
probability and 1/(1-p) scaling; different random stream than aten's Bernoulli) and saves no mask.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from graphtrain.passes.fuse_utils import aten, call, erase_dead, finish, getitem, is_op, match_dropout, only_user, shape
from graphtrain.passes.manager import PassContext, register_pass

import graphtrain.kernels  # noqa: F401


def split_linear_bias(g: fx.Graph, x: fx.Node):
    """x = view(addmm(b, a, W)) or addmm(...) with single users -> (view(mm(a, W)), b); else (x, None)."""
    if is_op(x, aten.add) and isinstance(x.args[1], fx.Node) and len(shape(x.args[1]) or ()) == 1 \
            and shape(x.args[1])[0] == shape(x)[-1] and shape(x.args[0]) == shape(x):
        return x.args[0], x.args[1]
    v = x if is_op(x, aten.view, aten._unsafe_view) else None
    mm = v.args[0] if v is not None else x
    if not is_op(mm, aten.addmm) or len(mm.users) != 1 or (v is not None and len(v.users) != 1):
        return x, None
    b, a, w = mm.args[:3]
    if mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1 or len(shape(b) or ()) != 1:
        return x, None
    with g.inserting_before(mm):
        new = call(g, aten.mm.default, a, w)
        if v is not None:
            new = call(g, v.target, new, *v.args[1:])
    return new, b


@register_pass("pre_autodiff", default=True, order=40)
def fuse_bias_dropout_add_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite dropout (with its bias and residual add where present) to graphtrain::bias_dropout_add."""
    g, n = gm.graph, 0
    for node in list(g.nodes):
        if getattr(node, "_erased", False):
            continue
        d = match_dropout(node)
        if d is None or d[1] <= 0 or shape(node) is None:
            continue
        x, p, mask_nodes = d
        x_dtype = x.meta["val"].dtype
        if not x_dtype.is_floating_point:
            continue
        residual, out_node = None, node
        u = only_user(node)
        if u is not None and is_op(u, aten.add) and len(u.args) == 2 and u.kwargs.get("alpha", 1) == 1:
            other = u.args[1] if u.args[0] is node else u.args[0]
            if isinstance(other, fx.Node) and shape(other) == shape(node) and other.meta["val"].dtype == x_dtype:
                residual, out_node = other, u
        with g.inserting_before(out_node):
            bias = None
            if len(x.users) == 1:
                x, bias = split_linear_bias(g, x)
            if bias is not None and bias.meta["val"].dtype != x_dtype:
                x, bias = d[0], None
            fused = call(g, torch.ops.graphtrain.bias_dropout_add.default, x, bias, residual, p)
            out = getitem(g, fused, 0)
        out_node.replace_all_uses_with(out)
        erase_dead(g, [out_node, node] + mask_nodes)
        n += 1
    ctx.count(n)
    return finish(gm)
