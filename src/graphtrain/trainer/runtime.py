"""Process setup for a training run: device, threads, determinism, seeds, the graph engine."""
from __future__ import annotations

from typing import Any

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
    dp (optionally ZeRO-1), tp, pp and their products; not ZeRO-1 with tp or with dp x pp, not fp16
    loss scaling across ranks.
    """
    par, tc = config.parallel, config.train
    if par.world_size > 1:
        if par.zero_stage == 1 and par.tp > 1:
            raise ValueError("parallel.zero_stage=1 with parallel.tp>1 is not supported yet: set "
                             "parallel.zero_stage=0 or parallel.tp=1")
        if par.zero_stage == 1 and par.dp > 1 and par.pp > 1:
            raise ValueError("parallel.zero_stage=1 with parallel.dp>1 and parallel.pp>1 is not supported yet (dp "
                             "composed with pp runs through FSDP2 replicate, whose DTensor parameters "
                             "ZeroRedundancyOptimizer cannot partition): set parallel.zero_stage=0")
        if (par.pp > 1 and tc.batch_size != "auto" and tc.batch_size % par.dp == 0
                and (tc.batch_size // par.dp) % par.microbatches):
            raise ValueError(f"train.batch_size={tc.batch_size} gives {tc.batch_size // par.dp} samples per "
                             f"data-parallel rank, which must divide into parallel.microbatches={par.microbatches} "
                             f"pipeline micro-batches: set train.batch_size={par.dp * par.microbatches} (or a "
                             f"multiple)")
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


def rank_seed(seed: int, dp_rank: int, pp_rank: int) -> int:
    """The seed of one rank's random stream. Data-parallel replicas draw different dropout; so do pipeline
    stages, which hold different layers: with one shared stream stage 1 would draw stage 0's seeds in the
    same order, and graphtrain's hash dropout would give its layers stage 0's masks wherever the shapes match.
    Tensor-parallel ranks of one stage share the stream (dropout on replicated activations must agree; attention
    dropout on each rank's heads is salted by tp rank, distributed/tensor_parallel.py). Rank (0, 0) keeps the
    single-process stream."""
    if pp_rank >= 1009:
        raise ValueError(f"pipeline rank {pp_rank}: at most 1009 stages are supported")
    return seed + 1_000_003 * dp_rank + 1_009 * pp_rank


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


def build_whole_step(model: torch.nn.Module, config: Config) -> Any:
    """graphtrain.compile_step for train.whole_step, after checking the run can use it."""
    tc = config.train
    problems = [msg for bad, msg in (
        (config.parallel.world_size > 1, "one process (parallel.dp=tp=pp=1)"),
        (tc.grad_accum != 1, f"train.grad_accum=1 (got {tc.grad_accum})"),
        (config.optim.name != "adamw", f"optim.name=adamw (got {config.optim.name!r})"),
        (not tc.accelerate, "train.accelerate=true")) if bad]
    if problems:
        raise ValueError(f"train.whole_step=true needs {', '.join(problems)}; set train.whole_step=false to train "
                         f"with the graph engine and a separate optimizer step")
    from graphtrain.engine.step_graph import compile_step
    return compile_step(model, config)


class StepGraphOptimizer:
    """What the Trainer needs of an optimizer when the step graph owns the update: the learning rate it
    sets (passed to the graph each step), state_dict/load_state_dict (the graph's moments, step counts and
    loss-scale state) and a zero_grad with nothing to do (gradients never leave the graph)."""

    def __init__(self, step: Any) -> None:
        self.step_graph = step
        self.param_groups = [{"lr": config_lr(step)}]

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.step_graph.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_graph.load_state_dict(state)


def config_lr(step: Any) -> float:
    return float(step.optim.lr)


def accelerate_distributed(par, config: Config) -> torch.nn.Module:
    """The graph engine on this rank's part of the model (`Parallelized.accelerate`: in place, per layout).
    Without the engine in this install, engine.fallback decides (as maybe_accelerate)."""
    if importlib.util.find_spec("graphtrain.engine.api") is None:
        return maybe_accelerate(par.module, config)
    return par.accelerate(config.engine)


def check_distributed_capture(module: torch.nn.Module, wrapper: torch.nn.Module, config: Config) -> str:
    """After the first distributed step: did the engine capture graphs on every rank (no silent eager run)?

    Collective (all ranks call it). Returns the line rank 0 logs; a rank that fell back to eager raises
    under engine.fallback=error and warns otherwise."""
    import torch.distributed as dist
    from graphtrain.engine.report import report
    rep = report(module)
    mine = (len(rep.graphs), bool(rep.eager_only), len(rep.fallbacks))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    graphs = sorted({g for g, _, _ in every})
    bucket = getattr(wrapper, "bucket_bytes_cap", None)
    line = (f"graphtrain engine, distributed: {'/'.join(map(str, graphs))} graph(s) captured per rank"
            + (f" (Dynamo's DDPOptimizer splits at DDP's {bucket / 2**20:g} MiB gradient buckets)" if bucket else "")
            + f", eager fallbacks on {sum(1 for _, e, f in every if e or f)} of {len(every)} ranks")
    if any(g == 0 or e for g, e, _ in every):
        msg = f"{line}: the distributed model is not running through the graph engine"
        if config.engine.fallback == "error":
            raise ValueError(msg)
        if config.engine.fallback == "warn" and dist.get_rank() == 0:
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return line


def is_accelerated(model: torch.nn.Module) -> bool:
    return hasattr(model, "_graphtrain")


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
