"""Process setup for a training run: what is supported, device, threads, determinism, seeds, data, batch size."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from graphtrain.config.sections import Config, TrainConfig
from graphtrain.data import build_data
from graphtrain.memory.allocator import trim
from graphtrain.memory.budget import budget_bytes
from graphtrain.memory.process import reset_peak_rss, rss_bytes
from graphtrain.models import build_model
from graphtrain.trainer.metrics import format_bytes

# Imports inside functions: import cost: an eager run (train.accelerate=false, one process) never loads the
# engine (Dynamo, Inductor), torch.distributed or the tools; each is imported where a run needs it.


def check_supported(config: Config) -> None:
    """Reject settings the Trainer cannot honour (yet), naming the fix.

    parallel.dp*tp*pp > 1 runs through graphtrain.distributed (launch with `graphtrain train --nproc N`):
    dp (optionally ZeRO-1), tp, pp and their products; not ZeRO-1 with tp or with dp x pp, not fp16
    loss scaling across ranks. train.whole_step (graphtrain.compile_step): AdamW, one micro-batch, one
    process, through the engine.
    """
    par, tc = config.parallel, config.train
    if tc.whole_step:
        problems = [
            msg
            for bad, msg in (
                (par.world_size > 1, "one process (parallel.dp=tp=pp=1)"),
                (tc.grad_accum != 1, f"train.grad_accum=1 (got {tc.grad_accum})"),
                (config.optim.name != "adamw", f"optim.name=adamw (got {config.optim.name!r})"),
                (not tc.accelerate, "train.accelerate=true"),
            )
            if bad
        ]
        if problems:
            raise ValueError(
                f"train.whole_step=true needs {', '.join(problems)}; set train.whole_step=false to train "
                f"with the graph engine and a separate optimizer step"
            )
    if config.model.hf is not None and par.pp > 1:
        raise ValueError(
            f"parallel.pp={par.pp} has no plan for model.hf models yet (pipeline stages are cut from "
            f"graphtrain's own GPT-2 by its layer names): train a model.hf model with parallel.dp and/or "
            f"parallel.tp (plans for GPT-2, BERT and Llama-family models), with parallel.pp=1"
        )
    if par.world_size > 1:
        if par.zero_stage == 1 and par.tp > 1:
            raise ValueError(
                "parallel.zero_stage=1 with parallel.tp>1 is not supported yet: set "
                "parallel.zero_stage=0 or parallel.tp=1"
            )
        if par.zero_stage == 1 and par.dp > 1 and par.pp > 1:
            raise ValueError(
                "parallel.zero_stage=1 with parallel.dp>1 and parallel.pp>1 is not supported yet (dp "
                "composed with pp runs through FSDP2 replicate, whose DTensor parameters "
                "ZeroRedundancyOptimizer cannot partition): set parallel.zero_stage=0"
            )
        if (
            par.pp > 1
            and tc.batch_size != "auto"
            and tc.batch_size % par.dp == 0
            and (tc.batch_size // par.dp) % par.microbatches
        ):
            raise ValueError(
                f"train.batch_size={tc.batch_size} gives {tc.batch_size // par.dp} samples per "
                f"data-parallel rank, which must divide into parallel.microbatches={par.microbatches} "
                f"pipeline micro-batches: set train.batch_size={par.dp * par.microbatches} (or a "
                f"multiple)"
            )
        if config.engine.precision == "fp16":
            raise ValueError(
                "engine.precision=fp16 (dynamic loss scaling) is not supported in distributed runs "
                "yet: use engine.precision=bf16 or fp32"
            )
        if tc.batch_size != "auto" and tc.batch_size % par.dp:
            raise ValueError(
                f"train.batch_size={tc.batch_size} must divide by parallel.dp={par.dp} (each "
                f"data-parallel rank takes an equal share): set train.batch_size="
                f"{max(par.dp, tc.batch_size // par.dp * par.dp)}"
            )


def memory_budget_bytes(config: Config, device: torch.device) -> float:
    """`engine.memory_budget` in bytes: bytes as given (> 1), or a fraction of the device's memory
    (graphtrain.memory.budget: CUDA, the GPU's total memory; CPU, the machine's physical RAM)."""
    budget = config.engine.memory_budget
    if budget is None:
        raise ValueError(
            "train.batch_size=auto needs a memory budget: set engine.memory_budget to bytes "
            "(e.g. engine.memory_budget=2000000000) or a fraction of device memory (e.g. 0.5), "
            "or set a number, e.g. train.batch_size=8"
        )
    return budget_bytes(budget, device)


def auto_batch_size(
    config: Config, model: torch.nn.Module | None, vocab_size: int, device: torch.device
) -> tuple[Config, str]:
    """train.batch_size=auto -> the config with the largest micro-batch fitting engine.memory_budget (per rank,
    times parallel.dp; grad_accum kept), and the line saying so."""
    from graphtrain.tools.autobatch import pick_batch_size

    budget = memory_budget_bytes(config, device)
    if model is not None:

        def factory() -> torch.nn.Module:
            return model

    else:

        def factory() -> torch.nn.Module:
            return build_model(config.model, vocab_size=vocab_size)

    with torch.random.fork_rng(devices=[]):  # building probe models must not move the weights' seed
        plan = pick_batch_size(factory, config.data.seq_len, budget, engine_cfg=config.engine)
    dp = config.parallel.dp
    chosen = plan.micro_batch * dp
    line = (
        f"train.batch_size=auto: micro-batch {plan.micro_batch}"
        f"{f' per rank x {dp} dp ranks = {chosen}' if dp > 1 else ''} (predicted step peak "
        f"{format_bytes(plan.predicted_peak)} of the {format_bytes(int(budget))} engine.memory_budget), "
        f"grad_accum {config.train.grad_accum}: {chosen * config.train.grad_accum} samples per step"
    )
    return config.with_overrides({"train.batch_size": chosen}), line


def load_data(config: Config, family: str, env: Any) -> Any:
    """The run's data. Distributed (`env`), rank 0 builds (or reads) the cached tokenizer and tokens first; the
    others then read its cache."""
    if env is None:
        return build_data(config, family)
    import torch.distributed as dist

    data = build_data(config, family) if env.is_main else None
    dist.barrier()
    return data if data is not None else build_data(config, family)


def data_preparation_peak(device: torch.device, data: Any) -> int | None:
    """After the data was prepared here (a cold cache: the tokenizer trained, the corpus tokenized), the heap's free
    pages go back to the OS and the process's high-water mark restarts, so the steps' "peak mem" is the memory
    training needs; returns the preparation's peak, to be shown apart.

    gpt2-mini's default job on the 2-core AMX Xeon: after a cold preparation the process held 600 MB (a warm start:
    310 MB), most of it freed memory that glibc's heaps kept (365 MB after a malloc_trim), and 10 steps peaked at
    963 MB against a warm run's 705 MB; with the trim, and the ids mapped from the cache files
    (data/tokenizer.py), at 776 MB, the preparation's own peak (741 MB) printed apart. None when the data came from
    the cache, or on CUDA (its peak is the allocator's); where the mark cannot restart (not Linux), the heap is still
    trimmed and None returned."""
    info = getattr(data, "info", None)
    if device.type != "cpu" or not isinstance(info, dict) or info.get("from_cache", True):
        return None
    peak = rss_bytes("VmHWM")
    trim()
    return peak if peak is not None and reset_peak_rss() else None


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


def is_accelerated(model: torch.nn.Module) -> bool:
    return hasattr(model, "_graphtrain")


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
