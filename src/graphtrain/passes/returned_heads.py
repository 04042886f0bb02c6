"""Returned LM-head logits without a gradient buffer of their own: the logits a model returns beside its loss.

A Hugging Face language model computes its loss from the logits inside the graph and returns both. As an output of
the compiled graph that requires grad, the logits get a tangent in its backward, and the autograd engine hands the
compiled function a zero tensor of the logits' full size when the caller did not backpropagate through them (the
usual case: the loss is what trains). So every step filled an [N, V] buffer with zeros and added it to the loss's
logit gradient, another [N, V] pass: on HF Llama small (b8 s128, vocabulary 16384, 2-core Zen 4) a 64 MiB memset
per step; with GPT-2's vocabulary of 50257 at 4096 tokens, 823 MB.

Rewrite (``detach_returned_heads``, on the Dynamo graph, before everything else): an output that is
``linear(h, W[, b])`` of a parameter W (an LM head) and is used inside the graph as well (by the loss) is returned
detached, and h is returned too. ``reattach`` then gives the caller the logits with a gradient function of their own,
``linear``'s backward (``_HeadGrad``: dh = g W, dW = g^T h, db = sum g), which the autograd engine runs only if the
caller backpropagates through the logits; h, an output of the graph that requires grad, carries dh into the graph's
backward. Unused, h's tangent is [N, d] zeros instead of [N, V].

Left alone: a head whose logits leave the graph with no use inside it (their gradient is the caller's), heads of a
weight computed in the graph, graphs compiled under no_grad, graphs with DTensor inputs (tensor parallelism).

The pass ``detach_returned_heads`` (stage ``dynamo``) makes the rewrite and hands the caller ``(heads, output count
before)`` in ``ctx.results["detach_returned_heads"]``, for ``reattach``; a caller that runs the pass must reattach.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphtrain.passes.manager import PassContext, register_pass

LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


@dataclass(frozen=True)
class ReturnedHead:
    output: int  # which output of the graph holds the (detached) logits
    hidden: int  # which output holds h, added after the graph's own
    weight: int  # the input (placeholder) index of W
    bias: int | None  # and of b


def _linear_args(node: fx.Node) -> tuple[Any, Any, Any] | None:
    if node.op != "call_function" or node.target not in LINEARS:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    h, w, b = args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    return h, w, b


@register_pass("dynamo", phase="grad", after="lift_no_grad_regions", adds_outputs=True)  # after: their old order
def detach_returned_heads_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """`detach_returned_heads` on a training Dynamo graph of plain tensors (grad enabled, no DTensor input); counts
    the heads, whose (heads, output count) go to ``ctx.results["detach_returned_heads"]`` for `reattach`. Switched
    off, the logits stay outputs of the graph (with their zero gradient of [N, V] when the loss is what trains)."""
    if not torch.is_grad_enabled() or _dtensors(ctx.example_inputs):
        return gm
    heads, n_out = detach_returned_heads(gm)
    if heads:
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        ctx.results["detach_returned_heads"] = (heads, n_out)
        ctx.count(len(heads))
        for hd in heads:
            ctx.tell(
                f"returned logits of {placeholders[hd.weight]}: detached from the graph, given linear's "
                f"backward outside it (no zero gradient of their size when the loss is what trains)"
            )
    return gm


def _dtensors(inputs: Sequence[Any]) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return any(isinstance(x, DTensor) for x in inputs)


def detach_returned_heads(gm: fx.GraphModule) -> tuple[list[ReturnedHead], int]:
    """Rewrite `gm` in place (see the module docstring); returns the heads and the graph's output count before."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs = out.args[0]
    if not isinstance(outs, (tuple, list)):
        return [], 1
    outs = list(outs)
    n_out, heads = len(outs), []
    for i, o in enumerate(list(outs)):
        args = _linear_args(o) if isinstance(o, fx.Node) else None
        if args is None:
            continue
        h, w, b = args
        if not (isinstance(h, fx.Node) and w in index and (b is None or b in index)):
            continue
        if not any(u is not out for u in o.users):  # returned only: its gradient is the caller's
            continue
        val = o.meta.get("example_value")
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            continue
        with gm.graph.inserting_after(o):
            det = gm.graph.call_method("detach", (o,))
        det.meta = {k: v for k, v in o.meta.items() if k != "example_value"}
        det.meta["example_value"] = val.detach()
        outs[i] = det
        heads.append(ReturnedHead(i, len(outs), index[w], None if b is None else index[b]))
        outs.append(h)
    if heads:
        out.args = (tuple(outs),)
        gm.graph.lint()
        gm.recompile()
    return heads, n_out


class _HeadGrad(torch.autograd.Function):
    """`logits` (computed, detached, by the graph) as linear(h, weight, bias)'s output for autograd."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        ctx.has_bias = bias is not None
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        h, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        dh = dw = db = None
        if ctx.needs_input_grad[1]:
            dh = (g2 @ weight.to(g2.dtype)).to(h.dtype).view(h.shape)
        if ctx.needs_input_grad[2]:
            dw = (g2.t() @ h.reshape(-1, h.shape[-1]).to(g2.dtype)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = g2.sum(0)
        return None, dh, dw, db


def reattach(compiled: Callable[..., Any], heads: Sequence[ReturnedHead], n_out: int) -> Callable[..., Any]:
    """`compiled` (the rewritten graph's callable) returning the graph's original outputs, each head's logits with
    `_HeadGrad` as their gradient function."""

    def run(*args: Any) -> Any:
        weights = [(args[hd.weight], None if hd.bias is None else args[hd.bias]) for hd in heads]
        outs = compiled(*args)
        kept = list(outs[:n_out])
        for hd, (w, b) in zip(heads, weights):
            h = outs[hd.hidden]
            if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
                kept[hd.output] = _HeadGrad.apply(kept[hd.output], h, w, b)
        return type(outs)(kept) if isinstance(outs, tuple) else kept

    return run
