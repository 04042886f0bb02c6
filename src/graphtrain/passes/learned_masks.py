"""SDPA calls whose mask needs a gradient keep eager's choice of kernel: aten's math implementation.

A learned attention bias (Swin's relative position bias table, added to its shifted-window mask) reaches
``F.scaled_dot_product_attention`` as an ``attn_mask`` that requires grad. Eager's SDPA then takes the math
implementation (matmul, softmax, matmul), the only one that gives the mask a gradient. graphtrain traces the
forward to aten with autograd off (pipeline/trace.py), so at trace time nothing requires grad and SDPA picks CPU
flash attention, whose backward refuses a mask that needs a gradient: the aten provider failed and the whole
module ran eagerly (Hugging Face Swin, 2026-11-26).

``learned_masks_to_math(gm)`` runs on the Dynamo graph, whose example values were computed with autograd on: each
SDPA call (in the graph or in a repeated block's body) whose mask's example value requires grad is pointed at
``sdpa_math``, the same call through ``aten._scaled_dot_product_attention_math``. The trace then decomposes it into
the ops eager runs, and autodiff gives the mask its gradient. Numerics are eager's: the same implementation.
The pass ``route_learned_masks_to_math`` (stage ``dynamo``) runs it on every Dynamo graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from graphtrain.passes.graph_utils import call_arg, example_value, is_sdpa_call
from graphtrain.passes.manager import PassContext, register_pass


# after: the order the two ran in before they were passes (they rewrite different calls: a mask that requires
# grad is no constant)
@register_pass("dynamo", phase="masks", after="specialize_static_masks")
def route_learned_masks_to_math_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """`learned_masks_to_math` on the Dynamo graph; counts the SDPA calls pointed at aten's math implementation.
    Switched off, such a call reaches CPU flash attention, whose backward refuses the mask (the provider fails)."""
    if learned := learned_masks_to_math(gm):
        ctx.count(learned)
        ctx.tell(
            f"{learned} SDPA call(s) with a mask that needs a gradient (a learned bias): run through aten's "
            f"math implementation, as eager does"
        )
    return gm


def sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` through aten's math implementation (what eager runs for a mask that
    requires grad)."""
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )[0]


def _needs_grad(mask: Any) -> bool:
    v = example_value(mask)
    return isinstance(v, torch.Tensor) and v.requires_grad


def learned_masks_to_math(gm: fx.GraphModule) -> int:
    """Point every SDPA call whose mask requires grad at `sdpa_math` (module docstring), in `gm` and in the
    graphs it holds (block bodies). Returns how many calls were rewritten."""
    done = 0
    for mod in gm.modules():
        if not isinstance(mod, fx.GraphModule):
            continue
        changed = False
        for n in mod.graph.nodes:
            if is_sdpa_call(n) and _needs_grad(call_arg(n, 3, "attn_mask")):
                n.target = sdpa_math
                changed = True
                done += 1
        if changed:
            mod.recompile()
    return done
