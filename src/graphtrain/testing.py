"""Parity helpers shared by every test and benchmark: compare with eager PyTorch under one table.

Tolerances are per dtype. Loosening one for a test needs a comment there saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# (rtol, atol) per dtype for results whose numerics legitimately change (fusion, reordering).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    name: str = "tensor",
    bitwise: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Assert two tensors match: bitwise, or within the dtype's tolerance (overridable per call)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != expected {expected.dtype}")
    if bitwise:
        if not torch.equal(actual, expected):
            diff = (actual.double() - expected.double()).abs().max().item()
            raise AssertionError(f"{name}: not bitwise equal (max abs diff {diff:.3e})")
        return
    r, a = TOLERANCES.get(expected.dtype, (0.0, 0.0))
    torch.testing.assert_close(
        actual,
        expected,
        rtol=r if rtol is None else rtol,
        atol=a if atol is None else atol,
        msg=lambda m: f"{name}: {m}",
    )


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()}


def assert_grads_close(actual: torch.nn.Module, expected: torch.nn.Module, **kw: Any) -> None:
    """Every parameter's gradient matches (both None, or close/bitwise)."""
    ga, ge = grads_of(actual), grads_of(expected)
    assert ga.keys() == ge.keys(), f"parameter names differ: {sorted(set(ga) ^ set(ge))}"
    for n in ge:
        if ge[n] is None or ga[n] is None:
            assert ge[n] is None and ga[n] is None, f"grad of {n}: {'missing' if ga[n] is None else 'unexpected'}"
            continue
        assert_close(ga[n], ge[n], name=f"grad of {n}", **kw)


def run_step(
    module: torch.nn.Module, inputs: tuple, loss_fn: Callable[[Any], torch.Tensor] | None = None, seed: int = 0
) -> torch.Tensor:
    """Forward (with a fixed RNG seed), loss, backward; returns the loss. Zeroes grads first."""
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = module(*inputs)
    loss = loss_fn(out) if loss_fn is not None else _default_loss(out)
    loss.backward()
    return loss.detach()


def _default_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().square().mean() if out.dim() else out
    if isinstance(out, dict) or hasattr(out, "loss"):
        loss = out["loss"] if isinstance(out, dict) else out.loss
        if loss is not None:
            return loss
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().square().mean() for t in leaves)  # type: ignore[return-value]
