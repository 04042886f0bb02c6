"""Recomputable dropout: split graphtrain::bias_dropout_add into its random draw and a deterministic op.

``graphtrain::bias_dropout_add(x, bias, residual, p) -> (out, seed)`` draws its seed inside the op
(``kernels._common.new_seed``: one ``torch.randint`` on the default CPU generator) and hashes
(seed, element index) into the keep-mask. Its schema does not say it is random, so a partitioner
allowed to recompute custom ops re-runs it in the backward with a *new* seed: a different mask
than the forward used, i.e. wrong gradients (measured before this module: gpt2-tiny under
``recompute: full`` with the default fusion passes, gradients off by up to 4e-2 from ``none``).

``split_fused_dropout`` rewrites each such node in the joint graph into

    seed = graphtrain::dropout_seed(i)                                  # random: tagged, never recomputed
    out  = graphtrain::bias_dropout_add_seeded(x, bias, residual, p, seed)   # deterministic

which draws the same number from the same generator (so the forward's mask, the RNG state after the
step and every result are bitwise those of the fused op) and lets the partitioner save 8 bytes of
seed instead of an activation: the output is recomputed from its inputs and the seed. Both ops are
registered in kernels/bias_dropout_add.py, whose descriptors name them (roles SEED and SEEDED).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import graphtrain.kernels  # noqa: F401  (registers the kernels and their descriptors)
from graphtrain.kernels.registry import FORWARD, KERNELS, SEED, SEEDED


def seeded_variants() -> dict[torch._ops.OpOverload, tuple[torch._ops.OpOverload, torch._ops.OpOverload]]:
    """Random fused op -> (its seed draw, its seeded variant), for each kernel whose descriptors name both
    (registry.SEED / SEEDED roles; today graphtrain::bias_dropout_add's)."""
    out = {}
    for spec in KERNELS.values():
        fwd, seed, seeded = spec.op_with_role(FORWARD), spec.op_with_role(SEED), spec.op_with_role(SEEDED)
        if fwd is not None and fwd.random and seed is not None and seeded is not None:
            out[fwd.op.default] = (seed.op.default, seeded.op.default)
    return out


def split_fused_dropout(joint: fx.GraphModule) -> int:
    """Rewrite every random fused op that has a seeded variant (graphtrain::bias_dropout_add) in `joint` into its
    seed draw + its seeded variant (dropout_seed + bias_dropout_add_seeded)."""
    g, count = joint.graph, 0
    variants = seeded_variants()
    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in variants:
            continue
        outs = [u for u in n.users if u.target is operator.getitem]
        if len(outs) != len(n.users):
            continue
        draw, seeded = variants[n.target]
        with g.inserting_before(n):
            seed = g.call_function(draw, (count,))
            out = g.call_function(seeded, (*n.args, seed), dict(n.kwargs))
        val = n.meta.get("val")
        seed.meta["val"], out.meta["val"] = val[1], val[0]
        for key in ("stack_trace", "nn_module_stack", "seq_nr", "partitioner_tag", "custom"):
            if key in n.meta:
                seed.meta[key] = out.meta[key] = n.meta[key]
        for u in outs:
            u.replace_all_uses_with(out if u.args[1] == 0 else seed)
            g.erase_node(u)
        g.erase_node(n)
        count += 1
    if count:
        joint.recompile()
    return count
