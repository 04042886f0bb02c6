"""graphtrain's fused ops: each a `torch.ops.graphtrain.<name>` custom op with its own backward.

Every op (one file each) has a plain-PyTorch reference (the specification and fallback), a CPU path
where one measurably wins, a Triton path for CUDA and an autograd rule, registered once with
torch.library so AOTAutograd, both providers and torch.compile understand it. `KERNELS` (registry.py) says
which ops exist, which implementation serves each device, and what the rest of graphtrain needs to know
about each custom op (`OPS`, `op_descriptor`: random, recompute cost, precision policy, workspace bytes, C++
functions); a checker claims an input only where the fast path supports it, else the reference runs.
Importing this works without triton installed.
"""

from graphtrain.kernels import _cpu_ext, capability
from graphtrain.kernels._common import HAS_TRITON, runtime_fallbacks
from graphtrain.kernels.attention import attention
from graphtrain.kernels.bias_dropout_add import bias_dropout_add
from graphtrain.kernels.bias_gelu import bias_gelu
from graphtrain.kernels.cross_entropy import cross_entropy
from graphtrain.kernels.gemm import WIN_MARGIN, gemm, gemm_probe, gemm_probe_ran, onednn_fp32, onednn_gemm_wins
from graphtrain.kernels.layer_norm import layer_norm
from graphtrain.kernels.linear_cross_entropy import linear_cross_entropy
from graphtrain.kernels.registry import KERNELS, OPS, KernelSpec, OpDescriptor, op_descriptor
from graphtrain.kernels.rms_norm import rms_norm


def implementation_for(name: str, device: str, *args) -> str:
    """Which implementation `name` uses on `device` for these arguments ('reference' if no fast path)."""
    if name not in KERNELS:
        raise ValueError(f"unknown fused op {name!r}; known: {', '.join(sorted(KERNELS))}")
    return KERNELS[name].implementation_for(device, *args)


def capabilities() -> dict:
    """What this machine offers graphtrain's kernels and which implementation each capability selects (the
    report prints it): CPU and ISA, the C++ kernels' build, oneDNN's fp32 GEMM (chosen or not, and why),
    native bf16, Triton, CUDA, and every fast path that failed at run time and fell back to its reference."""
    c = capability.cpu()
    dnn_ok, dnn_why = onednn_fp32()
    if not dnn_ok:
        gemm = f"aten (MKL/OpenBLAS): oneDNN's fp32 GEMM unavailable: {dnn_why}"
    elif gemm_probe_ran():
        p = gemm_probe()
        gemm = (
            f"{'oneDNN' if onednn_gemm_wins() else 'aten'}: probe oneDNN {p['onednn']:.0f} vs aten "
            f"{p['aten']:.0f} GFLOP/s over {len(p['shapes'])} layer shapes{' (cached)' if p.get('cached') else ''}"
            f"; oneDNN is used when {WIN_MARGIN}x faster (inside graphtrain's kernels; the step's own GEMMs are "
            f"probed shape by shape, see lower_gemm_onednn)"
        )
    else:
        gemm = "aten until the first fp32 GEMM probe (oneDNN's fp32 path is available)"
    level = _cpu_ext.isa_level()
    err = _cpu_ext.build_error(level)
    cpp = _cpu_ext.loaded_variant() or (f"not built: {err}" if err else f"c++ ({level} build), not loaded yet")
    bf_ok, bf_why = capability.bf16_is_fast("cpu")
    return dict(
        cpu=c.name,
        arch=c.arch,
        torch_isa=c.torch_isa,
        isa=c.isa,
        simulated=c.simulated,
        cpp_kernels=cpp if not err else f"reference ops (c++ not built: {err[:200]})",
        cpu_fp32_gemm=gemm,
        onednn_fp32=dict(ok=dnn_ok, why=dnn_why),
        native_bf16=dict(ok=bf_ok, why=bf_why),
        triton=dict(zip(("ok", "why"), capability.triton())),
        cuda=dict(zip(("ok", "why"), capability.cuda())),
        runtime_fallbacks=[
            dict(op=f.op, implementation=f.implementation, reason=f.reason) for f in runtime_fallbacks()
        ],
    )


__all__ = [
    "capabilities",
    "HAS_TRITON",
    "KERNELS",
    "KernelSpec",
    "OPS",
    "OpDescriptor",
    "op_descriptor",
    "attention",
    "bias_dropout_add",
    "bias_gelu",
    "cross_entropy",
    "gemm",
    "implementation_for",
    "layer_norm",
    "linear_cross_entropy",
    "rms_norm",
]
