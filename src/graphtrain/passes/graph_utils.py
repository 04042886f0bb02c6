"""Node predicates every pass (and the recompute partitioner) shares. Pass modules import helpers from here or
from fuse_utils.py, never from each other."""
from __future__ import annotations

import torch
import torch.fx as fx

from graphtrain.kernels.registry import is_random_op


def is_random(n: fx.Node) -> bool:
    """`n` draws random numbers: an ATen op tagged nondeterministic_seeded (dropout, bernoulli, rand, ...) or a
    graphtrain op whose descriptor says random (fused dropout and attention draw their seed inside). Such a call
    is never merged, duplicated, recomputed or deleted: the RNG stream must advance as in eager."""
    return n.op == "call_function" and is_random_op(n.target)


def has_random_tag(n: fx.Node) -> bool:
    """`n`'s schema is tagged nondeterministic_seeded: ATen's random ops (which Inductor lowers itself) and
    graphtrain::dropout_seed, but not graphtrain's fused ops that draw their seed inside (see `is_random`)."""
    t = n.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags
