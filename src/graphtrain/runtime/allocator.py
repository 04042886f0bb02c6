"""The CPU allocator policy: which mode (memory/allocator.py: release, keep or default), huge pages and the block
cache a process runs under, and when it is set. memory/allocator.py holds the mechanism (glibc's mallopt, the C++
allocator of kernels/_cpu_ext.py); this module decides, once per process: at an accelerated module's first training
call on CPU (frontend/accelerate.py, before Dynamo traces) or at the first CPU graph compiled (runtime/backend.py),
whichever comes first; a benchmark or measurement harness sets it itself (``set_cpu_allocator``) so that every
variant it compares runs under one setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphtrain.config.sections import EngineConfig
from graphtrain.memory import allocator

_ALLOCATOR_SET: str | None = None


def allocator_mode(config: EngineConfig) -> str:
    """The CPU allocator mode `config` asks for (memory/allocator.py): `auto` releases freed blocks to the OS when
    the user asked for memory savings (recompute or a memory budget) and keeps them for the next step otherwise.

    Release (glibc's threshold pinned at 128 KiB): with glibc's growing threshold the freed activations of a step
    stay in its heap, measured ~90 MiB on gpt2-mini b16 s128, but every larger allocation becomes a fresh mmap
    whose pages fault in on first touch: 0.55 s/step pinned vs 0.38 s unpinned (gpt2-mini b16 s128, 2-core Xeon,
    fp32, aten provider). Keep: blocks over glibc's 32 MiB cap (logits) are reused instead of faulted in."""
    if config.cpu_allocator != "auto":
        return config.cpu_allocator
    return "release" if (config.recompute != "none" or config.memory_budget is not None) else "keep"


HUGE_PAGES_MIN_PARAM_BYTES = 256 << 20  # cpu_huge_pages auto under keep: see huge_pages_wanted


def huge_pages_wanted(config: EngineConfig, mode: str, param_bytes: int | None) -> bool:
    """engine.cpu_huge_pages: `auto` puts 2 MiB+ blocks on huge pages except under `keep` for a model with less than
    HUGE_PAGES_MIN_PARAM_BYTES of parameters (`param_bytes`; None: unknown, on). Under keep every step reuses the
    heap blocks the first step faulted in, so huge pages only speed up the first touch, which is most of a large
    model's first step (GPT-2 Medium, 1.4 GB of parameters: 9.0 s to 5.6 s, memory/allocator.py); on a small one
    the 2 MiB rounding of each block is all they add (gpt2-mini, 21 MB: peak 770-776 MB with, 725-739 without,
    the same step time, 2-core Zen 5). The threshold lies between those two measured models; it is not tuned. On
    some CPUs they also slow every step's GEMMs that read a power-of-two-wide activation gradient transposed (2.9x
    for a [512, 16384] one on a Zen 2, memory/allocator.py). graphtrain pads the LM head's buffer, which it owns;
    the layers' gradients are aten's. For a large model with power-of-two widths that cost was not measured against
    its first-step gain."""
    if config.cpu_huge_pages != "auto":
        return bool(config.cpu_huge_pages)
    return mode != "keep" or param_bytes is None or param_bytes >= HUGE_PAGES_MIN_PARAM_BYTES


def set_cpu_allocator_once(example_inputs: Sequence[Any], config: EngineConfig, param_bytes: int | None = None) -> None:
    """Apply `allocator_mode(config)` the first time the engine meets CPU tensors (a CPU graph's inputs, or a CPU
    module's parameter); the process keeps that setting (glibc's is per process: a later model asking for another
    mode does not change it). `param_bytes`: the model's parameters, where the caller knows them; else those among
    `example_inputs` (a graph's lifted parameters)."""
    if _ALLOCATOR_SET is not None:
        return
    if any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in example_inputs):
        return
    mode = allocator_mode(config)
    if param_bytes is None:
        params = [x for x in example_inputs if isinstance(x, torch.nn.Parameter)]
        param_bytes = sum(x.numel() * x.element_size() for x in params) if params else None
    set_cpu_allocator(
        mode,
        huge_pages=huge_pages_wanted(config, mode, param_bytes),
        block_cache=mode == "release" and config.cpu_block_cache,
    )


def huge_pages_as_graphtrain(model: torch.nn.Module, config: EngineConfig | None = None) -> bool:
    """Apply, from now on, the huge-page setting graphtrain chooses for `model` under this process's allocator mode
    (huge_pages_wanted on the model's parameter bytes; `config`: the engine's, default settings when None) and return
    whether huge pages are on. A benchmark harness calls it in every variant's process after building the model, as
    graphtrain decides when it first meets the model's parameters: every variant then runs under the setting
    graphtrain would run that model under, not huge pages for all (a small model under keep runs without; a
    power-of-two-wide matrix read transposed was up to 2.9x slower on them on a Zen 2, memory/allocator.py)."""
    cfg = config if config is not None else EngineConfig()
    mode = _ALLOCATOR_SET or allocator_mode(cfg)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    want = huge_pages_wanted(cfg, mode, param_bytes)
    if want or allocator.huge_pages_on():
        allocator.use_huge_pages(want)
    return bool(allocator.huge_pages_on())


def cpu_allocator_set() -> str | None:
    """The CPU allocator mode this process was given (set_cpu_allocator), None if none yet."""
    return _ALLOCATOR_SET


def set_cpu_allocator(mode: str, huge_pages: bool = True, block_cache: bool | None = None) -> bool:
    """Apply CPU allocator `mode` (memory/allocator.py apply), huge pages (allocator.use_huge_pages) and the block
    cache (allocator.use_block_cache; None: on under `release`) to this process and remember it, so that no later
    compile changes it (a benchmark harness gives every variant's process the same setting this way). Returns
    whether a glibc setting was applied."""
    global _ALLOCATOR_SET
    _ALLOCATOR_SET = mode
    cache = mode == "release" if block_cache is None else block_cache
    if cache or allocator.block_cache_stats() is not None:
        allocator.use_block_cache(cache)
    if huge_pages or allocator.huge_pages_on():
        allocator.use_huge_pages(huge_pages)
    return allocator.apply(mode)
