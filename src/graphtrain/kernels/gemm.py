"""graphtrain::gemm: a @ b (+ bias) on 2-D tensors, with the CPU provider's own fp32 GEMM and bf16 GEMM plans.

Why this op exists: for fp32 on CPU, ``aten.mm`` calls MKL's sgemm. On AMD CPUs MKL runs its AVX2
code path, whatever the CPU supports; on this machine (2-core AMD EPYC, Zen 5, AVX-512) that is
~220 GFLOP/s, while oneDNN, which PyTorch also ships (and uses for bf16 matmuls), dispatches on the
ISA and runs the same IEEE fp32 GEMM with AVX-512 at 430-490 GFLOP/s on the GPT-2/BERT shapes
(``python -m graphtrain.bench.kernels --ops gemm_linear,gemm_lm_head``). Training graphs never
reach it on their own: eager and Inductor both lower fp32 mm/addmm to aten. The pre-autodiff pass
``lower_gemm_onednn`` (passes/lower_gemm.py) rewrites the step's fp32 CPU mm/addmm nodes to this op
(its backward is this op again, so the gradient GEMMs follow) when `onednn_gemm_wins()` measured
oneDNN faster on the running CPU.

Numerics: fp32 in, fp32 accumulate, fp32 out (no bf16/tf32 down-conversion: torch's default
``torch.backends.mkldnn.matmul.fp32_precision`` keeps oneDNN's math mode strict; the tests check the
error against fp64 is fp32-sized). Only the summation order differs from MKL.

Implementation: ``at::native::mkldnn_matmul`` (what aten's bf16 matmuls call), reached through a
one-line C++ wrapper (csrc/matmul.cpp) because the wheel exports the function but ships no Python binding
for fp32. It reads contiguous and transposed operands in place (no copies for the weight-gradient
product dY^T @ X), writes into a given output (chunked callers fill slices of one buffer) and can
accumulate into it (beta = 1: addmm's bias, and += without a temporary).

bf16 on CPU: aten's matmul already goes through oneDNN, but oneDNN's own choice of blocking and threads is slow at
some shapes (a long inner dimension on 2 threads, a transposed first operand). There graphtrain::gemm runs the GEMM
by a plan measured per machine and shape (`low_plan`: whole, in row blocks, one single-threaded oneDNN call per
thread, or the first operand copied row-major first), and the pass ``lower_gemm_plans`` routes only the GEMMs whose
plan is not the whole call to it. Other dtypes and devices use aten.mm/addmm, and CUDA uses cuBLAS. CPUs where
oneDNN's matmul does not run (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only EPYC raises) or does not win
use aten as well: `onednn_fp32()` checks the capability and makes a trial call before the probe times anything, and
a oneDNN call that still fails at run time falls back to aten (`_common.guarded`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import torch.fx as fx
from torch import Tensor

from graphtrain.kernels import _cpu_ext, capability
from graphtrain.kernels._common import guarded
from graphtrain.kernels._cpu_ext import ONEDNN_MATMUL, ONEDNN_MATMUL_ROWS, TRANSPOSE_BF16
from graphtrain.kernels.contract import Layout
from graphtrain.kernels.registry import (
    FOLLOW,
    FORWARD,
    NEVER,
    KernelSpec,
    OpDescriptor,
    input_value,
    register_kernel_spec,
)


def gemm_reference(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """a @ b (+ bias) by aten. With a bias of the operands' dtype, one addmm / baddbmm (BLAS beta = 1 over the bias
    broadcast into the result), as nn.Linear runs: `a @ b + bias` held two [m, n] results at once, which on a CPU
    without oneDNN's matmul (an AVX2 EPYC) put a second copy of BERT's returned logits (vocabulary 30522, 4096 tokens:
    477 MiB) on the process peak."""
    if bias is None:
        return a @ b
    if bias.dtype == a.dtype == b.dtype and a.dim() == b.dim() and a.dim() in (2, 3):
        return (torch.addmm if a.dim() == 2 else torch.baddbmm)(bias, a, b)
    return a @ b + bias


@functools.cache
def _onednn_trial(level: str) -> str | None:
    """None if oneDNN's fp32 matmul runs here (a 2x2 trial call through the `level` build), else why not."""
    mod = _cpu_ext.load(level)
    if mod is None:
        return f"graphtrain's C++ kernels are not built ({_cpu_ext.build_error(level) or 'disabled'})"
    a, b, out = torch.ones(2, 2), torch.ones(2, 2), torch.empty(2, 2)
    try:
        mod.onednn_matmul(a, b, out, 0.0)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError; anything else means no as well
        return " ".join(str(e).split())[:200]
    return None if torch.equal(out, torch.full((2, 2), 2.0)) else "the trial call returned a wrong result"


