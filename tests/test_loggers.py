"""train.loggers: TensorBoard event files next to metrics.jsonl, with every metric and the engine's report."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from graphtrain import Trainer
from graphtrain.config.sections import Config

pytestmark = pytest.mark.usefixtures("tiny_env")
TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=2",
    "train.steps=3",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.ckpt_every=0",
    "train.progress=false",
    "train.threads=1",
    "train.sample_tokens=0",
    "engine.provider=aten",
]


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(folder))
    ea.Reload()
    return ea


def test_tensorboard_has_every_curve_and_the_engine_report(tmp_path, monkeypatch):
    from graphtrain.kernels import capability

    monkeypatch.setattr(capability, "peek_probe", lambda name, **kw: {"fp32": 1e11})  # a measured peak: MFU is logged
    Trainer(Config().with_overrides([*TINY, f"train.out_dir={tmp_path}"])).fit()
    ea = _scalars(tmp_path / "tensorboard")
    tags = set(ea.Tags()["scalars"])
    for tag in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/ms_per_step",
        "train/peak_mem_bytes",
        "train/mfu",
        "train/skipped",
        "eval/val_loss",
    ):
        assert tag in tags, sorted(tags)
    assert [e.step for e in ea.Scalars("train/loss")] == [1, 2, 3]
    assert all(0 < e.value < 1 for e in ea.Scalars("train/mfu"))  # tiny model, a 100 GFLOP/s peak
    assert "engine/report/text_summary" in ea.Tags()["tensors"]
    text = ea.Tensors("engine/report/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "graphtrain report" in text and "graphs captured" in text


def test_tensorboard_has_the_hyperparameters_and_the_config(tmp_path):
    """The HParams dashboard's experiment (the config keys, the metrics) and this run's values, and the config as
    YAML text, read back from the event file as TensorBoard reads it."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    cfg = Config().with_overrides([*TINY, "train.accelerate=false", "optim.lr=0.003", f"train.out_dir={tmp_path}"])
    Trainer(cfg).fit()
    ea = _scalars(tmp_path / "tensorboard")
    content = ea.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {m.name.tag for m in experiment.metric_infos} >= {"eval/val_loss", "train/loss"}
    assert {"optim.lr", "model.name", "train.batch_size", "train.loggers"} <= {h.name for h in experiment.hparam_infos}
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["optim.lr"].number_value == 0.003
    assert start.hparams["model.name"].string_value == "gpt2-tiny"
    assert start.hparams["train.loggers"].string_value == '["jsonl", "tensorboard"]'
    assert [e.step for e in ea.Scalars("eval/val_loss")] == [2, 3]  # the metric the dashboard sets against them
    text = ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert Config.from_dict(yaml.safe_load(textwrap.dedent(text))) == cfg


def test_jsonl_only_writes_no_event_files(tmp_path):
    Trainer(
        Config().with_overrides([*TINY, "train.accelerate=false", "train.loggers=[jsonl]", f"train.out_dir={tmp_path}"])
    ).fit()
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / "tensorboard").exists()


def test_unknown_logger_is_one_clear_error():
    with pytest.raises(ValueError, match=r"unknown logger\(s\) \['comet'\]; choose from"):
        Config().with_overrides(["train.loggers=[jsonl, comet]"])


def test_wandb_offline_and_mlflow_local_get_the_metrics(tmp_path, monkeypatch):
    """Optional loggers (skipped where the packages are not installed): W&B offline, MLflow's local file store."""
    wandb = pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_SILENT", "true")
    Trainer(
        Config().with_overrides(
            [*TINY, "train.accelerate=false", "train.loggers=[jsonl, wandb, mlflow]", f"train.out_dir={tmp_path}"]
        )
    ).fit()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert runs, list((tmp_path / "wandb").iterdir())
    mlflow.set_tracking_uri(f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    found = mlflow.search_runs(search_all_experiments=True)
    assert len(found) == 1 and found["metrics.train.loss"].notna().all(), found.columns.tolist()
    assert wandb  # imported for the skip
