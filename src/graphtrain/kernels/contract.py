"""A native kernel's contract, stated once: the Python gate and the C++ checks are both derived from it.

A `Contract` names a C++ entry point of the CPU extension, its parameters, and the rules its code relies on
(shapes, head counts, strides, dtypes, 32-bit ranges). Each rule is one boolean expression in a small syntax that
reads the same in Python and C++: parameter names, ``t.dim()``, ``t.size(i)``, ``t.stride(i)``, ``t.numel()``,
``t.is_contiguous()``, the helpers below (``f32(t)``, ``floating(t)``, ``same_dtype(a, b)``, ``same_shape(a, b)``,
``int64(t)``, ``cpu(t)``), integers, ``GT_INT32_MAX``, comparisons, ``+ - * %``, parentheses, ``&&`` and ``||``. Rules are
checked in order, so a rule may assume the ones before it (``q.dim() == 4`` before ``q.size(3)``).

- `Contract.violation(*args)` evaluates the rules in Python on tensors, fake tensors or `Layout`s (a tensor's
  shape, strides and dtype without its memory: what a caller will pass after making it contiguous) and returns the
  first broken rule's message, or None. The kernel files' ``*_ok`` gates call it: a call that breaks the contract
  never chooses the kernel, the next implementation runs.
- `Contract.cpp()` is a C++ function ``gt_check_<name>(...)`` with one ``TORCH_CHECK`` per rule, which the entry point
  calls first, before it touches memory: a caller that skipped the gate gets an error, never undefined behaviour.
  `_cpu_ext.py` puts every contract's check into the extension's source where it includes ``gt_contracts.h``
  (`cpp_checks`); the C++ helpers the rules call are hand-written, in ``csrc/contract_helpers.h``.

Hand-written rather than borrowed: no library states one contract for both a Python dispatcher and a C++ extension
(ATen writes its ``TORCH_CHECK``s and Python meta functions separately, Thunder its checkers in Python only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

GT_INT32_MAX = 2**31 - 1
"""The largest size, stride or leading dimension a 32-bit BLAS integer (LP64 sgemm_) or a 32-bit offset holds."""


class Layout(NamedTuple):
    """What a contract reads of a tensor, without the tensor: shape, strides, dtype and device."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"

    @staticmethod
    def of(t: torch.Tensor) -> Layout:
        return Layout(tuple(int(d) for d in t.shape), tuple(int(s) for s in t.stride()), t.dtype, t.device.type)

    @staticmethod
    def contiguous(shape: Any, dtype: torch.dtype, device: str = "cpu") -> Layout:
        shape = tuple(int(d) for d in shape)
        strides, acc = [], 1
        for d in reversed(shape):
            strides.append(acc)
            acc *= max(d, 1)
        return Layout(shape, tuple(reversed(strides)), dtype, device)

    def with_strides(self, strides: Any) -> Layout:
        return self._replace(strides=tuple(int(s) for s in strides))


MAX_VERDICTS = 4096
"""Verdicts a contract keeps (Contract._verdicts); past them, new layouts are evaluated each time."""

_ABSENT = Layout((0,), (1,), torch.float32)
"""An optional tensor not given: the empty tensor the C++ entry points take for it."""


class _View:
    """A tensor or Layout seen through the C++ tensor methods the rules use."""

    __slots__ = ("shape", "strides", "dtype", "device")

    def __init__(self, t: torch.Tensor | Layout | None) -> None:
        lay = t if isinstance(t, Layout) else Layout.of(t) if t is not None else _ABSENT
        self.shape, self.strides, self.dtype, self.device = lay

    def dim(self) -> int:
        return len(self.shape)

    def size(self, i: int) -> int:
        return self.shape[i]

    def stride(self, i: int) -> int:
        return self.strides[i]

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def is_contiguous(self) -> bool:
        """As torch defines it: dims of size 1 may have any stride; an empty tensor is contiguous."""
        if self.numel() == 0:
            return True
        dense = Layout.contiguous(self.shape, self.dtype).strides
        return all(st == ex for d, st, ex in zip(self.shape, self.strides, dense) if d != 1)


_HELPERS_PY = {
    "GT_INT32_MAX": GT_INT32_MAX,
    "f32": lambda t: t.dtype == torch.float32,
    "floating": lambda t: t.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64),
    "same_dtype": lambda a, b: a.dtype == b.dtype,
    "same_shape": lambda a, b: a.shape == b.shape,
    "bf16": lambda t: t.dtype == torch.bfloat16,
    "int64": lambda t: t.dtype == torch.int64,
    "cpu": lambda t: t.device == "cpu",
}

