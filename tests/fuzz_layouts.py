"""Layout fuzzing's shared pieces (issue #49, item 3): Hypothesis strategies for a fused op's inputs, the budgets,
and the comparison with the op's reference.

A drawn input is an `Arg`: a leaf tensor (what requires grad) and the view of it the op receives, laid out one of
`LAYOUTS` ways: contiguous, transposed (a permutation of a tensor allocated in another dim order), sliced (every
dim cut from a larger tensor with an offset and a step), expanded (stride 0 along the dims the leaf holds once) or
channels-last (4-D). The fused op and the reference each get their own copy of the leaf, viewed the same way, so
the gradients compared are the leaves' (an expanded input's gradient is the sum over its repeats, as autograd
gives it). The reference runs in fp64 on the same values: the specification's exact answer, which the fused op
in fp32/bf16/fp16 must meet within the tolerance table (graphtrain.testing.TOLERANCES).

Budgets: `fuzz(prop, budget)` runs a property ``prop(data)`` with ``settings(max_examples=..., deadline=None,
derandomize=True)``: "default" in the default suite (a few seconds per op), "slow" behind ``-m slow``; the
Hypothesis profiles ``graphtrain-fuzz`` and ``graphtrain-fuzz-slow`` (tests/conftest.py) hold them, and
GRAPHTRAIN_FUZZ_EXAMPLES=<n> overrides both (a long local hunt). Derandomized: a failure reproduces on every run,
and Hypothesis prints the drawn example.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")  # requirements-dev.txt pins it
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from graphtrain.testing import TOLERANCES  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("contiguous", "transposed", "sliced", "expanded", "channels_last")
PRIMES = (2, 3, 5, 7, 11, 13, 17, 31, 37, 61, 67, 127)

BUDGET_PARAMS = [pytest.param("default", id="default"), pytest.param("slow", id="slow", marks=pytest.mark.slow)]
"""Parametrize a fuzz test over these: the default suite runs the small budget, ``-m slow`` the large one."""


def fuzz(prop: Callable, budget: str, share: float = 1.0) -> None:
    """Run ``prop(data)`` (data: Hypothesis's st.data()) under the budget's profile, with `share` of its examples (a
    property run once per stratum, such as per dtype, takes its part of the budget)."""
    profile = settings.get_profile("graphtrain-fuzz" if budget == "default" else "graphtrain-fuzz-slow")
    n = int(os.environ.get("GRAPHTRAIN_FUZZ_EXAMPLES", "0") or 0) or profile.max_examples
    s = settings(profile, max_examples=max(1, round(n * share)))
    s(given(st.data())(prop))()


def bind(fn: Callable, **kw) -> Callable:
    """fn with keyword arguments bound, as a plain function of `data` (Hypothesis's @given takes no partials)."""

    def prop(data):
        return fn(data, **kw)

    return prop


def fuzz_per_dtype(prop: Callable, budget: str) -> None:
    """Run ``prop(data, dtype=...)`` once per dtype of DTYPES, each with its share of the budget: drawn with the
    rest, the dtype came out unevenly over a few dozen examples (Hypothesis favours its first choices)."""
    for dtype in DTYPES:
        fuzz(bind(prop, dtype=dtype), budget, share=1 / len(DTYPES))


def sizes(lo: int = 1, hi: int = 67) -> st.SearchStrategy[int]:
    """A dim's size: 1, a prime, or anything in [lo, hi] (Hypothesis shrinks towards lo)."""
    return st.one_of(st.just(max(lo, 1)), st.sampled_from([p for p in PRIMES if lo <= p <= hi]), st.integers(lo, hi))


def dtypes() -> st.SearchStrategy[torch.dtype]:
    return st.sampled_from(DTYPES)


@dataclass
class Arg:
    """A drawn input: `leaf` (its own values, requires grad if floating) and `view(leaf)` -> what the op gets."""

    leaf: torch.Tensor
    view: Callable[[torch.Tensor], torch.Tensor]
    layout: str

    def fresh(self, dtype: torch.dtype | None = None, grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(a new leaf with the same values, in `dtype` if given; the op's input viewed from it)."""
        leaf = self.leaf.detach().to(dtype or self.leaf.dtype).clone()
        if grad and leaf.is_floating_point():
            leaf.requires_grad_(True)
        return leaf, self.view(leaf)

    def __repr__(self) -> str:  # what Hypothesis prints for a failing example
        v = self.view(self.leaf.detach())
        return f"Arg({self.layout}, shape={tuple(v.shape)}, stride={v.stride()}, {v.dtype})"


def _values(gen: torch.Generator, shape, dtype: torch.dtype, scale: float, offset: float) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale + offset).to(dtype)


def tensor(
    data, shape, dtype: torch.dtype, *, layouts=LAYOUTS, scale: float = 1.0, offset: float = 0.0, label: str = "x"
) -> Arg:
    """Draw an input of logical `shape` in one of `layouts` (those that do not apply to the shape are skipped)."""
    shape = tuple(int(d) for d in shape)
    nd = len(shape)
    ok = [
        lay
        for lay in layouts
        if (lay != "channels_last" or nd == 4)
        and (lay not in ("transposed",) or nd >= 2)
        and (lay != "expanded" or nd >= 1)
    ]
    layout = data.draw(st.sampled_from(ok or ["contiguous"]), label=f"{label} layout")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label=f"{label} seed"))
    if layout == "contiguous":
        return Arg(_values(gen, shape, dtype, scale, offset), lambda t: t, layout)
    if layout == "channels_last":
        leaf = _values(gen, shape, dtype, scale, offset).contiguous(memory_format=torch.channels_last)
        # the leaf keeps its strides through fresh(): .clone() preserves a dense layout
        return Arg(leaf, lambda t: t, layout)
    if layout == "transposed":
        perm = data.draw(st.permutations(range(nd)).filter(lambda p: list(p) != list(range(nd))), label=f"{label} perm")
        inv = [perm.index(i) for i in range(nd)]
        leaf = _values(gen, [shape[p] for p in perm], dtype, scale, offset)
        return Arg(leaf, lambda t: t.permute(inv), layout)
    if layout == "sliced":
        steps = [data.draw(st.sampled_from([1, 2, 3]), label=f"{label} step{i}") for i in range(nd)]
        offs = [data.draw(st.integers(0, 2), label=f"{label} offset{i}") for i in range(nd)]
        big = [
            o + (d - 1) * s + 1 + data.draw(st.integers(0, 2), label=f"{label} tail{i}") if d > 0 else o + 1
            for i, (d, s, o) in enumerate(zip(shape, steps, offs))
        ]
        leaf = _values(gen, big, dtype, scale, offset)
        idx = tuple(slice(o, o + d * s, s) for d, s, o in zip(shape, steps, offs))
        return Arg(leaf, lambda t: t[idx], layout)
    # expanded: stride 0 along a non-empty subset of dims (the leaf holds size 1 there)
    dims = data.draw(st.sets(st.integers(0, nd - 1), min_size=1), label=f"{label} expanded dims")
    leaf = _values(gen, [1 if i in dims else d for i, d in enumerate(shape)], dtype, scale, offset)
    return Arg(leaf, lambda t: t.expand(shape), layout)


def optional(data, label: str) -> bool:
    return data.draw(st.booleans(), label=f"{label}?")


def tolerance(dtype: torch.dtype, slack: float = 1.0) -> tuple[float, float]:
    r, a = TOLERANCES[dtype]
    return r * slack, a * slack


def close(
    actual: torch.Tensor | None,
    expected: torch.Tensor | None,
    dtype: torch.dtype,
    name: str,
    eager: torch.Tensor | None = None,
    slack: float = 1.0,
    scale: float = 1.0,
) -> None:
    """`actual` (the fused op's, in `dtype`) against `expected` (the fp64 reference's): NaN exactly where the
    reference has NaN, and the other values within the table's tolerance, or, where that strict comparison fails, no
    further from the reference than eager PyTorch's own result in `dtype` (`eager`) is, up to 2x for a different
    summation order (the parity rule of docs/design/kernels-testing.md: an ill-conditioned input, such as a
    LayerNorm row whose spread is tiny against its mean, costs the fused op and eager the same digits). `scale`
    multiplies the absolute tolerance: the magnitude of the terms a result sums, where it cancels to about 0."""
    assert (actual is None) == (expected is None), f"{name}: {actual is None=} but {expected is None=}"
    if actual is None:
        return
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    a, e = actual.detach().double(), expected.detach().double()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), (
        f"{name}: NaN at {int((nan_a & ~nan_e).sum())} unexpected places, missing at {int((nan_e & ~nan_a).sum())}"
    )
    a, e = a[~nan_a], e[~nan_e].to(dtype).double()  # the reference rounded to the dtype: that rounding is no error
    r, at = tolerance(dtype, slack)
    at *= max(1.0, scale)
    try:
        torch.testing.assert_close(a, e, rtol=r, atol=at, msg=lambda m: f"{name} ({dtype}): {m}")
    except AssertionError as failed:
        if eager is None or a.numel() == 0:
            raise
        g = eager.detach().double()[~nan_e]
        ours, theirs = (a - e).abs().max().item(), (g - e).abs().max().item()
        if not ours <= 2 * theirs:
            raise AssertionError(
                f"{name} ({dtype}): outside the table's tolerance (max abs error {ours:.3e} against "
                f"the fp64 reference) and further off than eager PyTorch in {dtype} ({theirs:.3e})"
            ) from failed


