"""A user's ``torch.autograd.Function`` inside a captured graph, kept whole through graphtrain's pre-autodiff passes.

Dynamo records ``MyFunction.apply(x)`` as one ``torch.ops.higher_order.autograd_function_apply(fwd_body, bwd_body,
*args)`` node whose two bodies are the function's forward and backward as FX graphs. AOTAutograd honours it (the
backward is the user's, not the forward's derivative), but graphtrain's trace to aten does not: it runs under
functorch's functionalize, which has no rule for an autograd.Function, so a graph with one (Hugging Face Bloom's
GELU, a straight-through estimator, a hand-written fused op) used to skip every pre-autodiff pass. Its block
graph also could not be sent to a background compile, so provider auto compiled it with Inductor before the first
step (Bloom, 4 layers: 4.1 s of a 6.4 s warm first step).

``hide(gm)`` returns a copy of the graph where each such node is a call of ``graphtrain::autograd_function``, an
opaque functional op keyed by its bodies' digest (its fake implementation runs the forward body on fake tensors,
so tracing sees the right shapes). The trace and the passes leave the op alone. ``restore(gm)`` turns every op
back into the ``autograd_function_apply`` node it was, bodies attached, before AOTAutograd builds the gradient
graph, so the step runs the user's forward and backward as eager would. The op has no autograd formula of its
own: reaching autograd un-restored is an error, never a silent gradient through the forward.

Hand-written because neither torch's functionalize nor make_fx keep an autograd.Function opaque (torch 2.13).
Applied only where the node's arguments are tensors and its forward body returns its outputs as a tuple (what
Dynamo records); anything else keeps the old behaviour (passes skipped, reported).

The pass ``hide_autograd_functions`` (stage ``dynamo``, phase ``opaque``) runs ``hide`` on each graph the backend
traces. Its other half is not a pass: the backend calls ``restore`` on every traced graph after its pre-autodiff
passes, whether the pass ran or not (nothing hidden: nothing to restore), so switching passes never separates them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.fx as fx

from graphtrain.kernels.registry import FOLLOW, FORWARD, NEVER, OpDescriptor, no_workspace, register_ops
from graphtrain.passes.graph_utils import copy_graph, graph_digest
from graphtrain.passes.manager import PassContext, register_pass

_HOP = getattr(torch.ops.higher_order, "autograd_function_apply", None)
_BODIES: dict[str, tuple[fx.GraphModule, fx.GraphModule, dict[str, Any]]] = {}
"""Each hidden function's (forward body, backward body, the node's keyword arguments), by digest: content
addressed, so the same function hidden twice (or in another process) gets the same key and the pass cache's
keys are stable."""


def _run_forward(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    fwd = _BODIES[key][0]
    with torch.no_grad():
        outputs, _saved = fx.Interpreter(fwd).run(*args)
    return [o.clone() for o in outputs]  # an op's outputs may not alias its inputs


@torch.library.custom_op("graphtrain::autograd_function", mutates_args=())
def autograd_function(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    """A user's autograd.Function held opaque through the pre-autodiff passes (see the module docstring)."""
    if key not in _BODIES:
        raise RuntimeError(
            f"graphtrain::autograd_function {key[:12]}: no such function in this process (a graph "
            f"hidden by passes/autograd_functions.hide runs only after its restore)"
        )
    return _run_forward(key, args)


@autograd_function.register_fake
def _(key: str, args: list[torch.Tensor]) -> list[torch.Tensor]:
    return _run_forward(key, args)


# random: a user's function may draw random numbers (a dropout inside), so no pass merges two calls of it; it is
# never recomputed and follows its inputs' precision (it only exists between the trace and autodiff).
register_ops(
    OpDescriptor(
        "autograd_function",
        role=FORWARD,
        random=True,
        recompute=NEVER,
        precision=FOLLOW,
        workspace_bytes=no_workspace,
        cpp=(),
    ),
    owner="engine.autograd_functions",
)


