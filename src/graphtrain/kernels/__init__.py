"""graphtrain's fused ops: each a `torch.ops.graphtrain.<name>` custom op with its own backward.

Every op (one file each) has a plain-PyTorch reference (the specification and fallback), a CPU path
where one measurably wins, a Triton path for CUDA and an autograd rule, registered once with
torch.library so AOTAutograd, both providers and torch.compile understand it. `KERNELS` says which
ops exist and which implementation serves each device; a checker claims an input only where the
fast path supports it, else the reference runs. Importing this works without triton installed.
"""
from graphtrain.kernels._common import HAS_TRITON, KERNELS, KernelSpec
from graphtrain.kernels.attention import attention
from graphtrain.kernels.bias_dropout_add import bias_dropout_add
from graphtrain.kernels.bias_gelu import bias_gelu
from graphtrain.kernels.cross_entropy import cross_entropy
from graphtrain.kernels.gemm import gemm
from graphtrain.kernels.layer_norm import layer_norm
from graphtrain.kernels.linear_cross_entropy import linear_cross_entropy
from graphtrain.kernels.rms_norm import rms_norm


def implementation_for(name: str, device: str, *args) -> str:
    """Which implementation `name` uses on `device` for these arguments ('reference' if no fast path)."""
    if name not in KERNELS:
        raise ValueError(f"unknown fused op {name!r}; known: {', '.join(sorted(KERNELS))}")
    return KERNELS[name].implementation_for(device, *args)


__all__ = ["HAS_TRITON", "KERNELS", "KernelSpec", "attention", "bias_dropout_add", "bias_gelu", "cross_entropy",
           "gemm", "implementation_for", "layer_norm", "linear_cross_entropy", "rms_norm"]
