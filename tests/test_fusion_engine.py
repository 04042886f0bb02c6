"""Fusion passes end to end through graphtrain.accelerate: reference GPT-2/BERT and HF tiny models train
with the fused ops (aten and inductor providers) with loss and every gradient matching eager.

Regression: BERT's q/k/v are x.view(B, S, H, D).transpose(1, 2); graphtrain::attention_backward's fake
kernel returned empty_like(q) strides while the real kernel returned contiguous grads, so AOTAutograd's
backward graph view()ed a contiguous dq as if transposed ("view size is not compatible", provider aten)
and Inductor asserted on the stride ("expected stride 8192==64"). tests/test_kernels_fake_strides.py
checks fake-vs-real metadata op by op.
"""

from __future__ import annotations

import copy
import importlib.util
import math

import pytest
import torch

import graphtrain
from graphtrain.testing import assert_close, assert_grads_close

HAS_HF = importlib.util.find_spec("transformers") is not None
VOCAB = 512
# the fusions every model here must show in the report (> 0 rewrites)
EXPECTED_FUSIONS = ("fuse_attention", "fuse_layer_norm", "fuse_bias_gelu", "fuse_linear_cross_entropy")
# Every fusion switched on explicitly: by default the norm/GELU/cross-entropy fusions are on under the aten
# provider only; under Inductor they are only detected and left to its codegen (see their register_pass
# comments for the measurements).
ALL_FUSIONS = {
    name: True for name in (*EXPECTED_FUSIONS, "fuse_cross_entropy", "fuse_rms_norm", "fuse_bias_dropout_add")
}


def _ids(shape=(2, 16), seed=1, high=VOCAB):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _make(kind: str, dropout: float = 0.0):
    """(model, forward kwargs, fallback mode) for one kind of model."""
    torch.manual_seed(0)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # padding in the second sequence: the attention mask path
    mlm_labels = torch.where(_ids(seed=3, high=10) < 3, ids, torch.full_like(ids, -100))
    if kind in ("gpt2-tiny", "bert-tiny"):
        from graphtrain.config.sections import ModelConfig
        from graphtrain.models import build_model

        m = build_model(ModelConfig(name=kind, dropout=dropout))
        kw = {"input_ids": ids, "labels": ids}
        if kind == "bert-tiny":
            kw = {"input_ids": ids, "attention_mask": mask, "labels": mlm_labels}
        return m, kw, "error"
    import transformers as tf

    if kind == "hf-gpt2":
        cfg = tf.GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=64,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            attn_implementation="eager",
        )
        m, kw = tf.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}
    else:
        cfg = tf.BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=2,
            intermediate_size=128,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            attn_implementation="eager",
        )
        m, kw = tf.BertForMaskedLM(cfg), {"input_ids": ids, "attention_mask": mask, "labels": mlm_labels}
    m.train()
    # HF's forward logs a warning_once (a graph break, as under torch.compile): fallback=silent allows it
    return m, kw, "silent"


def _loss(m, kw):
    out = m(**kw)
    return out if isinstance(out, torch.Tensor) else out.loss


def _step(m, kw, seed):
    m.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = _loss(m, kw)
    loss.backward()
    return loss.detach()


def _rewrites(m) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in graphtrain.report(m).passes:
        assert r["error"] is None, f"pass {r['name']} failed: {r['error']}"
        out[r["name"]] = out.get(r["name"], 0) + r["rewrites"]
    return out


def check_parity(kind: str, provider: str, steps: int = 2):
    ref, kw, fallback = _make(kind)
    m = graphtrain.accelerate(copy.deepcopy(ref), provider=provider, fallback=fallback, passes=ALL_FUSIONS)
    for step in range(steps):  # step 1 reruns the compiled graphs
        lf, le = _step(m, kw, step), _step(ref, kw, step)
        assert torch.isfinite(lf)
        assert_close(lf, le, name=f"{kind}/{provider} loss, step {step}")
        assert_grads_close(m, ref)
    rep = graphtrain.report(m)
    assert not rep.eager_only and rep.graphs, str(rep)
    counts = _rewrites(m)
    # the loss is fused by one of the two cross-entropy passes: with its LM head where the head is in the same
    # graph (HF GPT-2's forward breaks the graph between head and loss under Dynamo, so there it is the plain one)
    counts["fuse_linear_cross_entropy"] = counts.get("fuse_linear_cross_entropy", 0) + counts.get(
        "fuse_cross_entropy", 0
    )
    missing = [f for f in EXPECTED_FUSIONS if counts.get(f, 0) == 0]
    assert not missing, f"{kind}: no rewrites by {missing}: {counts}"


