"""``provider: auto``'s measurement: a graph's compiled candidates (``Candidate``) timed on a call's inputs, the
faster kept (``Measured``), the decision stored next to the pass results (pipeline/cache.py), keyed like them, so
that a warm process compiles the winner only. runtime/provider_auto.py says why and when it measures.

Each candidate is timed on inputs of the graph's own shapes: a warm-up call, then the best of up to ``REPEATS``
forward+backward calls (fewer once ``BUDGET_S`` is spent). The faster one runs the graph (Inductor keeps ties within
``TIE_MARGIN``: it fuses, and its own cache makes it cheap to load again); the times go to the report. The timing
runs on copies of the inputs (parameters never receive these gradients) and under a forked RNG (the training run's
random stream is untouched); a graph with symbolic sizes is timed at the sizes of that call.

Timing between steps (``Tiered.preload``) has no call's inputs at hand, only what the first call left
(``InputSpec``), and the values matter, not only the shapes. Measured on the 2-core AMX Xeon (HF BERT small, bf16,
b8 s128), with the standard-normal weights and zero labels this timing used before: the sparse LM head's backward
ran every row (labels 0 where the batch has -100 on 85% of them: 75-80 ms a call against 38-39 ms on the real
inputs, both providers), and the encoder block's Inductor code 40.5 ms against 28.5 ms (aten 35 ms either way),
so provider auto kept aten for the blocks and the whole step ran at 266 ms instead of 240 ms. So an InputSpec
keeps what it takes to time on inputs like the call's: a parameter's own values (a weak reference; copied when
timed), a small input the graph does not differentiate (ids, labels, masks: a copy), and the mean and spread of
any other float input (an activation: random values of that scale).
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from graphtrain.config.fallback import report_fallback
from graphtrain.pipeline.blocks import laid_out_as

REPEATS = 3
BUDGET_S = 0.5
"""Timed calls stop after this much time per candidate (at least one timed call after the warm-up): a large
model's head graph (GPT-2 Medium's 50k-word softmax) takes ~0.5 s a call, and four calls per candidate would
add seconds to the first step for a decision a single call already makes."""
TIE_MARGIN = 1.03
CANDIDATES = ("inductor", "aten")


@dataclass(frozen=True)
class Candidate:
    """One provider's compile of a graph, waiting to be timed against the others."""

    provider: str
    compiled: Callable[..., Any]
    record: dict[str, Any]  # the graph's GraphRecord fields as this candidate's compile left them
    passes: list[Any]  # the PassRecords its compile added to the state (a loser's leave the report)


VALUES_MAX_BYTES = 1 << 22
"""An input the graph does not differentiate (ids, labels, an attention mask) whose memory is up to this size is kept
by value for the timing between steps: a sparse head's cost depends on which labels are ignored, a mask's on its
-inf."""


@dataclass(frozen=True)
class InputSpec:
    """A call's tensor input without its memory: its shape, layout and kind (`meta`, on the meta device) and its
    device. Timing on it makes a new tensor (``real_input``) as like the call's as the spec can say: `param`'s
    values (a weak reference to a leaf the graph differentiates: a parameter), else `values` (a copy of a small
    input the graph does not differentiate), else random values of `scale` (mean, standard deviation: the call's
    float input's), else standard-normal floats and zero indices. A graph's compiled code runs the same kernels
    whatever the values, but not always at the same speed (the module's docstring)."""

    meta: torch.Tensor
    device: torch.device
    param: Any = None  # weakref.ref to the call's tensor, or None
    values: torch.Tensor | None = None
    scale: tuple[float, float] | None = None


