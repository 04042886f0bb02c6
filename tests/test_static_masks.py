"""engine.static_masks: an attention mask that is a constant of the graph's shapes reaches SDPA as is_causal (or no
mask); any other mask is left alone. Each case checks the rewrite (or its absence) and forward+backward against
eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from graphtrain.config.sections import EngineConfig
from graphtrain.passes.graph_utils import mask_kind
from graphtrain.passes.manager import PassContext, registered_passes
from graphtrain.passes.static_masks import specialize_static_masks
from graphtrain.pipeline.trace import trace_aten_forward
from graphtrain.testing import assert_close

NEG = float("-inf")


def test_mask_kind_reads_bool_and_additive_masks():
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert mask_kind(causal.expand(2, 1, 5, 5), 5, 5) == "causal"
    assert mask_kind(torch.zeros(5, 5).masked_fill(~causal, NEG), 5, 5) == "causal"
    lowest = torch.finfo(torch.float32).min
    assert mask_kind(torch.zeros(3, 1, 5, 5).masked_fill(~causal, lowest), 5, 5) == "causal"
    assert mask_kind(torch.ones(2, 1, 5, 5, dtype=torch.bool), 5, 5) == "full"
    assert mask_kind(torch.zeros(1, 5), 5, 5) == "full"  # broadcast over queries, attends everywhere
    padded = causal.expand(2, 1, 5, 5).clone()
    padded[1, :, :, 0] = False  # one sequence's first key is padding
    assert mask_kind(padded, 5, 5) is None
    window = causal & ~torch.ones(5, 5, dtype=torch.bool).tril(-2)  # sliding window of 2
    assert mask_kind(window, 5, 5) is None
    assert mask_kind(causal, 5, 6) is None  # not is_causal's shape
    assert mask_kind(torch.zeros(5, 5).masked_fill(~causal, -1e4), 5, 5) is None  # a finite bias is a bias
    assert mask_kind(causal.long(), 5, 5) is None


class ShapeMasked(torch.nn.Module):
    """Attention whose mask is built from the input's shape, in the ways a model may spell it."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(s)
        if self.style == "causal_bool":  # HF's spelling: kv index <= q index, expanded over the batch
            mask = (i[None, :] <= i[:, None])[None, None].expand(b, 1, s, s)
        elif self.style == "causal_additive":
            mask = torch.zeros(s, s).masked_fill(i[None, :] > i[:, None], torch.finfo(x.dtype).min)
        elif self.style == "full":
            mask = torch.ones(b, 1, s, s, dtype=torch.bool)
        elif self.style == "window":
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 3)
        elif self.style == "mutated":  # built, then changed in place: the value read is not the value built
            mask = torch.zeros(s, s)
            mask.masked_fill_(i[None, :] > i[:, None], NEG)
        elif self.style == "padded":  # the user's padding mask: an input
            mask = (i[None, :] <= i[:, None])[None, None] & pad[:, None, None, :].bool()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, 16)


def _compiled(module, *inputs):
    """The module compiled with a backend that only runs specialize_static_masks: (outputs, grads, its lines)."""
    lines = []

    def backend(gm, example_inputs):
        lines.extend(specialize_static_masks(gm))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    out.pow(2).sum().backward()
    return out.detach(), [p.grad.clone() for p in module.parameters()], lines


@pytest.mark.parametrize(
    "style,kind",
    [
        ("causal_bool", "causal"),
        ("causal_additive", "causal"),
        ("full", "all-"),
        ("window", None),
        ("mutated", None),
        ("padded", None),
    ],
)
def test_shape_masks_rewritten_only_when_constant_and_exact(style, kind):
    torch.manual_seed(0)
    m = ShapeMasked(style)
    ref = copy.deepcopy(m)
    x = torch.randn(2, 7, 16)
    pad = torch.ones(2, 7)
    pad[1, 5:] = 0
    args = (x, pad) if style == "padded" else (x,)
    out, grads, lines = _compiled(m, *args)
    r = ref(*args)
    r.pow(2).sum().backward()
    if kind is None:
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith("1 SDPA call(s)") and kind in lines[0], lines
    assert_close(out, r.detach(), name="output")
    for a, p in zip(grads, ref.parameters()):
        assert_close(a, p.grad, name="grad")


