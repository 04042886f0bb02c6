"""Reference models: shapes, explicit == sdpa attention, masking, parameter counts, learning, errors."""

from __future__ import annotations

import pytest
import torch

from graphtrain.config.sections import ModelConfig
from graphtrain.models import BERT, GPT2, PRESETS, build_model, count_parameters
from graphtrain.testing import assert_close, assert_grads_close

FAMILIES = ["gpt2", "bert"]


pytestmark = pytest.mark.usefixtures("one_thread")
ATTENTIONS = ["explicit", "sdpa"]


def tiny(family: str, attention: str = "explicit", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(name=f"{family}-tiny", attention=attention, **overrides))


def random_ids(batch: int, seq: int, vocab: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def mlm_labels(ids: torch.Tensor, seed: int = 1) -> torch.Tensor:
    keep = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.15
    keep[:, 0] = True  # at least one prediction per row
    return ids.masked_fill(~keep, -100)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_shapes(family: str, attention: str) -> None:
    model = tiny(family, attention)
    assert model.family == family and isinstance(model, GPT2 if family == "gpt2" else BERT)
    assert model.spec.family == family and model.spec.vocab_size == 512
    ids = random_ids(2, 17)
    logits = model(ids)
    assert logits.shape == (2, 17, 512) and logits.dtype == torch.float32
    # Independent random targets (labels = ids would favour the tied embedding's own token).
    labels = random_ids(2, 17, seed=5) if family == "gpt2" else mlm_labels(ids)
    loss = model(ids, labels=labels)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # Fresh init predicts roughly uniformly: loss near ln(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 0.5


@pytest.mark.parametrize("family", FAMILIES)
def test_explicit_matches_sdpa(family: str) -> None:
    explicit = tiny(family, "explicit", dropout=0.0)
    sdpa = tiny(family, "sdpa", dropout=0.0)
    sdpa.load_state_dict(explicit.state_dict())
    ids = random_ids(3, 20)
    kwargs: dict = {}
    if family == "bert":
        mask = torch.ones_like(ids)
        mask[1, 14:] = 0  # padding in one row exercises the additive mask in both spellings
        kwargs = {"attention_mask": mask, "token_type_ids": (torch.arange(20) >= 10).long().expand(3, 20)}
    assert_close(sdpa(ids, **kwargs), explicit(ids, **kwargs), name=f"{family} logits sdpa vs explicit")

    labels = ids if family == "gpt2" else mlm_labels(ids)
    for model in (explicit, sdpa):
        model.zero_grad()
        model(ids, labels=labels, **kwargs).backward()
    assert_grads_close(sdpa, explicit)


def test_gpt2_is_causal() -> None:
    model = tiny("gpt2").eval()
    ids = random_ids(1, 12)
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 512
    assert_close(model(changed)[:, :8], model(ids)[:, :8], name="logits before the change")
    assert not torch.allclose(model(changed)[:, 8:], model(ids)[:, 8:])


def test_bert_padding_is_ignored() -> None:
    model = tiny("bert").eval()
    ids = random_ids(1, 12)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    changed = ids.clone()
    changed[0, 9:] = (changed[0, 9:] + 7) % 512
    assert_close(
        model(changed, attention_mask=mask)[:, :9],
        model(ids, attention_mask=mask)[:, :9],
        name="logits of kept positions",
    )
    # Without the mask the padded tokens do leak into every position.
    assert not torch.allclose(model(changed)[:, :9], model(ids)[:, :9])


def test_weight_tying_and_init() -> None:
    gpt = tiny("gpt2")
    assert gpt.lm_head.weight is gpt.wte.weight
    assert gpt.blocks[0].attn.proj.weight.std() < gpt.blocks[0].attn.qkv.weight.std()  # scaled residual init
    bert = tiny("bert")
    assert bert.mlm.decoder.weight is bert.embeddings.word.weight


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_init_then_materialize(family: str) -> None:
    with torch.device("meta"):
        model = build_model(ModelConfig(name=f"{family}-tiny"))
    model.to_empty(device="cpu")  # uninitialized memory, embeddings untied
    model.reset_parameters()
    ids = random_ids(2, 9)
    loss = model(ids, labels=random_ids(2, 9, seed=5) if family == "gpt2" else mlm_labels(ids))
    assert abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 0.5
    assert all(abs(p.std().item() - 0.02) < 0.005 for n, p in model.named_parameters() if n.endswith("qkv.weight"))
    head, emb = (model.lm_head, model.wte) if family == "gpt2" else (model.mlm.decoder, model.embeddings.word)
    assert head.weight is emb.weight


# Published counts: HF GPT2LMHeadModel("gpt2-medium") with tied embeddings; BERT-Large as HF
# BertModel (with pooler) and BertForMaskedLM (MLM head, no pooler).
PUBLISHED = {
    "gpt2-medium": [354_823_168],
    "bert-large": [335_141_888, 335_174_458],
    "gpt2": [124_439_808],
    "bert-base": [109_482_240, 109_514_298],
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name: str) -> None:
    with torch.device("meta"):
        model = build_model(ModelConfig(name=name))
    n = count_parameters(model)
    for published in PUBLISHED[name]:
        assert abs(n - published) / published < 0.01, f"{name}: {n:,} parameters vs published {published:,}"


def test_all_presets_build_on_meta() -> None:
    for name, spec in PRESETS.items():
        with torch.device("meta"):
            model = build_model(ModelConfig(name=name))
        assert model.spec == spec and model.family == spec.family
        assert count_parameters(model) > spec.vocab_size * spec.d_model


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_falls_on_a_fixed_batch(family: str) -> None:
    model = tiny(family, dropout=0.0)
    ids = random_ids(4, 32, seed=3)
    labels = torch.roll(ids, -1, dims=1) if family == "gpt2" else mlm_labels(ids, seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(ids, labels=labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], f"{family}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"


def test_build_model_overrides_and_vocab_precedence() -> None:
    with torch.device("meta"):
        assert build_model(ModelConfig(name="gpt2-tiny")).spec.vocab_size == 512  # the preset's
        assert build_model(ModelConfig(name="gpt2-tiny"), vocab_size=300).spec.vocab_size == 300  # tokenizer's
        m = build_model(ModelConfig(name="bert-tiny", vocab_size=1000, dropout=0.0, max_seq_len=32), vocab_size=300)
    assert m.spec.vocab_size == 1000 and m.spec.dropout == 0.0 and m.spec.max_seq_len == 32
    assert m.embeddings.word.num_embeddings == 1000 and m.embeddings.position.num_embeddings == 32
    assert m.layers[0].attn.attention == "explicit"
    assert build_model(ModelConfig(name="gpt2-tiny", attention="sdpa")).blocks[0].attn.attention == "sdpa"
    assert PRESETS["gpt2-tiny"].vocab_size == 512  # overrides never mutate the presets
    with pytest.raises(ValueError, match="vocab_size"):
        build_model(ModelConfig(name="gpt2-tiny"), vocab_size=0)
    with pytest.raises(TypeError, match="ModelConfig"):
        build_model({"name": "gpt2-tiny"})  # type: ignore[arg-type]


def test_unknown_preset_suggests() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt2-mnii'.*did you mean 'gpt2-mini'.*bert-large"):
        build_model(ModelConfig(name="gpt2-mnii"))


@pytest.mark.parametrize("family", FAMILIES)
def test_too_long_sequence_raises(family: str) -> None:
    model = tiny(family)
    with pytest.raises(ValueError, match=r"sequence length 65 exceeds .*max_seq_len 64.*data\.seq_len"):
        model(random_ids(1, 65))


def test_generate() -> None:
    model = tiny("gpt2").train()
    prompt = random_ids(2, 5)
    out = model.generate(prompt, max_new_tokens=7, top_k=10, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 12) and out.dtype == torch.long
    assert torch.equal(out[:, :5], prompt) and int(out.max()) < 512
    assert model.training  # mode restored
    again = model.generate(prompt, max_new_tokens=7, top_k=10, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    assert torch.equal(model.generate(prompt, max_new_tokens=0), prompt)
    # A prompt longer than max_seq_len is cropped, not an error.
    long_prompt = random_ids(1, 70)
    assert model.generate(long_prompt, max_new_tokens=3, temperature=0.0).shape == (1, 73)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, max_new_tokens=-1)
