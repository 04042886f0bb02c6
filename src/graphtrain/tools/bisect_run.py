"""What ``graphtrain.bisect`` runs and compares (tools/bisect.py scans the configurations): a model called on a
batch, its training loss, a few SGD steps with the generator seeded per step, and one tensor against eager's
under the tolerance table."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from graphtrain.pipeline.functional import loss_of
from graphtrain.tools.bisect_report import TensorError


def _call(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    if isinstance(batch, torch.Tensor):
        return model(batch)
    raise TypeError(
        f"batch must be a dict of keyword arguments, a tuple of positional arguments or a tensor, "
        f"got {type(batch).__name__}"
    )


def _training_loss(out: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    if loss_fn is not None:
        loss, source = loss_fn(out), "loss_fn"
    else:
        source = "the model"
        try:
            loss = loss_of(out)
        except TypeError:
            loss = None
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        if isinstance(loss, torch.Tensor):
            got = f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
        else:
            got = type(loss).__name__ if loss_fn is not None else f"{type(out).__name__} without a loss"
        raise TypeError(
            f"bisect needs the training loss, but {source} returned {got}, not a scalar floating-point "
            f"loss: pass loss_fn=lambda out: ..., or put the labels the model computes its loss from "
            f"in the batch"
        )
    if not loss.requires_grad:
        raise ValueError("the loss does not depend on any trainable parameter: nothing to compare after backward")
    return loss


def switch_off_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout probability the model exposes to 0: nn.Dropout modules, and float attributes named like
    ``*drop*`` on modules and on their (Hugging Face) ``config``, which some attention code reads at run time.
    Returns what was changed."""
    changed: list[str] = []
    configs_seen: set[int] = set()
    for name, mod in model.named_modules():
        where = name or type(model).__name__
        if isinstance(mod, torch.nn.modules.dropout._DropoutNd) and mod.p > 0:
            mod.p = 0.0
            changed.append(f"{where} ({type(mod).__name__})")
        holders = [(where, mod)]
        cfg = getattr(mod, "config", None)
        if (
            cfg is not None
            and not isinstance(cfg, torch.nn.Module)
            and hasattr(cfg, "__dict__")
            and id(cfg) not in configs_seen
        ):
            configs_seen.add(id(cfg))
            holders.append((f"{where}.config", cfg))
        for prefix, obj in holders:
            for attr, value in list(vars(obj).items()):
                if type(value) is float and value > 0 and "drop" in attr.lower() and not attr.startswith("_"):
                    setattr(obj, attr, 0.0)
                    changed.append(f"{prefix}.{attr}")
    return changed


def rng_state(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def same_rng(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def device_of(model: torch.nn.Module, batch: Any) -> torch.device:
    for t in [*model.parameters(), *torch.utils._pytree.tree_leaves(batch)]:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


# -------------------------------------------------------------------------------------- comparison ----


def compare(
    name: str, step: int, actual: torch.Tensor | None, expected: torch.Tensor | None, rtol: float, atol: float
) -> TensorError:
    """`actual` against `expected` elementwise, by torch.testing.assert_close's rule |a - e| <= atol + rtol |e|."""
    if actual is None or expected is None or actual.shape != expected.shape:
        inf = 0.0 if actual is None and expected is None else math.inf
        return TensorError(name, step, inf, inf, inf, rtol, atol)
    a, e = actual.detach().double(), expected.detach().double()
    diff = (a - e).abs()
    diff = torch.where(a.isnan() & e.isnan(), 0.0, diff).nan_to_num(nan=math.inf, posinf=math.inf)
    diff = torch.where(a == e, 0.0, diff)  # equal infinities
    if diff.numel() == 0:
        return TensorError(name, step, 0.0, 0.0, 0.0, rtol, atol)
    ratio = diff / (atol + rtol * e.abs().nan_to_num(nan=0.0, posinf=0.0))
    i = int(ratio.flatten().argmax())
    d, ref = float(diff.flatten()[i]), abs(float(e.flatten()[i]))
    rel = 0.0 if d == 0 else (d / ref if ref > 0 else math.inf)
    return TensorError(name, step, float(diff.max()), rel, float(ratio.flatten()[i]), rtol, atol)


@dataclass
class Step:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    rng: list[torch.Tensor]


def train(
    model: torch.nn.Module, batch: Any, loss_fn: Any, steps: int, seed: int, lr: float, device: torch.device
) -> list[Step]:
    """`steps` SGD steps on `batch`, the generator seeded before each: what eager and every configuration run."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.SGD([p for _, p in named], lr=lr)
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(seed + step)
        loss = _training_loss(_call(model, batch), loss_fn)
        loss.backward()
        out.append(
            Step(
                loss.detach().clone(),
                {n: None if p.grad is None else p.grad.detach().clone() for n, p in named},
                rng_state(device),
            )
        )
        opt.step()
    return out


@dataclass
class Run:
    """What one engine configuration did: its steps (or error), the passes' rewrites, the fast paths chosen."""

    steps: list[Step] | None
    error: str | None
    rewrites: dict[str, int]
    chosen: set[tuple[str, str]]
    notes: list[str]
    seconds: float
