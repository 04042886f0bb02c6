"""Where a run's metrics go besides metrics.jsonl (the source of truth: resume and `graphtrain plot` read it).

``train.loggers`` names them; ``tensorboard`` writes event files under ``<out_dir>/tensorboard`` with
``torch.utils.tensorboard`` (every numeric field of every metrics record as a scalar ``<kind>/<field>``:
train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/ms_per_step, train/mfu, train/peak_mem_bytes,
train/loss_scale, eval/val_loss, skip/... as the trainer writes them), and the engine's report as text at the end
of a run. Only rank 0 logs. On resume the events after the resumed step are purged, as metrics.jsonl's records
are (``SummaryWriter(purge_step=)``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


class TensorBoardLogger:
    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as e:
            raise RuntimeError(f"train.loggers asks for tensorboard, which is not installed ({e}): "
                               f"pip install tensorboard, or set train.loggers=[jsonl]") from None
        self.folder = folder
        self.writer: Any = None
        self.purge_step: int | None = None

    def _open(self) -> Any:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter
            self.folder.mkdir(parents=True, exist_ok=True)
            self.writer = SummaryWriter(str(self.folder), purge_step=self.purge_step)
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


def make_loggers(names: list[str], out_dir: Path) -> list[Any]:
    """The sinks for `train.loggers` (jsonl is MetricsLog itself, always written)."""
    return [TensorBoardLogger(Path(out_dir) / "tensorboard") for name in names if name == "tensorboard"]