def test_repeated_block_bodies_lose_the_mask_input():
    """Blocks compiled once (pipeline/blocks.py) read the mask as an input: every call gets it from the same constant,
    so the body is specialized and the mask no longer computed or passed. A padding mask keeps its mask; an
    all-ones attention_mask is passed as None (what it means) and takes the causal path."""
    transformers = pytest.importorskip("transformers")
    import graphtrain
    from graphtrain.pipeline.state import state_of

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        attn_implementation="sdpa",
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(cfg)
    ref = copy.deepcopy(model)
    fast = graphtrain.accelerate(model, provider="aten")
    x = torch.randint(1, 128, (2, 12))
    padding = torch.ones_like(x)
    padding[1, :3] = 0  # left padding: a mask that is not is_causal's
    for kw in ({}, {"attention_mask": padding}, {"attention_mask": torch.ones_like(x)}):
        out = fast(input_ids=x, labels=x, **kw)
        out.loss.backward()
        r = ref(input_ids=x, labels=x, **kw)
        r.loss.backward()
        assert_close(out.loss.detach(), r.loss.detach(), name="loss")
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            assert_close(a.grad, b.grad, name=name)
        model.zero_grad()
        ref.zero_grad()
    state, _ = state_of(fast)
    notes = [n for n in state.notes if "static_masks" in n]
    assert notes == [
        "3 SDPA call(s) with a constant causal mask (built from shapes, e.g. Hugging Face's under "
        "tracing): rewritten to is_causal=True (engine.static_masks)",
        "attention_mask of all ones passed as None, as Hugging Face's eager SDPA path treats it (its "
        "causal mask then reaches SDPA as is_causal; engine.static_masks)",
    ], state.notes


def _accelerated_step(**engine):
    """ShapeMasked("causal_bool") accelerated with `engine`, one step checked against eager: its report."""
    import graphtrain

    torch.manual_seed(0)
    eager = ShapeMasked("causal_bool")
    m = graphtrain.accelerate(copy.deepcopy(eager), provider="aten", fallback="error", **engine)
    x = torch.randn(2, 7, 16)
    for mod in (eager, m):
        mod.out = mod(x)
        mod.out.square().sum().backward()
    assert_close(m.out, eager.out, name="output")
    for a, b in zip(m.parameters(), eager.parameters()):
        assert_close(a.grad, b.grad, name="grad")
    return graphtrain.report(m)


def test_the_pass_is_recorded():
    """specialize_static_masks is a pass of the dynamo stage: its record counts the calls it rewrote."""
    rep = _accelerated_step()
    (rec,) = [p for p in rep.passes if p["name"] == "specialize_static_masks"]
    assert rec["stage"] == "dynamo" and rec["rewrites"] == 1 and not rec["error"], rec
    assert any("causal mask(s) -> is_causal" in n for n in rec["notes"]), rec
    assert any("static_masks" in n for n in rep.notes), rep.notes


@pytest.mark.parametrize(
    "switch",
    [{"static_masks": False}, {"passes": {"specialize_static_masks": False}}],
    ids=["engine.static_masks", "engine.passes"],
)
def test_switch_off_keeps_the_mask(switch):
    rep = _accelerated_step(**switch)
    assert not [n for n in rep.notes if "static_masks" in n]
    assert not [p for p in rep.passes if p["name"] == "specialize_static_masks" and p["rewrites"]], rep.passes
    if "passes" in switch:
        assert not [p for p in rep.passes if p["name"] == "specialize_static_masks"], rep.passes
        assert "switched off (engine.passes): specialize_static_masks" in str(rep)


def test_fused_attention_takes_sdpas_causal_mask_as_is_causal():
    """SDPA with dropout is decomposed, its is_causal spelled as where(tril(ones), 0, -inf): the fused op gets
    is_causal back (the C++ kernel then computes each row's first i + 1 scores only) and no mask."""

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)

    ins = [torch.randn(2, 3, 9, 8) for _ in range(3)]
    gm = trace_aten_forward(f, ins)
    ctx = PassContext(EngineConfig(), "pre_autodiff")
    gm = registered_passes()["fuse_attention"].fn(gm, ctx)
    att = [n for n in gm.graph.nodes if n.target is torch.ops.graphtrain.attention.default]
    assert ctx.rewrites == 1 and len(att) == 1
    q, k, v, mask, scale, causal, p = att[0].args
    assert mask is None and causal is True and p == pytest.approx(0.1)