@pytest.mark.parametrize("kind", ["gpt2-tiny", "bert-tiny"])
def test_reference_models_fused_match_eager_aten(kind):
    check_parity(kind, "aten")


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
@pytest.mark.parametrize("kind", ["hf-gpt2", "hf-bert"])
def test_hf_models_fused_match_eager_aten(kind):
    check_parity(kind, "aten")


@pytest.mark.parametrize("kind", ["gpt2-tiny", "bert-tiny"])
def test_reference_models_fused_match_eager_inductor(kind):
    # Inductor reorders fp32 reductions: within the fp32 tolerance table, not bitwise
    check_parity(kind, "inductor", steps=1)


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_hf_gpt2_tanh_gelu_runs_in_cpp_under_inductor():
    """lower_gelu_tanh: HF GPT-2's spelled-out tanh GELU (NewGELU) goes to graphtrain::bias_gelu's C++ kernel under
    Inductor, one per layer; loss and gradients match eager within the fp32 tolerance table."""
    from graphtrain.kernels import _cpu_ext

    if _cpu_ext.load() is None:
        pytest.skip(f"no C++ compiler: {_cpu_ext.build_error()}")
    ref, kw, fallback = _make("hf-gpt2")
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="inductor", fallback=fallback)
    lf, le = _step(m, kw, 0), _step(ref, kw, 0)
    assert_close(lf, le, name="hf-gpt2 inductor loss")
    assert_grads_close(m, ref)
    passes = {r["name"]: r for r in graphtrain.report(m).passes}
    from graphtrain.kernels.bias_gelu import gelu_tanh_probe

    wins = gelu_tanh_probe()["cpp_wins"]  # lowered only where the C++ kernel measured faster than aten's tanh
    assert passes["lower_gelu_tanh"]["rewrites"] == (2 if wins else 0), passes["lower_gelu_tanh"]  # one a layer
    assert passes["fuse_bias_gelu"]["rewrites"] == (0 if wins else 2)  # the rest is left to Inductor's GELU


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_hf_gpt2_tanh_gelu_runs_in_cpp_under_inductor_in_bf16():
    """In a bf16 graph the mixed-precision pass has cast the GELU formula's pieces (its cube and tanh read x in fp32,
    its 0.5 x in bf16): lower_gelu_tanh still finds it, one a layer, and the op reads the bf16 x. Loss and gradients
    within bf16 tolerances of fp32 eager."""
    from graphtrain.kernels import _cpu_ext
    from graphtrain.kernels.bias_gelu import gelu_tanh_probe

    if _cpu_ext.load() is None:
        pytest.skip(f"no C++ compiler: {_cpu_ext.build_error()}")
    ref, kw, fallback = _make("hf-gpt2")
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="inductor", fallback=fallback, precision="bf16")
    lf, le = _step(m, kw, 0), _step(ref, kw, 0)
    torch.testing.assert_close(lf, le, rtol=2e-2, atol=2e-2)
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        rel = float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12))
        assert rel < 5e-2, (n, rel)
    wins = gelu_tanh_probe()["cpp_wins"]
    assert _rewrites(m)["lower_gelu_tanh"] == (2 if wins else 0)
    gelus = [o for o in graphtrain.report(m).fused_ops if o["name"] == "bias_gelu"]
    assert [o["count"] for o in gelus] == ([2] if wins else [])


