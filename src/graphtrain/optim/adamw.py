"""AdamW for graphtrain: torch's own fused multi-tensor kernel, chosen by measurement.

Decoupled weight decay (Loshchilov & Hutter): ``p *= 1 - lr * wd`` then the bias-corrected Adam
step. Every parameter of a group is updated by one call into ``torch._fused_adamw_``, which has a
vectorised CPU kernel (one pass over p, g, m, v per tensor, no temporaries) as well as CUDA ones.

Why not our own: measured on 27.6M parameters with gpt2-small shapes, 2 Zen 4 cores, torch 2.13,
interleaved, 15 steps each (minimum of the quiet runs):

    torch.optim.AdamW(fused=True)      16.7-17.9 ms/step
    torch.optim.AdamW(foreach=True)    80.6-88.4 ms/step   (each _foreach_ op is a separate pass)
    torch.optim.AdamW(foreach=False)   86.9-99.6 ms/step

A ``_foreach_*`` AdamW of ours would run the same separate passes as ``foreach=True``, so
``FusedAdamW`` is ``torch.optim.AdamW`` with ``fused=True`` wherever the kernel exists for the
parameters' device and dtype, and ``foreach=True`` elsewhere (e.g. parameters of mixed devices).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

_FUSED_DEVICES = ("cpu", "cuda", "xpu", "mps")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def fused_supported(params: Iterable[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel takes these parameters (one device type, float dtypes)."""
    params = list(params)
    if not params or not hasattr(torch, "_fused_adamw_"):
        return False
    devices = {p.device.type for p in params}
    return (
        len(devices) == 1
        and devices <= set(_FUSED_DEVICES)
        and all(p.dtype in _FUSED_DTYPES and not p.is_sparse for p in params)
    )


class FusedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` pinned to its fastest implementation (fused, else foreach)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ) -> None:
        params = list(params)
        tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        if any(not isinstance(p, torch.Tensor) for p in tensors):
            raise TypeError(
                "FusedAdamW takes parameters or param-group dicts {'params': [...], ...}; "
                "pass model.parameters() or graphtrain.optim.param_groups(model, wd)"
            )
        fused = fused_supported(tensors)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            fused=fused or None,
            foreach=None if fused else True,
        )
        self.implementation = "fused" if fused else "foreach"
