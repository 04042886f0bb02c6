"""Optimizers: `build_optimizer(model, cfg)` is the one entry point the Trainer uses.

- ``adamw``: ``FusedAdamW`` (torch's fused multi-tensor AdamW kernel; ``fused: false`` gives the
  plain ``torch.optim.AdamW`` for-loop reference).
- ``lamb``: ``LAMB`` with apex FusedLAMB semantics (``fused: false`` uses the ``_foreach_`` path).

Gradient clipping by global norm is done once, by ``graphtrain.optim.step.optimizer_step``, with
``cfg.grad_clip``; LAMB's own pre-normalisation is therefore left off here (clipping to norm c and
apex's pre-normalisation with max_grad_norm=c are the same operation).
"""

from __future__ import annotations

import torch

from graphtrain.config.sections import OptimConfig
from graphtrain.optim.adamw import FusedAdamW
from graphtrain.optim.lamb import LAMB
from graphtrain.optim.loss_scale import DynamicLossScaler, make_loss_scaler
from graphtrain.optim.step import optimizer_step

__all__ = [
    "DynamicLossScaler",
    "FusedAdamW",
    "LAMB",
    "build_optimizer",
    "make_loss_scaler",
    "optimizer_step",
    "param_groups",
]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases, norm weights and other 1-D parameters get no weight decay."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"build_optimizer takes the model (an nn.Module), got {type(model).__name__}")
    if not isinstance(cfg, OptimConfig):
        raise TypeError(f"build_optimizer takes an OptimConfig (config.optim), got {type(cfg).__name__}")
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        if cfg.fused:
            return FusedAdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)
    if cfg.name == "lamb":
        return LAMB(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, max_grad_norm=0.0, fused=cfg.fused)
    raise ValueError(f"optim.name={cfg.name!r} is not available; use adamw or lamb")