@pytest.mark.parametrize("kind", ["gpt2-tiny", "bert-tiny"])
def test_fused_dropout_trains_like_eager(kind):
    """With dropout the fused ops draw masks from their own counter-based hash, not torch's Bernoulli, so
    runs differ from eager step by step. Both must be finite, train (loss falls on a repeated batch), and
    stay statistically close: at init dropout moves the loss by ~1e-2, so per-step losses
    must agree within 0.1 and the mean over the steps within 0.05."""
    steps, p = 6, 0.1
    ref, kw, fallback = _make(kind, dropout=p)
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="aten", fallback=fallback, passes=ALL_FUSIONS)
    curves = []
    for mod in (m, ref):
        opt = torch.optim.AdamW(mod.parameters(), lr=3e-3)
        curve = []
        for step in range(steps):
            curve.append(_step(mod, kw, step).item())
            opt.step()
        curves.append(curve)
    fused, eager = curves
    assert all(math.isfinite(x) for x in fused + eager), curves
    assert fused[-1] < fused[0] - 0.1 and eager[-1] < eager[0] - 0.1, curves
    assert max(abs(a - b) for a, b in zip(fused, eager)) < 0.1, curves
    assert abs(sum(fused) - sum(eager)) / steps < 0.05, curves
    counts = _rewrites(m)
    assert counts.get("fuse_bias_dropout_add", 0) > 0, counts
    assert counts.get("fuse_attention", 0) > 0, counts


# hf-bert: slow (25 s on the 2-core AVX2 EPYC); its fusions are checked on aten by the default suite
# (test_hf_models_fused_match_eager_aten), and this check under Inductor by gpt2-tiny.
@pytest.mark.parametrize("kind", ["gpt2-tiny", pytest.param("hf-bert", marks=pytest.mark.slow)])
def test_default_fusions_cover_every_layer_inductor(kind):
    """Default config, Inductor provider: every layer's attention and dropouts are rewritten to graphtrain
    ops, and every layer's LayerNorm and GELU are found and left to Inductor's own fused kernels (the
    report says which). Loss and gradients still match eager."""
    if kind.startswith("hf") and not HAS_HF:
        pytest.skip("transformers is not installed")
    ref, kw, fallback = _make(kind)
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="inductor", fallback=fallback)
    lf, le = _step(m, kw, 0), _step(ref, kw, 0)
    assert_close(lf, le, name=f"{kind} default fusions, inductor, loss")
    assert_grads_close(m, ref)
    n_layer = 2
    passes = {r["name"]: r for r in graphtrain.report(m).passes}
    assert passes["fuse_attention"]["rewrites"] == n_layer and passes["fuse_attention"]["left_to"] is None
    for name in ("fuse_layer_norm", "fuse_bias_gelu"):
        assert passes[name]["left_to"] == "inductor", passes[name]
        assert passes[name]["rewrites"] >= n_layer, passes[name]
    assert passes["fuse_layer_norm"]["rewrites"] >= 2 * n_layer
    # the loss: the LM head + cross-entropy is rewritten under Inductor too (graphtrain's chunked op). HF models
    # return their logits as well: those are detached from the graph and computed beside it
    # (passes/returned_heads.py), so their head and loss are fused like the reference models'
    lce, ce = passes["fuse_linear_cross_entropy"], passes["fuse_cross_entropy"]
    assert lce["left_to"] is None and (lce["rewrites"], ce["rewrites"]) == (1, 0), (lce, ce)
    if kind.startswith("hf"):
        assert any("returned logits" in n for n in graphtrain.report(m).notes), graphtrain.report(m).notes
    text = str(graphtrain.report(m))
    assert "left to inductor's fused kernels" in text


def test_mlm_head_becomes_linear_bias_cross_entropy(kind="bert-tiny"):
    """BERT's MLM decoder (the tied matrix, then its own bias) and the masked cross-entropy become one chunked
    graphtrain::linear_bias_cross_entropy: the [B*T, V] logits, their softmax and gradient are never
    materialized. check_parity above covers the numerics on this model and on HF BERT (whose decoder is a Linear
    with bias, addmm: the other spelling, checked on a graph in test_fusion_passes.py); HF's forward has
    data-dependent checks that only Dynamo (graph breaks) traces, so it is not traced whole here."""
    from graphtrain.passes.fuse_cross_entropy import fuse_linear_cross_entropy_pass
    from graphtrain.passes.manager import PassContext
    from graphtrain.pipeline.trace import trace_aten_forward

    m, kw, _ = _make(kind)
    named = dict(m.named_parameters())
    keys = ("input_ids", "attention_mask", "labels")

    def fn(*a):
        state = dict(zip(named, a[: len(named)]))
        out = torch.func.functional_call(m, state, (), dict(zip(keys, a[len(named) :])))
        return out if isinstance(out, torch.Tensor) else out.loss

    gm = trace_aten_forward(fn, [p.detach() for p in named.values()] + [kw[k] for k in keys])
    ctx = PassContext(config=graphtrain.EngineConfig(provider="aten"), stage="pre_autodiff")
    gm = fuse_linear_cross_entropy_pass(gm, ctx)
    assert ctx.rewrites == 1
    assert [n for n in gm.graph.nodes if n.target is torch.ops.graphtrain.linear_bias_cross_entropy.default]


