"""Flash-style Triton kernels for graphtrain::attention (CUDA; CPU tensors under TRITON_INTERPRET=1).

Forward: one program per (query block, batch*head), online softmax over key blocks, fp32
accumulation, dropout from the shared hash (same mask as the reference). Backward: a dK/dV kernel
per key block and a dQ kernel per query block, both recomputing P from the saved logsumexp.

Precision: every product is a tl.dot on fp32 operands (inputs are loaded as fp32), whose default on NVIDIA GPUs
is TF32 (10-bit mantissa): fp32 attention then missed the fp32 tolerance (max abs 2e-3 on an H200, issue #48).
So fp32 inputs run IEEE fp32 dots unless the user allows TF32 for fp32 matmuls, as eager's cuBLAS does
(`torch.backends.cuda.matmul.allow_tf32` / `fp32_precision`, compat.cuda_matmul_allows_tf32); bf16 and fp16
inputs keep TF32, finer than their own rounding. `dot_precision` is the rule.
"""

from __future__ import annotations

import torch

from graphtrain.config.torch_compat import cuda_matmul_allows_tf32
from graphtrain.kernels._common import keep_threshold, tl, triton
from graphtrain.kernels.bias_dropout_add import _keep


@triton.jit
def _scores(
    q,
    k,
    M,
    b,
    h,
    offs_m,
    offs_n,
    Sq,
    Sk,
    sm0,
    sm1,
    sm2,
    sm3,
    scale,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT: tl.constexpr,
):
    s = tl.dot(q, tl.trans(k), input_precision=DOT) * scale
    valid = (offs_m[:, None] < Sq) & (offs_n[None, :] < Sk)
    if HAS_MASK:
        s += tl.load(M + b * sm0 + h * sm1 + offs_m[:, None] * sm2 + offs_n[None, :] * sm3, mask=valid, other=0.0).to(
            tl.float32
        )
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    return tl.where(valid, s, -float("inf"))


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    M,
    O,  # noqa: E741 (the attention formula's names)
    LSE,
    H,
    Sq,
    Sk,
    D,
    Dv,
    sm0,
    sm1,
    sm2,
    sm3,
    scale,
    seed,
    thr,
    dscale,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d, offs_dv = tl.arange(0, BD), tl.arange(0, BDV)
    q = tl.load(
        Q + bh * Sq * D + offs_m[:, None] * D + offs_d[None, :],
        mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < D),
        other=0.0,
    ).to(tl.float32)
    m_i = tl.full([BM], -float("inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    for start in range(0, Sk, BN):
        offs_n = start + tl.arange(0, BN)
        k = tl.load(
            K + bh * Sk * D + offs_n[:, None] * D + offs_d[None, :],
            mask=(offs_n[:, None] < Sk) & (offs_d[None, :] < D),
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            V + bh * Sk * Dv + offs_n[:, None] * Dv + offs_dv[None, :],
            mask=(offs_n[:, None] < Sk) & (offs_dv[None, :] < Dv),
            other=0.0,
        ).to(tl.float32)
        s = _scores(q, k, M, b, h, offs_m, offs_n, Sq, Sk, sm0, sm1, sm2, sm3, scale, HAS_MASK, CAUSAL, DOT)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            idx = (bh.to(tl.int64) * Sq + offs_m[:, None]) * Sk + offs_n[None, :]
            p = tl.where(_keep(seed, idx, thr), p * dscale, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT)
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, tl.where(m_i == -float("inf"), 0.0, m_i) + tl.log(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(
        O + bh * Sq * Dv + offs_m[:, None] * Dv + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=(offs_m[:, None] < Sq) & (offs_dv[None, :] < Dv),
    )
    tl.store(LSE + bh * Sq + offs_m, lse, mask=offs_m < Sq)


@triton.jit
def _probs(
    q,
    k,
    M,
    b,
    h,
    bh,
    offs_m,
    offs_n,
    LSE,
    Sq,
    Sk,
    sm0,
    sm1,
    sm2,
    sm3,
    scale,
    seed,
    thr,
    dscale,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    DOT: tl.constexpr,
):
    s = _scores(q, k, M, b, h, offs_m, offs_n, Sq, Sk, sm0, sm1, sm2, sm3, scale, HAS_MASK, CAUSAL, DOT)
    lse = tl.load(LSE + bh * Sq + offs_m, mask=offs_m < Sq, other=float("inf"))
    p = tl.exp(s - lse[:, None])
    p = tl.where(s == -float("inf"), 0.0, p)
    if DROPOUT:
        idx = (bh.to(tl.int64) * Sq + offs_m[:, None]) * Sk + offs_n[None, :]
        keep = tl.where(_keep(seed, idx, thr), dscale, 0.0)
    else:
        keep = tl.full([1, 1], 1.0, tl.float32)
    return p, keep


@triton.jit
def _bwd_kernel(
    Q,
    K,
    V,
    M,
    DO,
    LSE,
    DELTA,
    DQ,
    DK,
    DV,
    H,
    Sq,
    Sk,
    D,
    Dv,
    sm0,
    sm1,
    sm2,
    sm3,
    scale,
    seed,
    thr,
    dscale,
    HAS_MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    DROPOUT: tl.constexpr,
    FOR_DQ: tl.constexpr,
    DOT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
):
    # FOR_DQ: program owns a query block and loops over keys; else owns a key block (dK, dV).
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_d, offs_dv = tl.arange(0, BD), tl.arange(0, BDV)
    if FOR_DQ:
        offs_m = pid * BM + tl.arange(0, BM)
        q = tl.load(
            Q + bh * Sq * D + offs_m[:, None] * D + offs_d[None, :],
            mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < D),
            other=0.0,
        ).to(tl.float32)
        do = tl.load(
            DO + bh * Sq * Dv + offs_m[:, None] * Dv + offs_dv[None, :],
            mask=(offs_m[:, None] < Sq) & (offs_dv[None, :] < Dv),
            other=0.0,
        ).to(tl.float32)
        delta = tl.load(DELTA + bh * Sq + offs_m, mask=offs_m < Sq, other=0.0)
        dq = tl.zeros([BM, BD], tl.float32)
        for start in range(0, Sk, BN):
            offs_n = start + tl.arange(0, BN)
            k = tl.load(
                K + bh * Sk * D + offs_n[:, None] * D + offs_d[None, :],
                mask=(offs_n[:, None] < Sk) & (offs_d[None, :] < D),
                other=0.0,
            ).to(tl.float32)
            v = tl.load(
                V + bh * Sk * Dv + offs_n[:, None] * Dv + offs_dv[None, :],
                mask=(offs_n[:, None] < Sk) & (offs_dv[None, :] < Dv),
                other=0.0,
            ).to(tl.float32)
            p, keep = _probs(
                q,
                k,
                M,
                b,
                h,
                bh,
                offs_m,
                offs_n,
                LSE,
                Sq,
                Sk,
                sm0,
                sm1,
                sm2,
                sm3,
                scale,
                seed,
                thr,
                dscale,
                HAS_MASK,
                CAUSAL,
                DROPOUT,
                DOT,
            )
            ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT) * keep - delta[:, None])
            dq += tl.dot(ds, k, input_precision=DOT)
        tl.store(
            DQ + bh * Sq * D + offs_m[:, None] * D + offs_d[None, :],
            (dq * scale).to(DQ.dtype.element_ty),
            mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < D),
        )
    else:
        offs_n = pid * BN + tl.arange(0, BN)
        k = tl.load(
            K + bh * Sk * D + offs_n[:, None] * D + offs_d[None, :],
            mask=(offs_n[:, None] < Sk) & (offs_d[None, :] < D),
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            V + bh * Sk * Dv + offs_n[:, None] * Dv + offs_dv[None, :],
            mask=(offs_n[:, None] < Sk) & (offs_dv[None, :] < Dv),
            other=0.0,
        ).to(tl.float32)
        dk = tl.zeros([BN, BD], tl.float32)
        dv = tl.zeros([BN, BDV], tl.float32)
        for start in range(0, Sq, BM):
            offs_m = start + tl.arange(0, BM)
            q = tl.load(
                Q + bh * Sq * D + offs_m[:, None] * D + offs_d[None, :],
                mask=(offs_m[:, None] < Sq) & (offs_d[None, :] < D),
                other=0.0,
            ).to(tl.float32)
            do = tl.load(
                DO + bh * Sq * Dv + offs_m[:, None] * Dv + offs_dv[None, :],
                mask=(offs_m[:, None] < Sq) & (offs_dv[None, :] < Dv),
                other=0.0,
            ).to(tl.float32)
            delta = tl.load(DELTA + bh * Sq + offs_m, mask=offs_m < Sq, other=0.0)
            p, keep = _probs(
                q,
                k,
                M,
                b,
                h,
                bh,
                offs_m,
                offs_n,
                LSE,
                Sq,
                Sk,
                sm0,
                sm1,
                sm2,
                sm3,
                scale,
                seed,
                thr,
                dscale,
                HAS_MASK,
                CAUSAL,
                DROPOUT,
                DOT,
            )
            dv += tl.dot(tl.trans(p * keep), do, input_precision=DOT)
            ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT) * keep - delta[:, None])
            dk += tl.dot(tl.trans(ds), q, input_precision=DOT)
        tl.store(
            DK + bh * Sk * D + offs_n[:, None] * D + offs_d[None, :],
            (dk * scale).to(DK.dtype.element_ty),
            mask=(offs_n[:, None] < Sk) & (offs_d[None, :] < D),
        )
        tl.store(
            DV + bh * Sk * Dv + offs_n[:, None] * Dv + offs_dv[None, :],
            dv.to(DV.dtype.element_ty),
            mask=(offs_n[:, None] < Sk) & (offs_dv[None, :] < Dv),
        )


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for attention on `dtype` inputs: "ieee" for fp32 unless TF32 is allowed."""
    return "tf32" if dtype != torch.float32 or cuda_matmul_allows_tf32() else "ieee"


def _meta(q, k, v, mask, p):
    B, H, Sq, D = q.shape
    Sk, Dv = k.shape[2], v.shape[3]
    strides = mask.stride() if mask is not None else (0, 0, 0, 0)
    blk = 16 if q.device.type == "cpu" else 64
    return dict(
        H=H,
        Sq=Sq,
        Sk=Sk,
        D=D,
        Dv=Dv,
        sm0=strides[0],
        sm1=strides[1],
        sm2=strides[2],
        sm3=strides[3],
        BM=blk,
        BN=blk,
        BD=max(16, triton.next_power_of_2(D)),
        BDV=max(16, triton.next_power_of_2(Dv)),
        thr=keep_threshold(p),
        dscale=1.0 / (1.0 - p),
        DROPOUT=p > 0,
        HAS_MASK=mask is not None,
        DOT=dot_precision(q.dtype),
    )


def attention_fwd_triton(q, k, v, mask, scale, is_causal, p, seed):
    B, H, Sq, _ = q.shape
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(B, H, Sq, v.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    meta = _meta(q, k, v, mask, p)
    grid = (triton.cdiv(Sq, meta["BM"]), B * H)
    _fwd_kernel[grid](
        qc, kc, vc, mask if mask is not None else qc, out, lse, scale=scale, seed=seed, CAUSAL=is_causal, **meta
    )
    return out, lse


def attention_bwd_triton(dout, q, k, v, mask, out, lse, scale, is_causal, p, seed):
    B, H, Sq, _ = q.shape
    qc, kc, vc, doc = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    delta = (doc.float() * out.float()).sum(-1).contiguous()
    dq, dk, dv = torch.empty_like(qc), torch.empty_like(kc), torch.empty_like(vc)
    meta = _meta(q, k, v, mask, p)
    m = mask if mask is not None else qc
    args = (qc, kc, vc, m, doc, lse.contiguous(), delta, dq, dk, dv)
    _bwd_kernel[(triton.cdiv(Sq, meta["BM"]), B * H)](
        *args, scale=scale, seed=seed, CAUSAL=is_causal, FOR_DQ=True, **meta
    )
    _bwd_kernel[(triton.cdiv(k.shape[2], meta["BN"]), B * H)](
        *args, scale=scale, seed=seed, CAUSAL=is_causal, FOR_DQ=False, **meta
    )
    return dq, dk, dv
