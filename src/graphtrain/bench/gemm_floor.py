"""The step's matmuls, each timed alone at its own shape and layout: the GEMM floor of a step.

The roofline line of a bench report divides the step's FLOPs by the machine's peak, the rate of one large square
matmul. The matmuls a model runs are not that square: a hidden size of 256 makes every layer GEMM a K=256 GEMM, and a
weight gradient is a transposed operand. The floor is the time the same matmuls take when nothing else runs: it
bounds from below any variant that runs them, and so bounds from above its speed-up over eager.

How it is measured (`record` then `measure`): one eager step runs under a dispatch mode that notes every
aten.mm/addmm/bmm/baddbmm with its operands' shapes, strides and dtype (after autocast: the dtype that ran). Each
distinct call is then timed alone on fresh operands of the same layout (median of 3 batches); fp32 takes the faster of
aten's and graphtrain's oneDNN GEMM where that applies, a bf16 mm the faster of aten's call and the plan graphtrain
measured for its shape (kernels/gemm.py `low_plan`). Fused attention ops (SDPA's CPU kernels), whose inner GEMMs no
dispatch mode sees, are counted by their FLOPs at the machine's peak: optimistic, so the floor stays a lower bound.

Written here, not taken from torch.utils.flop_counter: that counts FLOPs, and the floor needs the calls' layouts and
their times."""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphtrain.kernels.gemm import _contract_ok, gemm_onednn, low_plan, onednn_available, plan_runner
from graphtrain.runtime.measured import InputSpec, real_input

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)
# SDPA's fused CPU kernels: (phase, index of q, index of is_causal); q, k, v are [B, H, S, D]. The backward's
# arguments are grad_out, q, k, v, out, logsumexp, dropout_p, is_causal.
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: ("fwd", 0, 4),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ("bwd", 1, 7),
}
Spec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.matmuls: collections.Counter[tuple[Any, tuple[Spec, ...]]] = collections.Counter()
        self.attention_flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in MATMULS:
            specs = tuple((tuple(a.shape), tuple(a.stride()), a.dtype) for a in args if isinstance(a, torch.Tensor))
            self.matmuls[(func, specs)] += 1
        elif func in ATTENTION:
            self.attention_flops += _attention_flops(func, args, kwargs)
        return func(*args, **kwargs)


def _attention_flops(func: Any, args: Any, kwargs: dict[str, Any]) -> int:
    """Q K^T and P V: 4 B H Sq Sk D forward; the backward recomputes Q K^T and runs four more: 10 B H Sq Sk D.
    Causal halves both (the kernels skip the masked blocks)."""
    phase, first, at_causal = ATTENTION[func]
    q, k = args[first], args[first + 1]
    b, h, sq, d = q.shape
    sk = k.shape[-2]
    causal = bool(kwargs.get("is_causal", args[at_causal] if len(args) > at_causal else False))
    flops = (4 if phase == "fwd" else 10) * b * h * sq * sk * d
    return flops // 2 if causal else flops


def record(step: Callable[[], Any]) -> dict[str, Any]:
    """Run `step()` once under the recorder: {"matmuls": [(op, specs, count)], "attention_flops": int}."""
    rec = _Recorder()
    with rec:
        step()
    return {
        "matmuls": [(op, specs, n) for (op, specs), n in rec.matmuls.items()],
        "attention_flops": rec.attention_flops,
    }


def _flops(op: Any, specs: tuple[Spec, ...]) -> int:
    a, b = specs[-2][0], specs[-1][0]
    if op in (aten.mm.default, aten.addmm.default):
        return 2 * a[0] * a[1] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]


def _operands(specs: tuple[Spec, ...], device: str) -> list[torch.Tensor]:
    """Random operands laid out as recorded (transposed, expanded): what provider auto times its candidates on."""
    return [
        real_input(InputSpec(torch.empty_strided(shape, stride, dtype=dtype, device="meta"), torch.device(device)))
        for shape, stride, dtype in specs
    ]


def _time(fn: Callable[..., Any], args: tuple[Any, ...], device: str, min_s: float) -> float:
    """Median seconds of one call over 3 batches, each at least `min_s` long (after 2 warm-up calls)."""

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for _ in range(2):
        fn(*args)
    sync()
    t0 = time.perf_counter()
    fn(*args)
    sync()
    once = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, int(min_s / once))
    batches = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        sync()
        batches.append((time.perf_counter() - t0) / reps)
    return statistics.median(batches)


def measure(
    recorded: dict[str, Any], peak_flops: float | None, device: str = "cpu", min_s: float = 0.05
) -> dict[str, Any]:
    """Time every recorded matmul alone; the floor in ms with the few calls that weigh most."""
    onednn = device == "cpu" and onednn_available()
    rows = []
    for op, specs, n in recorded["matmuls"]:
        ts = _operands(specs, device)
        flops = _flops(op, specs)
        seconds = _time(op, tuple(ts), device, min_s)
        lib = "aten"
        a, b = ts[-2], ts[-1]
        if onednn and a.dtype == torch.float32 and a.dim() == 2 and _contract_ok(a, b):
            bias = ts[0] if op is aten.addmm.default else None
            if bias is None or (bias.dim() == 1 and bias.is_contiguous()):
                t = _time(gemm_onednn, (a, b, bias), device, min_s)
                if t < seconds:
                    seconds, lib = t, "onednn"
        if device == "cpu" and op is aten.mm.default and a.dim() == 2 and a.dtype == torch.bfloat16 and a.shape[0] > 32:
            plan = low_plan(a, b)  # graphtrain's bf16 GEMM plans (kernels/gemm.py): the floor holds for its GEMMs too
            if plan != "whole":
                out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)
                t = _time(plan_runner(a, b, out, plan), (), device, min_s)
                if t < seconds:
                    seconds, lib = t, f"graphtrain {plan}"
        rows.append(
            {
                "op": str(op).split(".")[1],
                "shapes": [list(s[0]) for s in specs],
                "strides": [list(s[1]) for s in specs],
                "dtype": str(specs[-1][2]).replace("torch.", ""),
                "count": n,
                "ms_each": seconds * 1e3,
                "gflops_s": flops / seconds / 1e9,
                "library": lib,
                "flops": flops * n,
            }
        )
    rows.sort(key=lambda r: -r["ms_each"] * r["count"])
    matmul_ms = sum(r["ms_each"] * r["count"] for r in rows)
    matmul_flops = sum(r["flops"] for r in rows)
    attn_flops = recorded["attention_flops"]
    attn_ms = attn_flops / peak_flops * 1e3 if peak_flops and attn_flops else 0.0
    return {
        "floor_ms": matmul_ms + attn_ms,
        "matmul_ms": matmul_ms,
        "matmul_flops": matmul_flops,
        "matmul_calls": sum(r["count"] for r in rows),
        "attention_flops": attn_flops,
        "attention_ms_at_peak": attn_ms,
        "top": rows[:8],
    }
