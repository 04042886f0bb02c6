"""What this machine can do: probed, never assumed.

Every kernel, probe and pass that needs a CPU feature (AVX2, AVX-512, native bf16, AMX), Triton or
CUDA asks here first, and picks the next implementation when the answer is no (oneDNN's fp32 matmul
is probed beside its kernel, gemm.py; the C++ kernels' build, _cpu_ext.py). ``graphtrain.report``
prints `graphtrain.kernels.capabilities()`, so a user sees what was picked and why.

Sources: ``torch._C._cpu._get_cpu_capability()`` (cpuinfo's feature flags, the same table aten's own
dispatch reads), ``torch.backends.cpu.get_cpu_capability()`` (the vector ISA aten's kernels were
dispatched to: DEFAULT, AVX2, AVX512, ...).

Simulating a smaller machine: ``GRAPHTRAIN_SIMULATE_CPU=avx2`` (or ``simulate("avx2")`` in a test)
reports an AVX2-only CPU: no AVX-512, no native bf16, no AMX, no oneDNN fp32 path; the C++ kernels
are then built for x86-64-v3 (AVX2 + FMA) only. Combine it with torch's own ``ATEN_CPU_CAPABILITY=avx2``
and ``ONEDNN_MAX_CPU_ISA=AVX2`` to approximate a first-generation EPYC on a bigger CPU. For debugging
and tests only; it never enables a feature the CPU lacks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SIMULATE_ENV = "GRAPHTRAIN_SIMULATE_CPU"
_SIMULATIONS = ("avx2",)
_simulated: str | None = None  # set by simulate(); the env var is read when this is None


@dataclass(frozen=True)
class CPUInfo:
    """The CPU as aten and cpuinfo see it (after any simulation)."""

    name: str
    arch: str
    torch_isa: str  # torch.backends.cpu.get_cpu_capability(): DEFAULT | AVX2 | AVX512 | ...
    flags: frozenset[str]  # cpuinfo features that are present (avx2, avx512_bf16, amx_bf16, ...)
    simulated: str | None = None

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags and "fma3" in self.flags

    @property
    def avx512(self) -> bool:
        """AVX-512 F, BW, VL and DQ: what oneDNN's avx512_core kernels (and its fp32 matmul here) need."""
        return {"avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"} <= self.flags

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512_BF16, AMX-BF16, AVX-NE-CONVERT): bf16 matmuls run faster than
        fp32. Without them aten emulates bf16 matmul; measured ~1.4 GFLOP/s against ~43 GFLOP/s fp32 on the
        2-core first-generation AVX2 EPYC (shared/MEASURED.md)."""
        return bool({"avx512_bf16", "amx_bf16", "avx_ne_convert"} & self.flags)

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags and "amx_tile" in self.flags

    @property
    def isa(self) -> str:
        """A short label: amx | avx512_bf16 | avx512 | avx2 | default (the best of these the CPU has)."""
        if self.amx:
            return "amx"
        if self.avx512 and "avx512_bf16" in self.flags:
            return "avx512_bf16"
        if self.avx512:
            return "avx512"
        if self.avx2:
            return "avx2"
        return "default"


def _simulation() -> str | None:
    sim = _simulated if _simulated is not None else os.environ.get(SIMULATE_ENV) or None
    if sim and sim.lower() not in _SIMULATIONS:
        raise ValueError(f"{SIMULATE_ENV}={sim!r} is not a known simulation; use one of {', '.join(_SIMULATIONS)}")
    return sim.lower() if sim else None


@functools.cache
def _cpu_info(sim: str | None) -> CPUInfo:
    try:
        raw: dict[str, Any] = dict(torch._C._cpu._get_cpu_capability())
    except Exception:  # noqa: BLE001 - an older torch without the binding: only aten's ISA is known
        raw = {}
    flags = {k for k, v in raw.items() if v is True}
    isa = str(torch.backends.cpu.get_cpu_capability())
    if not raw and isa.startswith("AVX"):  # infer the minimum from aten's dispatch
        flags |= {"avx", "avx2", "fma3"} | (
            {"avx512_f", "avx512_bw", "avx512_vl", "avx512_dq"} if "512" in isa else set()
        )
    if sim == "avx2":
        flags = {f for f in flags if not f.startswith(("avx512", "amx", "avx10", "avx_ne", "avx_vnni"))}
        isa = "AVX2" if "avx2" in flags else isa
    return CPUInfo(
        name=str(raw.get("cpu_name") or platform.processor() or "unknown"),
        arch=platform.machine(),
        torch_isa=isa,
        flags=frozenset(flags),
        simulated=sim,
    )


def cpu() -> CPUInfo:
    return _cpu_info(_simulation())


@contextlib.contextmanager
def simulate(name: str | None) -> Iterator[CPUInfo]:
    """Within the block, report a smaller CPU (see the module docstring); None: the real one."""
    global _simulated
    if name is not None and name not in _SIMULATIONS:
        raise ValueError(f"unknown simulation {name!r}; use one of {', '.join(_SIMULATIONS)}")
    before = _simulated
    _simulated = name if name is not None else ""
    _clear()
    try:
        yield cpu()
    finally:
        _simulated = before
        _clear()


_CLEAR_HOOKS: list[Any] = []


def on_change(fn: Any) -> Any:
    """Register a cache-clearing function that runs when a simulation starts or ends (probes built on
    capabilities register theirs, so a test's simulation never sees a decision cached outside it)."""
    _CLEAR_HOOKS.append(fn)
    return fn


def _clear() -> None:
    for fn in _CLEAR_HOOKS:
        fn()


def triton() -> tuple[bool, str]:
    try:
        import triton as _triton  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a broken install
        return False, "not installed (pip install triton): CUDA fused ops run their references"
    return True, "installed"


def cuda() -> tuple[bool, str]:
    ok = torch.cuda.is_available()
    return ok, (torch.cuda.get_device_name(0) if ok else "no CUDA device")


def bf16_is_fast(device: str = "cpu") -> tuple[bool, str]:
    """Whether bf16 compute pays on `device`: CUDA with bf16 support, or a CPU with native bf16."""
    if device.startswith("cuda"):
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, "CUDA bf16" if ok else "this CUDA device has no bf16"
    c = cpu()
    if c.native_bf16:
        return True, f"native bf16 ({', '.join(sorted(c.flags & {'avx512_bf16', 'amx_bf16', 'avx_ne_convert'}))})"
    return False, (
        f"no native bf16 on this CPU ({c.isa.upper()}: no AVX512_BF16, AMX or AVX-NE-CONVERT); bf16 "
        f"matmuls are emulated, measured ~30x slower than fp32 on an AVX2 EPYC"
    )


def resolve_precision(precision: str, device: str = "cpu") -> str:
    """`auto` -> bf16 where the hardware has it (bf16_is_fast), fp32 otherwise; other values unchanged."""
    if precision != "auto":
        return precision
    return "bf16" if bf16_is_fast(device)[0] else "fp32"


# --------------------------------------------------------------------------------- probe cache ----
# Probes that time something (the oneDNN-vs-MKL GEMM choice, the matmul peak) run once per machine: their
# results are kept in one JSON file keyed by the machine (CPU, ISA, simulation, torch version, threads), so
# a choice does not flip between runs on timing noise, and a slow machine pays for a probe once.


def probe_cache_file() -> Path:
    root = os.environ.get("GRAPHTRAIN_PROBE_CACHE")
    if root:
        return Path(root)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "graphtrain" / "probes.json"


def machine_key() -> str:
    c = cpu()
    return (
        f"{c.name} | {c.isa}{' (simulated)' if c.simulated else ''} | torch {torch.__version__} | "
        f"{torch.get_num_threads()} threads"
    )


_probe_lock = threading.Lock()


def cached_probe(name: str, run: Callable[[], dict[str, Any]], replace: bool = False) -> dict[str, Any]:
    """`run()`'s result for this machine, measured once and kept in probe_cache_file(); the result records
    `cached: True` when it came from the file. A cache that cannot be read or written is ignored."""
    key = machine_key()
    path = probe_cache_file()
    with _probe_lock:
        try:
            table = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            table = {}
        hit = table.get(key, {}).get(name) if isinstance(table, dict) else None
        if isinstance(hit, dict) and not replace:
            return dict(hit, cached=True)
        result = run()
        if not isinstance(table, dict):
            table = {}
        table.setdefault(key, {})[name] = result
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError:
            pass
        return dict(result, cached=False)


def peek_probe(name: str, any_threads: bool = False) -> dict[str, Any] | None:
    """This machine's cached `name` probe, or None when it was never measured here (nothing is measured).
    `any_threads`: an entry measured with any thread count on this CPU will do (the one with the most threads):
    the matmul peak is the machine's, whatever threads a run then uses."""
    try:
        table = json.loads(probe_cache_file().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(table, dict):
        return None
    if not any_threads:
        hit = table.get(machine_key(), {}).get(name)
        return hit if isinstance(hit, dict) else None
    stem = machine_key().rsplit(" | ", 1)[0]
    hits = [
        (int(k.rsplit(" | ", 1)[1].split()[0]), v[name])
        for k, v in table.items()
        if isinstance(v, dict)
        and k.rsplit(" | ", 1)[0] == stem
        and isinstance(v.get(name), dict)
        and k.rsplit(" | ", 1)[1].split()[0].isdigit()
    ]
    return max(hits, key=lambda h: h[0])[1] if hits else None


def store_probe(name: str, result: dict[str, Any]) -> None:
    """Replace this machine's cached `name` probe with `result` (a re-measurement)."""
    cached_probe(name, lambda: result, replace=True)
