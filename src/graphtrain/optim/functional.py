"""The optimizer-step rules as plain functions: the one home of the AdamW, LAMB, clipping and loss-scale math.

Every caller takes its update from here: the eager optimizers (``optim/lamb.py``'s LAMB, ``optim/loss_scale.py``'s
DynamicLossScaler) and the update graph ``frontend/compile_step.py`` traces after the backward (AdamW, the
global-norm clip, the fp16 loss-scale update). The functions work on lists of tensors and write in place where
their name ends in ``_``; nothing here holds state.

- ``global_grad_norm``: the L2 norm over all gradients, one ``_foreach_norm`` reduction (non-finite when any
  gradient is: it doubles as the overflow check).
- ``clip_divisor``: ``max(1, norm / max_norm)``, what gradients are divided by to clip them to ``max_norm`` (the
  compiled step and LAMB's pre-normalisation); ``clip_coefficient``: torch's factor ``min(1, max_norm / (norm +
  1e-6))`` they are multiplied by (the distributed layouts' clip, the eager ``optimizer_step``'s through torch).
- ``adamw_fused_``: torch's fused AdamW kernel (decoupled decay, bias correction; ``grad_scale`` unscales and
  ``found_inf`` skips inside the kernel); ``adamw_``: the same update as elementwise tensor math (for graphs whose
  compiler cannot trace the kernel).
- ``adam_direction_fused_`` / ``adam_direction``: LAMB's first half, the moments and the bias-corrected Adam
  direction; ``lamb_apply_``: its second half, weight decay and the layer-wise trust ratio.
- ``loss_scale_update``: dynamic loss scaling with hysteresis, on Python numbers (the eager scaler) or on tensors
  (a graph), by the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from graphtrain.config.sections import EngineConfig, OptimConfig

# --- gradients -------------------------------------------------------------------------------------


def global_grad_norm(grads: Sequence[Tensor]) -> Tensor:
    """The L2 norm over every gradient (one multi-tensor reduction); inf/nan when any gradient is not finite."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(list(grads))))


