"""LAMB (You et al. 2019) as in the BERT-Large recipe: NVIDIA apex ``FusedLAMB`` semantics.

Per step, for every parameter ``p`` with gradient ``g`` (``t`` counts that parameter's steps)::

    g      = g / max(1, ||G|| / max_grad_norm)        optional pre-normalisation by the global norm
                                                      ||G|| over every gradient (max_grad_norm > 0)
    m      = beta1 * m + (1 - beta1) * g
    v      = beta2 * v + (1 - beta2) * g * g
    u      = (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * p
    ratio  = ||p|| / ||u||   (1 when either norm is 0)
    p      = p - lr * ratio * u

As in apex, the trust ratio applies to groups with weight decay; groups without (biases and
LayerNorm weights, see ``graphtrain.optim.param_groups``) take a plain ``lr * u`` step unless
``use_nvlamb=True``. Bias correction can be switched off (``bias_correction=False``).

All parameters of a group update in one multi-tensor pass, with no per-parameter Python work beyond
the bias-correction scalars. ``fused=True`` (the default where ``torch._fused_adam_`` exists) computes
clip, moments and the bias-corrected Adam direction in torch's fused Adam kernel, run with lr=-1 on
a zeroed scratch buffer (one extra parameter-sized buffer); ``fused=False`` uses ``torch._foreach_*``
ops. Then weight decay, the per-parameter norms (one ``_foreach_norm`` each), the trust ratios as
one vector, and the update. Measured on 27.6M parameters (gpt2-small shapes, 2 shared Zen 4 cores,
15 interleaved steps, two runs under other jobs' load): fused is 2.1-3.0x faster than foreach
(minimum 65 vs 168 ms, and 350 vs 1061 ms under heavier load); torch's fused AdamW took 18-50 ms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from graphtrain.optim.functional import (
    adam_direction,
    adam_direction_fused_,
    clip_divisor,
    global_grad_norm,
    lamb_apply_,
)


class LAMB(Optimizer):
    """Layer-wise adaptive moments (LAMB), multi-tensor; see the module docstring for the update."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        max_grad_norm: float = 0.0,
        bias_correction: bool = True,
        use_nvlamb: bool = False,
        fused: bool | None = None,
    ) -> None:
        if not lr > 0.0:
            raise ValueError(f"LAMB lr must be positive, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"LAMB betas must be two numbers in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"LAMB eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"LAMB weight_decay must be >= 0, got {weight_decay}")
        if fused is None:
            fused = hasattr(torch, "_fused_adam_")
        if not max_grad_norm >= 0.0:
            raise ValueError(f"LAMB max_grad_norm must be >= 0 (0 switches pre-normalisation off), got {max_grad_norm}")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            use_nvlamb=use_nvlamb,
        )
        super().__init__(params, defaults)
        self.max_grad_norm = float(max_grad_norm)
        self.fused = bool(fused)
        self._scratch: dict[torch.Tensor, torch.Tensor] = {}  # fused path: each parameter's update buffer

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["max_grad_norm"] = self.max_grad_norm
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.max_grad_norm = float(state_dict.pop("max_grad_norm", self.max_grad_norm))
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        grads_all = [p.grad for _, ps in groups for p in ps]
        if not grads_all:
            return loss
        for p in grads_all:
            if p.is_sparse:
                raise TypeError("LAMB does not support sparse gradients; use dense embeddings (sparse=False)")
        clip = None  # gradients are divided (in place, like clip_grad_norm_) by max(1, ||G|| / max_grad_norm)
        if self.max_grad_norm > 0:
            clip = clip_divisor(global_grad_norm(grads_all), self.max_grad_norm)
        for group, params in groups:
            if params:
                self._update_group(group, params, clip)
        return loss

    def _update_group(self, group: dict[str, Any], params: list[torch.Tensor], clip: torch.Tensor | None) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        grads = [p.grad for p in params]
        exp_avg, exp_avg_sq, steps, scratch = [], [], [], []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avg.append(st["exp_avg"])
            exp_avg_sq.append(st["exp_avg_sq"])
            steps.append(st["step"])
        torch._foreach_add_(steps, 1.0)

        if self.fused and group["bias_correction"]:
            # One fused kernel for clip, both moments and the bias-corrected Adam direction: torch's fused Adam on
            # a scratch list with lr=-1, leaving the direction in it.
            for p in params:
                if p not in self._scratch:
                    self._scratch[p] = torch.empty_like(p, memory_format=torch.preserve_format)
                scratch.append(self._scratch[p])
            update = adam_direction_fused_(
                scratch, grads, exp_avg, exp_avg_sq, steps, betas=(beta1, beta2), eps=eps, grad_scale=clip
            )
        else:
            update = adam_direction(
                grads,
                exp_avg,
                exp_avg_sq,
                steps,
                betas=(beta1, beta2),
                eps=eps,
                bias_correction=group["bias_correction"],
                grad_scale=clip,
            )
        lamb_apply_(params, update, lr=lr, weight_decay=wd, use_nvlamb=group["use_nvlamb"])
