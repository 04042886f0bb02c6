"""graphtrain.accelerate matches eager PyTorch: outputs, every gradient, and 50-step loss curves."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphtrain
from graphtrain.testing import assert_close, assert_grads_close


@pytest.fixture(autouse=True)
def _many_instances():
    # Every test builds new instances of the same classes; Dynamo counts their compiles per code object.
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


HAS_HF = importlib.util.find_spec("transformers") is not None
HAS_MODELS = importlib.util.find_spec("graphtrain.models") is not None


class Block(nn.Module):
    def __init__(self, d: int = 32, h: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, 2))
        att = (q @ k.transpose(-2, -1)) / (C // self.h) ** 0.5
        causal = torch.ones(T, T).tril() == 0  # built from constants: folded at compile time
        att = self.drop(att.masked_fill(causal, float("-inf")).softmax(-1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    """A small hand-written causal transformer with tied embeddings and dropout everywhere."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


@pytest.fixture
def deterministic():
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(prev)


def _loss(out):
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().square().mean()
    return out.loss


# The fusion engineers' passes (in flux in this checkout, with their own parity tests) are switched off
# here: these tests check the engine itself (capture, cleanup passes, autodiff, partition, providers).
ENGINE_ONLY = {
    name: False
    for name in (
        "fuse_attention",
        "fuse_cross_entropy",
        "fuse_linear_cross_entropy",
        "fuse_bias_dropout_add",
        "fuse_bias_gelu",
        "fuse_layer_norm",
        "fuse_rms_norm",
        "inplace_elementwise",
    )
}


def _pair(make, fallback="error", **accel):
    from graphtrain.passes.manager import registered_passes

    accel.setdefault("passes", {k: v for k, v in ENGINE_ONLY.items() if k in registered_passes()})
    torch.manual_seed(0)
    ref = make().train()
    m = make().train()
    m.load_state_dict(ref.state_dict())
    return ref, graphtrain.accelerate(m, fallback=fallback, **accel)


def _check_parity(make, kwargs, *, provider="aten", bitwise=True, steps=2, fallback="error", **tol):
    """Forward loss and every parameter gradient match eager for a few dropout seeds."""
    ref, m = _pair(make, fallback=fallback, provider=provider)
    for seed in range(steps):
        outs = []
        for mod in (ref, m):
            mod.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            loss = _loss(mod(**kwargs))
            loss.backward()
            outs.append(loss.detach())
        assert_close(outs[1], outs[0], name=f"loss (seed {seed})", bitwise=bitwise, **tol)
        assert_grads_close(m, ref, bitwise=bitwise, **tol)
    rep = graphtrain.report(m)
    assert rep.graphs and all(g["provider"] == provider for g in rep.graphs), str(rep)
    return ref, m


