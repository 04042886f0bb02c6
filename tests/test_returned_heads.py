"""Logits a model returns beside its loss (passes/returned_heads.py): detached from the compiled graph and given
linear's backward outside it, so a step that trains on the loss fills no zero gradient of the logits' size. Checked
against eager PyTorch: the loss alone, and a caller that backpropagates through the returned logits too."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphtrain
from graphtrain.passes.returned_heads import _HeadGrad
from graphtrain.testing import assert_close, assert_grads_close

pytestmark = pytest.mark.usefixtures("one_thread")


class TinyLM(nn.Module):
    """Embedding, one layer, an LM head (tied or not, with or without a bias); returns (loss, logits) as Hugging Face
    models do, or the logits alone (`loss_inside=False`: the caller computes the loss)."""

    def __init__(self, tied: bool, bias: bool, loss_inside: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(97, 24)
        self.mid = nn.Linear(24, 24)
        self.head = nn.Linear(24, 97, bias=bias)
        if tied:
            self.head.weight = self.emb.weight
        self.loss_inside = loss_inside

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):
        logits = self.head(torch.tanh(self.mid(self.emb(ids))))
        if not self.loss_inside:
            return logits
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1)), logits


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 97, (3, 11), generator=g), torch.randint(0, 97, (3, 11), generator=g)


@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)], ids=["tied", "untied-bias"])
@pytest.mark.parametrize("through_logits", [False, True], ids=["loss", "loss+logits"])
def test_returned_logits_train_like_eager(tied, bias, through_logits):
    torch.manual_seed(0)
    eager = TinyLM(tied, bias)
    model = graphtrain.accelerate(copy.deepcopy(eager), provider="aten", fallback="error")
    ids, labels = _batch()
    for m in (eager, model):
        loss, logits = m(ids, labels)
        total = loss + (logits.square().mean() if through_logits else 0)
        total.backward()
        m.out = (loss.detach(), logits.detach())
    assert_close(model.out[0], eager.out[0], name="loss")
    assert_close(model.out[1], eager.out[1], name="logits")
    assert_grads_close(model, eager)
    _, logits = model(ids, labels)
    assert isinstance(logits.grad_fn, _HeadGrad._backward_cls) and logits.requires_grad
    rep = graphtrain.report(model)
    assert any("returned logits of" in n for n in rep.notes)
    (rec,) = [p for p in rep.passes if p["name"] == "detach_returned_heads"]
    assert rec["stage"] == "dynamo" and rec["rewrites"] == 1, rec


def test_switched_off_the_logits_stay_outputs_of_the_graph():
    """engine.passes: {detach_returned_heads: false}: no head detached (the logits' gradient function is the
    graph's), the same training as eager, and the report says the pass was off."""
    torch.manual_seed(0)
    eager = TinyLM(tied=True, bias=False)
    model = graphtrain.accelerate(
        copy.deepcopy(eager), provider="aten", fallback="error", passes={"detach_returned_heads": False}
    )
    ids, labels = _batch()
    for m in (eager, model):
        loss, logits = m(ids, labels)
        (loss + logits.square().mean()).backward()
        assert not isinstance(logits.grad_fn, _HeadGrad._backward_cls)
        m.out = loss.detach()
    assert_close(model.out, eager.out, name="loss")
    assert_grads_close(model, eager)
    rep = graphtrain.report(model)
    assert not any("returned logits of" in n for n in rep.notes), rep.notes
    assert not [p for p in rep.passes if p["name"] == "detach_returned_heads"], rep.passes
    assert "switched off (engine.passes): detach_returned_heads" in str(rep)


def test_a_failing_dynamo_pass_leaves_the_graph_as_it_was(monkeypatch):
    """The pass manager's contract holds on the Dynamo graph: a pass that rewrote, handed its heads over and then
    failed is undone (the graph from before it, no heads to reattach, no note) and reported."""
    from graphtrain.passes import manager, returned_heads

    def broken(gm, ctx):
        returned_heads.detach_returned_heads_pass(gm, ctx)
        raise RuntimeError("boom")

    monkeypatch.setattr(manager._REGISTRY["detach_returned_heads"], "fn", broken)
    torch.manual_seed(0)
    eager = TinyLM(tied=False, bias=True)
    model = graphtrain.accelerate(copy.deepcopy(eager), provider="aten", fallback="silent")
    ids, labels = _batch()
    for m in (eager, model):
        loss, logits = m(ids, labels)
        (loss + logits.square().mean()).backward()
        assert not isinstance(logits.grad_fn, _HeadGrad._backward_cls)
    assert_grads_close(model, eager)
    rep = graphtrain.report(model)
    assert ("pass detach_returned_heads", "RuntimeError: boom") in rep.fallbacks, rep.fallbacks
    (rec,) = [p for p in rep.passes if p["name"] == "detach_returned_heads"]
    assert rec["error"] == "RuntimeError: boom" and rec["rewrites"] == 0, rec
    assert not any("returned logits of" in n for n in rep.notes), rep.notes


def test_logits_without_a_use_inside_the_graph_keep_their_gradient():
    """Only returned (the caller computes the loss): their gradient is the caller's, and nothing is rewritten."""
    torch.manual_seed(0)
    eager = TinyLM(tied=False, bias=True, loss_inside=False)
    model = graphtrain.accelerate(copy.deepcopy(eager), provider="aten", fallback="error")
    ids, labels = _batch()
    for m in (eager, model):
        logits = m(ids, labels)
        nn.functional.cross_entropy(logits.view(-1, 97), labels.view(-1)).backward()
        assert not isinstance(logits.grad_fn, _HeadGrad._backward_cls)
    assert_grads_close(model, eager)
    assert not any("returned logits of" in n for n in graphtrain.report(model).notes)


def test_hugging_face_language_models_return_reattached_logits():
    """GPT-2 (tied head, loss in the same graph as the logits after graphtrain's capture) and BERT's masked-LM head
    (tied weight, its own bias): the loss's gradients as eager's, the logits reattached."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    models = {
        "gpt2": transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_layer=2,
                n_embd=32,
                n_head=2,
                vocab_size=101,
                n_positions=32,
                attn_implementation="sdpa",
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        ),
        "bert": transformers.BertForMaskedLM(
            transformers.BertConfig(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=2,
                intermediate_size=64,
                vocab_size=101,
                max_position_embeddings=32,
                attn_implementation="sdpa",
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        ),
    }
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    for name, eager in models.items():
        eager.train()
        model = graphtrain.accelerate(copy.deepcopy(eager), provider="aten", fallback="error")
        for m in (eager, model):
            out = m(input_ids=ids, labels=ids)
            (out.loss + 0.1 * out.logits.mean()).backward()
        assert isinstance(out.logits.grad_fn, _HeadGrad._backward_cls), name
        assert_grads_close(model, eager)
