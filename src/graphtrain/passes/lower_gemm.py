"""lower_gemm_onednn: fp32 CPU mm/addmm -> graphtrain::gemm (oneDNN), before autodiff; lower_gemm_plans: bf16 CPU
mm/addmm -> graphtrain::gemm where another plan beats aten's one call, after autodiff (its docstring, below).

Rewriting the forward graph reaches every GEMM of the step: AOTAutograd builds the backward's input-
and weight-gradient products from graphtrain::gemm's own backward, which is graphtrain::gemm again.
(As a pass on the partitioned graphs it would also work, but its rewrites would vanish from the
report on a compile-cache hit, since Inductor skips its post-grad passes then.) See kernels/gemm.py
for why (MKL's AVX2 path on AMD CPUs vs oneDNN's AVX-512 one) and for the numerics (IEEE fp32 both
ways; the summation order differs, so the pass is registered as changing numerics).

It runs after apply_mixed_precision (phase ``lower`` follows phase ``precision``), so under bf16/fp16 it sees
the matmuls that pass left in fp32 and leaves the low-precision ones to aten (which sends them to oneDNN
already) and to lower_gemm_plans.

Graphs with Inductor-lowered random ops (dropout left as aten.bernoulli / native_dropout, i.e. with
fuse_bias_dropout_add switched off) are left unchanged: with ``fallback_random`` (eager's RNG stream)
and these extern GEMMs in between, torch 2.13's Inductor scheduled a dropout's in-place
``bernoulli_`` after the kernel that reads the mask (seen in the generated code; the loss of
tests/test_engine_parity.py's TinyGPT moved by 3%). graphtrain's own dropout ops draw from their
hash RNG and are unaffected, so by default (dropouts fused) the pass applies.

On by default under the Inductor provider when oneDNN's fp32 matmul runs on this CPU (gemm.onednn_fp32:
not on AVX2-only CPUs), decided GEMM by GEMM from the shapes this graph runs: each distinct (m, k, n) and weight
layout is timed once per machine, forward and both gradient GEMMs, oneDNN against aten.mm (gemm.shape_probe,
cached), and only the shapes where oneDNN wins by ``WIN_MARGIN`` are rewritten. Which library is faster depends
on the shape (measured on a 2-core Zen 5: oneDNN about 2x on a GPT-2 layer's GEMMs, near parity on small or
skinny ones), so one probe of fixed shapes would decide wrongly for some models. The report's note for the pass
lists every shape with its measured speedup. ``engine.passes.lower_gemm_onednn: true`` forces it for every GEMM
(no probe; where oneDNN's fp32 path does not run, the fallback policy says so), ``false`` switches it off. The ``aten`` provider, graphtrain's bitwise reference, leaves
matmuls to aten unless the pass is switched on by name. Rewritten: aten.mm(a, b) and
aten.addmm(bias, a, b) with alpha = beta = 1, a and b 2-D fp32 on CPU (each a node's fake value says so).
"""

from __future__ import annotations

from typing import TypeGuard

import torch
import torch.fx as fx

import graphtrain.kernels  # noqa: F401  (registers torch.ops.graphtrain.gemm)
from graphtrain.config.torch_compat import optimization_hint
from graphtrain.kernels.gemm import onednn_available, onednn_fp32, plan_for, shape_probe
from graphtrain.passes.fuse_utils import aten, call, finish, is_op, val
from graphtrain.passes.graph_utils import has_random_tag
from graphtrain.passes.manager import PassContext, register_pass


def _cpu_of(n: object, dtype: torch.dtype) -> TypeGuard[fx.Node]:
    """A CPU tensor of `dtype` and at most 2 dimensions (by the node's fake value)."""
    v = val(n)
    return isinstance(v, torch.Tensor) and v.dim() <= 2 and v.dtype == dtype and v.device.type == "cpu"


def gemm_operands(node: fx.Node, dtype: torch.dtype = torch.float32) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(a, b, bias) if `node` is an mm/addmm of `dtype` operands that these passes rewrite, else None."""
    bias: fx.Node | None = None
    if is_op(node, aten.mm) and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
    elif is_op(node, aten.addmm) and len(node.args) == 3 and all(node.kwargs.get(k, 1) == 1 for k in ("alpha", "beta")):
        c, a, b = node.args
        if not _cpu_of(c, dtype):
            return None
        bias = c
    else:
        return None
    if not (_cpu_of(a, dtype) and _cpu_of(b, dtype) and _cpu_of(node, dtype)):
        return None
    if not val(a).dim() == val(b).dim() == val(node).dim() == 2:
        return None
    return a, b, bias


@register_pass("pre_autodiff", phase="lower", changes_numerics=True, providers=("inductor",))
def lower_gemm_onednn_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite fp32 CPU mm/addmm to graphtrain::gemm where oneDNN beats aten.mm on this CPU (not in graphs with
    aten random ops, see the module docstring)."""
    forced = ctx.config.passes.get("lower_gemm_onednn") is True
    if not onednn_available():
        if forced:  # asked for by name: the fallback policy reports (or raises) why it cannot apply
            raise RuntimeError(f"oneDNN's fp32 matmul is not usable on this machine: {onednn_fp32()[1]}")
        return gm
    if any(has_random_tag(n) for n in gm.graph.nodes):  # aten's random ops: see the module docstring
        return gm
    g, n = gm.graph, 0
    probed: dict[tuple[int, int, int, bool], dict] = {}
    for node in list(g.nodes):
        ops = gemm_operands(node)
        if ops is None:
            continue
        a, b, bias = ops
        if not forced:
            shape = _shape(a, b)
            if shape not in probed:
                probed[shape] = shape_probe(*shape)
            if not probed[shape]["wins"]:
                continue
        _to_gemm(g, node, a, b, bias)
        n += 1
    ctx.count(n)
    if probed:
        ctx.note(
            "oneDNN where it measured faster (forward + both gradient GEMMs, aten time / oneDNN time; "
            "rows capped at the probe's): "
            + ", ".join(
                f"{m}x{k}x{nn}{'t' if t else ''} {r['speedup']:.2f}x -> {'oneDNN' if r['wins'] else 'aten'}"
                for (m, k, nn, t), r in probed.items()
            )
        )
    return finish(gm) if n else gm


