"""Shared pieces of graphtrain's fused ops: the Triton import guard, the dropout hash, the run-time fallback
every fast path goes through (`guarded`), and `force_reference` (diagnosis). The op registry is registry.py.

Dropout masks in every implementation (reference, C++ CPU, Triton) come from one counter-based hash
of (seed, flat element index), so a mask is reproducible from an int64 seed: backward regenerates
it instead of saving it, and the implementations agree bit for bit (tests check that).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from graphtrain.config import fallback
from graphtrain.config.fallback import GraphtrainFallbackWarning  # noqa: F401  (re-exported for kernels' users)

try:  # graphtrain works without triton; the CUDA fast paths then fall back to the references
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install
    triton = None
    tl = None
    HAS_TRITON = False

# The hash constants (splitmix64's finalizer), as signed int64 for torch.
_C0 = 0x9E3779B97F4A7C15 - (1 << 64)
_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_C2 = 0x94D049BB133111EB - (1 << 64)


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def keep_threshold(p: float) -> int:
    t = int(p * 4294967296.0)
    return min(t, 0xFFFFFFFF)


def dropout_keep_mask(
    numel: int, p: float, seed: torch.Tensor | int, device: torch.device | str = "cpu", offset: int = 0
) -> torch.Tensor:
    """Reference keep-mask (bool, flat) for elements offset..offset+numel: hash32(seed, i) >= p*2^32."""
    s = int(seed.item()) if isinstance(seed, torch.Tensor) else int(seed)
    i = torch.arange(offset + 1, offset + numel + 1, dtype=torch.int64, device=device)
    z = i * _C0 + s
    z = (z ^ _lsr(z, 30)) * _C1
    z = (z ^ _lsr(z, 27)) * _C2
    z = z ^ _lsr(z, 31)
    return _lsr(z, 32) >= keep_threshold(p)


def dense_empty(like: torch.Tensor, shape=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous empty tensor shaped like `like` (or `shape`): what fake kernels return.

    Stride contract of every graphtrain op: each tensor output is contiguous, on every path (the
    real kernels call .contiguous() on what they return), and each fake kernel returns exactly that.
    torch.empty_like(x) would instead keep a non-contiguous x's strides (e.g. BERT's transposed
    q/k/v), which AOTAutograd then trusts when it emits view()s in the backward graph.
    """
    return torch.empty(
        like.shape if shape is None else shape, dtype=like.dtype if dtype is None else dtype, device=like.device
    )


def new_seed() -> torch.Tensor:
    """A fresh dropout seed from torch's default CPU generator (so torch.manual_seed reproduces it)."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64)


# --- dropout on tensor-parallel shards ---------------------------------------------------------------------
# Every tp rank of a data-parallel replica runs from the same default-generator state, because a dropout on
# replicated activations (after a row-parallel all-reduce) must drop the same elements on every tp rank. So
# every rank draws the same seed for a given op. Attention dropout, however, runs on each rank's *own* heads
# (at equal local shapes): with that shared seed, rank 0's local head h and rank 1's local head h would get
# the same mask (measured on gpt2-tiny at tp=2 before this salt: the ranks' attention masks agreed on 100% of
# elements instead of (1-p)^2 + p^2). Megatron draws that dropout from a separate RNG seeded per tp rank;
# here the seed is still drawn from the shared generator (so every rank's stream stays aligned and
# checkpoints need nothing new) and graphtrain::attention hashes it with the process's tp salt, which
# distributed.tensor_parallel sets to the tp rank when it shards a model. Salt 0 (one process, or tp rank 0)
# leaves the seed as drawn, so results without tensor parallelism are unchanged bit for bit.
_SHARDED_DROPOUT_SALT = 0
_M64 = (1 << 64) - 1


def set_sharded_dropout_salt(salt: int) -> None:
    """Mix `salt` (the tp rank) into the seed of every later graphtrain::attention call in this process."""
    global _SHARDED_DROPOUT_SALT
    if not isinstance(salt, int) or salt < 0:
        raise ValueError(f"the sharded-dropout salt must be an int >= 0 (the tensor-parallel rank), got {salt!r}")
    _SHARDED_DROPOUT_SALT = salt


def sharded_dropout_salt() -> int:
    return _SHARDED_DROPOUT_SALT


def _mix64(z: int) -> int:
    """splitmix64 (a bijection of 64-bit ints whose outputs look independent for related inputs)."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def salted_seed(seed: int, salt: int) -> int:
    """`seed` for salt 0, else a hash of (seed, salt) in new_seed's range [0, 2^62) (what every implementation
    takes). A hash, not seed + salt: the mask hashes seed + (i + 1) * golden, so seeds that differ by a small
    multiple of the golden ratio constant would give shifted copies of one mask."""
    return seed if salt == 0 else _mix64(seed ^ _mix64(salt)) & ((1 << 62) - 1)


