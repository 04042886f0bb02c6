"""The largest micro-batch that fits a memory budget (``train.batch_size: auto``).

Peak memory is affine in the batch size for these models (persistent state + per-sample
activations), so we predict on fake tensors at two small batches, extrapolate the line to the
budget, then check the candidate with an exact prediction and step down until one fits. Nothing
but fake tensors is allocated, so any batch can be probed. Optionally one real step in a fresh
subprocess confirms it (reference presets only: the subprocess rebuilds the model by name).

The budget counts what ``predict_peak`` counts: tensor bytes of the step (parameters, gradients,
optimizer state, batch, activations), not the interpreter and libraries (~240 MiB resident here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graphtrain.frontend.capture import predict_for_model
from graphtrain.memory.predict import MemoryEstimate
from graphtrain.tools.measure import measure


def _vocab(model: torch.nn.Module) -> int:
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else 2


def lm_batch(model: torch.nn.Module, batch: int, seq_len: int) -> tuple:
    """(input_ids, labels) of the right shape for the reference GPT2/BERT models."""
    v = _vocab(model)
    ids, labels = torch.randint(0, v, (batch, seq_len)), torch.randint(0, v, (batch, seq_len))
    if getattr(model, "family", "gpt2") == "bert":  # BERT.forward(input_ids, attention_mask, token_type_ids, labels)
        return ids, None, None, labels
    return ids, labels


@dataclass
class BatchPlan:
    micro_batch: int
    grad_accum: int
    predicted_peak: int
    budget: float
    per_sample_bytes: float
    fixed_bytes: float
    probes: dict[int, int] = field(default_factory=dict)  # batch -> predicted peak
    measured_peak: int | None = None

    def __iter__(self):  # (micro_batch, grad_accum) = pick_batch_size(...)
        return iter((self.micro_batch, self.grad_accum))


def pick_batch_size(
    model_factory: Callable[[], torch.nn.Module],
    seq_len: int,
    budget_bytes: float,
    global_batch: int | None = None,
    engine_cfg: Any = None,
    *,
    max_batch: int = 4096,
    make_batch: Callable[[torch.nn.Module, int, int], tuple] = lm_batch,
    confirm_model: str | None = None,
    optimizer: str = "adamw",
) -> BatchPlan:
    """Pick the largest micro-batch whose predicted step peak fits `budget_bytes`.

    global_batch: samples per optimizer step; the micro-batch is then the largest divisor of it
    that fits, and grad_accum = global_batch / micro_batch. confirm_model: a preset name to run one
    real step of in a subprocess (graphtrain.tools.measure); if it measures over budget the
    micro-batch is scaled down by the measured/predicted ratio."""
    model = model_factory()
    probes: dict[int, int] = {}

    def peak(b: int) -> int:
        if b not in probes:
            est: MemoryEstimate = predict_for_model(
                model, make_batch(model, b, seq_len), engine_cfg, optimizer=optimizer
            )
            probes[b] = est.peak
        return probes[b]

    p1, p2 = peak(1), peak(2)
    if p1 > budget_bytes:
        raise ValueError(
            f"even batch 1 needs {p1 / 2**20:,.0f} MiB, over the budget of {budget_bytes / 2**20:,.0f} MiB: "
            f"raise the budget or set engine.recompute (selective/full/auto)"
        )
    per_sample = max(p2 - p1, 1)
    fixed = p1 - per_sample
    b = max(1, min(max_batch, int((budget_bytes - fixed) // per_sample)))
    hi_ok = 1
    while b > hi_ok and peak(b) > budget_bytes:  # the line is a guess: step down geometrically, then bisect
        lo = max(hi_ok, int(b * budget_bytes / peak(b)))
        if lo < b and peak(lo) <= budget_bytes:
            hi_ok = lo
            while b - hi_ok > 1:
                mid = (b + hi_ok) // 2
                hi_ok, b = (mid, b) if peak(mid) <= budget_bytes else (hi_ok, mid)
            b = hi_ok
            break
        b = lo
    micro, accum = _split(b, global_batch)
    plan = BatchPlan(micro, accum, peak(micro), budget_bytes, per_sample, fixed, probes)
    if confirm_model is not None:
        cfg = engine_cfg
        r = measure(
            model=confirm_model,
            seq=seq_len,
            batch=micro,
            mode="graphtrain",
            steps=1,
            warmup=1,
            recompute=getattr(cfg, "recompute", "none"),
            budget=getattr(cfg, "memory_budget", None),
        )
        if "error" in r:
            raise RuntimeError(f"confirming batch {micro} failed: {r['error']}")
        plan.measured_peak = r["peak_tensor_bytes"]
        if plan.measured_peak > budget_bytes:
            b = max(1, int(micro * budget_bytes / plan.measured_peak))
            plan.micro_batch, plan.grad_accum = _split(b, global_batch)
    return plan


def _split(bmax: int, global_batch: int | None) -> tuple[int, int]:
    if global_batch is None:
        return bmax, 1
    micro = max(d for d in range(1, min(bmax, global_batch) + 1) if global_batch % d == 0)
    return micro, global_batch // micro


def largest_fitting(peak_of: Callable[[int], float], budget: float, hi: int = 1024) -> int:
    """Largest b in [0, hi] with peak_of(b) <= budget, for any increasing peak_of (bisection)."""
    lo = 0
    while lo < hi:
        mid = math.ceil((lo + hi + 1) / 2) if hi - lo > 1 else hi
        if peak_of(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
