"""The Hugging Face Trainer trains a graphtrain-accelerated model unchanged: the same per-step losses as the
plain Trainer (fp32 tolerance table), the engine's summary in its log."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _model():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _losses(model, out_dir, callbacks=()):
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (8, 16), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=2, max_steps=4,
                                          learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                                          use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer.state.log_history


def test_trainer_losses_match_plain_trainer(tmp_path):
    from graphtrain.integrations.hf import GraphtrainCallback, accelerate_for_trainer
    threads = torch.get_num_threads()
    try:
        plain, _ = _losses(_model(), tmp_path / "plain")
        model = accelerate_for_trainer(_model(), provider="aten", fallback="error")
        fast, log = _losses(model, tmp_path / "graphtrain", [GraphtrainCallback()])
    finally:
        torch.set_num_threads(threads)
    assert len(plain) == len(fast) == 4
    torch.testing.assert_close(torch.tensor(fast), torch.tensor(plain), rtol=1e-4, atol=1e-5)
    summary = next(h for h in log if "graphtrain_graphs" in h)
    assert summary["graphtrain_graphs"] >= 3 and summary["graphtrain_fallbacks"] == 0 and not \
        summary["graphtrain_eager_only"]
