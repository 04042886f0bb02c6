"""Softmax cross-entropy fusions, two passes over one matcher, and the sparse LM head:

- fuse_linear_cross_entropy: LM head + log_softmax + nll_loss -> graphtrain::linear_cross_entropy /
  linear_bias_cross_entropy (chunked: the full logits are never materialized). On under every provider. A head
  whose logits also leave the graph detached (passes/returned_heads.py: a Hugging Face model's returned logits,
  through views) -> graphtrain::linear_cross_entropy_logits / linear_bias_cross_entropy_logits: the logits computed
  once as an output, the loss's gradient chunked from them (no [N, V] gradient).
- sparse_lm_head: the fused LM-head losses skip the rows whose target is ignored (their logits are
  never computed); a pass of its own so it can be switched off and measured alone. Measured under Inductor (batch 8, seq 128,
  2-core EPYC, `graphtrain.accelerate` step with fused AdamW, on vs off): bert-small fp32 461 vs 585
  ms/step (the MLM head runs on the 15% labelled rows; before the C++ row kernel below); gpt2-small (every row labelled) fp32 542 vs
  570, bf16 318 vs 310 ms/step, i.e. even within noise, without the [N, V] logits, their
  log-probabilities and gradient in memory.
- loss_only_lm_head: in a graph compiled under no_grad (an evaluation), the LM-head op above becomes
  graphtrain::linear_cross_entropy_loss: the loss alone, one matmul instead of three, smaller chunks. On gpt2-mini
  the head's d hidden and d weight were two 2.1 GFLOP matmuls per evaluation batch, more than the rest of its
  forward, for gradients nothing read. A returned head (the *_logits ops) is not fused in such a graph: its op
  computes the loss's gradient beside the logits; the logits and a cross-entropy over them are all it needs.
- fuse_cross_entropy: log_softmax + nll_loss on any other logits -> graphtrain::cross_entropy. Under
  Inductor it is left to Inductor's generated reduction kernels (on by default under aten only); it
  also takes the LM-head form when fuse_linear_cross_entropy is switched off.

Spellings: aten._log_softmax(x, 1|-1) feeding aten.nll_loss_forward(., target, None, reduction,
ignore_index) (what F.cross_entropy and HF's ForCausalLMLoss / MaskedLM loss trace to), only the loss
output used, no class weights, 2-D logits. Linear CE when the logits are
view/_unsafe_view(mm(h, t(W))) (tied or untied LM head without bias), and with a bias
(graphtrain::linear_bias_cross_entropy) when they are addmm(b, h, t(W)) (a Linear with bias, HF BERT's
MLM decoder) or add(view(mm(h, t(W))), b) (graphtrain BERT's tied decoder plus its own bias), with
single users all the way and a mean/sum reduction. Same function; only rounding differs.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import Argument

import graphtrain.kernels  # noqa: F401
from graphtrain.passes.fuse_utils import aten, call, finish, getitem, is_op, shape
from graphtrain.passes.manager import PassContext, register_pass


def _strip_views(cur: Argument) -> Argument:
    while is_op(cur, aten.view, aten._unsafe_view, aten.reshape) and len(cur.users) == 1:
        cur = cur.args[0]
    return cur


def _lm_head(x: fx.Node) -> tuple[fx.Node, Argument, fx.Node | None] | None:
    """logits node -> (hidden 2-D, weight^T node, bias [V] node or None) if an LM-head matmul (plus bias)."""
    cur = _strip_views(x)
    bias: Argument = None
    if is_op(cur, aten.addmm) and len(cur.users) == 1 and len(cur.args) == 3 and not cur.kwargs:
        bias, h, wt = cur.args  # Linear with bias (Hugging Face's MLM decoder)
    else:
        if is_op(cur, aten.add) and len(cur.users) == 1 and len(cur.args) == 2 and not cur.kwargs:
            a, b = cur.args  # mm + a separate bias (graphtrain BERT's MLM head)
            for mm_side, b_side in ((a, b), (b, a)):
                if isinstance(b_side, fx.Node) and len(shape(b_side) or ()) == 1:
                    cur, bias = _strip_views(mm_side), b_side
                    break
            else:
                return None
        if not is_op(cur, aten.mm) or len(cur.users) != 1:
            return None
        h, wt = cur.args
    hs = shape(h)
    if not isinstance(h, fx.Node) or hs is None or len(hs) != 2:
        return None
    if bias is not None:
        bs, xs = shape(bias), shape(x)
        if not isinstance(bias, fx.Node) or bs is None or len(bs) != 1 or xs is None or bs[0] != xs[-1]:
            return None
    return h, wt, bias


_VIEWS = (aten.view, aten._unsafe_view, aten.reshape)


def _returned_chain(u: fx.Node) -> list[fx.Node] | None:
    """`u` and the nodes after it when they are views ending in a detach whose only user is the graph's output (the
    logits passes/returned_heads.py returns detached), else None."""
    chain = [u]
    while is_op(chain[-1], *_VIEWS) and len(chain[-1].users) == 1:
        chain.append(next(iter(chain[-1].users)))
    last = chain[-1]
    if not is_op(last, aten.detach, aten.alias) or not all(x.op == "output" for x in last.users):
        return None
    return chain


def _returned_lm_head(
    x: fx.Node, ls: fx.Node
) -> tuple[fx.Node, Argument, fx.Node | None, fx.Node, list[fx.Node]] | None:
    """x (the cross-entropy's 2-D logits) -> (hidden, weight^T, bias, head node, nodes to move after the fused op)
    when x is an LM head matmul (mm, or addmm with a bias) whose logits also leave the graph detached, through views
    only; None otherwise."""
    path = [x]
    while is_op(path[-1], *_VIEWS) and isinstance(src := path[-1].args[0], fx.Node):
        path.append(src)
    head = path[-1]
    bias: fx.Node | None = None
    if is_op(head, aten.addmm) and len(head.args) == 3 and not head.kwargs:
        b, h, wt = head.args
        if not isinstance(b, fx.Node) or len(shape(b) or ()) != 1:
            return None
        bias = b
    elif is_op(head, aten.mm):
        h, wt = head.args
    else:
        return None
    hs = shape(h)
    if not isinstance(h, fx.Node) or hs is None or len(hs) != 2 or shape(head) != shape(x):
        return None
    on_path, returned = set(path), False
    moved: list[fx.Node] = []
    for node in reversed(path):  # head first
        for u in node.users:
            if u in on_path or u is ls:
                continue
            chain = _returned_chain(u)
            if chain is None:
                return None
            moved.extend(chain)
            returned = True
    if not returned:
        return None
    return h, wt, bias, head, [n for n in reversed(path[:-1])] + moved


def _fuse_returned(
    g: fx.Graph, node: fx.Node, ls: fx.Node, x: fx.Node, target: Any, reduction: Any, ignore: Any
) -> bool:
    """Rewrite the LM head + cross-entropy (`node`, the nll_loss) of a head whose logits are also returned to
    graphtrain's *_logits op (the logits computed once, the loss's gradient chunked from them:
    kernels/linear_cross_entropy.py); False when `x` is not such a head."""
    found = _returned_lm_head(x, ls) if reduction in (1, 2) else None
    if found is None:
        return False
    h, wt, bias, head, moved = found
    with g.inserting_before(node):
        w = wt.args[0] if is_op(wt, aten.t) else call(g, aten.t.default, wt)
        if bias is None:
            fused = call(
                g, torch.ops.graphtrain.linear_cross_entropy_logits.default, h, w, target, ignore, reduction, 0, False
            )
            logits = getitem(g, fused, 3)
        else:
            fused = call(
                g,
                torch.ops.graphtrain.linear_bias_cross_entropy_logits.default,
                h,
                w,
                bias,
                target,
                ignore,
                reduction,
                0,
                False,
            )
            logits = getitem(g, fused, 4)
        loss = getitem(g, fused, 0)
    for u in list(node.users):
        u.replace_all_uses_with(loss)
        g.erase_node(u)
    g.erase_node(node)
    g.erase_node(ls)
    anchor = logits
    for m in moved:  # the views and detach that returned the head's logits now follow the op that computes them
        anchor.append(m)
        anchor = m
    head.replace_all_uses_with(logits)
    return True


def _fuse(gm: fx.GraphModule, ctx: PassContext, linear_only: bool) -> fx.GraphModule:
    g, n = gm.graph, 0
    for node in list(g.nodes):
        if not is_op(node, aten.nll_loss_forward) or getattr(node, "_erased", False):
            continue
        ls, target, weight, reduction, ignore = node.args[:5]
        if weight is not None or not is_op(ls, aten._log_softmax, aten.log_softmax) or len(ls.users) != 1:
            continue
        x = ls.args[0]
        xs = shape(x)
        if (
            not isinstance(x, fx.Node)
            or xs is None
            or len(xs) != 2
            or ls.args[1] not in (1, -1)
            or (len(ls.args) > 2 and ls.args[2])
        ):
            continue
        if any(not (is_op(u, operator.getitem) and u.args[1] == 0) for u in node.users):
            continue
        head = _lm_head(x) if reduction in (1, 2) and len(x.users) == 1 else None
        # a returned head's op computes the loss's gradient beside the logits: not in a no_grad graph, where the
        # logits (computed anyway) and a cross-entropy over them are all there is to do
        if head is None and not ctx.inference and _fuse_returned(g, node, ls, x, target, reduction, ignore):
            n += 1
            continue
        if linear_only and head is None:
            continue
        with g.inserting_before(node):
            if head is not None:
                h, wt, bias = head
                w = wt.args[0] if is_op(wt, aten.t) else call(g, aten.t.default, wt)
                if bias is None:
                    fused = call(
                        g, torch.ops.graphtrain.linear_cross_entropy.default, h, w, target, ignore, reduction, 0, False
                    )
                else:
                    fused = call(
                        g,
                        torch.ops.graphtrain.linear_bias_cross_entropy.default,
                        h,
                        w,
                        bias,
                        target,
                        ignore,
                        reduction,
                        0,
                        False,
                    )
            else:
                fused = call(g, torch.ops.graphtrain.cross_entropy.default, x, target, ignore, reduction)
            out = getitem(g, fused, 0)
        for u in list(node.users):
            u.replace_all_uses_with(out)
            g.erase_node(u)
        g.erase_node(node)
        n += 1
    g.eliminate_dead_code()
    ctx.count(n)
    return finish(gm)


@register_pass("pre_autodiff", phase="fuse_epilogue")
def fuse_linear_cross_entropy_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite an LM head (matmul, optional bias) feeding softmax cross-entropy to graphtrain's chunked op."""
    return _fuse(gm, ctx, linear_only=True)


