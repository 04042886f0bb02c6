"""Dynamic loss scaling for fp16 training (bf16 has fp32's exponent range and needs none).

fp16 gradients underflow below 6e-8; multiplying the loss by a large scale S moves them into range,
and dividing the fp32 parameter gradients by S afterwards restores them. When a step overflows
(an inf/nan gradient) it is skipped and S shrinks; after ``growth_interval`` clean steps S grows::

    scaler = make_loss_scaler(config.engine)      # None unless engine.precision == "fp16"
    scaler.scale(loss).backward()
    if scaler.unscale_and_check(params):         # unscale + one inf/nan check over all grads
        optimizer.step()
    scaler.update(found_inf)                      # or let graphtrain.optim.step.optimizer_step do all of it

Hysteresis (Megatron-LM / DeepSpeed semantics): the scale backs off on the ``hysteresis``-th
overflow since it last grew, so ``hysteresis - 1`` isolated overflows are skipped without shrinking
the scale; ``hysteresis=1`` backs off on every overflow. Once backed off, every further overflow
backs off again until the scale next grows. The scale never drops below ``min_scale``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from graphtrain.config.sections import EngineConfig
from graphtrain.optim.functional import loss_scale_update


class DynamicLossScaler:
    """Scale the loss, unscale and check the gradients in one fused pass, adapt the scale."""

    def __init__(
        self,
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"loss scale init_scale must be positive, got {init_scale}")
        if not growth_factor > 1:
            raise ValueError(f"loss scale growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"loss scale backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"loss scale growth_interval and hysteresis must be >= 1, got {growth_interval} and {hysteresis}"
            )
        if not 0 < min_scale <= init_scale:
            raise ValueError(f"loss scale min_scale must be in (0, init_scale={init_scale}], got {min_scale}")
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis, self.min_scale = int(growth_interval), int(hysteresis), float(min_scale)
        self._scale = float(init_scale)
        self._growth_tracker = 0  # clean steps since the last overflow or growth
        self._hysteresis_left = self.hysteresis
        self.skipped_steps = 0
        self.steps = 0

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> DynamicLossScaler:
        return cls(
            init_scale=cfg.loss_scale_init,
            growth_factor=cfg.loss_scale_growth,
            backoff_factor=cfg.loss_scale_backoff,
            growth_interval=cfg.loss_scale_interval,
            hysteresis=cfg.loss_scale_hysteresis,
            min_scale=cfg.loss_scale_min,
        )

    @property
    def scale_value(self) -> float:
        """The current loss scale (for metrics)."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * scale`: call backward on this."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"scale() takes the loss tensor, got {type(loss).__name__}")
        return loss * self._scale

    @torch.no_grad()
    def unscale_and_check(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide every gradient by the scale in place; True when all are finite (safe to step).

        One fused multi-tensor pass per (device, dtype) group: ``torch._amp_foreach_non_finite_check_and_unscale_``."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"unscale_and_check takes parameters (tensors), got {type(p).__name__}")
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise TypeError("loss scaling does not support sparse gradients")
                groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        found = None
        for (device, _), grads in groups.items():
            found_inf = torch.zeros(1, device=device)
            inv_scale = torch.full((1,), 1.0 / self._scale, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            found = found_inf if found is None else found + found_inf.to(found.device)
        return found is None or found.item() == 0

    def update(self, found_inf: bool) -> None:
        """Adapt the scale after a step: back off (with hysteresis) on overflow, grow after clean steps
        (``graphtrain.optim.functional.loss_scale_update``, the rule the compiled step's graph runs too)."""
        self.steps += 1
        found_inf = bool(found_inf)
        self.skipped_steps += found_inf
        self._scale, self._growth_tracker, self._hysteresis_left = loss_scale_update(
            self._scale,
            self._growth_tracker,
            self._hysteresis_left,
            found_inf,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
            hysteresis=self.hysteresis,
            min_scale=self.min_scale,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_left": self._hysteresis_left,
            "skipped_steps": self.skipped_steps,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_left"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state is missing {sorted(missing)}: pass a DynamicLossScaler.state_dict()")
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.steps = int(state.get("steps", 0))

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self._scale:g}, skipped={self.skipped_steps}/{self.steps}, "
            f"interval={self.growth_interval}, hysteresis={self.hysteresis})"
        )


def make_loss_scaler(cfg: EngineConfig) -> DynamicLossScaler | None:
    """A DynamicLossScaler for fp16; None for fp32 and bf16 (bf16 keeps fp32's range: no scaling)."""
    if not isinstance(cfg, EngineConfig):
        raise TypeError(f"make_loss_scaler takes an EngineConfig (config.engine), got {type(cfg).__name__}")
    return DynamicLossScaler.from_config(cfg) if cfg.precision == "fp16" else None