def _ids(vocab, shape=(2, 16), seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_tiny_transformer_bitwise_with_aten_provider():
    ref, m = _check_parity(TinyGPT, {"idx": _ids(64), "labels": _ids(64, seed=2)})
    assert list(m.state_dict()) == list(ref.state_dict())  # drop-in: keys unchanged
    rep = graphtrain.report(m)
    folded = sum(p["rewrites"] for p in rep.passes if p["name"] == "fold_constants")
    assert folded >= 3, str(rep)  # the causal mask: ones, tril, eq
    assert rep.saved_activation_bytes_per_sample and rep.saved_activation_bytes_per_sample > 0


def test_fifty_steps_same_loss_curve_bitwise(deterministic):
    """50 AdamW steps with dropout 0.1: aten provider in deterministic mode gives eager's curve bitwise."""
    ref, m = _pair(TinyGPT, provider="aten")
    curves = []
    for mod in (ref, m):
        opt = torch.optim.AdamW(mod.parameters(), lr=3e-3)
        torch.manual_seed(123)
        losses = []
        for step in range(50):
            loss = mod(_ids(64, seed=step), _ids(64, seed=1000 + step))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        curves.append(torch.stack(losses))
    assert_close(curves[1], curves[0], name="loss curve", bitwise=True)
    assert curves[0][-1] < curves[0][0]  # it trained


def test_frozen_layers_get_no_gradient_work():
    torch.manual_seed(0)
    m = TinyGPT()
    frozen = [m.wpe, m.blocks[0]]
    for mod in frozen:
        mod.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    graphtrain.accelerate(m, provider="aten", fallback="error")
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    m(_ids(64), _ids(64, seed=2)).backward()
    opt.step()
    frozen_names = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert frozen_names and all(m.get_parameter(n).grad is None for n in frozen_names)
    for n, p in m.named_parameters():
        assert torch.equal(p, before[n]) == (n in frozen_names), n
    rep = graphtrain.report(m)
    n_frozen = sum(p.numel() for mod in frozen for p in mod.parameters())
    assert rep.params["frozen"] == n_frozen and rep.params["frozen_bytes"] == 4 * n_frozen
    g = rep.graphs[0]
    assert g["frozen_inputs_with_grad"] == 0
    assert g["grads_computed"] == sum(k == "param" for k in g["input_kinds"])
    assert "with gradient work: 0" in str(rep)


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_hf_models_match_eager(family, attn):
    import transformers as tf

    if family == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64, attn_implementation=attn)
        make = lambda: tf.GPT2LMHeadModel(cfg)  # noqa: E731
    else:
        cfg = tf.BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=2,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=64,
            attn_implementation=attn,
        )
        make = lambda: tf.BertForMaskedLM(cfg)  # noqa: E731
    ids = _ids(512)
    labels = torch.where(_ids(10, seed=3) < 2, ids, torch.full_like(ids, -100)) if family == "bert" else ids
    # HF's forward logs a warning_once (a graph break, as under torch.compile): fallback=silent allows it.
    # Not bitwise: the tied word-embedding/decoder weight gets two gradient terms, which eager autograd
    # accumulates in AccumulateGrad order and AOTAutograd sums in graph order (measured 3e-8 max diff on
    # BERT's word embeddings); everything else is bitwise. So the fp32 tolerance table applies.
    _check_parity(make, {"input_ids": ids, "labels": labels}, fallback="silent", bitwise=False)


@pytest.mark.skipif(not HAS_MODELS, reason="graphtrain.models (reference models) is not in this checkout yet")
@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny"])
def test_reference_models_match_eager(name):
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    ids = _ids(512)
    kwargs = {"input_ids": ids, "labels": ids}
    if name.startswith("bert"):
        kwargs["labels"] = torch.where(_ids(10, seed=3) < 2, ids, torch.full_like(ids, -100))
        kwargs["attention_mask"] = torch.ones_like(ids)
    _check_parity(lambda: build_model(ModelConfig(name=name)), kwargs)


@pytest.mark.slow  # measured 78 s on the shared 2-core box (Inductor C++ compile of fw + bw)
def test_inductor_provider_within_tolerance():
    """Inductor fuses pointwise ops and reductions (layernorm, softmax, cross-entropy), which reorders fp32
    sums: results differ from eager in the last bits. Measured with dropout on, in an earlier version of this
    test (torch 2.13 CPU): max loss diff 3.8e-6 abs / 2.0e-7 rel over the 10 steps (5 of 10 steps bitwise equal), max step-0 gradient diff 1.3e-7 abs,
    so we compare with the fp32 tolerance table. Dropout is off: with the fusions off (ENGINE_ONLY) it would stay
    ATen's bernoulli, which graphtrain does not hand Inductor on CPU (providers.UnsuitableProvider: an in-place
    bernoulli_ can run after the kernel that reads its mask); Inductor with graphtrain's own dropout is checked in
    test_fusion_engine.py."""

    def make() -> TinyGPT:
        model = TinyGPT()
        for mod in model.modules():
            if isinstance(mod, nn.Dropout):
                mod.p = 0.0
        return model

    ref, m = _pair(make, provider="inductor")
    curves = []
    for mod in (ref, m):
        opt = torch.optim.AdamW(mod.parameters(), lr=3e-3)
        torch.manual_seed(7)
        losses = []
        for step in range(10):
            loss = mod(_ids(64, seed=step), _ids(64, seed=1000 + step))
            loss.backward()
            if step == 0:
                grads = {n: p.grad.clone() for n, p in mod.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        curves.append((torch.stack(losses), grads))
    assert_close(curves[1][0], curves[0][0], name="loss curve")
    for n in curves[0][1]:
        assert_close(curves[1][1][n], curves[0][1][n], name=f"grad of {n}")
    assert graphtrain.report(m).graphs[0]["provider"] == "inductor"
