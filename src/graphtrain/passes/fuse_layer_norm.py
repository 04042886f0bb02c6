"""fuse_layer_norm / fuse_rms_norm: normalizations over the last dim -> graphtrain::layer_norm / rms_norm.

LayerNorm spellings: aten.native_layer_norm over the last dim (nn.LayerNorm, F.layer_norm) when only
its output is used; the hand-written (x - mean) / sqrt(var + eps) [* w] [+ b] with var as
var(x, correction=0) or mean((x - mean)^2), and 1/sqrt as div by sqrt or mul by rsqrt.
RMSNorm spellings: x * rsqrt(mean(x^2) + eps) [* w] (HF Llama/T5 style, either operand order) and
aten._fused_rms_norm. Same function; only rounding differs.
"""

from __future__ import annotations

import operator
from typing import Any, TypeGuard

import torch
import torch.fx as fx
from torch.fx.node import Argument

import graphtrain.kernels  # noqa: F401
from graphtrain.passes.fuse_utils import aten, call, finish, getitem, is_op, number, only_user, shape, val
from graphtrain.passes.manager import PassContext, register_pass


def _last_dim(n: Argument, dims: Argument) -> bool:
    s = shape(n)
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and s is not None and dims[0] in (-1, len(s) - 1)


def _mean_last(n: Argument, x: Argument = None) -> TypeGuard[fx.Node]:
    return (
        is_op(n, aten.mean)
        and len(n.args) >= 2
        and _last_dim(n.args[0], n.args[1])
        and bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))
        and (x is None or n.args[0] is x)
    )


def _same(a: Argument, b: Argument) -> bool:
    """The same node, or the same sub(x, mean) computed twice (code that writes `x - mu` twice)."""
    return a is b or (is_op(a, aten.sub) and is_op(b, aten.sub) and a.args == b.args and a.kwargs == b.kwargs)


def _eps_rsqrt(n: fx.Node) -> tuple[Argument, float, str] | None:
    """n = 1/sqrt(v + eps) as rsqrt(add(v, eps)) -> (v, eps, 'rsqrt'); sqrt(add(v, eps)) -> (v, eps, 'sqrt')."""
    if not is_op(n, aten.rsqrt, aten.sqrt):
        return None
    a = n.args[0]
    if not is_op(a, aten.add) or (eps := number(a.args[1])) is None:
        return None
    return a.args[0], eps, "rsqrt" if is_op(n, aten.rsqrt) else "sqrt"


def _affine(g: fx.Graph, y: fx.Node, n_last: int) -> tuple[fx.Node | None, fx.Node | None, fx.Node]:
    """Optional * w then + b (1-D of the last dim) after y -> (weight, bias, last node)."""
    w: fx.Node | None = None
    b: fx.Node | None = None
    last = y
    u = only_user(last)
    if u is not None and is_op(u, aten.mul):
        other = u.args[1] if u.args[0] is last else u.args[0]
        if isinstance(other, fx.Node) and shape(other) == (n_last,) and shape(u) == shape(y):
            w, last = other, u
    u = only_user(last)
    if u is not None and is_op(u, aten.add) and u.kwargs.get("alpha", 1) == 1:
        other = u.args[1] if u.args[0] is last else u.args[0]
        if isinstance(other, fx.Node) and shape(other) == (n_last,) and shape(u) == shape(y):
            b, last = other, u
    return w, b, last


def _replace(g: fx.Graph, last: fx.Node, target: Any, *args: Any) -> bool:
    """`last` (a hand-written norm's final node) replaced by `target(*args)[0]`, unless the norm's result is not
    contiguous: the fused ops return contiguous rows, and the graph after a norm was traced for eager's layout, which
    elementwise ops keep from their input. Gemma 3 normalizes q and k after moving the heads in front (a [B, S, H, D]
    tensor seen as [B, H, S, D]); fused, its attention's output came out in another layout, and a view of its merged
    heads failed the aten provider's trace ("Cannot view a tensor ..."): the block ran eagerly."""
    v = val(last)
    if isinstance(v, torch.Tensor) and not v.is_contiguous():
        return False
    with g.inserting_before(last):
        out = getitem(g, call(g, target, *args), 0)
    last.replace_all_uses_with(out)
    return True