@functools.cache
def onednn_fp32() -> tuple[bool, str]:
    """(usable, why) for oneDNN's fp32 matmul on this CPU: torch built with oneDNN, a CPU with AVX-512
    BW/VL/DQ or AVX-NE-CONVERT (what at::native::mkldnn_matmul checks; on an AVX2-only EPYC it raises
    "mkldnn_matmul bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"),
    the C++ wrapper built, and a trial call that runs."""
    if not torch.backends.mkldnn.is_available():
        return False, "torch was built without oneDNN"
    c = capability.cpu()
    if c.arch in ("x86_64", "AMD64") and not (c.avx512 or "avx_ne_convert" in c.flags):
        sim = f", simulated {c.simulated}" if c.simulated else ""
        return False, f"needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; this CPU has {c.isa.upper()}{sim}"
    err = _onednn_trial(_cpu_ext.isa_level())
    return err is None, err or "available (trial call ran)"


def onednn_available() -> bool:
    """oneDNN's fp32 matmul runs on this machine (`onednn_fp32`); otherwise aten.mm serves every GEMM."""
    return onednn_fp32()[0]


def _fp32_cpu(*ts: Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in ts)


def _contract_ok(a: Tensor, b: Tensor, out: Tensor | None = None) -> bool:
    """_cpu_ext.py ONEDNN_MATMUL holds for a @ b into `out` (a fresh contiguous output when None)."""
    if out is not None:
        return ONEDNN_MATMUL.holds(a, b, out)
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        return False
    return ONEDNN_MATMUL.holds(a, b, Layout.contiguous((*a.shape[:-1], b.shape[-1]), a.dtype, a.device.type))


def _takes(a: Tensor, b: Tensor, bias: Tensor | None) -> bool:
    """Whether the oneDNN path serves these inputs: 2-D fp32 CPU operands, a bias broadcastable to the output."""
    if not (a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and _fp32_cpu(a, b, bias)):
        return False
    if bias is not None and bias.dim() > 2:
        return False
    return min(a.shape[0], a.shape[1], b.shape[1]) > 0 and _contract_ok(a, b) and onednn_available()


def gemm_onednn(
    a: Tensor, b: Tensor, bias: Tensor | None = None, out: Tensor | None = None, accumulate: bool = False
) -> Tensor:
    """out = a @ b (+ bias) (+ out if `accumulate`) through oneDNN's fp32 GEMM; a, b 2-D (or 3-D, batched).
    `out` (contiguous) is allocated when not given. The caller checked the inputs (fp32 CPU) and
    `onednn_available()`; callers that can fall back go through `matmul` / `mm_into` instead."""
    shape = (*a.shape[:-1], b.shape[-1])
    if out is None:
        out = a.new_empty(shape)
        accumulate = False
    beta = 1.0 if accumulate else 0.0
    if bias is not None:
        if accumulate:
            out.add_(bias)
        else:
            out.copy_(bias.expand(shape))
        beta = 1.0
    _cpu_ext.load().onednn_matmul(a, b, out, beta)
    return out