def sharded_dropout_seed() -> torch.Tensor:
    """new_seed(), salted with this process's tp salt: the seed of a dropout on a tensor-parallel shard."""
    seed = new_seed()
    if _SHARDED_DROPOUT_SALT == 0:
        return seed
    return torch.tensor([salted_seed(int(seed.item()), _SHARDED_DROPOUT_SALT)], dtype=torch.int64)


def check_dropout_p(p: float, what: str) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{what}: dropout probability must be in [0, 1), got {p}")


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


TRITON_MAX_NUMEL = 2**31 - 1
"""The Triton kernels compute element offsets from int32 program ids and strides (row * stride + column): every
tensor they take must have fewer elements than an int32 holds, or an offset wraps and the kernel reads or writes
outside the tensor. Larger tensors run the next implementation (part of each Triton kernel's contract)."""


def _max_offset(t: torch.Tensor) -> int:
    """The largest element offset a view of t reaches from its first element."""
    return sum((d - 1) * st for d, st in zip(t.shape, t.stride()) if d > 0)


def triton_ok(*tensors: torch.Tensor | None) -> bool:
    """Whether the Triton path may take these tensors: CUDA tensors (or CPU under TRITON_INTERPRET=1), each with
    offsets within int32 (`TRITON_MAX_NUMEL`)."""
    if not HAS_TRITON:
        return False
    ts = [t for t in tensors if t is not None]
    if any(t.numel() > TRITON_MAX_NUMEL or _max_offset(t) > TRITON_MAX_NUMEL for t in ts):
        return False
    if interpret_mode():
        return all(t.device.type == "cpu" for t in ts)
    return all(t.device.type == "cuda" for t in ts)


# ---------------------------------------------------------------------------------------------------------
# Run-time fallback. A fast path was chosen because its checker accepted the inputs, but it can still fail
# on a machine or input nobody tested (a oneDNN primitive the CPU lacks, a Triton compile error). Then the
# op's reference implementation runs instead, once per (op, implementation) a warning says so, and that fast
# path stays off for the rest of the process; only the `error` policy (engine.fallback: error) stops the run.
# If the reference fails too, the input itself is bad: the reference's error is raised, as eager would.


class KernelFallbackError(RuntimeError):
    """A fused op's fast path failed under the `error` fallback policy."""


@dataclass(frozen=True)
class KernelFallback:
    op: str
    implementation: str
    reason: str


_FALLBACKS: list[KernelFallback] = []
_DISABLED: set[tuple[str, str]] = set()
_FALLBACK_LOCK = threading.Lock()


def set_fallback_policy(policy: str) -> None:
    """warn (default) | silent | error: what a failing fast path does (graphtrain.config.fallback.set_policy)."""
    fallback.set_policy(policy)


def runtime_fallbacks() -> list[KernelFallback]:
    """Every fast path that failed at run time in this process, in order (graphtrain.report lists them)."""
    return list(_FALLBACKS)


