"""Training loop, checkpoints, LR schedule and metrics: what `graphtrain train` runs.

from graphtrain.trainer import Trainer
summary = Trainer(Config.from_yaml("configs/default.yaml")).fit()
"""

from __future__ import annotations

from graphtrain.trainer.checkpoint import (
    FORMAT_VERSION,
    checkpoint_path,
    latest_checkpoint,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from graphtrain.trainer.faults import TrainingFailed, TrainingPreempted
from graphtrain.trainer.schedule import lr_at
from graphtrain.trainer.trainer import Trainer

__all__ = [
    "FORMAT_VERSION",
    "Trainer",
    "TrainingFailed",
    "TrainingPreempted",
    "checkpoint_path",
    "latest_checkpoint",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "lr_at",
    "save_checkpoint",
    "verify_checkpoint",
]