def matmul(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """a @ b (+ bias) for 2-D or batched 3-D operands, through oneDNN where `onednn_gemm_wins()` (fp32 CPU),
    else torch.matmul: graphtrain's own CPU kernels (attention, chunked linear cross-entropy) call this."""
    if (
        a.dim() == b.dim()
        and a.dim() in (2, 3)
        and a.shape[:-2] == b.shape[:-2]
        and a.shape[-1] == b.shape[-2]
        and a.numel() > 0
        and b.numel() > 0
        and _fp32_cpu(a, b, bias)
        and _contract_ok(a, b)
        and onednn_available()
        and onednn_gemm_wins()
    ):
        return guarded("gemm", "onednn", lambda: gemm_onednn(a, b, bias), lambda: gemm_reference(a, b, bias))
    return gemm_reference(a, b, bias)


def _blas_rows(t: Tensor) -> bool:
    """A 2-D tensor of dense rows at a stride of at least its width: what BLAS takes as a matrix with a leading
    dimension (aten's mm and addmm_ write into it without a copy)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= max(t.shape[1], 1)


def mm_into(a: Tensor, b: Tensor, out: Tensor, accumulate: bool) -> None:
    """out (+)= a @ b: oneDNN straight into `out` for fp32 CPU where it wins, else aten."""

    def aten() -> None:
        # a row-strided out (a padded buffer's rows: linear_cross_entropy.logits_row_stride) is a BLAS C matrix with
        # ldc = out.stride(0): aten writes it in place, no temporary
        same = out.dtype == a.dtype == b.dtype and (out.is_contiguous() or _blas_rows(out))
        if accumulate and same:
            out.addmm_(a, b)  # BLAS beta = 1: no [m, n] temporary, no second pass over `out`
        elif accumulate:
            out.add_((a @ b).to(out.dtype))
        elif same:
            torch.mm(a, b, out=out)  # beta = 0: `out` is written, never read (it may hold garbage)
        else:
            out.copy_(a @ b)

    if (
        out.is_contiguous()
        and out.dtype == a.dtype
        and _fp32_cpu(a, b)
        and _contract_ok(a, b, out)
        and onednn_available()
        and onednn_gemm_wins()
    ):
        # beta = 1 reads `out`; a oneDNN failure raises before it writes (primitive creation), so the retry
        # through aten sees the same `out`
        guarded("gemm", "onednn", lambda: gemm_onednn(a, b, out=out, accumulate=accumulate), aten)
    else:
        aten()


def _takes_low(a: Tensor, b: Tensor, bias: Tensor | None) -> bool:
    """Whether a low-precision GEMM has a plan to choose (`low_plan`): 2-D bf16/fp16 CPU operands of one dtype and
    more than 32 rows, a bias (if any) of that dtype broadcastable to the output."""
    return (
        a.dim() == b.dim() == 2
        and a.device.type == b.device.type == "cpu"
        and a.dtype in (torch.bfloat16, torch.float16)
        and b.dtype == a.dtype
        and a.shape[1] == b.shape[0]
        and a.shape[0] > 32
        and b.shape[1] > 0
        and (bias is None or (bias.dtype == a.dtype and bias.dim() <= 2 and bias.device.type == "cpu"))
    )


def _gemm_low(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
    """a @ b (+ bias) in bf16/fp16 by the shape's measured plan (`low_plan`); a bias is written first and the
    product added to it by the threads plan (beta = 1), as aten's addmm adds it otherwise."""
    plan = low_plan(a, b)
    if plan == "whole":
        return (torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)).contiguous()
    out = a.new_empty((a.shape[0], b.shape[1]))
    if bias is not None and plan == "threads" and thread_rows_available(a, b, out):
        out.copy_(bias.expand(out.shape))
        guarded(
            "gemm",
            "onednn_rows",
            lambda: mm_thread_rows(a, b, out, accumulate=True),
            lambda: torch.addmm(bias, a, b, out=out),
        )
        return out
    mm_plan(a, b, out, plan)
    return out if bias is None else out.add_(bias)


@torch.library.custom_op("graphtrain::gemm", mutates_args=())
def _gemm_op(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
    def aten() -> Tensor:
        return (torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)).contiguous()

    if _takes(a, b, bias):
        return guarded("gemm", "onednn", lambda: gemm_onednn(a, b, bias), aten)
    if _takes_low(a, b, bias):
        return _gemm_low(a, b, bias)
    return aten()


@_gemm_op.register_fake
def _(a, b, bias):
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup(ctx, inputs, output):
    a, b, bias = inputs
    ctx.save_for_backward(a, b)
    ctx.bias_shape = None if bias is None else tuple(bias.shape)


def _column_major(t: Tensor) -> bool:
    """A 2-D tensor laid out as the transpose of a contiguous one (nn.Linear's weight as `w.t()`)."""
    return t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 and t.t().is_contiguous()