# Under inductor, norm/GELU/cross-entropy fusions stay off by default: Inductor fuses these itself and an
# opaque custom op blocks it. Measured gpt2-mini b16 s128 bf16, 2-core Xeon (AMX): inductor with all
# graphtrain fusions 0.263 s/step (no attention fusion), with only fuse_bias_dropout_add 0.160.
@register_pass("pre_autodiff", phase="fuse", providers=("aten",))
def fuse_layer_norm_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite LayerNorms (aten or hand-written) to graphtrain::layer_norm."""
    g, n = gm.graph, 0
    for node in list(g.nodes):
        if getattr(node, "_erased", False):
            continue
        if is_op(node, aten.native_layer_norm):
            x, ns, w, b, eps = node.args[:5]
            if (
                not isinstance(ns, (list, tuple))
                or len(ns) != 1
                or any(not (is_op(u, operator.getitem) and u.args[1] == 0) for u in node.users)
            ):
                continue
            with g.inserting_before(node):
                fused = call(g, torch.ops.graphtrain.layer_norm.default, x, w, b, eps)
            for user in list(node.users):
                user.replace_input_with(node, fused)
            n += 1
            continue
        # hand-written: anchor on 1/sqrt(var + eps)
        m = _eps_rsqrt(node)
        if m is None:
            continue
        var, eps, kind = m
        u = only_user(node)
        if u is None:
            continue
        if kind == "rsqrt" and is_op(u, aten.mul):
            centered = u.args[0] if u.args[1] is node else u.args[1]
        elif kind == "sqrt" and is_op(u, aten.div) and u.args[1] is node:
            centered = u.args[0]
        else:
            continue
        if not is_op(centered, aten.sub) or not _mean_last(centered.args[1], centered.args[0]):
            continue
        x = centered.args[0]
        if is_op(var, aten.var):
            ok = (
                var.args[0] is x
                and _last_dim(x, var.args[1])
                and var.kwargs.get("correction", 1) == 0
                and var.kwargs.get("keepdim", False)
            )
        else:
            sq = var.args[0] if _mean_last(var) else None
            ok = sq is not None and (
                (is_op(sq, aten.pow) and _same(sq.args[0], centered) and number(sq.args[1]) == 2)
                or (is_op(sq, aten.mul) and _same(sq.args[0], centered) and _same(sq.args[1], centered))
            )
        xs = shape(x)  # not None: _mean_last read it
        if not ok or xs is None:
            continue
        w, b, last = _affine(g, u, xs[-1])
        n += _replace(g, last, torch.ops.graphtrain.layer_norm.default, x, w, b, eps)
    g.eliminate_dead_code()
    ctx.count(n)
    return finish(gm)


# after fuse_layer_norm: a hand-written LayerNorm contains an RMSNorm pattern (the RMSNorm of x - mean)
@register_pass("pre_autodiff", phase="fuse", after="fuse_layer_norm", providers=("aten",))
def fuse_rms_norm_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite RMSNorms (x * rsqrt(mean(x^2) + eps) [* w], aten._fused_rms_norm) to graphtrain::rms_norm."""
    g, n = gm.graph, 0
    for node in list(g.nodes):
        if getattr(node, "_erased", False):
            continue
        if is_op(node, aten._fused_rms_norm):
            x, ns, w, eps = (
                node.args[0],
                node.args[1],
                node.args[2] if len(node.args) > 2 else None,
                node.args[3] if len(node.args) > 3 else None,
            )
            if (
                not isinstance(ns, (list, tuple))
                or len(ns) != 1
                or eps is None
                or any(u.args[1] != 0 for u in node.users)
            ):
                continue
            with g.inserting_before(node):
                fused = call(g, torch.ops.graphtrain.rms_norm.default, x, w, eps)
            for user in list(node.users):
                user.replace_input_with(node, fused)
            n += 1
            continue
        m = _eps_rsqrt(node)
        if m is None or m[2] != "rsqrt" or not _mean_last(mean := m[0]):
            continue
        sq = mean.args[0]
        if not (
            (is_op(sq, aten.pow) and number(sq.args[1]) == 2) or (is_op(sq, aten.mul) and sq.args[0] is sq.args[1])
        ):
            continue
        x = sq.args[0]
        u, xs = only_user(node), shape(x)
        if u is None or not is_op(u, aten.mul) or x not in u.args or xs is None or shape(u) != xs:
            continue
        w, b, last = _affine(g, u, xs[-1])
        if b is not None:  # x * rstd * w + b is not an RMSNorm; leave the add outside
            pre_bias = last.args[0] if last.args[1] is b else last.args[1]  # the node _affine's add read
            if not isinstance(pre_bias, fx.Node):
                continue
            last = pre_bias
        n += _replace(g, last, torch.ops.graphtrain.rms_norm.default, x, w, m[1])
    g.eliminate_dead_code()
    ctx.count(n)
    return finish(gm)
