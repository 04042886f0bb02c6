"""graphtrain::rms_norm: y = x / sqrt(mean(x^2) + eps) * weight over the last dim.

Layers: `rms_norm_reference` (plain PyTorch, fp32 math); CPU path: aten._fused_rms_norm forward (one
vectorized pass, fp32); backward is the reference (aten has no CPU _fused_rms_norm_backward); CUDA: Triton (one row per program, fp32 compute).
Outputs (y, rstd) with rstd fp32 [rows] (fp64 for fp64 inputs), saved for backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from graphtrain.kernels._common import HAS_TRITON, dense_empty, dispatch, tl, triton, triton_ok
from graphtrain.kernels.registry import (
    BACKWARD,
    CHEAP,
    FOLLOW,
    FORWARD,
    FP32,
    KernelSpec,
    OpDescriptor,
    no_workspace,
    register_kernel_spec,
)


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm_reference(x: Tensor, weight: Tensor | None, eps: float):
    xf = x.to(_acc(x))
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    y = xf * rstd
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype), rstd.reshape(-1)


def rms_norm_backward_reference(dy, x, weight, rstd):
    n = x.shape[-1]
    rows = math.prod(x.shape[:-1])  # not reshape(-1, n): an empty last dim leaves -1 undetermined
    xf, dyf = x.to(_acc(x)).reshape(rows, n), dy.to(_acc(x)).reshape(rows, n)
    xhat = xf * rstd[:, None]
    g = dyf * weight.to(xf.dtype) if weight is not None else dyf
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyf * xhat).sum(0) if weight is not None else None
    return dx.reshape(x.shape).to(x.dtype), dw


if HAS_TRITON:

    @triton.jit
    def _rms_fwd_kernel(X, W, Y, RSTD, N, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(X + row * N + cols, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
        y = x * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=m)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _rms_bwd_kernel(DY, X, W, RSTD, DX, DW, M, N, ROWS_PER, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32) if HAS_W else tl.where(m, 1.0, 0.0)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        for r in range(0, ROWS_PER):
            row = pid * ROWS_PER + r
            if row < M:
                x = tl.load(X + row * N + cols, mask=m, other=0.0).to(tl.float32)
                dy = tl.load(DY + row * N + cols, mask=m, other=0.0).to(tl.float32)
                rstd = tl.load(RSTD + row)
                xhat = x * rstd
                g = dy * w
                dx = rstd * (g - xhat * (tl.sum(g * xhat, 0) / N))
                tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=m)
                dw += dy * xhat
        tl.store(DW + pid * N + cols, dw, mask=m)


def _supports_triton(x, weight=None, *rest) -> bool:
    return triton_ok(x, weight) and 0 < x.shape[-1] <= 65536 and x.numel() > 0


def _supports_cpu(x, *rest) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32


@torch.library.custom_op("graphtrain::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    n = x.shape[-1]

    def triton_path():
        x2 = x.reshape(-1, n).contiguous()
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        _rms_fwd_kernel[(x2.shape[0],)](
            x2,
            weight if weight is not None else x2,
            y,
            rstd,
            n,
            eps,
            HAS_W=weight is not None,
            BLOCK=triton.next_power_of_2(n),
        )
        return y.reshape(x.shape).contiguous(), rstd

    def cpu():
        y, rstd = torch.ops.aten._fused_rms_norm(x, [n], weight, eps)
        return y.contiguous(), rstd.reshape(-1).float().contiguous()

    def reference():
        y, rstd = rms_norm_reference(x, weight, eps)
        return y.contiguous(), rstd.contiguous()

    return dispatch(
        "rms_norm", [("triton", _supports_triton(x, weight), triton_path), ("cpu", _supports_cpu(x), cpu)], reference
    )


@_rms_norm_op.register_fake
def _(x, weight, eps):
    rows = math.prod(x.shape[:-1])  # one statistic per row, also for an empty last dim (what the kernels give)
    return dense_empty(x), x.new_empty(rows, dtype=_acc(x))


@torch.library.custom_op("graphtrain::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor) -> tuple[Tensor, Tensor]:
    n = x.shape[-1]

    def triton_path():
        x2, dy2 = x.reshape(-1, n).contiguous(), dy.reshape(-1, n).contiguous()
        rows = x2.shape[0]
        rows_per = triton.cdiv(rows, max(1, min(rows, 128)))
        progs = triton.cdiv(rows, rows_per)
        dx = torch.empty_like(x2)
        dw = torch.empty(progs, n, dtype=torch.float32, device=x.device)
        _rms_bwd_kernel[(progs,)](
            dy2,
            x2,
            weight if weight is not None else x2,
            rstd,
            dx,
            dw,
            rows,
            n,
            rows_per,
            HAS_W=weight is not None,
            BLOCK=triton.next_power_of_2(n),
        )
        return dx.reshape(x.shape), dw.sum(0)

    # CPU too runs the reference: aten._fused_rms_norm_backward has no CPU kernel in torch 2.13
    dx, dw = dispatch(
        "rms_norm_backward",
        [("triton", _supports_triton(x, weight), triton_path)],
        lambda: rms_norm_backward_reference(dy, x, weight, rstd),
    )
    dw = dw.to(weight.dtype) if (weight is not None and dw is not None) else x.new_zeros(n)
    return dx.contiguous(), dw.contiguous()


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd):
    return dense_empty(x), dense_empty(x, (x.shape[-1],), weight.dtype if weight is not None else None)


def _setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.has_w = weight is not None


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.graphtrain.rms_norm_backward(dy, x, weight, rstd)
    return dx, (dw if ctx.has_w else None), None


_rms_norm_op.register_autograd(_backward, setup_context=_setup)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
    """Fused RMSNorm over the last dim (weight of shape [x.shape[-1]] or None)."""
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    return torch.ops.graphtrain.rms_norm(x, weight, float(eps))[0]


SPEC = register_kernel_spec(
    KernelSpec(
        "rms_norm",
        rms_norm,
        rms_norm_reference,
        {"cpu": "aten._fused_rms_norm", "cuda": "triton"},
        {"cpu": _supports_cpu, "cuda": _supports_triton},
        ops=(
            # fp32 like layer_norm (and aten's rms_norm in the mixed-precision table): normalization statistics
            OpDescriptor(
                "rms_norm",
                role=FORWARD,
                random=False,
                recompute=CHEAP,
                precision=FP32,
                workspace_bytes=no_workspace,
                cpp=(),
            ),
            OpDescriptor(
                "rms_norm_backward",
                role=BACKWARD,
                random=False,
                recompute=CHEAP,
                precision=FOLLOW,
                workspace_bytes=no_workspace,
                cpp=(),
            ),
        ),
    )
)