def _backward(ctx, grad):
    """Each gradient in its operand's own layout, as aten's mm backward does (mm_mat1/mat2_backward): the weight
    gradient of `x @ w.t()` is computed as grad^T @ x, [n, k] like w, and handed back transposed, so neither the
    autograd engine nor a tied weight's accumulation copies or strides through a transposed [k, n] result. Measured
    on Hugging Face BERT small (b8 s128, 2-core Zen 4): the tied 16384 x 512 embedding's gradient took an 11 ms copy
    and a 17 ms strided add per step before."""
    a, b = ctx.saved_tensors
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = (
            torch.ops.graphtrain.gemm(b, grad.t(), None).t()
            if _column_major(a)
            else torch.ops.graphtrain.gemm(grad, b.t(), None)
        )
    if ctx.needs_input_grad[1]:
        gb = (
            torch.ops.graphtrain.gemm(grad.t(), a, None).t()
            if _column_major(b)
            else torch.ops.graphtrain.gemm(a.t(), grad, None)
        )
    gbias = None
    if ctx.bias_shape is not None and ctx.needs_input_grad[2]:
        gbias = grad.sum_to_size(ctx.bias_shape) if len(ctx.bias_shape) else grad.sum()
    return ga, gb, gbias


_gemm_op.register_autograd(_backward, setup_context=_setup)


def gemm(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """a [m, k] @ b [k, n] (+ bias broadcastable to [m, n]) as graphtrain::gemm."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gemm: a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.dtype != b.dtype or (bias is not None and bias.dtype != a.dtype):
        raise TypeError(
            f"gemm: dtypes must match, got a {a.dtype}, b {b.dtype}" + ("" if bias is None else f", bias {bias.dtype}")
        )
    return torch.ops.graphtrain.gemm(a, b, bias)


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _time(fn, budget_s: float, max_reps: int = 5) -> float:
    """Best time of up to `max_reps` calls after a warm-up, stopping once `budget_s` is spent."""
    t0 = time.perf_counter()
    fn()  # warm up (oneDNN builds and caches its primitive on the first call)
    best = time.perf_counter() - t0
    spent = best
    for _ in range(max_reps):
        if spent > budget_s:
            break
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best


PROBE_SHAPES = ((1024, 512, 512), (1024, 512, 2048), (1024, 2048, 512))
"""(m, k, n) of a transformer layer's GEMMs at 1024 tokens, width 512: projection, MLP up, MLP down."""


def _measure(shapes=PROBE_SHAPES, budget_s: float = 0.6) -> dict:
    g = torch.Generator().manual_seed(0)
    per_shape, t_aten, t_dnn, flop = [], 0.0, 0.0, 0.0
    with torch.no_grad():
        for m, k, n in shapes:
            a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).t()
            out = a.new_empty((m, n))
            budget = budget_s / (2 * len(shapes))
            ta = _time(functools.partial(torch.mm, a, b, out=out), budget)
            td = _time(functools.partial(gemm_onednn, a, b, out=out), budget)
            f = 2.0 * m * k * n
            per_shape.append({"shape": [m, k, n], "aten": round(f / ta / 1e9, 1), "onednn": round(f / td / 1e9, 1)})
            t_aten, t_dnn, flop = t_aten + ta, t_dnn + td, flop + f
    # GFLOP/s over the sampled shapes as a whole (time-weighted, as a step spends it)
    return {"aten": flop / t_aten / 1e9, "onednn": flop / t_dnn / 1e9, "shapes": per_shape}


def gemm_probe() -> dict:
    """GFLOP/s of aten.mm (MKL) and oneDNN on fp32 GEMMs of transformer-layer shapes (PROBE_SHAPES), measured
    once per machine (at most ~0.6 s) and cached (capability.cached_probe); `onednn_gemm_wins` reads it.
    Without a usable oneDNN fp32 path nothing is timed and the result says why. Kept in this process per
    machine key, which counts the threads: the winner can differ between 1 and 2 threads (2-core Zen 4: aten
    97 vs oneDNN 105 GFLOP/s at 1 thread), and a process that changes its thread count (a Trainer with
    train.threads) must run the GEMMs a fresh process with that count runs, or its numerics differ."""
    key = capability.machine_key()
    if key not in _PROBES:
        ok, why = onednn_fp32()
        _PROBES[key] = (
            capability.cached_probe("gemm_onednn_vs_aten", _measure)
            if ok
            else {"aten": None, "onednn": None, "shapes": [], "skipped": why, "cached": False}
        )
    return _PROBES[key]