@register_pass("pre_autodiff", phase="fuse_loss", providers=("aten",))
def fuse_cross_entropy_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite softmax cross-entropy (and an LM head feeding it, if still there) to graphtrain's fused ops."""
    return _fuse(gm, ctx, linear_only=False)


_LINEAR_CE = {
    torch.ops.graphtrain.linear_cross_entropy.default: 6,
    torch.ops.graphtrain.linear_bias_cross_entropy.default: 7,
    torch.ops.graphtrain.linear_cross_entropy_logits.default: 6,
    torch.ops.graphtrain.linear_bias_cross_entropy_logits.default: 7,
}  # op -> index of skip_ignored


# it flags the LM-head ops both fusions above insert
@register_pass("pre_autodiff", phase="fuse_loss", after="fuse_cross_entropy")
def sparse_lm_head_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Let the fused LM-head losses skip rows whose label is ignore_index (the sparse masked-LM head: ~85% of
    BERT's rows; see kernels/linear_cross_entropy.py). Same loss and gradients up to summation order; the rows
    to skip are found from the labels at run time, so a batch with every row labelled runs dense."""
    n = 0
    for node in gm.graph.nodes:
        i = _LINEAR_CE.get(node.target) if node.op == "call_function" else None
        if i is None:
            continue
        args = list(node.args)
        if len(args) == i:  # skip_ignored left at its default
            args.append(True)
            n += 1
        elif args[i] is not True:
            args[i] = True
            n += 1
        node.args = tuple(args)
    ctx.count(n)
    if n:
        gm.recompile()
    return gm


_LOSS_ONLY = {
    torch.ops.graphtrain.linear_cross_entropy.default: False,
    torch.ops.graphtrain.linear_bias_cross_entropy.default: True,
}  # op -> whether it takes a bias (its argument 2)


@register_pass("pre_autodiff", phase="fuse_loss", after="sparse_lm_head")
def loss_only_lm_head_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """In a graph compiled under no_grad (ctx.inference: an evaluation), let the fused LM-head loss compute the loss
    alone (graphtrain::linear_cross_entropy_loss): the training op computes d hidden and d weight in its forward,
    which no backward reads here. Same loss up to summation order (its chunks differ)."""
    if not ctx.inference:
        return gm
    g, n = gm.graph, 0
    for node in list(g.nodes):
        has_bias = _LOSS_ONLY.get(node.target) if node.op == "call_function" else None
        if has_bias is None or any(not (is_op(u, operator.getitem) and u.args[1] == 0) for u in node.users):
            continue
        args = list(node.args)
        if not has_bias:
            args.insert(2, None)
        # (hidden, weight, bias, target, ignore_index, reduction, chunk_rows[, skip_ignored]): the training op's
        # default chunk (0) becomes the loss op's own default, and so does skip_ignored's (True)
        with g.inserting_before(node):
            loss = call(g, torch.ops.graphtrain.linear_cross_entropy_loss.default, *args)
        for u in list(node.users):
            u.replace_all_uses_with(loss)
            g.erase_node(u)
        g.erase_node(node)
        n += 1
    ctx.count(n)
    return finish(gm) if n else gm
