"""A graph's inputs as data, and back: what provider auto's background compile sends to its child process
(runtime/tiered.py ``Tiered``, runtime/background.py) and what both processes rebuild fake inputs from, static or
symbolic, so that their compile-cache keys agree; and the size check that comes with Inductor's code for a symbolic
graph compiled that way. Its own module: the pass cache (pipeline/cache.py), the backend and provider auto all use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx


class GuardsUnreadable(ValueError):
    """Inductor's compile of a symbolic graph added a guard on a size no input carries alone: its code cannot be
    checked call by call."""


def symbolic_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    """`example_inputs` with each real tensor whose placeholder Dynamo traced with symbolic sizes replaced by that
    fake value: Dynamo hands a backend the frame's real tensors (dynamic shapes live in the placeholders' metadata
    and in its fake mode), while the pieces of a graph split at its blocks get fake values already."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return list(example_inputs)
    out: list[Any] = []
    for x, n in zip(example_inputs, placeholders):
        val = n.meta.get("example_value", n.meta.get("val"))
        symbolic = (
            isinstance(val, torch.Tensor)
            and isinstance(x, torch.Tensor)
            and any(isinstance(d, torch.SymInt) for d in (*val.shape, *val.stride()))
        )
        out.append(val if symbolic else x)
    return out


def input_metas(example_inputs: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Each input as data: ("tensor", shape, stride, dtype, device, requires_grad, symbols) or ("value", v). Under
    dynamic shapes a size or stride is the string of its expression in the graph's symbols (``"s27"``,
    ``"64*s27"``), a SymInt input is ("symint", expression, symbols), and `symbols` maps each symbol it names to
    the value it had at capture (the hint the compile keys on); {} for static inputs."""
    out: list[tuple[Any, ...]] = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            symbols: dict[str, int] = {}
            shape, stride = _dims(x.shape, symbols), _dims(x.stride(), symbols)
            out.append(("tensor", shape, stride, x.dtype, x.device.type, x.requires_grad, symbols))
        elif isinstance(x, torch.SymInt):
            symbols = {}
            out.append(("symint", _dims((x,), symbols)[0], symbols))
        elif isinstance(x, (int, float, bool)) or x is None:
            out.append(("value", x))
        else:
            raise TypeError(f"input {type(x).__name__} is not plain data")
    return out


def _dims(sizes: Sequence[Any], symbols: dict[str, int]) -> tuple[Any, ...]:
    """`sizes` with each symbolic one as the string of its expression (its symbols' capture values into
    `symbols`); raises TypeError for an expression that is not a polynomial in plain symbols (rebuilt by eval)."""
    out: list[Any] = []
    for d in sizes:
        if isinstance(d, torch.SymInt) and d.node.is_symbolic():
            expr, env = d.node.expr, d.node.shape_env
            if not expr.is_polynomial() or any(not str(f).isidentifier() for f in expr.free_symbols):
                raise TypeError(f"size {expr} is not plain data")
            for f in expr.free_symbols:
                symbols[str(f)] = int((getattr(env, "backed_var_to_val", None) or env.var_to_val)[f])
            out.append(str(expr))
        else:
            out.append(int(d))
    return tuple(out)


def rebuild_sizes(metas: list[tuple[Any, ...]]) -> tuple[Any, Callable[[Any], Any]]:
    """(a ShapeEnv, a function from an encoded size to its int or SymInt) for `metas` (input_metas): one dynamic
    symbol per symbol of the capture, each with its capture value as hint. Duck sizing is off: two symbols that
    happened to have the same value at capture (batch 32, length 32) stay two, as in the captured graph; and a
    symbol whose value was 0 or 1 stays a symbol, not the constant a fresh shape environment makes of it (HF
    Bloom's, Falcon's and GPT-J's heads take an integer input that was 0 at capture; a symbol of value 0 or less
    is not assumed positive)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv(duck_shape=False)
    symbols: dict[str, int] = {}
    for m in metas:
        symbols.update(m[-1] if m[0] in ("tensor", "symint") else {})
    names: dict[str, Any] = {}
    for name, hint in sorted(symbols.items()):
        source = ConstantSource(f"graphtrain_{name}")
        sym = env.create_symbol(
            hint,
            source,
            dynamic_dim=DimDynamic.DYNAMIC,
            do_not_specialize_zero_one=True,
            positive=True if hint > 0 else None,
        )
        names[name] = env.create_symintnode(sym, hint=hint, source=source)

    def size(d: Any) -> Any:
        return d if isinstance(d, int) else eval(d, {"__builtins__": {}}, names)  # noqa: S307 - our own encoding

    return env, size


class SizeChecked:
    """Inductor's code for a symbolic graph compiled from data, with the size conditions its compile assumed.
    Compiled in a ShapeEnv of its own (runtime/tiered.py compile_inductor_from), the guards Inductor added while compiling (a
    size bound, a specialization) never reached Dynamo's guards for the frame: `check(args)` says whether a call's
    sizes meet them, and provider auto runs the calls that do not on aten (tiered.size_checked)."""

    def __init__(self, fn: Callable[..., Any], check: Callable[[Sequence[Any]], bool]) -> None:
        self.fn, self.check = fn, check

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def size_check(
    env: Any, metas: list[tuple[Any, ...]], size: Callable[[Any], Any]
) -> Callable[[Sequence[Any]], bool] | None:
    """A check of a call's sizes against the guards `env` collected (None: no guard), reading each symbol where an
    input carries it alone (a SymInt input, or a tensor dimension). Raises GuardsUnreadable for a guard on a symbol
    no input carries alone."""
    if not env.guards:
        return None
    import math

    import sympy
    from torch.utils._sympy.printers import PythonPrinter

    where: dict[str, tuple[int, int | None]] = {}  # a symbol of the capture -> (input, its dimension or None)
    rename: dict[Any, Any] = {}  # the fresh ShapeEnv's symbols -> the capture's (guards read as Dynamo's would)
    for i, m in enumerate(metas):
        dims = [(None, m[1])] if m[0] == "symint" else list(enumerate(m[1])) if m[0] == "tensor" else []
        for d, e in dims:
            if isinstance(e, str) and e.isidentifier():
                where.setdefault(e, (i, d))
                rename[size(e).node.expr] = sympy.Symbol(e, integer=True)
    guards = [g.expr.xreplace(rename) for g in env.guards]
    free = sorted({str(f) for g in guards for f in g.free_symbols})
    if any(f not in where for f in free):
        raise GuardsUnreadable(
            f"Inductor's compile of this symbolic graph assumed {guards}, on sizes no input carries alone"
        )
    code = " and ".join(dict.fromkeys(f"({PythonPrinter().doprint(g)})" for g in guards))  # each guard once
    # torch's printer writes Max/Min/Abs and the float ops as Python builtins and math functions
    names = {"__builtins__": {}, "max": max, "min": min, "abs": abs, "int": int, "float": float, "math": math}
    test = eval(f"lambda {', '.join(free)}: {code}", names)  # noqa: S307 - printed guards
    spots = [where[f] for f in free]

    def check(args: Sequence[Any]) -> bool:
        return bool(test(*[args[i] if d is None else args[i].shape[d] for i, d in spots]))

    check.guards = code  # type: ignore[attr-defined]
    return check