def fast_path_disabled(op: str, implementation: str) -> bool:
    return (op, implementation) in _DISABLED


def reset_runtime_fallbacks() -> None:
    """Forget the failures (tests; a process that fixed its environment)."""
    with _FALLBACK_LOCK:
        _FALLBACKS.clear()
        _DISABLED.clear()


def guarded(op: str, implementation: str, fast: Callable[[], Any], reference: Callable[[], Any]) -> Any:
    """fast(), or reference() when fast raises (see above). Both closures compute the same op on the same
    inputs; `fast` must not have mutated them when it raises (graphtrain's kernels write into fresh buffers)."""
    if (op, implementation) in _DISABLED or _forced(op, implementation):
        return reference()
    try:
        return fast()
    except Exception as e:  # noqa: BLE001 - any failure of an optional fast path
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:400]
        policy = fallback.policy()
        if policy == "error":
            raise KernelFallbackError(
                f"graphtrain::{op}: its {implementation} implementation failed: {reason}. Set engine.fallback=warn "
                f"to run the op's reference implementation instead"
            ) from e
        try:
            out = reference()
        except Exception as ref_error:  # the inputs are bad, not the fast path: say what the reference says
            raise ref_error from e
        with _FALLBACK_LOCK:
            first = (op, implementation) not in _DISABLED
            _DISABLED.add((op, implementation))
            if first:
                _FALLBACKS.append(KernelFallback(op, implementation, reason))
        if first and policy == "warn":
            warnings.warn(
                f"graphtrain: fused op {op}: its {implementation} implementation failed ({reason}); "
                f"running its reference implementation from now on",
                GraphtrainFallbackWarning,
                stacklevel=2,
            )
        return out


def dispatch(op: str, candidates: list[tuple[str, bool, Callable[[], Any]]], reference: Callable[[], Any]) -> Any:
    """Run the first candidate (implementation name, its checker's answer, closure) that is accepted and not
    switched off by an earlier failure, `guarded` by the reference; the reference when none is."""
    for name, accepted, fn in candidates:
        if accepted and (op, name) not in _DISABLED:
            return guarded(op, name, fn, reference)
    return reference()


# ---------------------------------------------------------------------------------------------------------
# Forcing references, for diagnosis (`graphtrain bisect`): inside `force_reference(...)` the named ops run their
# reference instead of the fast path their checker chose, so one graph can run with and without a fast path and
# the two be compared. Process-wide, not per thread, because fused ops' backward runs in autograd's threads.


@dataclass
class _Forcing:
    ops: frozenset[str] | None  # None: every op
    except_for: frozenset[str]
    chosen: set[tuple[str, str]]  # (op, implementation) fast paths chosen inside the block, forced or not


_FORCING: list[_Forcing] = []  # a stack: the innermost block decides


@contextlib.contextmanager
def force_reference(ops: Any = None, *, except_for: Any = ()) -> Any:
    """Run the reference implementation of fused ops inside the block instead of their fast paths.

    `ops` and `except_for` are iterables of the names ops dispatch under (``layer_norm``, ``layer_norm_backward``,
    ``attention``, ``gemm``, ...; see `dispatch`); ``ops=None`` forces every op except those in `except_for`.
    Yields a set that collects every (op, implementation) fast path chosen inside the block, forced or not:
    which fast paths a model exercises. Diagnosis only: the switch is process-wide."""
    forcing = _Forcing(None if ops is None else frozenset(ops), frozenset(except_for), set())
    _FORCING.append(forcing)
    try:
        yield forcing.chosen
    finally:
        _FORCING.remove(forcing)


def _forced(op: str, implementation: str) -> bool:
    if not _FORCING:
        return False
    f = _FORCING[-1]
    f.chosen.add((op, implementation))
    return (f.ops is None or op in f.ops) and op not in f.except_for
