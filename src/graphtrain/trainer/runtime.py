"""Process setup for a training run: device, threads, determinism, seeds, the graph engine."""
from __future__ import annotations

import importlib.util
import os
import random
import warnings
from pathlib import Path

import numpy as np
import torch

from graphtrain.config import Config, TrainConfig


def check_supported(config: Config) -> None:
    """Reject settings this single-process trainer cannot honour, naming the fix."""
    if config.train.batch_size == "auto":
        raise ValueError("train.batch_size='auto' needs the memory planner, which this trainer does not use yet; "
                         "set a number, e.g. train.batch_size=8")
    if config.parallel.world_size > 1:
        raise ValueError(f"parallel.dp*tp*pp = {config.parallel.world_size}: the Trainer runs one process; "
                         f"set parallel.dp=1 parallel.tp=1 parallel.pp=1 (distributed runs use graphtrain.distributed)")


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def setup(tc: TrainConfig) -> None:
    """Threads and deterministic algorithms (process-wide settings)."""
    if tc.threads is not None:
        if tc.threads < 1:
            raise ValueError(f"train.threads must be >= 1 or null (all cores), got {tc.threads}")
        torch.set_num_threads(tc.threads)
    if tc.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # required by deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def maybe_accelerate(model: torch.nn.Module, config: Config) -> torch.nn.Module:
    """`graphtrain.accelerate(model, config.engine)` when train.accelerate is on and the engine exists.

    Without the engine in this install, `engine.fallback` decides: error raises, warn trains
    eagerly with a warning, silent trains eagerly.
    """
    if not config.train.accelerate:
        return model
    if importlib.util.find_spec("graphtrain.engine.api") is None:
        msg = ("train.accelerate=true but the graphtrain engine (graphtrain.engine.api) is not in this install; "
               "set train.accelerate=false (--no-accelerate) to train eagerly")
        if config.engine.fallback == "error":
            raise ValueError(msg)
        if config.engine.fallback == "warn":
            warnings.warn(msg + "; training eagerly", RuntimeWarning, stacklevel=3)
        return model
    from graphtrain.engine.api import accelerate
    return accelerate(model, config.engine)


def is_accelerated(model: torch.nn.Module) -> bool:
    return hasattr(model, "_graphtrain")


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