_PROBES: dict[str, dict] = {}


def gemm_probe_ran() -> bool:
    return capability.machine_key() in _PROBES


WIN_MARGIN = 1.05
"""oneDNN must beat aten.mm by this factor to be used: clear of the probes' timing noise (best of interleaved
repeats), so a near tie keeps aten. A decision is made once per machine and shape and cached, so it does not flip
between runs. Measured on a 2-core Zen 4 (b8 s128 Hugging Face BERT small's block GEMMs): oneDNN 1.07-1.27x faster
than MKL, every one of them under the 1.15x this margin was before, so the step ran 40% of its GEMM FLOPs on the
slower library."""


def onednn_gemm_wins() -> bool:
    """Whether fp32 CPU GEMMs should go through oneDNN on this machine (probed once per machine)."""
    p = gemm_probe()
    return p["onednn"] is not None and p["onednn"] > WIN_MARGIN * p["aten"] > 0


SAMPLE_ROWS = 512
"""Rows (tokens) a shape probe runs at most: a model's GEMMs have thousands of rows, and past a few hundred the
rate no longer depends on them (the probe's cost does), while k and n are the model's own."""

PROBE_ROUNDS = 3
"""Timed calls per library and GEMM in a shape probe, aten and oneDNN alternating, best of each kept: a burst of
noise then hits both libraries instead of one."""


def training_gemms(a: Tensor, b: Tensor, dy: Tensor) -> tuple[tuple[Tensor, Tensor], ...]:
    """The three GEMMs of a linear layer's training step as graphtrain::gemm runs them: the forward a @ b, the input
    gradient dy @ b.t() and the weight gradient in the weight's own layout (dy.t() @ a for a transposed weight,
    a.t() @ dy otherwise: _backward)."""
    weight_grad = (dy.t(), a) if _column_major(b) else (a.t(), dy)
    return (a, b), (dy, b.t()), weight_grad


def _measure_shape(m: int, k: int, n: int, b_transposed: bool, budget_s: float) -> dict:
    """aten.mm and oneDNN seconds for one linear layer's three GEMMs as training runs them (training_gemms), at
    min(m, SAMPLE_ROWS) rows, b as the layer stores it (a transposed (n, k) weight, or a (k, n) one): after a warm-up
    call of each, up to PROBE_ROUNDS alternating timed calls per library, best of each, while `budget_s` lasts."""
    g = torch.Generator().manual_seed(0)
    m = min(m, SAMPLE_ROWS)
    a, dy = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g)
    b = torch.randn(n, k, generator=g).t() if b_transposed else torch.randn(k, n, generator=g)
    t_aten = t_dnn = 0.0
    with torch.no_grad():
        for x, y in training_gemms(a, b, dy):
            out = x.new_empty((x.shape[0], y.shape[1]))
            aten, dnn = functools.partial(torch.mm, x, y, out=out), functools.partial(gemm_onednn, x, y, out=out)
            best = [_once(aten), _once(dnn)]  # the warm-ups (oneDNN builds its primitive), an upper bound
            spent = 0.0
            for _ in range(PROBE_ROUNDS):
                if spent > budget_s / 3:
                    break
                for i, fn in enumerate((aten, dnn)):
                    dt = _once(fn)
                    best[i], spent = min(best[i], dt), spent + dt
            t_aten, t_dnn = t_aten + best[0], t_dnn + best[1]
    return {"rows": m, "aten_s": t_aten, "onednn_s": t_dnn, "flop": 3 * 2.0 * m * k * n}


