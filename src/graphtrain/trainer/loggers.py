"""Where a run's metrics go besides metrics.jsonl (the source of truth: resume and `graphtrain plot` read it).

``train.loggers`` names them. ``wandb`` and ``mlflow`` log the same scalars when those packages are installed
(never required; asked for without them: one error naming the package). W&B runs offline unless ``WANDB_MODE``
says otherwise (nothing leaves the machine by default); MLflow writes to ``<out_dir>/mlflow.db`` (SQLite) unless
``MLFLOW_TRACKING_URI`` points elsewhere. ``tensorboard`` writes event files under ``<out_dir>/tensorboard`` with
``torch.utils.tensorboard`` (every numeric field of every metrics record as a scalar ``<kind>/<field>``:
train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/ms_per_step, train/mfu, train/peak_mem_bytes,
train/loss_scale, eval/val_loss, skip/... as the trainer writes them), the run's config as hyperparameters (the
HParams dashboard: every config key, flattened as ``optim.lr``, against the metrics eval/val_loss and train/loss, so
runs compare by config) and as YAML text (tag ``config``), and the engine's report as text at the end of a run.
Only rank 0 logs. On resume the events after the resumed step are purged, as metrics.jsonl's records
are (``SummaryWriter(purge_step=)``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

# The metrics the HParams dashboard sets against each run's hyperparameters (scalars the run writes itself).
HPARAM_METRICS = ("eval/val_loss", "train/loss", "train/tokens_per_s")


def hparam_values(config: dict[str, Any]) -> dict[str, Any]:
    """The config as HParams takes it: flat keys, each value a number, string or bool (lists and null as text)."""
    out = {}
    for key, value in _flat(config).items():
        out[key] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
    return out


class TensorBoardLogger:
    def __init__(self, folder: Path, config: dict[str, Any] | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"train.loggers asks for tensorboard, which is not installed ({e}): "
                f"pip install tensorboard, or set train.loggers=[jsonl]"
            ) from None
        self.folder = folder
        self.config = config or {}
        self.writer: Any = None
        self.purge_step: int | None = None

    def _open(self) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams

            self.folder.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(str(self.folder), purge_step=self.purge_step)
            if self.config:  # into this run's own event file (add_hparams would start another run folder)
                for summary in hparams(hparam_values(self.config), {m: 0.0 for m in HPARAM_METRICS}):
                    self.writer.file_writer.add_summary(summary)
                self.text("config", yaml.safe_dump(self.config, sort_keys=False), 0)
        return self.writer

    def purge_after(self, step: int) -> None:
        """A resumed run starts after `step`: events written past it by the run that stopped are dropped."""
        self.purge_step = step + 1

    def record(self, record: dict[str, Any]) -> None:
        kind, step = record.get("kind"), record.get("step", 0)
        writer = None
        for key, value in record.items():
            if key in ("kind", "step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            writer = writer or self._open()
            writer.add_scalar(f"{kind}/{key}", value, step)
        if writer is not None:
            writer.flush()

    def text(self, tag: str, text: str, step: int) -> None:
        writer = self._open()
        writer.add_text(tag, "    " + text.replace("\n", "\n    "), step)  # indented: shown as preformatted
        writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    kind = record.get("kind")
    return {
        f"{kind}/{k}": float(v)
        for k, v in record.items()
        if k not in ("kind", "step", "time") and not isinstance(v, bool) and isinstance(v, (int, float))
    }


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _require(module: str, key: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:  # a usage error (exit 2), found before the first step: one line, no traceback
        raise ValueError(
            f"train.loggers asks for {key}, which is not installed: pip install {key}, or drop it from train.loggers"
        ) from None


class WandbLogger:
    def __init__(self, out_dir: Path, config: dict[str, Any]) -> None:
        import os

        self.wandb = _require("wandb", "wandb")
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT", "graphtrain"),
            name=Path(out_dir).name,
            dir=str(out_dir),
            config=_flat(config),
            mode=os.environ.get("WANDB_MODE", "offline"),
            reinit="finish_previous",
        )

    def purge_after(self, step: int) -> None:  # W&B keeps history; a resumed run logs on from `step`
        pass

    def record(self, record: dict[str, Any]) -> None:
        values = _scalars(record)
        if values:
            self.run.log(values, step=int(record.get("step", 0)))

    def text(self, tag: str, text: str, step: int) -> None:
        self.run.summary[tag] = text

    def close(self) -> None:
        self.run.finish()


class MLflowLogger:
    def __init__(self, out_dir: Path, config: dict[str, Any]) -> None:
        import os

        self.mlflow = _require("mlflow", "mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            self.mlflow.set_tracking_uri(f"sqlite:///{(Path(out_dir) / 'mlflow.db').resolve()}")
        self.run = self.mlflow.start_run(run_name=Path(out_dir).name)
        params = {k: str(v)[:250] for k, v in _flat(config).items()}
        self.mlflow.log_params(params)

    def purge_after(self, step: int) -> None:
        pass

    def record(self, record: dict[str, Any]) -> None:
        values = {k.replace("/", "."): v for k, v in _scalars(record).items()}
        if values:
            self.mlflow.log_metrics(values, step=int(record.get("step", 0)))

    def text(self, tag: str, text: str, step: int) -> None:
        self.mlflow.log_text(text, f"{tag.replace('/', '_')}.txt")

    def close(self) -> None:
        self.mlflow.end_run()


def make_loggers(names: list[str], out_dir: Path, config: dict[str, Any] | None = None) -> list[Any]:
    """The sinks for `train.loggers` (jsonl is MetricsLog itself, always written)."""
    out: list[Any] = []
    for name in names:
        if name == "tensorboard":
            out.append(TensorBoardLogger(Path(out_dir) / "tensorboard", config))
        elif name == "wandb":
            out.append(WandbLogger(Path(out_dir), config or {}))
        elif name == "mlflow":
            out.append(MLflowLogger(Path(out_dir), config or {}))
    return out
