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
seed instead of an activation: the output is recomputed from its inputs and the seed.
"""
from __future__ import annotations

import importlib
import operator
from typing import Optional

import torch
import torch.fx as fx
from torch import Tensor

import graphtrain.kernels  # noqa: F401  (registers graphtrain::bias_dropout_add)
from graphtrain.kernels._common import dense_empty, dispatch, new_seed

_bda = importlib.import_module("graphtrain.kernels.bias_dropout_add")  # the package re-exports a function by that name


@torch.library.custom_op("graphtrain::dropout_seed", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def _dropout_seed(salt: int) -> Tensor:
    """A fresh seed, as graphtrain::bias_dropout_add draws it. `salt` is unused: it makes each call site
    distinct, so common-subexpression elimination (which only knows ATen's random ops) cannot merge two
    draws into one."""
    return new_seed()


@_dropout_seed.register_fake
def _(salt: int) -> Tensor:
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("graphtrain::bias_dropout_add_seeded", mutates_args=())
def _bias_dropout_add_seeded(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], p: float,
                             seed: Tensor) -> Tensor:
    """graphtrain::bias_dropout_add's output for a given seed (the same kernels, so the same bits)."""
    def cpu():
        empty = x.new_empty(0)
        return _bda._cpu_ext.load().bias_dropout_add_fwd(x, bias if bias is not None else empty,
                                                         residual if residual is not None else empty, p,
                                                         int(seed.item()))

    def reference():
        out = _bda.bias_dropout_add_reference(x, bias, residual, p, seed)
        return x.clone(memory_format=torch.contiguous_format) if out is x else out

    return dispatch("bias_dropout_add", [
        ("triton", _bda._supports_triton(x, bias, residual), lambda: _bda._bda_triton(x, bias, residual, p, seed)),
        ("c++", _bda._supports_cpu(x, bias, residual), cpu)], reference).contiguous()


@_bias_dropout_add_seeded.register_fake
def _(x, bias, residual, p, seed):
    return dense_empty(x)


FUSED_RANDOM = {torch.ops.graphtrain.bias_dropout_add.default}
SEEDED = {torch.ops.graphtrain.bias_dropout_add_seeded.default}


def split_fused_dropout(joint: fx.GraphModule) -> int:
    """Rewrite every graphtrain::bias_dropout_add in `joint` into dropout_seed + bias_dropout_add_seeded."""
    g, count = joint.graph, 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in FUSED_RANDOM:
            continue
        outs = [u for u in n.users if u.target is operator.getitem]
        if len(outs) != len(n.users):
            continue
        with g.inserting_before(n):
            seed = g.call_function(torch.ops.graphtrain.dropout_seed.default, (count,))
            out = g.call_function(torch.ops.graphtrain.bias_dropout_add_seeded.default, (*n.args, seed), dict(n.kwargs))
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