def shape_probe(m: int, k: int, n: int, b_transposed: bool, budget_s: float = 0.3) -> dict:
    """oneDNN against aten.mm on one (m, k, n) GEMM of a model, with its two gradient GEMMs (_measure_shape),
    measured once per machine and shape and cached with the other probes (a few to a few hundred ms each the first
    time). Adds `speedup` (aten's time over oneDNN's) and `wins` (speedup >= WIN_MARGIN). Call only where
    `onednn_available()`."""
    # "v2": interleaved timing, the weight gradient in the weight's layout (results of the first method are not reused)
    name = f"gemm_shape_v2 {min(m, SAMPLE_ROWS)}x{k}x{n}{'t' if b_transposed else 'n'}"
    r = capability.cached_probe(name, lambda: _measure_shape(m, k, n, b_transposed, budget_s))
    speedup = r["aten_s"] / r["onednn_s"] if r["onednn_s"] > 0 else 0.0
    return dict(r, speedup=speedup, wins=speedup >= WIN_MARGIN)


ROW_BLOCK = 256
"""Rows per block of the "blocks" plan (`low_plan`)."""

PLAN_MARGIN = 1.15
"""A plan other than one whole GEMM must beat it by this factor: a near tie keeps one call."""

LOW_PLANS = ("whole", "blocks", "threads", "transpose")
"""How a bf16/fp16 CPU GEMM out = a @ b can run (`low_plan`): one aten call (oneDNN, every thread on the whole
product), aten calls on blocks of ROW_BLOCK rows one after the other, one single-threaded oneDNN call per thread on
its block of rows (C++ `onednn_matmul_rows`, bf16 only), or, where a is stored transposed (a weight gradient dY^T @ X),
a copied row-major first (C++ `transpose_bf16`) and the product then run by its own plan."""


def low_plan(a: Tensor, b: Tensor) -> str:
    """The fastest of LOW_PLANS for out = a @ b (bf16/fp16 CPU, 2-D, `out` contiguous) on this machine, measured once
    per machine, shape, operand layouts and dtype on random operands like these (a few to a few hundred ms) and cached
    with the other probes; "whole" unless another plan beats it by PLAN_MARGIN.

    Why: oneDNN's choice of blocking and threads for a long inner dimension depends on the shape, and some shapes
    land on a slow one. On the 2-core AMX Xeon (bf16), 1024 x 1408 x 512 (a Llama MLP's down projection, small size)
    ran 1.29 ms whole on 2 threads, no faster than on 1, and 0.69 ms as one 512-row GEMM per thread; the LM head's
    d hidden 1024 x 16384 x 512 took 20.5 ms whole, 13.1 in blocks of 256 rows and 10.1 as threads. A weight
    gradient reads its a transposed, which oneDNN ran 1.7-2.4x slower than the same product row-major: 1408 x 1024 x
    512 1.09 ms, against 0.15 ms to copy a row-major and 0.64 ms for the product. But 2048 x 704 x 256 and most
    forward GEMMs ran fastest whole, and a weight gradient 5x slower as threads. So it is measured, not assumed."""
    return plan_for(a.shape[0], a.shape[1], b.shape[1], _column_major(a), _column_major(b), a.dtype)


def plan_for(m: int, k: int, n: int, a_transposed: bool, b_transposed: bool, dtype: torch.dtype) -> str:
    """`low_plan` of an (m, k) @ (k, n) product by its sizes, each operand's layout (read transposed or not) and
    dtype."""
    # "v3": the transpose plan's copy 1.3-3x faster on large matrices (csrc/matmul.cpp transpose_bf16); "v4": the probe
    # times that copy into a block allocated once (_measure_low_plans). Plans measured before are not reused
    name = f"gemm_low_plan_v4 {m}x{k}x{n} {'tn'[not a_transposed]}{'tn'[not b_transposed]} {str(dtype)[6:]}"
    key = (capability.machine_key(), name)
    if key not in _LOW_PLANS:
        if a_transposed:  # the "transpose" plan runs the row-major product by its own plan: decided first, outside
            plan_for(m, k, n, False, b_transposed, dtype)  # this probe (the probe cache's lock is not reentrant)
        r = capability.cached_probe(name, lambda: _measure_low_plans(m, k, n, a_transposed, b_transposed, dtype))
        times = {p: r.get(f"{p}_s", 0.0) for p in LOW_PLANS}
        best = min((p for p in LOW_PLANS if times[p] > 0), key=times.__getitem__, default="whole")
        _LOW_PLANS[key] = best if times["whole"] >= PLAN_MARGIN * times[best] else "whole"
    return _LOW_PLANS[key]


