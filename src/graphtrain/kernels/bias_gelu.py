"""graphtrain::bias_gelu: y = gelu(x + bias), erf ("none") or tanh ("tanh") form; bias optional.

Layers: `bias_gelu_reference` (plain PyTorch, the spelled-out formulas); CPU path: the tanh form in graphtrain's
C++ kernel (`_cpu_ext.gelu_tanh_fwd/bwd`: bias added in the same pass, a vectorized exp-based tanh; aten's and
Inductor's tanh are Sleef's 1-ulp tanhf, 1.8-2.4 ms against 1.0-1.1 ms for a [2048, 1024] fp32 forward or
backward on the 2-core Zen 4), the erf form in aten.gelu / aten.gelu_backward on x + bias. HF GPT-2's tanh GELU
arrives as 8 elementwise ops, each a memory pass with its own saved tensor, and becomes one op that saves only
the pre-activation. CUDA: Triton elementwise kernels (fp32 compute). Backward recomputes x + bias instead of
saving it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from graphtrain.kernels import _cpu_ext, capability
from graphtrain.kernels._common import HAS_TRITON, dense_empty, dispatch, tl, triton, triton_ok
from graphtrain.kernels._cpu_ext import GELU_TANH_BWD, GELU_TANH_FWD
from graphtrain.kernels.gemm import _time
from graphtrain.kernels.registry import (
    BACKWARD,
    CHEAP,
    FOLLOW,
    FORWARD,
    KernelSpec,
    OpDescriptor,
    no_workspace,
    register_kernel_spec,
)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def bias_gelu_reference(x: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    z = x + bias if bias is not None else x
    zf = z.double() if z.dtype == torch.float64 else z.float()
    if approximate == "tanh":
        y = 0.5 * zf * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (zf + 0.044715 * zf.pow(3))))
    else:
        y = 0.5 * zf * (1.0 + torch.erf(zf / math.sqrt(2.0)))
    return y.to(x.dtype)


def bias_gelu_backward_reference(dy: Tensor, x: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    z = x + bias if bias is not None else x
    zf = z.double() if z.dtype == torch.float64 else z.float()
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (zf + 0.044715 * zf.pow(3))
        t = torch.tanh(inner)
        d = 0.5 * (1 + t) + 0.5 * zf * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * zf * zf)
    else:
        d = 0.5 * (1 + torch.erf(zf / math.sqrt(2.0))) + zf * torch.exp(-0.5 * zf * zf) / math.sqrt(2 * math.pi)
    return (dy.to(zf.dtype) * d).to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _tanh(u):
        return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)

    @triton.jit
    def _gelu_kernel(
        X, B, DY, OUT, numel, N, HAS_B: tl.constexpr, TANH: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < numel
        z = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_B:
            z += tl.load(B + offs % N, mask=m, other=0.0).to(tl.float32)
        if TANH:
            t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
            if BACKWARD:
                d = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * 0.7978845608028654 * (1 + 0.134145 * z * z)
            else:
                y = 0.5 * z * (1 + t)
        else:
            if BACKWARD:
                d = 0.5 * (1 + tl.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
            else:
                y = 0.5 * z * (1 + tl.erf(z * 0.7071067811865476))
        if BACKWARD:
            y = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32) * d
        tl.store(OUT + offs, y.to(OUT.dtype.element_ty), mask=m)


def _gelu_triton(x, bias, approximate, dy=None):
    xc = x.contiguous()
    out = torch.empty_like(xc)
    numel = xc.numel()
    block = 1024
    _gelu_kernel[(triton.cdiv(numel, block),)](
        xc,
        bias if bias is not None else xc,
        dy.contiguous() if dy is not None else xc,
        out,
        numel,
        x.shape[-1] if x.dim() else 1,
        HAS_B=bias is not None,
        TANH=approximate == "tanh",
        BACKWARD=dy is not None,
        BLOCK=block,
    )
    return out


def _supports_triton(x, bias=None, *rest) -> bool:
    return triton_ok(x, bias)


def _supports_cpu(x, bias=None, *rest) -> bool:
    return x.device.type == "cpu" and x.dtype != torch.float64  # fp64: reference (exact formulas, gradcheck)


def cpp_tanh_ok(x: Tensor, bias: Tensor | None, approximate: str) -> bool:
    """The C++ tanh-form kernel takes this call (CPU, fp32/bf16/fp16, a bias of the last dim's size or none) and
    measured faster than aten's on this machine (`gelu_tanh_probe`)."""
    return (
        approximate == "tanh"
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and (bias is None or bias.dim() == 1)
        and GELU_TANH_FWD.holds(x, bias)
        and _cpu_ext.load() is not None
        and gelu_tanh_probe()["cpp_wins"]
    )


_PROBE: dict[str, dict] = {}


def gelu_tanh_probe() -> dict:
    """Seconds of the C++ tanh-form GELU and of aten's (Sleef's tanh, as Inductor's kernel) on a [512, 2048] fp32
    activation, forward plus backward, best of up to 5 calls each (30 ms at most per call kind): the C++ kernel is
    used where it is at least WIN_MARGIN faster. Measured once per machine (about 20 ms on the Zen 4;
    capability.cached_probe): its speed rests on what gcc vectorized for this CPU's build, and a build that could
    not vectorize (a baseline ISA) loses."""
    key = capability.machine_key()
    if key not in _PROBE:

        def measure() -> dict:
            mod = _cpu_ext.load()
            g = torch.Generator().manual_seed(0)
            x, b, dy = (
                torch.randn(512, 2048, generator=g) * 2,
                torch.randn(2048, generator=g),
                torch.randn(512, 2048, generator=g),
            )
            with torch.no_grad():
                cpp = _time(lambda: mod.gelu_tanh_fwd(x, b), 0.03) + _time(lambda: mod.gelu_tanh_bwd(dy, x, b), 0.03)
                aten = _time(lambda: torch.ops.aten.gelu(x + b, approximate="tanh"), 0.03) + _time(
                    lambda: torch.ops.aten.gelu_backward(dy, x + b, approximate="tanh"), 0.03
                )
            return {"cpp_s": cpp, "aten_s": aten, "cpp_wins": cpp * WIN_MARGIN < aten}

        _PROBE[key] = (
            capability.cached_probe("gelu_tanh_cpp_vs_aten", measure)
            if _cpu_ext.load() is not None
            else {"cpp_wins": False, "skipped": "no C++ kernels", "cached": False}
        )
    return _PROBE[key]


WIN_MARGIN = 1.1
"""The C++ tanh GELU must beat aten's by this factor: a near tie keeps the library's (the probe is a short one)."""


def _no_bias(x: Tensor) -> Tensor:
    return x.new_empty(0)


def _check_approx(approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"bias_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


@torch.library.custom_op("graphtrain::bias_gelu", mutates_args=())
def _bias_gelu_op(x: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    return dispatch(
        "bias_gelu",
        [
            ("triton", _supports_triton(x, bias), lambda: _gelu_triton(x, bias, approximate)),
            (
                "c++",
                cpp_tanh_ok(x, bias, approximate),
                lambda: _cpu_ext.load().gelu_tanh_fwd(x, bias if bias is not None else _no_bias(x)),
            ),
            (
                "cpu",
                _supports_cpu(x, bias),
                lambda: torch.ops.aten.gelu(x + bias if bias is not None else x, approximate=approximate).contiguous(),
            ),
        ],
        lambda: bias_gelu_reference(x, bias, approximate).contiguous(),
    )


@_bias_gelu_op.register_fake
def _(x, bias, approximate):
    return dense_empty(x)


@torch.library.custom_op("graphtrain::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward_op(dy: Tensor, x: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    return dispatch(
        "bias_gelu_backward",
        [
            ("triton", _supports_triton(x, bias), lambda: _gelu_triton(x, bias, approximate, dy)),
            (
                "c++",
                cpp_tanh_ok(x, bias, approximate) and GELU_TANH_BWD.holds(dy, x, bias),
                lambda: _cpu_ext.load().gelu_tanh_bwd(dy, x, bias if bias is not None else _no_bias(x)),
            ),
            (
                "cpu",
                _supports_cpu(x, bias),
                lambda: torch.ops.aten.gelu_backward(
                    dy, x + bias if bias is not None else x, approximate=approximate
                ).contiguous(),
            ),
        ],
        lambda: bias_gelu_backward_reference(dy, x, bias, approximate).contiguous(),
    )


@_bias_gelu_backward_op.register_fake
def _(dy, x, bias, approximate):
    return dense_empty(x)


def _setup(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate
    ctx.has_b = bias is not None


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    dz = torch.ops.graphtrain.bias_gelu_backward(dy, x, bias, ctx.approximate)
    db = dz.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype) if ctx.has_b else None
    return dz, db, None


_bias_gelu_op.register_autograd(_backward, setup_context=_setup)


def bias_gelu(x: Tensor, bias: Tensor | None = None, approximate: str = "none") -> Tensor:
    """gelu(x + bias); bias of shape [x.shape[-1]] or None; approximate 'none' (erf) or 'tanh'."""
    _check_approx(approximate)
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"bias_gelu: bias must have shape ({x.shape[-1]},), got {tuple(bias.shape)}")
    return torch.ops.graphtrain.bias_gelu(x, bias, approximate)


SPEC = register_kernel_spec(
    KernelSpec(
        "bias_gelu",
        bias_gelu,
        bias_gelu_reference,
        {"cpu": "c++ (tanh form) / aten.gelu (erf form)", "cuda": "triton"},
        {"cpu": _supports_cpu, "cuda": _supports_triton},
        ops=(
            OpDescriptor(
                "bias_gelu",
                role=FORWARD,
                random=False,
                recompute=CHEAP,
                precision=FOLLOW,
                workspace_bytes=no_workspace,
                cpp=("gelu_tanh_fwd",),
            ),
            OpDescriptor(
                "bias_gelu_backward",
                role=BACKWARD,
                random=False,
                recompute=CHEAP,
                precision=FOLLOW,
                workspace_bytes=no_workspace,
                cpp=("gelu_tanh_bwd",),
            ),
        ),
    )
)
