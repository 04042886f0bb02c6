"""graphtrain::gemm: a @ b (+ bias) on 2-D tensors, with the CPU provider's own fp32 GEMM.

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
one-line C++ wrapper in _cpu_ext.py because the wheel exports the function but ships no Python binding
for fp32. It reads contiguous and transposed operands in place (no copies for the weight-gradient
product dY^T @ X), writes into a given output (chunked callers fill slices of one buffer) and can
accumulate into it (beta = 1: addmm's bias, and += without a temporary).

Other dtypes and devices (and CPUs without oneDNN) use aten.mm/addmm: bf16/fp16 CPU matmuls already
go through oneDNN there, and CUDA uses cuBLAS.
"""
from __future__ import annotations

import functools
import time
from typing import Optional

import torch
from torch import Tensor

from graphtrain.kernels import _cpu_ext
from graphtrain.kernels._common import KernelSpec, register_kernel_spec


def gemm_reference(a: Tensor, b: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    out = a @ b
    return out if bias is None else out + bias


def onednn_available() -> bool:
    """oneDNN is built into torch and the C++ wrapper compiled (no compiler: aten.mm serves)."""
    return bool(torch.backends.mkldnn.is_available()) and _cpu_ext.load() is not None


def _fp32_cpu(*ts: Optional[Tensor]) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in ts)


def _takes(a: Tensor, b: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether the oneDNN path serves these inputs: 2-D fp32 CPU operands, a bias broadcastable to the output."""
    if not (a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and _fp32_cpu(a, b, bias)):
        return False
    if bias is not None and bias.dim() > 2:
        return False
    return min(a.shape[0], a.shape[1], b.shape[1]) > 0 and onednn_available()


def gemm_onednn(a: Tensor, b: Tensor, bias: Optional[Tensor] = None, out: Optional[Tensor] = None,
                accumulate: bool = False) -> Tensor:
    """out = a @ b (+ bias) (+ out if `accumulate`) through oneDNN's fp32 GEMM; a, b 2-D (or 3-D, batched).
    `out` (contiguous) is allocated when not given. The caller checked the inputs (fp32 CPU)."""
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


def matmul(a: Tensor, b: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """a @ b (+ bias) for 2-D or batched 3-D operands, through oneDNN where `onednn_gemm_wins()` (fp32 CPU),
    else torch.matmul: graphtrain's own CPU kernels (attention, chunked linear cross-entropy) call this."""
    if (a.dim() == b.dim() and a.dim() in (2, 3) and a.shape[:-2] == b.shape[:-2] and a.shape[-1] == b.shape[-2]
            and a.numel() > 0 and b.numel() > 0 and _fp32_cpu(a, b, bias) and onednn_available()
            and onednn_gemm_wins()):
        return gemm_onednn(a, b, bias)
    return gemm_reference(a, b, bias)


@torch.library.custom_op("graphtrain::gemm", mutates_args=())
def _gemm_op(a: Tensor, b: Tensor, bias: Optional[Tensor]) -> Tensor:
    if _takes(a, b, bias):
        return gemm_onednn(a, b, bias)
    out = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    return out.contiguous()


@_gemm_op.register_fake
def _(a, b, bias):
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup(ctx, inputs, output):
    a, b, bias = inputs
    ctx.save_for_backward(a, b)
    ctx.bias_shape = None if bias is None else tuple(bias.shape)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    ga = torch.ops.graphtrain.gemm(grad, b.t(), None) if ctx.needs_input_grad[0] else None
    gb = torch.ops.graphtrain.gemm(a.t(), grad, None) if ctx.needs_input_grad[1] else None
    gbias = None
    if ctx.bias_shape is not None and ctx.needs_input_grad[2]:
        gbias = grad.sum_to_size(ctx.bias_shape) if len(ctx.bias_shape) else grad.sum()
    return ga, gb, gbias


_gemm_op.register_autograd(_backward, setup_context=_setup)


def gemm(a: Tensor, b: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """a [m, k] @ b [k, n] (+ bias broadcastable to [m, n]) as graphtrain::gemm."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gemm: a and b must be 2-D, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.dtype != b.dtype or (bias is not None and bias.dtype != a.dtype):
        raise TypeError(f"gemm: dtypes must match, got a {a.dtype}, b {b.dtype}"
                        + ("" if bias is None else f", bias {bias.dtype}"))
    return torch.ops.graphtrain.gemm(a, b, bias)


def _time(fn, reps: int) -> float:
    fn()  # warm up (oneDNN builds and caches its primitive on the first call)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=None)
def gemm_probe(m: int = 1024, k: int = 512, n: int = 512, reps: int = 5) -> dict[str, float]:
    """GFLOP/s of aten.mm (MKL) and oneDNN on one fp32 GEMM of transformer-layer size, measured once per
    process (~50 ms). `onednn_gemm_wins` reads it."""
    if not onednn_available():
        return {"aten": 0.0, "onednn": 0.0, "shape": (m, k, n)}
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).t()
    out = a.new_empty((m, n))
    flop = 2.0 * m * k * n
    with torch.no_grad():
        t_aten = _time(lambda: torch.mm(a, b, out=out), reps)
        t_dnn = _time(lambda: gemm_onednn(a, b, out=out), reps)
    return {"aten": flop / t_aten / 1e9, "onednn": flop / t_dnn / 1e9, "shape": (m, k, n)}


WIN_MARGIN = 1.15
"""oneDNN must beat aten.mm by this factor in the probe to be used: clear of timing noise, so the choice
(and with it the summation order) does not flip between runs on CPUs where the two are close."""


def onednn_gemm_wins() -> bool:
    """Whether fp32 CPU GEMMs should go through oneDNN on this machine (probed once per process)."""
    p = gemm_probe()
    return p["onednn"] > WIN_MARGIN * p["aten"] > 0


SPEC = register_kernel_spec(KernelSpec(
    "gemm", gemm, gemm_reference,
    {"cpu": "oneDNN fp32 GEMM (at::native::mkldnn_matmul)", "cuda": "aten (cuBLAS)"},
    {"cpu": lambda a, b, bias=None: _takes(a, b, bias)}))
