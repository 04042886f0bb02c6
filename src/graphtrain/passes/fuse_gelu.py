"""fuse_bias_gelu: GELU (erf or tanh form, as aten.gelu or spelled out) [after a linear's bias] ->
graphtrain::bias_gelu (provider aten); lower_gelu_tanh: the same rewrite for the tanh form on CPU under Inductor.

Spellings: aten.gelu(x, approximate='none'|'tanh'); the tanh formula
0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))) as HF GPT-2's NewGELU traces (8 ops); the erf
formula x * 0.5 * (1 + erf(x / sqrt(2))) (or * 0.7071...). A bias from the producing linear is
split off (view(addmm(b, a, W)) -> view(mm(a, W)), bias handed to the op) or taken from an explicit
add of a 1-D tensor. Same function; only rounding differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import Argument

import graphtrain.kernels  # noqa: F401
from graphtrain.kernels.bias_gelu import cpp_tanh_ok, gelu_tanh_probe
from graphtrain.passes.fuse_utils import (
    aten,
    call,
    erase_dead,
    finish,
    is_op,
    number,
    only_user,
    scalar_operand,
    split_linear_bias,
)
from graphtrain.passes.graph_utils import is_cast
from graphtrain.passes.manager import PassContext, register_pass


def _close(a: float | None, b: float) -> bool:
    return a is not None and abs(a - b) < 1e-4 * abs(b)


def _uncast(n: Argument) -> Argument:
    """n without the dtype casts around it (`is_cast`: what the mixed-precision pass puts in)."""
    while is_cast(n):
        n = n.args[0]
    return n


def _same_value(a: Argument, b: Argument) -> bool:
    """a and b hold the same elements up to their dtype: one node, or views (of one shape) of one value through
    dtype casts. In a mixed-precision graph the GELU formula reads x in two dtypes: its cube and tanh in fp32 (a cast
    of the matmul's bf16 output), its 0.5 x in bf16."""
    if a is b:
        return True

    def root(n: Argument) -> Argument:
        n = _uncast(n)
        while is_op(n, aten.view, aten._unsafe_view, aten.reshape):
            n = _uncast(n.args[0])
        return n

    return (
        isinstance(a, fx.Node)
        and isinstance(b, fx.Node)
        and root(a) is root(b)
        and tuple(a.meta["val"].shape) == tuple(b.meta["val"].shape)
    )


def _half_x_times(node: fx.Node, x: Argument, other: fx.Node) -> fx.Node | None:
    """node == (x * 0.5) * other or (other * 0.5) * x-like variants, through dtype casts: the x the 0.5 multiplies
    (x's value, perhaps in another dtype), or None."""
    if not is_op(node, aten.mul) or other not in node.args:
        return None
    h = _uncast(node.args[0] if node.args[1] is other else node.args[1])
    so = scalar_operand(h) if isinstance(h, fx.Node) else None
    return so[0] if so is not None and _same_value(so[0], x) and _close(so[1], 0.5) else None


def _match_formula(t: fx.Node) -> tuple[Argument, str, fx.Node] | None:
    """t = tanh(...) or erf(...) node -> (x, approximate, output node) or None."""
    arg = t.args[0]
    so = scalar_operand(arg) if isinstance(arg, fx.Node) else None
    if is_op(t, aten.tanh):
        if so is None or not _close(so[1], math.sqrt(2 / math.pi)) or not is_op(so[0], aten.add):
            return None
        a, b = so[0].args
        x, cube = (a, b) if scalar_operand(b) else (b, a)
        c = scalar_operand(cube) if isinstance(cube, fx.Node) else None
        if (
            c is None
            or not _close(c[1], 0.044715)
            or not is_op(c[0], aten.pow)
            or not _same_value(c[0].args[0], x)
            or number(c[0].args[1]) != 3
        ):
            return None
        approx = "tanh"
    else:
        if so is not None and _close(so[1], 1 / math.sqrt(2)):
            x = so[0]
        elif is_op(arg, aten.div) and _close(number(arg.args[1]), math.sqrt(2)):
            x = arg.args[0]
        else:
            return None
        approx = "none"
    one = only_user(t)
    if one is None or not is_op(one, aten.add) or not any(_close(number(a), 1.0) for a in one.args):
        return None
    out = only_user(one)
    half_x = _half_x_times(out, x, one) if out is not None else None
    if out is None or half_x is None:
        return None
    # the fused op reads x in the narrower of the dtypes the formula read it in (bf16 in a mixed-precision graph)
    if isinstance(x, fx.Node) and half_x.meta["val"].dtype.itemsize < x.meta["val"].dtype.itemsize:
        x = half_x
    return x, approx, out


# after the normalizations, as the numbered pipeline ran them (the fusions are independent)
@register_pass("pre_autodiff", phase="fuse", after="fuse_rms_norm", providers=("aten",))
def fuse_bias_gelu_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite GELUs (aten.gelu or the spelled-out erf/tanh formulas) and their bias to graphtrain::bias_gelu."""
    return _rewrite_gelus(gm, ctx, lambda x, approx: True)


# before lower_gemm_onednn: the linear's bias is still an addmm here, so the GELU op absorbs it
@register_pass(
    "pre_autodiff", phase="lower", before="lower_gemm_onednn", changes_numerics=True, providers=("inductor",)
)
def lower_gelu_tanh_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Under Inductor, GELU's tanh form on CPU (HF GPT-2's NewGELU, gelu(approximate='tanh')) to graphtrain::bias_gelu,
    which runs it in graphtrain's C++ kernel: Inductor's own kernel for it uses Sleef's 1-ulp tanh and cost 1.9 ms
    forward and 2.4 ms backward on a [2048, 1024] fp32 activation against 1.0 and 1.1 ms (2-core Zen 4). The erf form
    stays with Inductor, whose kernel fused with its neighbours beats an opaque op (fuse_bias_gelu, off there).
    Numerics: the C++ tanh is exp-based (rel. error < 3e-7), not Sleef's. It runs after the mixed-precision pass and
    sees through its casts (`_same_value`): before it did, a bf16 graph kept Inductor's GELU, 16.5 ms of HF GPT-2
    mini's bf16 step (b16 s128, forward and backward, 4 layers), which took 243 ms and takes 235 with the lowering."""
    out = _rewrite_gelus(gm, ctx, lambda x, approx: cpp_tanh_ok(x.meta["val"], None, approx))
    # the probe's verdict in the report, for graphs that had a tanh GELU (others never load or time anything)
    if any(is_op(n, aten.tanh) or is_op(n, torch.ops.graphtrain.bias_gelu.default) for n in out.graph.nodes):
        probe = gelu_tanh_probe()
        if "cpp_s" in probe:
            ctx.note(
                f"tanh GELU probe, [512, 2048] forward + backward: C++ {probe['cpp_s'] * 1e3:.2f} ms, aten "
                f"{probe['aten_s'] * 1e3:.2f} ms: {'lowered' if probe['cpp_wins'] else 'left to Inductor'}"
            )
    return out


def _replace_in_dtype(g: fx.Graph, out: fx.Node, fused: fx.Node) -> None:
    """Let `fused` replace `out`. Where their dtypes differ (the formula ended in fp32, the op computed in bf16), a
    user that cast `out` to the op's dtype reads the op itself, and any other user a cast of it to out's dtype."""
    want, got = out.meta["val"].dtype, fused.meta["val"].dtype
    if want != got:
        for u in list(out.users):
            if is_cast(u) and u.meta["val"].dtype == got:
                u.replace_all_uses_with(fused)
        if out.users:
            with g.inserting_after(fused):
                fused = call(g, aten._to_copy.default, fused, dtype=want)
    out.replace_all_uses_with(fused)


def _rewrite_gelus(gm: fx.GraphModule, ctx: PassContext, accept: Callable[[fx.Node, Any], bool]) -> fx.GraphModule:
    g, n = gm.graph, 0
    for node in list(g.nodes):
        if getattr(node, "_erased", False):
            continue
        if is_op(node, aten.gelu):
            x, approx, out = node.args[0], node.kwargs.get("approximate", "none"), node
        elif is_op(node, aten.tanh, aten.erf):
            m = _match_formula(node)
            if m is None:
                continue
            x, approx, out = m
        else:
            continue
        if not isinstance(x, fx.Node) or not x.meta["val"].dtype.is_floating_point or not accept(x, approx):
            continue
        with g.inserting_before(out):
            fused = call(g, torch.ops.graphtrain.bias_gelu.default, x, None, approx)
        _replace_in_dtype(g, out, fused)
        erase_dead(g, [out])
        g.eliminate_dead_code()
        if len(x.users) == 1:  # the formula is gone: absorb the linear's bias
            with g.inserting_before(fused):
                nx, bias = split_linear_bias(g, x)
            if bias is not None and bias.meta["val"].dtype == nx.meta["val"].dtype:
                fused.args = (nx, bias, approx)
            g.eliminate_dead_code()
        n += 1
    ctx.count(n)
    return finish(gm)
