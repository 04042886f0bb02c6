"""A memory budget in bytes: the one rule for ``engine.memory_budget`` given as bytes or as a fraction.

    budget_bytes(0.5, torch.device("cpu"))     # half the machine's physical RAM
    budget_bytes(0.5, torch.device("cuda:1"))  # half of GPU 1's memory
    budget_bytes(4e9, device)                  # bytes as given

A fraction is of the memory of the device the run uses: a CPU run's budget is a fraction of RAM even on a machine
with a GPU. Used by ``recompute: auto`` (memory/recompute.py, keyed on the device of the graph it partitions) and by
``train.batch_size: auto`` (trainer/runtime.py, keyed on the Trainer's device).
"""

from __future__ import annotations

import os

import torch


def device_memory_bytes(device: torch.device | str) -> int:
    """Total memory of `device`: a CUDA device's own memory, else the machine's physical RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget_bytes(budget: float, device: torch.device | str) -> float:
    """`budget` in bytes: bytes as given (> 1), or a fraction (0-1] of `device`'s memory (device_memory_bytes)."""
    if not budget > 0:
        raise ValueError(
            f"a memory budget must be positive, got {budget:g}: give bytes (e.g. 2000000000) or a "
            f"fraction of device memory (e.g. 0.5)"
        )
    return float(budget) if budget > 1 else budget * device_memory_bytes(device)