def thread_rows_available(a: Tensor, b: Tensor, out: Tensor) -> bool:
    """The C++ `onednn_matmul_rows` serves out = a @ b here: bf16 CPU operands that meet its contract, oneDNN's matmul
    usable on this CPU (`onednn_fp32`: the same ISA check guards its bf16 path) and more than one thread."""
    return (
        a.dtype == torch.bfloat16
        and torch.get_num_threads() > 1
        and ONEDNN_MATMUL_ROWS.holds(a, b, out)
        and onednn_available()
    )


def mm_thread_rows(a: Tensor, b: Tensor, out: Tensor, accumulate: bool = False) -> None:
    """out (+)= a @ b as one single-threaded oneDNN call per thread on its block of rows; the caller checked
    `thread_rows_available`."""
    _cpu_ext.load().onednn_matmul_rows(a, b, out, 1.0 if accumulate else 0.0)


def mm_row_blocks(a: Tensor, b: Tensor, out: Tensor) -> None:
    """out = a @ b as GEMMs of ROW_BLOCK rows (each block's rows are its own GEMM's: `out` is written, not read)."""
    for r in range(0, a.shape[0], ROW_BLOCK):
        torch.mm(a[r : r + ROW_BLOCK], b, out=out[r : r + ROW_BLOCK])


def transpose_available(a: Tensor) -> bool:
    """The C++ `transpose_bf16` copies a (bf16, stored transposed) row-major here."""
    return (
        _column_major(a)
        and a.dtype == torch.bfloat16
        and TRANSPOSE_BF16.holds(a, Layout.contiguous(a.shape, a.dtype, a.device.type))
        and _cpu_ext.load() is not None
    )


def row_major(a: Tensor, scratch: Tensor | None = None) -> Tensor:
    """a copied row-major by the C++ transpose, into `scratch` where it is a contiguous tensor of a's shape and dtype
    (else a new one); the caller checked `transpose_available`."""
    if scratch is None or scratch.shape != a.shape or scratch.dtype != a.dtype or not scratch.is_contiguous():
        scratch = torch.empty(a.shape, dtype=a.dtype)
    _cpu_ext.load().transpose_bf16(a, scratch)
    return scratch


def mm_plan(a: Tensor, b: Tensor, out: Tensor, plan: str, scratch: Tensor | None = None) -> None:
    """out = a @ b (`out` written, not read) by `plan` (one of LOW_PLANS); a failing C++ call reruns through aten. A
    plan whose kernel cannot serve these operands here (threads where oneDNN's bf16 matmul is not usable: an AVX2-only
    CPU) runs the whole product instead: a plan read from a cache or forced never runs on a guess.
    `scratch`: where the transpose plan copies a (`row_major`), else a block of its own."""
    if plan == "transpose":  # a already row-major (or not bf16): nothing to copy, the product's own plan
        ac = guarded("transpose", "c++", lambda: row_major(a, scratch), a.contiguous) if transpose_available(a) else a
        inner = low_plan(ac, b) if _low_cpu(ac, b, out) and ac.shape[0] > 32 else "whole"
        mm_plan(ac, b, out, "whole" if inner == "transpose" else inner)
    elif plan == "threads" and thread_rows_available(a, b, out):  # its contract met here, else the whole product
        guarded("gemm", "onednn_rows", lambda: mm_thread_rows(a, b, out), lambda: torch.mm(a, b, out=out))
    elif plan == "blocks":
        mm_row_blocks(a, b, out)
    else:
        torch.mm(a, b, out=out)


def plan_runner(a: Tensor, b: Tensor, out: Tensor, plan: str) -> Callable[[], None]:
    """out = a @ b by `plan` as a call to time (the plan probe, the bench's GEMM floor). The transpose plan's copy goes
    into one block allocated here, as `out` is: in a step it comes from the blocks the allocator keeps (glibc's heap
    under keep, the block cache under release). Allocated per call, the probe timed its page faults: the LM head's d
    weight (32768 x 1024 x 1024) took 67.5 ms by this plan against 69.9 whole and stayed whole; into one block 38.7
    against 52.7 (docs/design/benchmarks.md, "The transpose plan's probe")."""
    block = torch.empty(a.shape, dtype=a.dtype) if plan == "transpose" and transpose_available(a) else None
    return functools.partial(mm_plan, a, b, out, plan, block)


