"""One optimizer step as the Trainer takes it: unscale + overflow check, clip, step or skip.

    loss = model(**batch)
    (scaler.scale(loss) if scaler else loss).backward()
    info = optimizer_step(optimizer, params, scaler=scaler, grad_clip=cfg.optim.grad_clip)
    optimizer.zero_grad(set_to_none=True)
    # info == {"grad_norm": 0.83, "skipped": False, "scale": 65536.0}

On overflow (fp16 only) the gradients are not clipped and the optimizer does not step; the caller
still zeroes the gradients and moves on (its learning-rate schedule may advance or not: skipped
steps are counted in ``scaler.skipped_steps``). Without a scaler (fp32, bf16) a non-finite global
gradient norm skips the step the same way (``skip_nonfinite``): a NaN is never written into the
weights or the optimizer's moments.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from graphtrain.optim.loss_scale import DynamicLossScaler


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    params: Iterable[torch.Tensor],
    scaler: DynamicLossScaler | None = None,
    grad_clip: float | None = None,
    skip_nonfinite: bool = True,
) -> dict[str, Any]:
    """Unscale and check (with a scaler), clip by global norm (with grad_clip), then step or skip.

    Returns ``{"grad_norm": float (before clipping, nan on a skipped step), "skipped": bool,
    "scale": float | None}``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer_step takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if scaler is not None and not isinstance(scaler, DynamicLossScaler):
        raise TypeError(f"scaler must be a DynamicLossScaler or None, got {type(scaler).__name__}")
    if grad_clip is not None and not grad_clip > 0:
        raise ValueError(f"grad_clip must be positive or None (no clipping), got {grad_clip}")
    params = [p for p in params if p.grad is not None]
    if scaler is not None:
        finite = scaler.unscale_and_check(params)
        scaler.update(not finite)
        if not finite:
            return {"grad_norm": math.nan, "skipped": True, "scale": scaler.scale_value}
    if grad_clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True) if params else torch.zeros(())
    norm = float(norm)
    if skip_nonfinite and not math.isfinite(norm):
        return {"grad_norm": norm, "skipped": True, "scale": None if scaler is None else scaler.scale_value}
    optimizer.step()
    return {"grad_norm": norm, "skipped": False, "scale": None if scaler is None else scaler.scale_value}
