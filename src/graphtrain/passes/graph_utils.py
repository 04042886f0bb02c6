"""Node predicates every pass (and the recompute partitioner) shares. Pass modules import helpers from here or
from fuse_utils.py, never from each other."""
from __future__ import annotations

import torch
import torch.fx as fx

from graphtrain.kernels.registry import is_random_op


def is_random(n: fx.Node) -> bool:
    """`n` draws random numbers: an ATen op tagged nondeterministic_seeded (dropout, bernoulli, rand, ...) or a
    graphtrain op whose descriptor says random (fused dropout and attention draw their seed inside). Such a call
    is never merged, duplicated, recomputed or deleted: the RNG stream must advance as in eager. A call with a
    `dropout_p` argument of 0 (aten's SDPA kernels, tagged for their dropout) draws nothing."""
    return n.op == "call_function" and is_random_op(n.target) and not zero_dropout(n)


def has_random_tag(n: fx.Node) -> bool:
    """`n`'s schema is tagged nondeterministic_seeded (and it is not a call with dropout_p 0): ATen's random ops
    (which Inductor lowers itself) and graphtrain::dropout_seed, but not graphtrain's fused ops that draw their
    seed inside (see `is_random`)."""
    t = n.target
    return (isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags
            and not zero_dropout(n))


def zero_dropout(n: fx.Node) -> bool:
    """`n` calls an op with a `dropout_p` argument (aten's SDPA kernels) with the value 0: it samples nothing."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    for i, a in enumerate(t._schema.arguments):
        if a.name == "dropout_p":
            p = n.args[i] if i < len(n.args) else n.kwargs.get("dropout_p", a.default_value)
            return isinstance(p, (int, float)) and p == 0
    return False
