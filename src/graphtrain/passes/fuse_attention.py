"""fuse_attention: softmax(q @ k^T * scale + mask) [dropout] @ v -> graphtrain::attention.

Matched from each softmax node (aten._softmax / _safe_softmax over the last dim) outwards, so the
spellings real models use all land on one matcher: matmul of q with k.transpose(-2, -1) or
k.transpose(2, 3) traced as bmm on expanded/cloned/reshaped operands; `* scale` or `/ sqrt(d)`
applied to the scores, or to q and k (SDPA's math decomposition); an additive mask, masked_fill
(-inf or finfo.min) or torch.where; dropout as x * bernoulli / keep (F.dropout, SDPA's in-place
bernoulli_, native_dropout); bmm with the (dropped) probabilities and v; [B*H, S, S] bmm scores viewed as
[B, H, S, S] to meet a [B, 1, S, S] mask (DeBERTa), fused in that shape. HF GPT-2/BERT eager and
SDPA attention (SDPA with dropout is decomposed by the tracer into exactly this), graphtrain's own
GPT-2/BERT, and hand-written modules trace to these forms.

SDPA calls without dropout arrive as aten._scaled_dot_product_flash_attention_for_cpu, which is already one
fused kernel. Those graphtrain::attention would run head by head (fp32, no mask, CPU: `_flash_to_heads`) are
rewritten to it; the others are kept, and the pass's note counts both. The rewrite once cost more than it gained
(HF Llama, 6 layers, width 512, batch 8 x 128, fp32, 2-core AVX2 EPYC, aten provider: 0.90x eager's step with it,
0.95x without) because the op's outputs were contiguous [B, H, S, D] where the flash kernel's keep the model's
[B, S, H, D] layout, a transpose copy each way; they now keep q's (and k's, v's) layout. Under grouped-query
attention the rewrite passes k and v from before Hugging Face's repeat_kv (`_unrepeated_kv`): the op reads each
key/value head for its group of query heads, so the expanded copies of k and v and their gradients' sum are gone.

Safe: the fused op computes the same function (fully masked rows give zeros, as _safe_softmax;
with a plain _softmax they would be NaN); dropout keeps probability 1 - p and scales by 1/(1 - p)
but draws a different (hash-based) mask than aten's Bernoulli, like any change of RNG. Skipped
(no rewrite) when the probabilities or scores have other users (e.g. output_attentions), when the
mask is computed from trainable parameters (a learned bias needs a gradient the op does not give),
or when shapes do not line up (a mask that would not broadcast to the fused op's [B, H, Sq, Sk] scores).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx as fx
from torch.fx.node import Argument

import graphtrain.kernels  # noqa: F401  (registers torch.ops.graphtrain.*)
from graphtrain.kernels.attention import _cpu_heads_ok, _heads_last
from graphtrain.passes.fuse_utils import (
    aten,
    call,
    erase_dead,
    finish,
    getitem,
    is_op,
    known_shape,
    match_dropout,
    needs_gradient,
    number,
    only_user,
    shape,
    strip_views,
    val,
)
from graphtrain.passes.graph_utils import constant_mask_kind
from graphtrain.passes.manager import PassContext, register_pass


def _split_mask(g: fx.Graph, n: fx.Node) -> tuple[fx.Node, Callable[[], fx.Node] | None]:
    """scores-with-mask node -> (scores node, additive-mask builder or None)."""
    if (
        is_op(n, aten.add)
        and len(n.args) == 2
        and isinstance(a := n.args[0], fx.Node)
        and isinstance(b := n.args[1], fx.Node)
    ):
        # the scores side comes from a bmm (through views/scales); the other side is the mask
        sa = shape(a)
        if strip_views(a, sa[-2:] if sa else ()) and _reaches_bmm(a):
            return a, lambda: b
        if _reaches_bmm(b):
            return b, lambda: a
    if is_op(n, aten.masked_fill) and number(n.args[2]) is not None:
        s, m, v = n.args
        if isinstance(s, fx.Node):  # the tensor masked_fill is called on
            return s, lambda: call(g, aten.masked_fill.Scalar, call(g, aten.zeros_like.default, s), m, v)
    if is_op(n, aten.where) and len(n.args) == 3:
        c, s, other = n.args
        if isinstance(s, fx.Node) and _reaches_bmm(s):

            def build() -> fx.Node:
                fill = other if isinstance(other, fx.Node) else call(g, aten.full_like.default, s, other)
                return call(g, aten.where.self, c, call(g, aten.zeros_like.default, s), fill)

            return s, build
    return n, None


def _reaches_bmm(n: Argument) -> bool:
    for _ in range(8):
        if not isinstance(n, fx.Node):
            return False
        if is_op(n, aten.bmm):
            return True
        if is_op(n, aten.view, aten._unsafe_view, aten.reshape, aten.mul, aten.div, aten.clone, aten.expand):
            n = n.args[0] if isinstance(n.args[0], fx.Node) else n.args[1]
            continue
        return False
    return False


def _scores(n: Argument) -> tuple[fx.Node, float] | None:
    """scaled scores node -> (bmm node, scale)."""
    scale = 1.0
    while True:
        if is_op(n, aten.mul) and (c := number(n.args[1])) is not None:
            scale, n = scale * c, n.args[0]
        elif is_op(n, aten.div) and (c := number(n.args[1])) is not None:
            scale, n = scale / c, n.args[0]
        elif is_op(n, aten.view, aten._unsafe_view, aten.reshape):
            n = n.args[0]
        elif is_op(n, aten.bmm):
            return n, scale
        else:
            return None


def _as4d(g: fx.Graph, n: fx.Node, lead: tuple[int, int] | None = None) -> fx.Node:
    """n as [B, H, S, D]: a 3-D [B*H, S, D] operand is split as `lead` says (the masked scores' [B, H]), else
    given a batch of 1."""
    s = known_shape(n)
    if len(s) == 4:
        return n
    if lead is not None:
        return call(g, aten.reshape.default, n, [*lead, *s[-2:]])
    return call(g, aten.unsqueeze.default, n, 0)


def _scores_lead(scores: fx.Node, bmm: fx.Node) -> tuple[int, int] | None:
    """The [B, H] a 3-D bmm's [B*H, Sq, Sk] scores were viewed as before the mask met them (DeBERTa: bmm, then
    view(-1, H, Sq, Sk), then masked_fill with a [B, 1, Sq, Sk] mask), or None when the mask met them as the bmm
    gave them."""
    ms, bs = shape(scores), shape(bmm)
    if ms is None or bs is None or len(bs) != 3 or len(ms) != 4 or tuple(ms[-2:]) != tuple(bs[-2:]):
        return None
    return (ms[0], ms[1]) if ms[0] * ms[1] == bs[0] else None


def _try_fuse(gm: fx.GraphModule, sm: fx.Node, ctx: PassContext) -> bool:
    g = gm.graph
    ss = shape(sm)
    if ss is None or len(ss) not in (3, 4) or sm.args[1] not in (-1, len(ss) - 1):
        return False
    if is_op(sm, aten._softmax) and sm.args[2]:
        return False  # half_to_float softmax: different output dtype
    masked = sm.args[0]
    if not isinstance(masked, fx.Node) or len(masked.users) != 1:
        return False
    scores, mask_fn = _split_mask(g, masked)
    if mask_fn is not None and len(scores.users) != 1:
        return False
    sc = _scores(scores)
    if sc is None:
        return False
    bmm, post_scale = sc
    lead = _scores_lead(scores, bmm)
    ms, bs = shape(scores), shape(bmm)
    if ms is None or bs is None or (lead is None and len(ms) != len(bs)):
        return False  # the mask met the scores in a shape other than a split of the bmm's batch
    A, B = bmm.args
    sa, sb = shape(A), shape(B)
    if sa is None or sb is None:
        return False
    sq, sk = bs[-2:]
    qa, kb = strip_views(A, (sq, sa[-1])), strip_views(B, (sb[-2], sk))
    if qa is None or kb is None:
        return False
    (q, qs), (kt, ks) = qa, kb
    # forward side: optional dropout, then bmm with v
    users = [u for u in sm.users if not is_op(u, aten.empty_like)]  # empty_like: SDPA's dropout-mask shape
    p, cur = 0.0, (users[0] if len(users) == 1 else None)
    drop_nodes: list[fx.Node] = []
    if cur is not None and is_op(cur, aten.native_dropout) and len(cur.users) == 1:
        cur = next(iter(cur.users))  # its output (getitem 0): match_dropout's spelling of native_dropout
    d = match_dropout(cur) if cur is not None else None
    if cur is not None and d is not None and d[0] is sm:
        p, drop_nodes, cur = d[1], [cur] + d[2], only_user(cur)
    while cur is not None and is_op(cur, aten.view, aten._unsafe_view, aten.expand, aten.clone, aten.reshape):
        cur = only_user(cur)
    if cur is None or not is_op(cur, aten.bmm) or cur.args[1] is None or (s2 := shape(cur)) is None:
        return False
    bmm2 = cur
    va = strip_views(bmm2.args[1], (sk, s2[-1]))
    if va is None or va[1] != 1.0:
        return False
    v = va[0]
    mask: fx.Node | None = None
    with g.inserting_before(bmm2):
        if not (len(known_shape(q)) == len(known_shape(kt)) == len(known_shape(v))):
            # mixed 3-D/4-D: work in [B*H, S, D]
            q, kt, v = [
                n if len(known_shape(n)) == 3 else call(g, aten.reshape.default, n, [-1, *known_shape(n)[-2:]])
                for n in (q, kt, v)
            ]
        causal = False
        if mask_fn is not None:
            mask = mask_fn()
            if needs_gradient(mask, gm, ctx.input_kinds, ctx.example_inputs):
                return False
            kind = constant_mask_kind(gm, mask, sq, sk)
            if kind is not None:  # SDPA's own causal mask (is_causal=True) or one built from shapes
                mask, causal = None, kind == "causal"
        q4, v4 = _as4d(g, q, lead), _as4d(g, v, lead)
        k4 = call(g, aten.transpose.int, _as4d(g, kt, lead), -2, -1)
        if known_shape(q4)[:2] != known_shape(k4)[:2] or known_shape(k4)[:3] != known_shape(v4)[:3]:
            return False
        if mask is not None:
            if mask.meta["val"].dtype != q4.meta["val"].dtype:
                mask = call(g, aten._to_copy.default, mask, dtype=q4.meta["val"].dtype)
            if len(known_shape(mask)) < 4 and len(ss) == 3 and lead is None:
                mask = call(g, aten.unsqueeze.default, mask, 0)
            full = (*known_shape(q4)[:2], sq, sk)
            try:  # the mask must broadcast to the op's [B, H, Sq, Sk] scores, as it did to the graph's
                fits = tuple(torch.broadcast_shapes(known_shape(mask), full)) == full
            except RuntimeError:
                fits = False
            if not fits:
                return False
        att = call(g, torch.ops.graphtrain.attention.default, q4, k4, v4, mask, qs * ks * post_scale, causal, p)
        out = getitem(g, att, 0)
        out = call(g, aten.reshape.default, out, list(s2))  # a view unless the op's layout forbids one
    bmm2.replace_all_uses_with(out)
    erase_dead(g, [bmm2] + drop_nodes + [sm, masked, scores])
    return True


def _unrepeated_kv(n: Argument) -> fx.Node | None:
    """The key/value heads under a grouped-query repeat: Hugging Face's ``repeat_kv``, x[:, :, None] expanded to
    [B, Hkv, n, S, D] and reshaped to [B, Hkv * n, S, D] (traced unsqueeze -> expand -> clone -> _unsafe_view), gives
    x. graphtrain::attention takes it as it is: key/value heads that divide the query heads, query head h reading
    key/value head h // n, as the repeat lays them out. Its gradient is the repeat's (the n query heads' products
    summed, inside the op's GEMMs) without the [B, H, S, D] copies of k and v and their sum in the backward. None
    where `n` is not that pattern."""
    if not is_op(n, aten._unsafe_view, aten.view, aten.reshape):
        return None
    cur = n.args[0]
    if is_op(cur, aten.clone):
        cur = cur.args[0]
    if not is_op(cur, aten.expand):
        return None
    un = cur.args[0]
    if not (is_op(un, aten.unsqueeze) and un.args[1] in (2, -3) and isinstance(un.args[0], fx.Node)):
        return None
    x = un.args[0]
    xs, es, ns = shape(x), shape(cur), shape(n)
    if xs is None or es is None or ns is None or len(xs) != 4 or len(es) != 5:
        return None
    b, kv_heads, s, d = xs
    if es[:2] != (b, kv_heads) or es[3:] != (s, d) or ns != (b, kv_heads * es[2], s, d):
        return None
    return x


def _flash_to_heads(g: fx.Graph, node: fx.Node) -> bool:
    """Rewrite one aten CPU flash-attention call (SDPA without dropout) to graphtrain::attention where the op would
    run it head by head (kernels/attention.py `_cpu_heads_ok`: fp32, causal, no mask, static shapes), which was 1.2-1.5x
    aten's kernel forward + backward at 128 to 1024 tokens on the 2-core Zen 4. Only where q's memory runs
    [B, S, H, D] (`_heads_last`): the op's output is then laid out as the flash kernel's always is, so what the
    graph does with it after (the model's merge of the heads, a view) still holds. And only where the call's
    logsumexp output is unused (it is in a graph before autodiff)."""
    args = list(node.args) + [None] * (7 - len(node.args))
    names = ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale")
    q, k, v, p, causal, mask, scale = (node.kwargs.get(name, a) for name, a in zip(names, args))
    p, causal = p or 0.0, bool(causal)
    qv, kv, vv = (val(x) if isinstance(x, fx.Node) else None for x in (q, k, v))
    if (
        mask is not None
        or p != 0.0
        or not (isinstance(qv, torch.Tensor) and isinstance(kv, torch.Tensor) and isinstance(vv, torch.Tensor))
    ):
        return False
    if scale is not None and not isinstance(scale, (int, float, torch.SymFloat)):
        return False
    if not all(isinstance(d, int) for x in (qv, kv, vv) for d in x.shape):
        return False
    if not _cpu_heads_ok(qv, kv, vv, None, 0.0, causal):
        return False
    ku, vu = _unrepeated_kv(k), _unrepeated_kv(v)
    if ku is not None and vu is not None and val(ku).shape[1] == val(vu).shape[1]:
        if _cpu_heads_ok(qv, val(ku), val(vu), None, 0.0, causal):  # grouped-query: k and v as they were before
            k, v = ku, vu
    # the flash kernel's output is [B, S, H, D]-strided whatever q's layout, and the graph after it was traced so;
    # the op's is laid out as q is (with a contiguous q, a Hugging Face DDP test's view of the merged heads failed)
    if not _heads_last(qv):
        return False
    users = list(node.users)
    if not all(u.op == "call_function" and u.target is operator.getitem for u in users):
        return False
    if any(u.args[1] != 0 and u.users for u in users):  # the logsumexp is read
        return False
    with g.inserting_before(node):
        att = call(
            g,
            torch.ops.graphtrain.attention.default,
            q,
            k,
            v,
            None,
            float(scale) if scale is not None else qv.shape[-1] ** -0.5,
            causal,
            0.0,
        )
        out = getitem(g, att, 0)
    for u in users:
        if u.args[1] == 0:
            u.replace_all_uses_with(out)
        g.erase_node(u)
    g.erase_node(node)
    return True


# On by default for every provider. The CPU kernel for dropout > 0 (aten batched matmuls around one
# vectorised C++ softmax/dropout pass, probabilities never saved) against the unfused ops on
# gpt2-small's shape [8, 8, 128, 64], causal, p=0.1, fwd+bwd, 2 threads: fp32 5.0 ms vs 25.0 eager
# (5.8 with graphtrain's fused dropout), bf16 3.7 vs 9.0 (4.1); saved activations 1.1 vs 6.0 MiB.
# Reproduce: `python -m graphtrain.bench.kernels --ops attention_dropout [--dtype bf16]`. An
# earlier per-head C++ kernel, with loops of its own for the products, was slower than the unfused ops
# (gpt2-mini fp32 0.389 vs 0.358 s/step) and was replaced; the head-by-head kernel of today (kernels/csrc/attention.cpp,
# attn_heads_*) runs its products through BLAS.
# after the normalizations, as the numbered pipeline ran them (the fusions are independent)
@register_pass("pre_autodiff", phase="fuse", after="fuse_rms_norm")
def fuse_attention_pass(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite each softmax-attention subgraph to graphtrain::attention (see module docstring)."""
    n = kept = heads = 0
    for node in list(gm.graph.nodes):
        if node.graph is gm.graph and is_op(node, aten._softmax, aten._safe_softmax):
            n += bool(_try_fuse(gm, node, ctx))
        elif is_op(node, aten._scaled_dot_product_flash_attention_for_cpu):
            if _flash_to_heads(gm.graph, node):
                heads += 1
            else:
                kept += 1
    if kept:
        ctx.note(f"{kept} SDPA call(s) without dropout kept as aten's flash attention (already one fused kernel)")
    if heads:
        ctx.note(
            f"{heads} causal SDPA call(s) without dropout or mask (fp32, CPU) moved to graphtrain's head-by-head "
            f"attention kernel"
        )
    ctx.count(n + heads)
    return finish(gm)
