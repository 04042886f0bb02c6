"""graphtrain::attention: out = dropout(softmax(q @ k^T * scale + mask [+ causal]), p) @ v.

q [B, H, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] with Hkv dividing H (grouped-query attention); mask:
additive (float, broadcastable to [B, H, Sq, Sk]) or None; is_causal masks j > i (top-left, as SDPA). Fully masked rows give zeros
(as aten._safe_softmax). Outputs (out, lse [B, H, Sq] fp32, seed); backward recomputes the
probabilities from lse and regenerates the dropout mask from the seed (_common.py's hash), so
nothing of size Sq x Sk is saved.

Implementations: `attention_reference` (plain PyTorch, materialized scores: the specification);
CPU, fp32 without a mask (with dropout, or causal without): graphtrain's head-by-head C++ kernel (csrc/attention.cpp,
attn_heads_*: each thread takes whole heads and runs single-threaded BLAS GEMMs on blocks of HEADS_QB query rows,
skipping the blocks above a causal diagonal; q, k, v read through their strides); otherwise, CPU, dropout 0:
aten's flash kernel for CPU (what SDPA itself uses; never materializes [Sq, Sk]
for all heads), except bf16/fp16 over at most PROBS_MAX_KEYS_WITHOUT_DROPOUT keys, which take the next path (faster
there); CPU, dropout > 0 (fp32, bf16, fp16): batched matmuls (gemm.matmul: oneDNN for fp32 where it beats aten's
MKL path) around one C++ pass
(csrc/attention.cpp) that does scale, mask, softmax and hash-RNG dropout in place on the scores; the
[B, H, Sq, Sk] scores exist only transiently (forward: until P @ V; backward: recomputed from q
and k, one extra batched matmul), so the saved activations are q, k, v, out and lse as in flash
attention. aten's SDPA with dropout falls to its math path, which samples a Bernoulli mask and
saves the probabilities. Measured in `python -m graphtrain.bench.kernels`.
CUDA: flash-style Triton kernels (online softmax forward, dK/dV and dQ backward kernels).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.fx.node import Argument

from graphtrain.kernels import _cpu_ext
from graphtrain.kernels._common import (
    HAS_TRITON,
    check_dropout_p,
    dispatch,
    dropout_keep_mask,
    sharded_dropout_seed,
    triton_ok,
)
from graphtrain.kernels._cpu_attention import HEADS_BWD, HEADS_FWD, PROBS_FWD
from graphtrain.kernels.contract import Contract, Layout, Rule
from graphtrain.kernels.gemm import matmul
from graphtrain.kernels.registry import (
    BACKWARD,
    COMPUTE_BOUND,
    FOLLOW,
    FORWARD,
    LOW,
    KernelSpec,
    OpDescriptor,
    hint_int,
    input_value,
    register_kernel_spec,
)


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _scores(q, k, mask, scale, is_causal):
    s = torch.matmul(q.to(_acc(q)), k.to(_acc(q)).transpose(-2, -1)) * scale
    if mask is not None:
        s = s + mask.to(s.dtype)
    if is_causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _probs(s, lse, p, seed):
    pr = torch.exp(s - lse[..., None])  # lse = +inf on fully masked rows -> 0
    keep = None
    if p > 0:
        keep = dropout_keep_mask(s.numel(), p, seed, s.device).reshape(s.shape).to(s.dtype) / (1.0 - p)
    return pr, keep


def _groups(q: Tensor, k: Tensor) -> int:
    """Query heads per key/value head: 1, or more under grouped-query (multi-query) attention."""
    return q.shape[1] // k.shape[1]


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    """k or v [B, Hkv, S, D] as [B, Hkv * groups, S, D]: query head h reads head h // groups (SDPA's enable_gqa)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_groups(g: Tensor, groups: int) -> Tensor:
    """The gradient of `_repeat_kv`: [B, Hkv * groups, S, D] summed back to [B, Hkv, S, D]."""
    if groups == 1:
        return g
    b, h, s, d = g.shape
    return g.reshape(b, h // groups, groups, s, d).sum(2)


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, is_causal: bool, p: float, seed: Tensor
) -> tuple[Tensor, Tensor]:
    k, v = _repeat_kv(k, _groups(q, k)), _repeat_kv(v, _groups(q, k))
    s = _scores(q, k, mask, scale, is_causal)
    lse = torch.logsumexp(s, -1)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    pr, keep = _probs(s, lse, p, seed)
    if keep is not None:
        pr = pr * keep
    return torch.matmul(pr, v.to(pr.dtype)).to(q.dtype), lse.to(torch.float32 if q.dtype != torch.float64 else q.dtype)


