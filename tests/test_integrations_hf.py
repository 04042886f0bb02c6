"""The Hugging Face Trainer trains a graphtrain-accelerated model unchanged: the same per-step losses as the
plain Trainer (fp32 tolerance table), the engine's summary in its log."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _model():
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=128,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _losses(model, out_dir, callbacks=(), report_to="none"):
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (8, 16), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=2,
        max_steps=4,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=report_to,
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
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
    assert (
        summary["graphtrain_graphs"] >= 3
        and summary["graphtrain_fallbacks"] == 0
        and not summary["graphtrain_eager_only"]
    )


def test_callback_logs_through_the_trainer_so_report_to_loggers_get_it(tmp_path):
    """report_to=tensorboard: the engine's summary reaches TensorBoard's event file as scalars (train/...), written
    by transformers' own TensorBoardCallback from Trainer.log, and the Trainer's log history."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from graphtrain.integrations.hf import GraphtrainCallback, accelerate_for_trainer

    threads = torch.get_num_threads()
    try:
        model = accelerate_for_trainer(_model(), provider="aten", fallback="error")
        _, log = _losses(model, tmp_path / "out", [GraphtrainCallback()], report_to=["tensorboard"])
    finally:
        torch.set_num_threads(threads)
    entries = [h for h in log if "graphtrain_graphs" in h]
    assert len(entries) == 1 and entries[0]["step"] == 4, log
    events = sorted(tmp_path.rglob("events.out.tfevents.*"))
    assert events, list(tmp_path.rglob("*"))
    scalars = {}
    for path in events:
        acc = EventAccumulator(str(path))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars[tag] = [(e.step, e.value) for e in acc.Scalars(tag)]
    assert scalars["train/graphtrain_graphs"] == [(4, float(entries[0]["graphtrain_graphs"]))], scalars.keys()
    assert entries[0]["graphtrain_graphs"] >= 3
    assert scalars["train/graphtrain_fallbacks"] == [(4, 0.0)] and "train/loss" in scalars


def test_callback_driven_by_hand_says_where_its_summary_went(tmp_path):
    """Outside a Trainer's loop there is no Trainer to log through: one warning naming the fix, and the summary
    in state.log_history all the same."""
    from graphtrain.integrations.hf import GraphtrainCallback, accelerate_for_trainer

    model = accelerate_for_trainer(_model(), provider="aten")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    callback = GraphtrainCallback()
    callback.on_train_begin(args, state, control, model=model)
    assert callback.trainer is None
    with pytest.warns(UserWarning, match=r"pass the trainer: GraphtrainCallback\(trainer\)"):
        callback.on_train_end(args, state, control, model=model)
    assert state.log_history == [
        {
            "graphtrain_graphs": 0,
            "graphtrain_graph_breaks": 0,
            "graphtrain_fallbacks": 0,
            "graphtrain_eager_only": 0,
            "step": 0,
        }
    ]