def check_op(
    data,
    name: str,
    dtype: torch.dtype,
    args: list,
    fused: Callable,
    eager: Callable,
    ref: Callable,
    *,
    backward: bool = True,
    slack: float = 1.0,
) -> dict:
    """Run `fused` (in `dtype`), `eager` (plain PyTorch ops, in `dtype`) and `ref` (the op's reference, fp64) on their
    own copies of `args` (Args, or None for an absent input), each as ``fn(*views) -> output``; compare the outputs,
    then (if `backward`) the gradients for one drawn upstream gradient. The gradients are those of the op's inputs
    (the views), not of the leaves: what autograd then sums over an expanded view's repeats is not the op's, and
    such a sum of rounded terms that cancel (a constant row's LayerNorm gradient) has no digits to compare."""
    outs, views = {}, {}
    for kind, dt, fn in (("fused", dtype, fused), ("eager", dtype, eager), ("ref", torch.float64, ref)):
        views[kind] = [a.fresh(dt)[1] if a is not None else None for a in args]
        outs[kind] = fn(*views[kind])
    close(outs["fused"], outs["ref"], dtype, f"{name} out", outs["eager"], slack)
    if not backward or torch.isnan(outs["ref"]).any():  # NaN output (a mean over nothing): no gradient to compare
        return outs
    dy = upstream(data, outs["ref"].shape, dtype)  # rounded to the dtype: every run sees the same values
    grads = {}
    for kind in outs:
        wrt = [v for v in views[kind] if v is not None and v.requires_grad]
        got = iter(torch.autograd.grad(outs[kind], wrt, dy.to(outs[kind].dtype), allow_unused=True))
        grads[kind] = [next(got) if v is not None and v.requires_grad else None for v in views[kind]]
    for i, (a, e, g) in enumerate(zip(grads["fused"], grads["ref"], grads["eager"])):
        close(a, e, dtype, f"{name} grad of input {i}", g, slack)
    return outs


def upstream(data, shape, dtype: torch.dtype, label: str = "dy") -> torch.Tensor:
    """The gradient fed into the op's output (its own values, contiguous)."""
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label=f"{label} seed"))
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(dtype)
