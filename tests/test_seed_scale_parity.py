"""Parity at the seed models' depth and sequence length (slow): what docs/design/benchmarks.md's loss@N cannot show.

The seed models (GPT-2 Medium, BERT-Large) are 24 layers deep and train at seq 512-1024. These tests keep the
depth and the sequence length and shrink the width (d_model 256, 4 heads) so a run fits minutes on 2 cores:
- dropout 0: graphtrain's loss curve over 10 AdamW steps equals eager's within the fp32 tolerance table, for
  the default passes under both providers;
- dropout 0.1: graphtrain draws another random stream (its fused dropouts hash a seed), so its curve is one more
  sample of dropout noise; over 3 seeds its mean loss lies within the seed-to-seed spread of eager's (a Welch
  bound from both sides' spread, see `_within_spread`), on the reference models and on Hugging Face GPT-2 and
  BERT.
A stable learning rate (1e-4): at 1e-3 these models are unstable in eager PyTorch itself (GPT-2 Medium, seq 1024,
dropout 0.1: eager's loss after 4 steps was 8.10, 8.49 and 14.10 over three seeds), so a loss after N steps there
measures the spike, not the implementation.
"""

from __future__ import annotations

import statistics

import pytest
import torch

import graphtrain
from graphtrain.optim import param_groups
from graphtrain.testing import assert_close

pytestmark = pytest.mark.slow

STEPS = 10
LR = 1e-4
DEPTH = dict(n_layer=24, n_head=4, d_model=256, vocab_size=8192)
SEQ = 512


def _reference(family: str, dropout: float) -> torch.nn.Module:
    from graphtrain.models.presets import ModelSpec

    spec = ModelSpec(
        family=family, max_seq_len=SEQ, dropout=dropout, layer_norm_eps=1e-5 if family == "gpt2" else 1e-12, **DEPTH
    )
    if family == "gpt2":
        from graphtrain.models.gpt2 import GPT2

        return GPT2(spec)
    from graphtrain.models.bert import BERT

    return BERT(spec)


def _hf(family: str, dropout: float) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    common = dict(attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "hf-gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=8192,
            n_positions=SEQ,
            n_embd=256,
            n_layer=12,
            n_head=4,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            **common,
        )
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.BertConfig(
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=12,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        **common,
    )
    return transformers.BertForMaskedLM(cfg)


def _batch(family: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(5, 8192, (1, SEQ + 1), generator=g)
    if "gpt2" in family:
        ids = tokens[:, :-1].contiguous()
        return {"input_ids": ids, "labels": ids if family.startswith("hf") else tokens[:, 1:].contiguous()}
    ids = tokens[:, :-1].clone()
    masked = torch.rand(ids.shape, generator=g) < 0.15
    masked[:, 0] = True
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    ids[masked] = 4
    return {"input_ids": ids, "labels": labels}


def losses(family: str, mode: str, dropout: float, seed: int) -> list[float]:
    """10 AdamW steps (torch's fused kernel for both sides) on one fixed batch from the same initial weights;
    `seed` seeds the dropout stream."""
    torch.manual_seed(1337)
    model = (_hf if family.startswith("hf") else _reference)(family, dropout).train()
    if mode != "eager":  # Hugging Face models have graph breaks (logging), so no fullgraph capture for them
        model = graphtrain.accelerate(model, provider=mode, fallback="warn" if family.startswith("hf") else "error")
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=LR, betas=(0.9, 0.95), fused=True)
    batch = _batch(family)
    torch.manual_seed(1000 + seed)
    out = []
    for _ in range(STEPS):
        res = model(**batch)
        loss = res if isinstance(res, torch.Tensor) else res.loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.detach()))
    if mode != "eager":
        rep = graphtrain.report(model)
        assert rep.graphs and not rep.eager_only and not rep.fallbacks, (rep.fallbacks, rep.eager_only)
    return out


@pytest.mark.parametrize(
    "family,provider", [("gpt2", "aten"), ("gpt2", "inductor"), ("bert", "aten"), ("bert", "inductor")]
)
def test_dropout0_loss_curve_matches_eager_at_seed_depth(family, provider):
    # measured (2-core AVX2 EPYC): gpt2 aten and inductor equal eager to 4 decimals at all 10 steps
    want = losses(family, "eager", 0.0, 0)
    got = losses(family, provider, 0.0, 0)
    assert_close(torch.tensor(got), torch.tensor(want), name=f"{family} {provider} loss curve")


def _within_spread(got: list[list[float]], want: list[list[float]], steps: range, k: float = 8.0) -> list[str]:
    """Steps where graphtrain's mean loss over its seeds differs from eager's by more than k standard errors of the
    difference, sqrt(s_e^2/n + s_g^2/n) (Welch), with the per-step spread of each side over its seeds. With 3 seeds a
    side the statistic has about 4 degrees of freedom: Student's t exceeds 8.6 with probability 0.1% (two-sided),
    hence k = 8. Measured why k must not follow the normal table: Hugging Face BERT at step 4, seeds 0-2, was 5.6
    standard errors apart, and with 6 seeds a side 1.4 (eager 8.3240 +- 0.009, graphtrain 8.3314 +- 0.009;
    dropout 0: equal to 4 decimals). A biased dropout (a missing 1/(1-p)) moves the loss by tenths, tens of
    standard errors here."""
    bad = []
    for i in steps:
        e, g = [w[i] for w in want], [x[i] for x in got]
        se = (statistics.variance(e) / len(e) + statistics.variance(g) / len(g)) ** 0.5
        diff = statistics.mean(g) - statistics.mean(e)
        if abs(diff) > k * se:
            bad.append(
                f"step {i}: graphtrain {[round(v, 4) for v in g]}, eager {[round(v, 4) for v in e]}: "
                f"mean difference {diff:+.4f} is {abs(diff) / se:.1f} standard errors"
            )
    return bad


@pytest.mark.parametrize("family", ["gpt2", "bert", "hf-gpt2", "hf-bert"])
def test_dropout_loss_within_eager_seed_spread(family):
    want = [losses(family, "eager", 0.1, s) for s in range(3)]
    got = [losses(family, "aten", 0.1, s) for s in range(3)]
    bad = _within_spread(got, want, range(2, STEPS))
    assert not bad, f"{family}: " + "; ".join(bad)
