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

import graphtrain.kernels  # noqa: F401
from graphtrain.passes.fuse_utils import (
    aten,
    call,
    erase_dead,
    finish,
    getitem,
    is_op,
    match_dropout,
    only_user,
    shape,
    split_linear_bias,
)
from graphtrain.passes.manager import PassContext, register_pass


@register_pass("pre_autodiff", phase="fuse_epilogue")
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
