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