def _to_gemm(g: fx.Graph, node: fx.Node, a: fx.Node, b: fx.Node, bias: fx.Node | None) -> None:
    """`node` (an mm/addmm of a, b and bias) replaced by graphtrain::gemm of the same operands."""
    with g.inserting_before(node):
        new = call(g, torch.ops.graphtrain.gemm.default, a, b, bias)
    node.replace_all_uses_with(new)
    g.erase_node(node)


def _shape(a: fx.Node, b: fx.Node) -> tuple[int, int, int, bool]:
    """(m, k, n, b read transposed) of a @ b, from the fake values: a layer's weight is usually a transposed view
    of its (n, k) parameter (nn.Linear); HF's Conv1D stores it (k, n)."""
    va, vb = val(a), val(b)
    # Under dynamic shapes a size is symbolic: the probe takes its value in this call (optimization_hint) without
    # the guard int() would add, which would make Dynamo recompile the graph for every other size.
    m, k, n, rows = (optimization_hint(x) for x in (va.shape[0], va.shape[1], vb.shape[1], vb.shape[0]))
    transposed = vb.dim() == 2 and optimization_hint(vb.stride(0)) == 1 and rows > 1
    return m, k, n, bool(transposed)


@register_pass(("forward", "backward"), phase="lower", changes_numerics=True, providers=("inductor",))
def lower_gemm_plans_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite each bf16 CPU mm/addmm of the forward and backward graphs that runs faster by another plan than aten's
    one call on this machine (gemm.low_plan: in blocks of rows, one single-threaded oneDNN call per thread, or a
    transposed first operand copied row-major first) to graphtrain::gemm, which runs it by that plan. After autodiff,
    so each GEMM is decided on its own shape and layout (a layer's forward product, its input gradient and its weight
    gradient are three decisions), and every GEMM that no plan speeds up stays with aten, which Inductor calls without
    the custom op's dispatch (about 60 us a call). Measured on the 2-core AMX Xeon, b8 s128 (bench ablation
    ``graphtrain-bf16-no-gemm-plans``, two runs): 2-14% a step for HF Llama, GPT-2 and BERT small. The plans are
    measured where the pass runs, under provider auto in the background compile's process: a loop that trains
    beside it times them on a busy CPU. ``engine.passes.lower_gemm_plans: false`` leaves every bf16 GEMM to aten.
    Not in graphs with aten random ops (the module docstring says why)."""
    if not onednn_available():
        return gm
    if any(has_random_tag(n) for n in gm.graph.nodes):
        return gm
    g, n = gm.graph, 0
    decided: dict[str, str] = {}
    for node in list(g.nodes):
        ops = gemm_operands(node, torch.bfloat16)
        if ops is None:
            continue
        a, b, bias = ops
        m, k, nn, a_t, b_t = _dims(a, b)
        if m <= 32:
            continue
        plan = plan_for(m, k, nn, a_t, b_t, torch.bfloat16)
        decided[f"{m}x{k}x{nn}{'tn'[not a_t]}{'tn'[not b_t]}"] = plan
        if plan == "whole":
            continue
        _to_gemm(g, node, a, b, bias)
        n += 1
    ctx.count(n)
    if decided:
        ctx.note("bf16 GEMM plans measured here: " + ", ".join(f"{k} {p}" for k, p in decided.items()))
    return finish(gm) if n else gm


def _dims(a: fx.Node, b: fx.Node) -> tuple[int, int, int, bool, bool]:
    """(m, k, n, a read transposed, b read transposed) of a @ b from the fake values, sizes and strides as this call
    has them (optimization_hint, as `_shape`)."""

    def transposed(v: torch.Tensor) -> bool:  # gemm._column_major, on the hints
        rows, cols, s0, s1 = (optimization_hint(x) for x in (*v.shape, *v.stride()))
        return rows > 1 and cols > 1 and s0 == 1 and s1 == rows

    va, vb = val(a), val(b)
    m, k, n = (optimization_hint(x) for x in (va.shape[0], va.shape[1], vb.shape[1]))
    return m, k, n, transposed(va), transposed(vb)