def clip_divisor(norm: Tensor, max_norm: float) -> Tensor:
    """``max(1, norm / max_norm)``: gradients divided by it have a global norm of at most ``max_norm``."""
    return torch.clamp(norm / max_norm, min=1.0)


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / (norm + 1e-6))``, torch.nn.utils.clip_grad_norm_'s factor: gradients multiplied by it
    are clipped as torch clips them (the eager optimizer_step clips with torch's own function)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


# --- AdamW -----------------------------------------------------------------------------------------


def adamw_fused_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """torch.optim.AdamW's update in torch's fused kernel, in place; `steps` were already advanced. The kernel
    divides the gradients by `grad_scale` and leaves everything unchanged where `found_inf` is nonzero."""
    torch._fused_adamw_(
        params,
        grads,
        exp_avg,
        exp_avg_sq,
        [],
        steps,
        lr=lr,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=weight_decay,
        eps=eps,
        amsgrad=False,
        maximize=False,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


def adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    steps: list[Tensor],
    *,
    lr: Tensor,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
    grad_scale: Tensor,
    found_inf: Tensor | None,
) -> None:
    """``adamw_fused_``'s update (decoupled decay, bias correction) as elementwise math, written in place;
    `steps` were already advanced. With found_inf set, parameters and moments keep their old values."""
    b1, b2 = betas
    for p, g, m, v, t in zip(params, grads, exp_avg, exp_avg_sq, steps):
        g = g / grad_scale
        m_new = torch.lerp(m, g, 1 - b1)
        v_new = v * b2 + (1 - b2) * g * g
        bc1 = 1 - torch.pow(b1, t)
        bc2_sqrt = torch.sqrt(1 - torch.pow(b2, t))
        p_new = p * (1 - lr * weight_decay) - (lr / bc1) * m_new / (torch.sqrt(v_new) / bc2_sqrt + eps)
        if found_inf is not None:
            keep = found_inf > 0
            p_new, m_new, v_new = torch.where(keep, p, p_new), torch.where(keep, m, m_new), torch.where(keep, v, v_new)
        p.copy_(p_new)
        m.copy_(m_new)
        v.copy_(v_new)


# --- LAMB ------------------------------------------------------------------------------------------


def adam_direction_fused_(
    out: list[Tensor],
    grads: list[Tensor],
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    steps: list[Tensor],
    *,
    betas: tuple[float, float],
    eps: float,
    grad_scale: Tensor | None,
) -> list[Tensor]:
    """Advance the moments and write the bias-corrected Adam direction ``m_hat / (sqrt(v_hat) + eps)`` into `out`
    (zeroed here), gradients divided by `grad_scale`: torch's fused Adam run with lr=-1 on `out`. Returns `out`."""
    torch._foreach_zero_(out)
    torch._fused_adam_(
        out,
        grads,
        exp_avg,
        exp_avg_sq,
        [],
        steps,
        lr=-1.0,
        beta1=betas[0],
        beta2=betas[1],
        weight_decay=0.0,
        eps=eps,
        amsgrad=False,
        maximize=False,
        grad_scale=grad_scale,
    )
    return out


def adam_direction(
    grads: list[Tensor],
    exp_avg: list[Tensor],
    exp_avg_sq: list[Tensor],
    steps: list[Tensor],
    *,
    betas: tuple[float, float],
    eps: float,
    bias_correction: bool,
    grad_scale: Tensor | None,
) -> list[Tensor]:
    """``adam_direction_fused_``'s direction with ``_foreach_`` ops (optionally without bias correction), as new
    tensors; the moments advance in place and the gradients are divided by `grad_scale` in place."""
    beta1, beta2 = betas
    if grad_scale is not None:
        torch._foreach_div_(grads, grad_scale)
    torch._foreach_mul_(exp_avg, beta1)
    torch._foreach_add_(exp_avg, grads, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1.0 - beta2)
    update = torch._foreach_mul(exp_avg, 1.0)
    denom = torch._foreach_mul(exp_avg_sq, 1.0)
    if bias_correction:
        ts = [float(t) for t in steps]  # like torch's foreach Adam off-GPU: Python-float corrections
        torch._foreach_div_(update, [1.0 - beta1**t for t in ts])
        torch._foreach_div_(denom, [1.0 - beta2**t for t in ts])
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(update, denom)
    return update


def lamb_apply_(
    params: list[Tensor], update: list[Tensor], *, lr: float, weight_decay: float, use_nvlamb: bool
) -> None:
    """LAMB's step from the Adam direction `update` (overwritten): add weight decay, then
    ``p -= lr * ratio * u`` with the trust ratio ``||p|| / ||u||`` (1 when either is 0) where there is weight decay
    or `use_nvlamb`, else the plain ``p -= lr * u``."""
    if weight_decay != 0.0:
        torch._foreach_add_(update, params, alpha=weight_decay)
    if weight_decay != 0.0 or use_nvlamb:
        w_norm = torch.stack(torch._foreach_norm(params))
        u_norm = torch.stack(torch._foreach_norm(update))
        ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        torch._foreach_mul_(update, list((ratio * -lr).unbind()))
        torch._foreach_add_(params, update)
    else:
        torch._foreach_add_(params, update, alpha=-lr)


# --- dynamic loss scaling --------------------------------------------------------------------------


def _where(cond: Any, a: Any, b: Any) -> Any:
    return torch.where(cond, a, b) if isinstance(cond, Tensor) else (a if cond else b)


def _not(x: Any) -> Any:
    return ~x if isinstance(x, Tensor) else not x


def loss_scale_update(
    scale: Any,
    growth_tracker: Any,
    hysteresis_left: Any,
    found_inf: Any,
    *,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: float,
) -> tuple[Any, Any, Any]:
    """(scale, growth_tracker, hysteresis_left) after one step; `found_inf`: the step overflowed. Python numbers
    in, Python numbers out (the eager scaler); tensors in, tensors out (a graph: ``torch.where`` in place of
    branches).

    Hysteresis (Megatron-LM / DeepSpeed): an overflow counts `hysteresis_left` down and backs the scale off by
    `backoff_factor` (never below `min_scale`) once it reaches 0; `growth_interval` clean steps in a row grow the
    scale by `growth_factor` and restore `hysteresis_left` to `hysteresis`; an overflow restarts the count."""
    grow = _not(found_inf) & (growth_tracker + 1 >= growth_interval)
    new_hysteresis = _where(found_inf, hysteresis_left - 1, _where(grow, hysteresis, hysteresis_left))
    backoff = found_inf & (new_hysteresis <= 0)
    backed_off = scale * backoff_factor
    backed_off = (
        torch.clamp(backed_off, min=min_scale) if isinstance(backed_off, Tensor) else max(backed_off, min_scale)
    )
    new_scale = _where(backoff, backed_off, _where(grow, scale * growth_factor, scale))
    new_tracker = _where(found_inf | grow, 0, growth_tracker + 1)
    return new_scale, new_tracker, new_hysteresis


def like_param(grad: Tensor, param: Tensor) -> Tensor:
    """`grad` in `param`'s memory layout (a copy only where their strides differ).

    torch._fused_adamw_ walks each parameter, its gradient and its moments as flat buffers of one layout. Eager's
    AccumulateGrad gives ``p.grad`` the parameter's layout; a gradient from ``torch.autograd.grad`` keeps the layout
    of the kernel that made it: a convolution's weight gradient comes out channels-last when its input was
    (Inductor's layout optimization makes it so). compile_step passed those to the fused kernel as they were, and HF
    ViT's patch-embedding weight was updated with its gradient permuted (silently: the loss drifted from eager's by
    step 2)."""
    return grad if grad.stride() == param.stride() else torch.empty_like(param).copy_(grad)


def step_update(o: OptimConfig, e: EngineConfig, decay: list[bool], fp16: bool, fused_kernel: bool) -> Any:
    """compile_step's update, traced into its step graph: global norm and overflow check, clipping, AdamW
    (torch's fused kernel, or the same update as elementwise math for Inductor) and the fp16 loss-scale update, on
    tensors. `o`: the OptimConfig; `e`: the EngineConfig (loss-scale settings); `decay[i]`: parameter i takes
    weight decay. The returned function takes (params, grads, m, v, steps, lr, max_loss, scale, tracker, hyst,
    loss) and returns (loss, the unscaled gradient norm, found_inf)."""
    n_p = len(decay)
    max_norm = o.grad_clip

    def update(params, grads, m, v, steps, lr, max_loss, scale, tracker, hyst, loss):
        grads = [torch.zeros_like(p) if g is None else like_param(g, p) for p, g in zip(params, grads)]
        # one reduction: global norm (for clipping) and the overflow check (non-finite norm)
        norm = global_grad_norm(grads)
        true_norm = norm / scale if fp16 else norm
        grad_scale = scale if fp16 else torch.ones_like(scale)
        if max_norm is not None:
            grad_scale = grad_scale * clip_divisor(true_norm, max_norm)
        # skip the update on a non-finite norm (fp16: overflow) or loss, or a loss spike
        bad_loss = ~torch.isfinite(loss) | (loss > max_loss)
        overflow = ~torch.isfinite(norm)
        found_inf = (overflow | bad_loss).to(torch.float32)
        torch._foreach_add_(steps, [1.0 - found_inf] * len(steps))  # counters advance only on steps that update
        for wd, sel in ((o.weight_decay, True), (0.0, False)):
            idx = [i for i in range(n_p) if decay[i] == sel]
            if not idx:
                continue
            group = (
                [params[i] for i in idx],
                [grads[i] for i in idx],
                [m[i] for i in idx],
                [v[i] for i in idx],
                [steps[i] for i in idx],
            )
            hyper = dict(lr=lr, betas=o.betas, weight_decay=wd, eps=o.eps, grad_scale=grad_scale, found_inf=found_inf)
            if fused_kernel:
                adamw_fused_(*group, **hyper)
            else:
                with torch.no_grad():  # the parameters are leaves that require grad
                    adamw_(*group, **hyper)
        if fp16:  # DynamicLossScaler.update's rule, on tensors
            new_scale, new_tracker, new_hyst = loss_scale_update(
                scale,
                tracker,
                hyst,
                overflow,
                growth_factor=e.loss_scale_growth,
                backoff_factor=e.loss_scale_backoff,
                growth_interval=e.loss_scale_interval,
                hysteresis=e.loss_scale_hysteresis,
                min_scale=e.loss_scale_min,
            )
            tracker.copy_(new_tracker)
            hyst.copy_(new_hyst)
            scale.copy_(new_scale)
        return loss, true_norm, found_inf

    return update