def _hideable(n: fx.Node, gm: fx.GraphModule) -> bool:
    if n.op != "call_function" or _HOP is None or n.target is not _HOP or len(n.args) < 2:
        return False
    fwd, bwd = (
        getattr(gm, str(a.target), None) if isinstance(a, fx.Node) and a.op == "get_attr" else None for a in n.args[:2]
    )
    if not isinstance(fwd, fx.GraphModule) or not isinstance(bwd, fx.GraphModule):
        return False
    if not all(
        isinstance(a, fx.Node) and isinstance(a.meta.get("example_value", a.meta.get("val")), torch.Tensor)
        for a in n.args[2:]
    ):
        return False
    out = next(iter(fwd.graph.find_nodes(op="output")))
    result = out.args[0]
    # Dynamo's forward body returns (outputs, saved values); the outputs as a tuple of tensors
    return (
        isinstance(result, (tuple, list))
        and len(result) == 2
        and isinstance(result[0], (tuple, list))
        and all(isinstance(x, fx.Node) for x in result[0])
    )


def has_autograd_functions(gm: fx.GraphModule) -> bool:
    return _HOP is not None and any(n.op == "call_function" and n.target is _HOP for n in gm.graph.nodes)


def hide(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """(a copy of `gm` with each autograd.Function node it can hold opaque replaced by a ``graphtrain::
    autograd_function`` call, how many were). `gm` itself is untouched: the eager fallback still runs it."""
    if not any(_hideable(n, gm) for n in gm.graph.nodes):
        return gm, 0
    out = copy_graph(gm)
    hidden = 0
    for n in list(out.graph.nodes):
        if not _hideable(n, out):
            continue
        fwd, bwd = (getattr(out, str(a.target)) for a in n.args[:2])
        kw = hashlib.sha256(repr(sorted(n.kwargs.items())).encode()).hexdigest()
        key = hashlib.sha256(f"{graph_digest(fwd)} {graph_digest(bwd)} {kw}".encode()).hexdigest()
        _BODIES[key] = (fwd, bwd, dict(n.kwargs))
        with out.graph.inserting_before(n):
            op = out.graph.call_function(torch.ops.graphtrain.autograd_function.default, (key, list(n.args[2:])))
        op.meta.update(n.meta)
        bodies = n.args[:2]
        n.replace_all_uses_with(op)
        out.graph.erase_node(n)
        for b in bodies:  # the bodies' get_attr nodes (not a whole-graph DCE: it drops an unused in-place method)
            if not b.users:
                out.graph.erase_node(b)
        hidden += 1
    out.recompile()
    return out, hidden


@register_pass("dynamo", phase="opaque")
def hide_autograd_functions_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """`hide` on a graph about to be traced (a copy: the graph handed in, which the eager fallback runs, is left
    alone); counts the calls hidden. The caller must `restore` the traced graph before autodiff (module docstring).
    Switched off, a graph with an autograd.Function fails to trace and skips its pre-autodiff passes (reported)."""
    gm, hidden = hide(gm)
    if hidden:
        ctx.count(hidden)
        ctx.tell(
            f"{hidden} autograd.Function call(s) held opaque through the pre-autodiff passes (their own forward "
            f"and backward run)"
        )
    return gm


def restore(gm: fx.GraphModule) -> int:
    """Turn every ``graphtrain::autograd_function`` call in `gm` back into the autograd.Function node it was (in
    place; the bodies become attributes of `gm`). Returns how many."""
    restored = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.graphtrain.autograd_function.default:
            continue
        key, args = n.args
        fwd, bwd, kwargs = _BODIES[key]
        assert _HOP is not None  # hide() made this call only where the higher-order op exists
        names = []
        for body, what in ((fwd, "fwd"), (bwd, "bwd")):
            name = f"_autograd_function_{what}_{key[:16]}"
            if not hasattr(gm, name):
                gm.add_submodule(name, body)
            names.append(name)
        with gm.graph.inserting_before(n):
            bodies = [gm.graph.get_attr(name) for name in names]
            apply = gm.graph.call_function(_HOP, (*bodies, *args), dict(kwargs))
        apply.meta.update(n.meta)
        n.replace_all_uses_with(apply)
        gm.graph.erase_node(n)
        restored += 1
    if restored:
        gm.graph.lint()
        gm.recompile()
    return restored


__all__ = ["autograd_function", "has_autograd_functions", "hide", "restore"]
