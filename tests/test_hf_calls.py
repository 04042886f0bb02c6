"""models/hf_calls.py: the adjustments the engine's call wrapper makes to a call to a Hugging Face model, checked on
the adapter itself (tests/test_hf_families.py and tests/test_static_masks.py check them through accelerate)."""

from __future__ import annotations

import pytest
import torch

from graphtrain.config.sections import EngineConfig
from graphtrain.models.hf_calls import call_adapter

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg).train()


def test_a_module_that_is_not_a_hugging_face_model_gets_no_adapter():
    assert call_adapter(torch.nn.Linear(2, 2), EngineConfig()) is None


def test_training_calls_pass_use_cache_false_unless_the_caller_passes_it():
    model = _gpt2()
    adapter = call_adapter(model, EngineConfig())
    for given, expect in (({}, {"use_cache": False}), ({"use_cache": True}, {"use_cache": True})):
        adapter.before_call(given)
        assert given == expect
    model.eval()
    kwargs: dict = {}
    adapter.before_call(kwargs)
    assert kwargs == {}


def test_an_all_ones_mask_is_passed_as_none_under_static_masks_only():
    model, ones = _gpt2(), torch.ones(2, 8, dtype=torch.long)
    notes: list[str] = []
    kwargs = {"attention_mask": ones}
    call_adapter(model, EngineConfig()).before_compiled_call(kwargs, notes)
    assert kwargs["attention_mask"] is None and len(notes) == 1 and "engine.static_masks" in notes[0]
    padding = ones.clone()
    padding[0, 0] = 0
    for cfg, kw in (
        (EngineConfig(), {"attention_mask": padding}),
        (EngineConfig(), {"attention_mask": ones, "position_ids": torch.arange(8).expand(2, 8)}),
        (EngineConfig(static_masks=False), {"attention_mask": ones}),
        (EngineConfig(dynamic=True), {"attention_mask": ones}),
    ):
        mask = kw["attention_mask"]
        call_adapter(model, cfg).before_compiled_call(kw, [])
        assert kw["attention_mask"] is mask, cfg


def test_a_classifier_settles_its_problem_type_by_hugging_faces_rule():
    cfg = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=32, num_labels=3
    )
    for labels, expect in (
        (torch.tensor([0, 2]), "single_label_classification"),
        (torch.tensor([[0.0, 1.0, 0.0]]), "multi_label_classification"),
    ):
        model = transformers.BertForSequenceClassification(cfg).train()
        model.config.problem_type = None
        notes: list[str] = []
        call_adapter(model, EngineConfig()).before_compiled_call({"labels": labels}, notes)
        assert model.config.problem_type == expect and expect in notes[0]


def test_only_generation_calls_run_eagerly():
    adapter = call_adapter(_gpt2(), EngineConfig())
    assert adapter.eager_call({"input_ids": torch.zeros(1, 4, dtype=torch.long)}) is None
    assert adapter.eager_call({"past_key_values": None}) is None
    why = adapter.eager_call({"past_key_values": transformers.DynamicCache()})
    assert why is not None and "generate" in why
    uncached = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "use_cache": False, "return_dict": True}
    assert adapter.eager_call(uncached) is None  # with gradients on: a training call
    with torch.no_grad():
        assert "generate without a cache" in (adapter.eager_call(uncached) or "")
        assert adapter.eager_call({"input_ids": uncached["input_ids"]}) is None  # an evaluation call


@pytest.mark.parametrize(
    "family,use_cache",
    [  # each family and each cache setting once in the default suite; the other two pairs slow-marked
        pytest.param("gpt2", True, marks=pytest.mark.slow, id="gpt2-cache"),
        pytest.param("gpt2", False, id="gpt2-no-cache"),
        pytest.param("llama-gqa", True, id="llama-gqa-cache"),
        pytest.param("llama-gqa", False, marks=pytest.mark.slow, id="llama-gqa-no-cache"),
    ],
)
def test_generate_between_training_steps_runs_eagerly_and_training_stays_compiled(family, use_cache, recwarn):
    """Hugging Face's generate between steps (sampling text during training): its prefill and decoding calls carry
    a key/value cache and run eagerly. Before, each decoding step compiled a graph (a new cache length each), until
    Dynamo's recompile limit warned of a fallback and left later training shapes uncompiled. The generated tokens
    are eager's, no graph is compiled for them, and a new training shape after it still compiles and trains as
    eager does."""
    import copy

    import graphtrain
    from graphtrain.testing import assert_close, assert_grads_close

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )  # fmt: skip
        base = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=64, max_position_embeddings=64,
        )  # fmt: skip
        base = transformers.LlamaForCausalLM(cfg)
    ref = copy.deepcopy(base)
    model = graphtrain.accelerate(copy.deepcopy(base), provider="aten", fallback="error")
    ids = torch.randint(0, 64, (2, 16))

    def losses(batch):
        out = []
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            out.append(m(input_ids=batch, labels=batch).loss)
            out[-1].backward()
        assert_grads_close(model, ref, rtol=1e-4, atol=1e-6)
        return out

    assert_close(*losses(ids), rtol=1e-5, atol=1e-6, name="loss before generate")
    graphs = len(model._graphtrain.graphs)
    with torch.no_grad():
        out = [
            m.eval().generate(ids[:, :4], max_new_tokens=12, do_sample=False, pad_token_id=0, use_cache=use_cache)
            for m in (model, ref)
        ]
    assert torch.equal(out[0], out[1])
    model.train()
    ref.train()
    assert len(model._graphtrain.graphs) == graphs  # no graph compiled for generation
    rep = graphtrain.report(model)
    why = "key/value cache" if use_cache else "generate without a cache"
    assert not rep.fallbacks and any(why in n for n in model._graphtrain.notes), model._graphtrain.notes
    new = torch.randint(0, 64, (3, 16))  # a new training shape after generate: compiled, like eager
    got, want = losses(new)
    assert len(model._graphtrain.graphs) > graphs
    assert_close(got, want, rtol=1e-5, atol=1e-6, name="loss of a new shape after generate")
    assert not [w for w in recwarn if "graphtrain" in str(w.message)]