def _low_cpu(a: Tensor, b: Tensor, out: Tensor) -> bool:
    return (
        a.device.type == "cpu"
        and a.dtype in (torch.bfloat16, torch.float16)
        and b.dtype == a.dtype == out.dtype
        and a.dim() == b.dim() == out.dim() == 2
        and out.is_contiguous()
    )


def mm_low(a: Tensor, b: Tensor, out: Tensor) -> None:
    """out = a @ b (`out` written, not read); bf16/fp16 CPU operands by their measured plan (`low_plan`), other
    operands through `mm_into`."""
    if _low_cpu(a, b, out) and a.shape[0] > 32:
        mm_plan(a, b, out, low_plan(a, b))
    else:
        mm_into(a, b, out, accumulate=False)


def _measure_low_plans(m: int, k: int, n: int, a_t: bool, b_t: bool, dtype: torch.dtype) -> dict:
    """Seconds of each plan that applies (blocks: over ROW_BLOCK rows; threads: `thread_rows_available`; transpose:
    `transpose_available`) on random operands of these layouts: a warm-up of each, then PROBE_ROUNDS alternating timed
    calls, best of each. A plan whose first timed call took over twice the whole GEMM's best leaves the rounds (threads
    on a 16384-row weight gradient: 63 against 16 ms a call): its time stays an upper bound. 0 for a plan that does
    not apply."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(k, m, generator=g).to(dtype).t() if a_t else torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, k, generator=g).to(dtype).t() if b_t else torch.randn(k, n, generator=g).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    plans: dict[str, Callable[[], object]] = {"whole": functools.partial(torch.mm, a, b, out=out)}
    if m > ROW_BLOCK:
        plans["blocks"] = functools.partial(mm_row_blocks, a, b, out)
    if thread_rows_available(a, b, out):
        plans["threads"] = functools.partial(mm_thread_rows, a, b, out)
    if transpose_available(a):
        plans["transpose"] = plan_runner(a, b, out, "transpose")  # the product's own plan was decided first (plan_for)
    with torch.no_grad():
        best = {p: _once(fn) for p, fn in plans.items()}  # the warm-ups: oneDNN creates its primitives
        for r in range(PROBE_ROUNDS):
            for p, fn in plans.items():
                best[p] = min(best[p], _once(fn))
            if r == 0:
                plans = {p: fn for p, fn in plans.items() if p == "whole" or best[p] <= 2 * best["whole"]}
    return {f"{p}_s": best.get(p, 0.0) for p in LOW_PLANS}


_LOW_PLANS: dict[tuple[str, str], str] = {}


def _workspace(node: fx.Node) -> int:
    """The "transpose" plan's row-major copy of a bf16 a stored transposed (a weight gradient's d Y^T): at most a's
    bytes, whatever plan the shape then measures."""
    a = input_value(node, 0)
    if isinstance(a, Tensor) and a.dtype == torch.bfloat16 and a.device.type == "cpu" and _column_major(a):
        return a.numel() * a.element_size()
    return 0


@capability.on_change
def _forget() -> None:
    onednn_fp32.cache_clear()
    _PROBES.clear()
    _LOW_PLANS.clear()


SPEC = register_kernel_spec(
    KernelSpec(
        "gemm",
        gemm,
        gemm_reference,
        {"cpu": "oneDNN fp32 GEMM (at::native::mkldnn_matmul); bf16 by measured plan", "cuda": "aten (cuBLAS)"},
        {"cpu": lambda a, b, bias=None: _takes(a, b, bias)},
        ops=(
            # Its backward is graphtrain::gemm again. recompute=never keeps what the partitioner did before the
            # registry (gemm was not among recompute's deterministic ops, so it was always saved); compute-bound, like
            # aten.mm, would let recompute=full re-run it inside checkpointed layers. precision=follow: the passes that
            # insert it run after mixed precision (lower_gemm_onednn on fp32 matmuls, lower_gemm_plans on bf16 ones).
            OpDescriptor(
                "gemm",
                role=FORWARD,
                random=False,
                recompute=NEVER,
                precision=FOLLOW,
                workspace_bytes=_workspace,
                cpp=("onednn_matmul", "onednn_matmul_rows", "transpose_bf16"),
            ),
        ),
    )
)
