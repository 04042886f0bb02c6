"""The joint-graph rewrites that recompute relies on, made before and after AOTAutograd's partition
(``memory/recompute.py`` runs them; ``memory/seeded.py`` holds the fused-dropout split):

- ATen dropout's output becomes ``x * mask * scale`` from its saved 1-byte mask, so it can be recomputed;
- a full-size additive attention mask read only by ``graphtrain::attention`` is rebuilt at its broadcast size;
- random ops whose results nobody reads are erased from a partitioned graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from graphtrain.passes.graph_utils import is_random, symints_as_nodes

aten = torch.ops.aten
graphtrain_ops = torch.ops.graphtrain


def rewrite_dropout_for_recompute(joint: fx.GraphModule) -> int:
    """Make dropout outputs recomputable: uses of native_dropout(x)[0] read x * mask * scale."""
    count = 0
    for n in list(joint.graph.nodes):
        if n.op != "call_function" or n.target is not aten.native_dropout.default:
            continue
        x, p = n.args[0], n.args[1]
        outs = [u for u in n.users if u.target is operator.getitem and u.args[1] == 0 and u.users]
        masks = [u for u in n.users if u.target is operator.getitem and u.args[1] == 1]
        if not outs or not masks or p >= 1.0:
            continue
        scale = 1.0 / (1.0 - p)
        mask = masks[0]
        fake = detect_fake_mode([x.meta["val"]])
        if fake is None:  # no fake value to give the new nodes (a traced joint graph always has them)
            continue
        with joint.graph.inserting_after(mask):
            m1 = joint.graph.call_function(aten.mul.Tensor, (x, mask))
        with joint.graph.inserting_after(m1):
            m2 = joint.graph.call_function(aten.mul.Tensor, (m1, scale))
        with fake:
            m1.meta["val"] = aten.mul.Tensor(x.meta["val"], mask.meta["val"])
            m2.meta["val"] = aten.mul.Tensor(m1.meta["val"], scale)
        for key in ("stack_trace", "nn_module_stack", "seq_nr", "partitioner_tag"):
            if key in n.meta:
                m1.meta[key] = m2.meta[key] = n.meta[key]
        for o in outs:
            o.replace_all_uses_with(m2)
        count += 1
    joint.graph.eliminate_dead_code()
    joint.recompile()
    return count


_MASK_ARG = {graphtrain_ops.attention: 3, graphtrain_ops.attention_backward: 4}


def _reads_only_as_mask(u: fx.Node, mask: fx.Node) -> bool:
    packet = getattr(u.target, "overloadpacket", None)
    i = _MASK_ARG.get(packet) if packet is not None else None
    return (
        i is not None
        and len(u.args) > i
        and u.args[i] is mask
        and sum(a is mask for a in u.args) + sum(a is mask for a in u.kwargs.values()) == 1
    )


def shrink_attention_masks(joint: fx.GraphModule) -> int:
    """An additive mask built as ``masked_fill(zeros_like(scores), bool_mask, -inf)`` and read only as
    graphtrain::attention's (and its backward's) mask becomes ``masked_fill(zeros(bool_mask.shape), bool_mask, -inf)``.

    The attention op broadcasts its mask, so the values it sees are the same; but the full-size mask
    is batch x heads x seq x seq floats that the backward reads (saved for backward: as much memory as
    the probabilities the fused op exists to avoid saving), and ``zeros_like(scores)`` kept the score
    matmul q @ k^T alive in the forward only for its shape. Measured on gpt2-small seq 256: six
    [1, 8, 256, 256] fp32 masks saved, one per layer, and six dead bmm. Returns how many were rewritten."""
    g, count = joint.graph, 0
    for z in list(g.nodes):
        if z.op != "call_function" or z.target is not aten.zeros_like.default or len(z.users) != 1:
            continue
        mf = next(iter(z.users))
        if mf.target is not aten.masked_fill.Scalar or mf.args[0] is not z or not isinstance(mf.args[1], fx.Node):
            continue
        if not mf.users or not all(_reads_only_as_mask(u, mf) for u in mf.users):
            continue
        zval, m = z.meta["val"], mf.args[1]
        mshape = tuple(m.meta["val"].shape)
        if (
            len(mshape) > zval.dim()
            or tuple(torch.broadcast_shapes(mshape, tuple(zval.shape))) != tuple(zval.shape)
            or mf.meta["val"].numel() <= m.meta["val"].numel()
        ):
            continue
        fake = detect_fake_mode([zval])
        if fake is None:  # no fake value to give the new nodes (a traced joint graph always has them)
            continue
        with g.inserting_before(z):
            z2 = g.call_function(
                aten.zeros.default,
                symints_as_nodes(g, (list(mshape),)),
                {"dtype": zval.dtype, "device": zval.device, "pin_memory": False},
            )
        with g.inserting_after(z2):
            mf2 = g.call_function(aten.masked_fill.Scalar, (z2, m, mf.args[2]))
        with fake:
            z2.meta["val"] = torch.zeros(mshape, dtype=zval.dtype, device=zval.device)
            mf2.meta["val"] = aten.masked_fill.Scalar(z2.meta["val"], m.meta["val"], mf.args[2])
        for key in ("stack_trace", "nn_module_stack", "seq_nr", "custom"):
            if key in mf.meta:
                z2.meta[key] = mf2.meta[key] = mf.meta[key]
        mf.replace_all_uses_with(mf2)
        count += 1
    if count:
        joint.graph.eliminate_dead_code()
        joint.recompile()
    return count


def drop_dead_random_ops(gm: fx.GraphModule) -> int:
    """Erase random ops whose results nobody reads, then dead code.

    AOTAutograd's partitioners copy into the backward every forward node computable from the saved
    values; DCE then keeps random ops (impure). Measured on gpt2-tiny with default_partition: the
    backward re-ran bmm, scale, mask, softmax and native_dropout of each attention layer and threw
    the result away, costing compute and advancing the RNG (so the next step's dropout differs
    from eager's)."""
    count = 0
    for n in reversed(list(gm.graph.nodes)):
        if is_random(n) and all(u.target is operator.getitem and not u.users for u in n.users):
            for u in list(n.users):
                gm.graph.erase_node(u)
            gm.graph.erase_node(n)
            count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count
