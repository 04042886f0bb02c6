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
    """Reject settings the Trainer cannot honour (yet), naming the fix.

    parallel.dp*tp*pp > 1 runs through graphtrain.distributed (launch with `graphtrain train --nproc N`):
    dp (optionally ZeRO-1) or tp are supported, not both at once; pp is not wired into the Trainer yet (evaluation and
    sampling need the whole model on one rank), and neither is fp16 loss scaling across ranks.
    """
    par, tc = config.parallel, config.train
    if par.world_size > 1:
        if par.tp > 1 and par.pp > 1:
            raise ValueError("parallel.tp>1 together with parallel.pp>1 is not supported yet: use tp or pp")
        if par.tp > 1 and par.dp > 1:
            raise ValueError("parallel.dp>1 together with parallel.tp>1 is not supported yet: use dp (optionally "
                             "with zero_stage=1) or tp on its own")
        if par.pp > 1:
            raise ValueError("parallel.pp>1 is not supported by the Trainer yet (evaluation and sampling need the "
                             "whole model on one rank): use parallel.dp and/or parallel.tp, or drive "
                             "graphtrain.distributed.parallelize directly")
        if par.zero_stage == 1 and par.tp > 1:
            raise ValueError("parallel.zero_stage=1 with parallel.tp>1 is not supported yet: set "
                             "parallel.zero_stage=0 or parallel.tp=1")
        if config.engine.precision == "fp16":
            raise ValueError("engine.precision=fp16 (dynamic loss scaling) is not supported in distributed runs "
                             "yet: use engine.precision=bf16 or fp32")
        if tc.batch_size != "auto" and tc.batch_size % par.dp:
            raise ValueError(f"train.batch_size={tc.batch_size} must divide by parallel.dp={par.dp} (each "
                             f"data-parallel rank takes an equal share): set train.batch_size="
                             f"{max(par.dp, tc.batch_size // par.dp * par.dp)}")


def memory_budget_bytes(config: Config, device: torch.device) -> float:
    """`engine.memory_budget` in bytes: bytes as given (> 1), or a fraction of the device's memory
    (CUDA: the GPU's total memory; CPU: the machine's physical RAM)."""
    budget = config.engine.memory_budget
    if budget is None:
        raise ValueError("train.batch_size=auto needs a memory budget: set engine.memory_budget to bytes "
                         "(e.g. engine.memory_budget=2000000000) or a fraction of device memory (e.g. 0.5), "
                         "or set a number, e.g. train.batch_size=8")
    if budget > 1:
        return float(budget)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return budget * total


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


def distributed_eager_fallback(config: Config) -> None:
    """Distributed runs train the parallelized model eagerly for now; engine.fallback decides how loudly."""
    msg = ("train.accelerate=true is not supported with parallel.dp*tp*pp > 1 yet (the graph engine does not "
           "capture DDP / tensor-parallel modules); set train.accelerate=false (--no-accelerate)")
    if config.engine.fallback == "error":
        raise ValueError(msg)
    if config.engine.fallback == "warn" and int(os.environ.get("RANK", "0")) == 0:
        warnings.warn(msg + "; training eagerly", RuntimeWarning, stacklevel=3)


def is_accelerated(model: torch.nn.Module) -> bool:
    return hasattr(model, "_graphtrain")


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