def _footprint(a: torch.Tensor) -> int:
    """The bytes a tensor's elements span in memory (an expanded dimension adds none)."""
    if a.numel() == 0:
        return 0
    return (1 + sum((n - 1) * abs(st) for n, st in zip(a.shape, a.stride()))) * a.element_size()


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t`; an expanded one (a [B, 1, S, S] mask seen as [B, H, S, S]) in its own layout, in the memory
    it spans rather than its logical size."""
    expanded = any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))
    return laid_out_as(t, t) if expanded else t.clone()


def _spec(a: torch.Tensor) -> InputSpec:
    meta = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta").requires_grad_(a.requires_grad)
    if a.requires_grad and a.is_leaf:
        return InputSpec(meta, a.device, param=weakref.ref(a))
    if not a.requires_grad and _footprint(a) <= VALUES_MAX_BYTES:
        return InputSpec(meta, a.device, values=_copy(a.detach()))
    scale = None
    if a.dtype.is_floating_point and a.numel() > 1:
        std, mean = (float(v) for v in torch.std_mean(a.detach().float()))
        scale = (mean, std) if math.isfinite(mean) and math.isfinite(std) else None
    return InputSpec(meta, a.device, scale=scale)


def input_specs(args: Sequence[Any]) -> list[Any]:
    """`args` with each tensor replaced by its ``InputSpec`` (other arguments, such as sizes, kept): what a graph's
    call leaves to be timed on later, holding none of the call's activations (the small inputs it does not
    differentiate are copied; parameters are referenced weakly)."""
    return [_spec(a) if isinstance(a, torch.Tensor) else a for a in args]


def _from_spec(spec: InputSpec) -> torch.Tensor:
    x, device = spec.meta, spec.device
    src = spec.param() if spec.param is not None else None
    if src is not None and src.shape == x.shape and src.dtype == x.dtype:
        return src.detach().clone()
    if spec.values is not None:
        return _copy(spec.values)
    if not x.dtype.is_floating_point:  # indices (embeddings, labels): 0 is valid everywhere
        return torch.zeros(x.shape, dtype=x.dtype, device=device)
    out = torch.randn(x.shape, dtype=x.dtype, device=device)
    if spec.scale is not None:
        mean, std = spec.scale
        out.mul_(std).add_(mean)
    return out


def real_input(x: Any) -> Any:
    """A real tensor like `x` (a real input: a copy; an ``InputSpec``: ``_from_spec``; a fake one of a piece between
    blocks: random values) that owns its memory, laid out as `x` (its strides)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(x, InputSpec):
        out, x = _from_spec(x), x.meta
    elif not isinstance(x, torch.Tensor):
        return x
    elif isinstance(x, FakeTensor) or x.is_meta:  # only its shape: standard-normal floats, zero indices
        out = _from_spec(InputSpec(x, x.device))
    else:
        out = x.detach().clone()
    if out.stride() != x.stride():  # in `x`'s layout, which a compiled graph asserts (an expanded mask: stride 0)
        out = laid_out_as(out, x)
    return out.requires_grad_(x.requires_grad) if out.dtype.is_floating_point else out


def time_step(
    fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    repeats: int = REPEATS,
    budget_s: float = BUDGET_S,
    warmed: bool = False,
) -> float:
    """Best of up to `repeats` forward+backward calls of a compiled graph (seconds), after one warm-up call
    (none when it already ran: `warmed`), stopping once the timed calls took `budget_s`; the forward alone where
    nothing requires a gradient."""
    best, spent = float("inf"), 0.0
    with torch.random.fork_rng(devices=[]):  # the random inputs and the graph's dropout draw from a copy
        inputs = [real_input(x) for x in example_inputs]
        sync = (
            torch.cuda.synchronize if any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs) else (lambda: None)
        )
        for i in range(int(warmed), repeats + 1):
            if spent > budget_s:
                break
            t0 = time.perf_counter()
            outs = fn(*inputs)
            outs = outs if isinstance(outs, (list, tuple)) else [outs]
            grads = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
            if grads:
                torch.autograd.backward(grads, [torch.ones_like(o) for o in grads])
            sync()
            if i:
                dt = time.perf_counter() - t0
                best, spent = min(best, dt), spent + dt
            for x in inputs:
                if isinstance(x, torch.Tensor):
                    x.grad = None
    return best


class Measured:
    """The compiled candidates of one graph; the first call times them (on copies of its inputs; forward and
    backward, or the forward alone for a graph compiled under no_grad) and keeps the faster. Timing happens at
    run time because running a compiled backward inside Dynamo's
    compile (where the backend is called) is not allowed. `rec` (the graph's record) ends up describing the
    winner: each candidate brings the record as its compile left it, completed by its timed calls (Inductor
    compiles a backward at its first call)."""

    def __init__(
        self,
        candidates: Sequence[Candidate],
        rec: Any,
        folder: Any,
        key: str | None,
        state: Any,
        config: Any,
        warmed: frozenset[str] = frozenset(),
    ) -> None:
        self.candidates, self.rec, self.folder, self.key, self.state = list(candidates), rec, folder, key, state
        self.config = config
        self.warmed = warmed  # candidates that already ran in this process: timed without a warm-up call
        self.chosen: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.chosen is None:  # Dynamo compiles a graph per grad mode: an eval graph is timed forward only
            self._choose(args)
        return self.chosen(*args)

    def _choose(self, args: Sequence[Any]) -> None:
        compile_seconds = self.rec.compile_seconds  # set once both candidates compiled: not a candidate's field
        times, records, failed = {}, {}, {}
        for c in self.candidates:
            self.rec.__dict__.update(c.record)
            try:
                times[c.provider] = time_step(c.compiled, args, warmed=c.provider in self.warmed)
            except Exception as e:  # noqa: BLE001 - a candidate that raises is not one; reported below
                failed[c.provider] = e
                continue
            records[c.provider] = copy.copy(self.rec.__dict__)
        if not times:  # every candidate raised: the graph's own error, for the caller (accelerate falls back on it)
            raise next(iter(failed.values()))
        for provider, e in failed.items():
            report_fallback(
                f"provider {provider} on {self.rec.name} ({self.rec.frame})",
                f"raised when timed: {type(e).__name__}: {str(e)[:300]}",
                self.config,
                what="is not a candidate for provider auto",
                sink=self.state.fallbacks,
            )
        choice = decide(times)
        self.rec.__dict__.update(records[choice])
        self.rec.compile_seconds = compile_seconds
        self.rec.provider, self.rec.provider_times = choice, times
        self.rec.notes = [*self.rec.notes, describe(times, choice, cached=False)]
        if self.key is not None:
            save_decision(self.folder, self.key, choice, times)
        losers = {id(r) for c in self.candidates if c.provider != choice for r in c.passes}
        self.state.passes[:] = [r for r in self.state.passes if id(r) not in losers]
        self.chosen = next(c.compiled for c in self.candidates if c.provider == choice)
        self.candidates = []  # the loser's compiled code is released


def decide(times: dict[str, float]) -> str:
    """The faster provider; Inductor unless another beats it by more than TIE_MARGIN."""
    best = min(times, key=times.get)
    if "inductor" in times and times[best] * TIE_MARGIN >= times["inductor"]:
        return "inductor"
    return best


def describe(times: dict[str, float], choice: str, cached: bool) -> str:
    measured = ", ".join(f"{p} {1e3 * t:.2f} ms" for p, t in sorted(times.items(), key=lambda kv: kv[1]))
    return (
        f"provider auto -> {choice}: per call (forward, and backward in training) {measured} (best of up to "
        f"{REPEATS}"
        f"{', decided by an earlier process' if cached else ''})"
    )


def _path(folder: Any, key: str) -> Any:
    return folder / "providers" / f"{key}.json"


def load_decision(folder: Any, key: str) -> dict[str, Any] | None:
    try:
        d = json.loads(_path(folder, key).read_text())
        return d if d.get("choice") in CANDIDATES else None
    except (OSError, ValueError, AttributeError):
        return None


def save_decision(folder: Any, key: str, choice: str, times: dict[str, float]) -> None:
    path = _path(folder, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"choice": choice, "times": times}))
        os.replace(tmp, path)
    except OSError:
        pass