def attention_backward_reference(dout, q, k, v, mask, out, lse, scale, is_causal, p, seed):
    groups = _groups(q, k)
    if groups > 1:
        dq, dk, dv = attention_backward_reference(
            dout, q, _repeat_kv(k, groups), _repeat_kv(v, groups), mask, out, lse, scale, is_causal, p, seed
        )
        return dq, _sum_groups(dk, groups).to(k.dtype), _sum_groups(dv, groups).to(v.dtype)
    acc = _acc(q)
    s = _scores(q, k, mask, scale, is_causal)
    pr, keep = _probs(s, lse.to(acc), p, seed)
    do = dout.to(acc)
    pd = pr * keep if keep is not None else pr
    dv = pd.transpose(-2, -1) @ do
    dp = do @ v.to(acc).transpose(-2, -1)
    if keep is not None:
        dp = dp * keep
    delta = (do * out.to(acc)).sum(-1, keepdim=True)
    ds = pr * (dp - delta)
    dq = (ds @ k.to(acc)) * scale
    dk = (ds.transpose(-2, -1) @ q.to(acc)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _mask4d(mask: Tensor | None, q: Tensor, k: Tensor) -> Tensor | None:
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


SHAPES = Contract(
    "attention",
    ("q", "k", "v"),
    rules=(
        Rule("q.dim() == 4 && k.dim() == 4 && v.dim() == 4", "q, k and v must be [batch, heads, seq, head_dim]"),
        Rule("k.size(0) == q.size(0) && v.size(0) == q.size(0)", "q, k and v must have one batch size"),
        Rule(
            "k.size(1) > 0 && v.size(1) == k.size(1) && q.size(1) % k.size(1) == 0",
            "k and v must have the same number of heads, which divides q's (grouped-query attention)",
        ),
        Rule("v.size(2) == k.size(2) && k.size(3) == q.size(3)", "k and v must have one length, and k q's head size"),
    ),
)
"""The op's own contract, on every path: graphtrain::attention is reached from the public `attention`, from fusion
passes and from torch.ops directly, and aten's CPU flash kernel checks none of it (a v shorter than k was read past
its end). Not a C++ entry point's: checked in Python by the op and its fake (`_check_shapes`)."""


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    if any(isinstance(d, torch.SymInt) for t in (q, k, v) for d in (*t.shape, *t.stride())):
        return  # a fake under dynamic shapes: reading a symbol would specialize the graph; the run-time call checks
    why = SHAPES.violation(q, k, v)
    if why is not None:
        raise ValueError(f"graphtrain::{why}; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def _unit_d(t: Tensor) -> Tensor:
    """t with unit stride in its last dim: aten's CPU flash kernel assumes it (F.scaled_dot_product_attention makes
    its inputs so before it calls the kernel); with a strided D it returned NaN or run-to-run varying numbers."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _cpu_flash_ok(q, k, v, mask, p) -> bool:
    """aten's CPU flash kernel: no dropout, fp32 or bf16, one head size for q, k and v (it raises otherwise)."""
    return (
        p == 0
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and (mask is None or mask.dtype == q.dtype)
        and v.shape[-1] == q.shape[-1]
    )


PROBS_MAX_KEYS_WITHOUT_DROPOUT = 512
"""bf16 and fp16 attention without dropout takes the batched-matmul path up to this many keys, aten's flash kernel
beyond. Forward + backward in bf16 on the 2-core Zen 4 (family 25 model 17), [B, H, S, 64] read through HF's
[B, S, H, D] strides, flash against batched matmuls: Llama mini's [16, 4 (2 kv), 128] 13.9 against 9.0 ms causal
and 14.8 against 5.9 non-causal; [8, 12, 128] 25.9 against 17.3 and 25.7 against 12.0; [4, 8, 512] 59.5 against
31.4 and 55.4 against 39.8; [2, 8, 1024] 66.0 against 90.2 and 86.4 against 96.5. aten's flash kernel runs bf16 GEMMs
on small tiles; the batched path runs three batched GEMMs a direction on whole [Sq, Sk] blocks, whose scores it
materializes (`_cpu_scores_bytes`: 2 MiB at Llama mini's shape, 16 MiB at [4, 8, 512]). In fp32 the batched path
is no faster than flash (8.8 against 8.9 ms at Llama mini's shape) and the head-by-head kernel is faster than both,
so fp32 keeps its paths."""


def _probs_without_dropout(dtype: torch.dtype, keys: int) -> bool:
    """Whether attention without dropout in `dtype` over `keys` keys runs the batched-matmul path (no flash)."""
    return dtype in (torch.bfloat16, torch.float16) and keys <= PROBS_MAX_KEYS_WITHOUT_DROPOUT


def _cpu_cpp_ok(q, k, v, mask, p) -> bool:
    """The batched-matmul path: with dropout, and bf16/fp16 without it up to PROBS_MAX_KEYS_WITHOUT_DROPOUT keys. Its
    C++ pass must take the scores and mask `_cpu_fwd` gives it (_cpu_attention.py PROBS_FWD; PROBS_BWD adds only
    what `_cpu_bwd` derives from them)."""
    if not (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and (mask is None or mask.dtype == q.dtype)
        and q.dim() == 4
        and k.dim() == 4
        and (p > 0 or _probs_without_dropout(q.dtype, k.shape[2]))
    ):
        return False
    B, H, Sq = q.shape[:3]
    m = _mask4d(mask, q, k)
    scores = Layout.contiguous((B * H, Sq, k.shape[2]), q.dtype)
    return (
        PROBS_FWD.holds(scores, m if m is not None else Layout((0,), (1,), q.dtype), H) and _cpu_ext.load() is not None
    )


HEADS_QB = 64
"""Query rows per block in the head-by-head C++ kernel (csrc/attention.cpp, attn_heads_*): blocks above a causal diagonal
are skipped whole. [8, 8, 128, 64] forward + backward on the 2-core Zen 4: 7.6 ms at 32 rows, 7.1 at 64, 8.2 at 128."""


HEADS_MAX_KEYS_WITHOUT_DROPOUT = 2048
"""Without dropout, aten's flash kernel takes over from this many keys: forward + backward, causal, [1, 8, S, 64] on
the 2-core Zen 4, head by head 135 against 143 ms at 2048 keys and 531 against 491 ms at 4096. With dropout the
alternative materializes [B*H, Sq, Sk] scores, so the head-by-head kernel has no such bound."""


def _cpu_heads_ok(q, k, v, mask, p, causal) -> bool:
    """The head-by-head C++ kernel takes fp32 CPU attention without a mask with at least as many key/value heads
    (B * Hkv: its backward runs one per thread) as threads (fewer would leave threads idle): with dropout always;
    without, only causal attention up to HEADS_MAX_KEYS_WITHOUT_DROPOUT keys. Its gain over aten's flash kernel is the
    blocks above the diagonal it skips: non-causal, forward + backward on the 2-core Zen 4, [8, 4, 197, 64] (ViT)
    9.2 against 9.3 ms alone and 11.5 against 10.5 ms a layer inside HF ViT's step (`torch.profiler`). And only where
    its contract holds (_cpu_attention.py HEADS_FWD, HEADS_BWD: shapes, grouped-query head counts, 32-bit BLAS
    dimensions) for the layouts it will be given (`_blas_layout`)."""
    if not p and (not causal or k.dim() < 3 or k.shape[2] > HEADS_MAX_KEYS_WITHOUT_DROPOUT):
        return False
    if mask is not None or q.device.type != "cpu" or q.dim() != 4 or k.dim() != 4:
        return False
    if q.shape[0] * k.shape[1] < torch.get_num_threads():
        return False
    q_, k_, v_ = (_blas_layout(t) for t in (q, k, v))
    out = Layout.contiguous((*q.shape[:3], v.shape[-1]), q.dtype).with_strides(_strides_as(q, v.shape[-1]))
    if not HEADS_FWD.holds(q_, k_, v_, out, HEADS_QB):
        return False
    lse = Layout.contiguous(q.shape[:3], torch.float32)
    grads = (Layout.contiguous(t.shape, t.dtype).with_strides(_strides_as(t, t.shape[-1])) for t in (q, k, v))
    if not HEADS_BWD.holds(out, q_, k_, v_, out, lse, *grads, HEADS_QB):
        return False
    mod = _cpu_ext.load()
    return mod is not None and mod.attn_heads_available()


def _blas_ready(t: Tensor) -> bool:
    """BLAS reads t's rows in place: unit stride in D and a row stride of at least D (an expanded, stride-0 sequence
    or an overlapping view is no BLAS matrix)."""
    return t.stride(-1) == 1 and t.stride(-2) >= max(1, t.shape[-1])


def _blas_layout(t: Tensor) -> Layout:
    """t's layout as the head-by-head kernel receives it (`_for_blas`)."""
    return Layout.of(t) if _blas_ready(t) else Layout.contiguous(t.shape, t.dtype, t.device.type)


def _for_blas(t: Tensor) -> Tensor:
    """t, or a dense copy of it with canonical strides: `.contiguous()` would return a tensor torch deems contiguous
    as it is, keeping a size-1 dim's stride (a [1, 2, 1, 1] v of strides (2, 1, 2, 2)), which the kernel's contract
    refuses; the gate evaluates the contract on the canonical layout (`_blas_layout`)."""
    return t if _blas_ready(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _heads_last(t: Tensor) -> bool:
    """t's memory runs [B, S, H, D] and it is viewed as [B, H, S, D] (how models split heads: view, then
    transpose(1, 2), often of a slice of a fused q/k/v projection): its sequence stride is the larger."""
    return t.dim() == 4 and t.shape[1] > 1 and t.shape[2] > 1 and t.stride(1) < t.stride(2)


def _strides_as(t: Tensor, last: int) -> tuple[int, int, int, int]:
    """The strides of a [B, H, S, last] tensor in t's layout: a dense [B, S, H, last] viewed as [B, H, S, last] when
    t's memory runs that way (`_heads_last`), else contiguous. The op's outputs (out like q; dq, dk, dv like q, k, v)
    are laid out so: the model's merge of the heads (transpose(1, 2), reshape) is then a view, and so are the
    gradients' way back to the projections."""
    _, H, S = t.shape[:3]
    return (S * H * last, last, H * last, 1) if _heads_last(t) else (H * S * last, S * last, last, 1)


def _empty_as(t: Tensor, last: int) -> Tensor:
    """An empty [B, H, S, last] tensor in t's layout (`_strides_as`)."""
    return t.new_empty_strided((*t.shape[:3], last), _strides_as(t, last))


def _as(x: Tensor, t: Tensor, last: int) -> Tensor:
    """x in t's layout (`_strides_as`), copied where an implementation returned another. The strides are compared
    without allocating: this runs on every call of the op."""
    return x if x.stride() == _strides_as(t, last) else _empty_as(t, last).copy_(x)


def _supports_cpu(q, k, v, mask=None, scale=None, is_causal=False, p=0.0) -> bool:
    return _cpu_flash_ok(q, k, v, mask, p) or _cpu_cpp_ok(q, k, v, mask, p)


def _supports_triton(q, k, v, mask=None, *rest) -> bool:
    return HAS_TRITON and triton_ok(q, k, v, mask) and q.shape[-1] <= 256 and v.shape[-1] <= 256


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def _by_kv_head(t: Tensor, kv_heads: int) -> Tensor:
    """q (or d out) [B, H, S, D] as [B * Hkv, groups * S, D]: the query heads that read one key/value head stacked
    into one matrix. The batched path multiplies them by that head's k and v once, with no repeated copy of k and v
    under grouped-query attention, and their scores are [B * H, S, Sk] in memory as without groups, which the C++
    pass takes as they are. The products with the stacked rows' transposes (d k, d v) sum over the groups inside the
    GEMM."""
    return t.reshape(t.shape[0] * kv_heads, -1, t.shape[-1])


def _cpu_fwd(q, k, v, mask, scale, is_causal, p, seed):
    B, H, Sq, _ = q.shape
    Sk, Hkv = k.shape[2], k.shape[1]
    m = _mask4d(mask, q, k)
    s = matmul(_by_kv_head(q, Hkv), _flat(k).transpose(1, 2)).contiguous()
    probs, lse = _cpu_ext.load().attn_probs_fwd(
        s.view(B * H, Sq, Sk), m if m is not None else q.new_empty(0), H, scale, is_causal, p, int(seed.item())
    )
    out = matmul(probs.view(B * Hkv, -1, Sk), _flat(v))
    return out.reshape(B, H, Sq, v.shape[-1]), lse.reshape(B, H, Sq)


def _cpu_bwd(dout, q, k, v, mask, out, lse, scale, is_causal, p, seed):
    B, H, Sq = q.shape[:3]
    Sk, Hkv = k.shape[2], k.shape[1]
    m = _mask4d(mask, q, k)
    qf, kf, vf, dof = _by_kv_head(q, Hkv), _flat(k), _flat(v), _by_kv_head(dout, Hkv)
    s = matmul(qf, kf.transpose(1, 2)).contiguous()
    dp = matmul(dof, vf.transpose(1, 2)).contiguous()
    # rowsum(dO * O) = rowsum(P * dP); bf16/fp16: the kernel computes it from each rounded row (csrc/attention.cpp)
    delta = (
        (dout.float() * out.float()).sum(-1).reshape(-1, Sq).contiguous()
        if q.dtype == torch.float32
        else q.new_empty(0, dtype=torch.float32)
    )
    _cpu_ext.load().attn_probs_bwd(
        s.view(B * H, Sq, Sk),
        dp.view(B * H, Sq, Sk),
        m if m is not None else q.new_empty(0),
        lse.reshape(-1, Sq).contiguous(),
        delta,
        H,
        scale,
        is_causal,
        p,
        int(seed.item()),
    )
    dv = matmul(s.transpose(1, 2), dof)  # s now holds the dropped probabilities, dp holds dS * scale
    dq = matmul(dp, kf)
    dk = matmul(dp.transpose(1, 2), qf)
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


@torch.library.custom_op("graphtrain::attention", mutates_args=())
def _attention_op(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, is_causal: bool, p: float
) -> tuple[Tensor, Tensor, Tensor]:
    _check_shapes(q, k, v)
    # Salted with the tp rank under tensor parallelism (each rank's heads differ: see _common.py); the op
    # returns the salted seed, so backward regenerates the same mask.
    seed = sharded_dropout_seed()

    def triton_path():
        # import cost: the Triton kernels (and the torch shims they need) load only where a CUDA path runs
        from graphtrain.kernels._attention_triton import attention_fwd_triton

        groups = _groups(q, k)  # the Triton kernels read one key/value head per query head
        return attention_fwd_triton(
            q, _repeat_kv(k, groups), _repeat_kv(v, groups), _mask4d(mask, q, k), scale, is_causal, p, int(seed.item())
        )

    def flash():  # returns a [B, S, H, D]-strided view; made contiguous below
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _unit_d(q), _unit_d(k), _unit_d(v), 0.0, is_causal, attn_mask=_mask4d(mask, q, k), scale=scale
        )[:2]

    def heads():
        o = _empty_as(q, v.shape[-1])
        return o, _cpu_ext.load().attn_heads_fwd(
            _for_blas(q), _for_blas(k), _for_blas(v), o, scale, is_causal, p, int(seed.item()), HEADS_QB
        )

    out, lse = dispatch(
        "attention",
        [
            ("triton", _supports_triton(q, k, v, mask), triton_path),
            ("c++ heads", _cpu_heads_ok(q, k, v, mask, p, is_causal), heads),
            # before flash: it takes p = 0 only in bf16/fp16 over few keys, where it beats flash
            ("c++", _cpu_cpp_ok(q, k, v, mask, p), lambda: _cpu_fwd(q, k, v, mask, scale, is_causal, p, seed)),
            ("cpu flash", _cpu_flash_ok(q, k, v, mask, p), flash),
        ],
        lambda: attention_reference(q, k, v, mask, scale, is_causal, p, seed),
    )
    return _as(out, q, v.shape[-1]), lse.contiguous(), seed


@_attention_op.register_fake
def _(q, k, v, mask, scale, is_causal, p):
    _check_shapes(q, k, v)
    B, H, Sq, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return (_empty_as(q, v.shape[-1]), q.new_empty(B, H, Sq, dtype=lse_dtype), torch.empty(1, dtype=torch.int64))


@torch.library.custom_op("graphtrain::attention_backward", mutates_args=())
def _attention_backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    out: Tensor,
    lse: Tensor,
    seed: Tensor,
    scale: float,
    is_causal: bool,
    p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_shapes(q, k, v)

    def triton_path():
        # import cost: as in the forward
        from graphtrain.kernels._attention_triton import attention_bwd_triton

        groups = _groups(q, k)
        dq, dk, dv = attention_bwd_triton(
            dout,
            q,
            _repeat_kv(k, groups),
            _repeat_kv(v, groups),
            _mask4d(mask, q, k),
            out,
            lse,
            scale,
            is_causal,
            p,
            int(seed.item()),
        )
        return dq, _sum_groups(dk, groups), _sum_groups(dv, groups)

    def flash():
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(),
            _unit_d(q),
            _unit_d(k),
            _unit_d(v),
            _unit_d(out),
            lse,
            0.0,
            is_causal,
            attn_mask=_mask4d(mask, q, k),
            scale=scale,
        )

    def heads():
        grads = _empty_as(q, q.shape[-1]), _empty_as(k, k.shape[-1]), _empty_as(v, v.shape[-1])
        _cpu_ext.load().attn_heads_bwd(
            _for_blas(dout),
            _for_blas(q),
            _for_blas(k),
            _for_blas(v),
            _for_blas(out),
            lse.contiguous(),
            *grads,
            scale,
            is_causal,
            p,
            int(seed.item()),
            HEADS_QB,
        )
        return grads

    dq, dk, dv = dispatch(
        "attention_backward",
        [
            ("triton", _supports_triton(q, k, v, mask), triton_path),
            ("c++ heads", _cpu_heads_ok(q, k, v, mask, p, is_causal), heads),
            (
                "c++",
                _cpu_cpp_ok(q, k, v, mask, p),
                lambda: _cpu_bwd(dout, q, k, v, mask, out, lse, scale, is_causal, p, seed),
            ),
            ("cpu flash", _cpu_flash_ok(q, k, v, mask, p), flash),
        ],
        lambda: attention_backward_reference(dout, q, k, v, mask, out, lse, scale, is_causal, p, seed),
    )
    return _as(dq, q, q.shape[-1]), _as(dk, k, k.shape[-1]), _as(dv, v, v.shape[-1])


@_attention_backward_op.register_fake
def _(dout, q, k, v, mask, out, lse, seed, scale, is_causal, p):
    return _empty_as(q, q.shape[-1]), _empty_as(k, k.shape[-1]), _empty_as(v, v.shape[-1])


def _setup(ctx, inputs, output):
    q, k, v, mask, scale, is_causal, p = inputs
    out, lse, seed = output
    ctx.save_for_backward(q, k, v, mask, out, lse, seed)
    ctx.args = (scale, is_causal, p)


def _backward(ctx, dout, _dlse, _dseed):
    q, k, v, mask, out, lse, seed = ctx.saved_tensors
    dq, dk, dv = torch.ops.graphtrain.attention_backward(dout, q, k, v, mask, out, lse, seed, *ctx.args)
    return dq, dk, dv, None, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    training: bool = True,
) -> Tensor:
    """Fused attention on [B, H, S, D] tensors. mask: additive float or bool (True = attend), no gradient.
    k and v may have fewer heads than q, a divisor of its count (grouped-query or multi-query attention: query head
    h reads key/value head h // (H / Hkv), as SDPA's enable_gqa)."""
    check_dropout_p(dropout_p, "attention")
    _check_shapes(q, k, v)
    if mask is not None:
        if mask.requires_grad:
            raise ValueError(
                "attention: a mask that requires grad (learned bias) is not supported; use the unfused ops for it"
            )
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        else:
            mask = mask.to(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.graphtrain.attention(q, k, v, mask, scale, bool(is_causal), float(dropout_p) if training else 0.0)[
        0
    ]


def _cpu_scores_bytes(qv: Tensor, kv: Tensor, mask: Argument, p: Argument, causal: Argument, copies: int) -> int:
    """What the CPU paths allocate inside the op, invisible to the graph: the head-by-head kernel (fp32, no mask, with
    dropout or causal: `_cpu_heads_ok`) `copies` [HEADS_QB, Sk] blocks per thread; the batched-matmul path (dropout,
    or bf16/fp16 over few keys: `_cpu_cpp_ok`) [B*H, Sq, Sk] scores (forward: one buffer the probabilities
    overwrite; backward: scores and d-probabilities). The CPU flash kernel (no dropout, a mask) and the Triton
    kernels work in tiles."""
    if qv.device.type != "cpu":
        return 0
    sk = hint_int(kv.shape[2])
    if mask is None and qv.dtype == torch.float32 and (p or causal):
        return copies * torch.get_num_threads() * HEADS_QB * sk * 4
    if not p and not _probs_without_dropout(qv.dtype, sk):
        return 0
    b, h, sq = (hint_int(d) for d in qv.shape[:3])
    return copies * b * h * sq * sk * qv.element_size()


def _arg(n: torch.fx.Node, i: int, name: str, default: Argument) -> Argument:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _forward_workspace(n: torch.fx.Node) -> int:
    return _cpu_scores_bytes(
        input_value(n, 0),
        input_value(n, 1),
        _arg(n, 3, "mask", None),
        _arg(n, 6, "p", 0.0),
        _arg(n, 5, "is_causal", False),
        1,
    )


def _backward_workspace(n: torch.fx.Node) -> int:
    return _cpu_scores_bytes(
        input_value(n, 1),
        input_value(n, 2),
        _arg(n, 4, "mask", None),
        _arg(n, 10, "p", 0.0),
        _arg(n, 9, "is_causal", False),
        2,
    )


SPEC = register_kernel_spec(
    KernelSpec(
        "attention",
        attention,
        attention_reference,
        {
            "cpu": "c++ head by head (fp32, no mask) / aten bmm + c++ softmax-dropout (p>0; bf16/fp16 up to 512 keys) / "
            "aten flash (p=0)",
            "cuda": "triton flash",
        },
        {"cpu": _supports_cpu, "cuda": _supports_triton},
        ops=(
            # random: draws its dropout seed inside (never recomputed: it has no seeded variant yet, so it is saved)
            OpDescriptor(
                "attention",
                role=FORWARD,
                random=True,
                recompute=COMPUTE_BOUND,
                precision=LOW,
                workspace_bytes=_forward_workspace,
                cpp=("attn_heads_available", "attn_heads_fwd", "attn_probs_fwd", "onednn_matmul"),
            ),
            OpDescriptor(
                "attention_backward",
                role=BACKWARD,
                random=False,
                recompute=COMPUTE_BOUND,
                precision=FOLLOW,
                workspace_bytes=_backward_workspace,
                cpp=("attn_heads_bwd", "attn_probs_bwd", "onednn_matmul"),
            ),
        ),
    )
)