CPP_HELPERS = "contract_helpers.h"
"""The hand-written C++ of the helpers above (kernels/csrc/), which the generated checks include."""

_ALLOWED = re.compile(r"^[\w\s().,%*+\-<>=!&|]*$")


def _to_python(expr: str) -> str:
    if not _ALLOWED.match(expr) or re.search(r"!(?!=)", expr) or re.search(r"(?<![&|])[&|](?![&|])", expr):
        raise ValueError(f"contract rule {expr!r}: outside the shared Python/C++ syntax (use &&, ||, !=)")
    return expr.replace("&&", " and ").replace("||", " or ")


@dataclass(frozen=True)
class Rule:
    cond: str
    """The expression that must hold (the shared syntax above)."""
    message: str
    """What is wrong when it does not, for the error and the gate's reason."""


@dataclass(frozen=True)
class Contract:
    name: str
    """The C++ entry point it guards."""
    tensors: tuple[str, ...]
    """Its tensor parameters, in the check function's order (an absent optional tensor is an empty one)."""
    rules: tuple[Rule, ...]
    ints: tuple[str, ...] = ()
    """Its integer parameters, after the tensors."""
    _code: tuple[Any, ...] = field(default=(), repr=False, compare=False)
    _verdicts: dict[tuple[Any, ...], str | None] = field(default_factory=dict, repr=False, compare=False)
    """Verdicts by the arguments' layouts and ints, which are all a rule reads: the gates run at every call of a
    fused op (a kernel is chosen per call), and evaluating the rules cost about 35 us each time, 6.5 ms a step on a
    12-layer HF GPT-2 of width 32 (186 checks a step, 2-core Zen 4), more than its GEMMs."""

    def __post_init__(self) -> None:
        code = tuple(compile(_to_python(r.cond), f"<contract {self.name}>", "eval") for r in self.rules)
        object.__setattr__(self, "_code", code)

    def violation(self, *args: Any) -> str | None:
        """The first broken rule's message for these arguments (tensors, Layouts, ints; None for an absent optional
        tensor, which the C++ entry point receives as an empty one), or None."""
        if len(args) != len(self.tensors) + len(self.ints):
            raise TypeError(f"contract {self.name}: {len(args)} arguments for {self.tensors + self.ints}")
        n_tensors = len(self.tensors)
        key = tuple(
            (Layout.of(a) if isinstance(a, torch.Tensor) else a) if i < n_tensors else int(a)
            for i, a in enumerate(args)
        )
        try:
            return self._verdicts[key]
        except KeyError:
            pass
        verdict = self._evaluate(key)
        if len(self._verdicts) < MAX_VERDICTS:  # a bound for a run of ever new shapes (dynamic lengths)
            self._verdicts[key] = verdict
        return verdict

    def _evaluate(self, args: tuple[Any, ...]) -> str | None:
        env = dict(_HELPERS_PY)
        for name, a in zip(self.tensors + self.ints, args):
            env[name] = _View(a) if name in self.tensors else a
        for rule, code in zip(self.rules, self._code):
            if not eval(code, {"__builtins__": {}}, env):  # noqa: S307 - the rules are this package's constants
                return f"{self.name}: {rule.message}"
        return None

    def holds(self, *args: Any) -> bool:
        return self.violation(*args) is None

    def cpp(self) -> str:
        """``static void gt_check_<name>(...)``: one TORCH_CHECK per rule, in order."""
        params = [f"const torch::Tensor& {t}" for t in self.tensors] + [f"int64_t {i}" for i in self.ints]
        body = "".join(f"  TORCH_CHECK({r.cond}, {_cpp_string(f'{self.name}: {r.message}')});\n" for r in self.rules)
        return f"static void gt_check_{self.name}({', '.join(params)}) {{\n{body}}}\n"

    def call(self) -> str:
        """The C++ statement an entry point starts with."""
        return f"gt_check_{self.name}({', '.join(self.tensors + self.ints)});"


def _cpp_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


CONTRACTS: dict[str, Contract] = {}


def register_contract(c: Contract) -> Contract:
    if c.name in CONTRACTS and CONTRACTS[c.name] != c:
        raise ValueError(f"two contracts for {c.name}")
    CONTRACTS[c.name] = c
    return c


def cpp_checks() -> str:
    """Every registered contract's check function, after an include of the helpers they call
    (csrc/contract_helpers.h): the generated header ``gt_contracts.h``, which the extension's loader (_cpu_ext.py)
    puts where a source includes it."""
    return f'#include "{CPP_HELPERS}"\n' + "".join(c.cpp() for c in CONTRACTS.values())