class _SdpaAttention(torch.nn.Module):
    """Causal SDPA without dropout whose output is merged with transpose(1, 2).view(...), as Hugging Face models do.
    `contiguous_q`: q is made contiguous [B, H, S, D] first (the flash kernel's output is [B, S, H, D]-strided
    either way, and the traced view relies on it)."""

    def __init__(self, contiguous_q: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.contiguous_q = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32), contiguous_q

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = (t.view(B, S, 4, 8).transpose(1, 2) for t in self.qkv(x).split(32, -1))
        if self.contiguous_q:
            q = q.contiguous()
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(B, S, 32).view(B * S, 32)).sum()


@pytest.mark.parametrize("contiguous_q", [False, True])
def test_sdpa_without_dropout_runs_head_by_head_where_its_layout_allows(contiguous_q):
    torch.manual_seed(0)
    ref = _SdpaAttention(contiguous_q)
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="aten", fallback="error")
    x = torch.randn(2, 16, 32)
    m(x).backward()
    ref(x).backward()
    assert_grads_close(m, ref, rtol=1e-4, atol=1e-5)
    notes = [n for p in graphtrain.report(m).passes if p["name"] == "fuse_attention" for n in p["notes"]]
    moved = any("moved to graphtrain's head-by-head attention kernel" in n for n in notes)
    from graphtrain.kernels import _cpu_ext

    assert moved == (not contiguous_q and _cpu_ext.load() is not None), notes


@pytest.mark.parametrize("kind", ["gpt2-tiny", "bert-tiny"])
def test_an_evaluation_graph_computes_the_lm_head_loss_alone(kind, tmp_path, monkeypatch):
    """Under no_grad (an evaluation) the fused LM-head op becomes graphtrain::linear_cross_entropy_loss
    (loss_only_lm_head: no d hidden or d weight computed for nothing), the training graph keeps the training op,
    both losses match eager, and the pass cache keeps the two apart: a second process whose cache holds both
    results runs each graph with its own op."""
    import torch._dynamo

    from graphtrain.pipeline.cache import configure_cache

    lce = importlib.import_module("graphtrain.kernels.linear_cross_entropy")  # the package re-exports a function
    calls = []
    real = lce._chunk_loop

    def spy(*args, **kwargs):
        calls.append("loss alone" if args[-1] else "with gradients")
        return real(*args, **kwargs)

    monkeypatch.setattr(lce, "_chunk_loop", spy)
    m, kw, _ = _make(kind)
    ref = copy.deepcopy(m)
    eng = dict(provider="aten", fallback="error", cache_dir=str(tmp_path), compile_blocks=False)

    def run(model):
        model.train()
        out = model(**kw)
        (out if isinstance(out, torch.Tensor) else out.loss).backward()
        with torch.no_grad():  # in train mode: the same graph as the step's, but for the grad mode (and the key)
            out = model(**kw)
        return out if isinstance(out, torch.Tensor) else out.loss

    want = run(copy.deepcopy(ref))
    for attempt in ("cold", "warm"):
        torch._dynamo.reset()
        acc = graphtrain.accelerate(copy.deepcopy(m), **eng)
        configure_cache(acc._graphtrain.config)
        calls.clear()
        got = run(acc)
        assert_close(got, want, rtol=1e-5, atol=1e-6, name=f"{attempt} evaluation loss")
        # the training step's head computes its gradients, the evaluation's the loss alone
        assert calls == ["with gradients", "loss alone"], (attempt, calls)
        recs = {r.graph: r.rewrites for r in acc._graphtrain.passes if r.name == "loss_only_lm_head"}
        inference = {g["name"]: g["inference"] for g in graphtrain.report(acc).graphs}
        if attempt == "cold":  # the pass ran on both graphs and rewrote the evaluation graph's head only
            assert recs == {n: int(inf) for n, inf in inference.items()}, (recs, inference)
