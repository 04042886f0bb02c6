"""The contracts of graphtrain's CPU attention kernels (kernels/attention.py), whose C++ is kernels/csrc/attention.cpp,
built into the same extension as the other kernels (_cpu_ext.py), which inserts the contracts' checks (contract.py)
where the file includes gt_contracts.h. The contracts below state what each entry point relies on; attention.py's
gates evaluate them in Python before choosing a kernel, and each entry point's first statement is the same
contract's C++ check."""

from graphtrain.kernels.contract import Contract, Rule, register_contract

_4D = "must be [B, H, S, D]"
_BLAS = (
    "each row's stride (S) at least its length (D), every size and row stride within 32 bits: they are "
    "BLAS's leading dimensions"
)

HEADS_FWD = register_contract(
    Contract(
        "attn_heads_fwd",
        ("q", "k", "v", "out"),
        ints=("qb",),
        rules=(
            Rule("q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && out.dim() == 4", f"q, k, v and out {_4D}"),
            Rule(
                "cpu(q) && cpu(k) && cpu(v) && cpu(out) && f32(q) && f32(k) && f32(v) && f32(out)",
                "q, k, v and out must be fp32 CPU tensors",
            ),
            Rule("k.size(0) == q.size(0) && v.size(0) == q.size(0)", "q, k and v must have one batch size"),
            Rule(
                "k.size(1) > 0 && v.size(1) == k.size(1) && q.size(1) % k.size(1) == 0",
                "k and v must have the same number of heads, which divides q's (grouped-query attention)",
            ),
            Rule("k.size(2) > 0 && v.size(2) == k.size(2)", "k and v must have the same number of keys, at least one"),
            Rule("q.size(3) > 0 && k.size(3) == q.size(3) && v.size(3) > 0", "k must have q's head size (> 0)"),
            Rule(
                "out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == q.size(2) && "
                "out.size(3) == v.size(3)",
                "out must be [B, H, Sq, Dv] for q [B, H, Sq, D] and v [B, Hkv, Sk, Dv]",
            ),
            Rule(
                "q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && out.stride(3) == 1",
                "q, k, v and out must have unit stride in D",
            ),
            Rule(
                "q.stride(2) >= q.size(3) && k.stride(2) >= k.size(3) && v.stride(2) >= v.size(3) && "
                "out.stride(2) >= out.size(3) && q.size(2) <= GT_INT32_MAX && k.size(2) <= GT_INT32_MAX && "
                "q.size(3) <= GT_INT32_MAX && v.size(3) <= GT_INT32_MAX && q.stride(2) <= GT_INT32_MAX && "
                "k.stride(2) <= GT_INT32_MAX && v.stride(2) <= GT_INT32_MAX && out.stride(2) <= GT_INT32_MAX",
                _BLAS,
            ),
            Rule("qb > 0 && qb <= GT_INT32_MAX", "the query block must be 1 to 2^31 - 1 rows"),
        ),
    )
)

HEADS_BWD = register_contract(
    Contract(
        "attn_heads_bwd",
        ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv"),
        ints=("qb",),
        rules=(
            *HEADS_FWD.rules,
            Rule("dout.dim() == 4 && dq.dim() == 4 && dk.dim() == 4 && dv.dim() == 4", f"dout, dq, dk and dv {_4D}"),
            Rule(
                "cpu(dout) && cpu(dq) && cpu(dk) && cpu(dv) && f32(dout) && f32(dq) && f32(dk) && f32(dv)",
                "dout, dq, dk and dv must be fp32 CPU tensors",
            ),
            Rule(
                "same_shape(dout, out) && same_shape(dq, q) && same_shape(dk, k) && same_shape(dv, v)",
                "dout must be shaped as out, and dq, dk, dv as q, k, v",
            ),
            Rule(
                "dout.stride(3) == 1 && dq.stride(3) == 1 && dk.stride(3) == 1 && dv.stride(3) == 1 && "
                "dout.stride(2) >= dout.size(3) && dq.stride(2) >= dq.size(3) && dk.stride(2) >= dk.size(3) && "
                "dv.stride(2) >= dv.size(3) && dout.stride(2) <= GT_INT32_MAX && dq.stride(2) <= GT_INT32_MAX && "
                "dk.stride(2) <= GT_INT32_MAX && dv.stride(2) <= GT_INT32_MAX",
                _BLAS,
            ),
            Rule(
                "cpu(lse) && f32(lse) && lse.is_contiguous() && lse.dim() == 3 && lse.size(0) == q.size(0) && "
                "lse.size(1) == q.size(1) && lse.size(2) == q.size(2)",
                "lse must be a contiguous fp32 [B, H, Sq]",
            ),
        ),
    )
)

_PROBS_MASK = Rule(
    "mask.numel() == 0 || (mask.dim() == 4 && same_dtype(mask, s) && cpu(mask) && "
    "mask.size(1) == heads && mask.size(0) * heads == s.size(0) && mask.size(2) == s.size(1) && "
    "mask.size(3) == s.size(2))",
    "mask must be empty or [B, H, Sq, Sk] (any strides) of the scores' dtype",
)

PROBS_FWD = register_contract(
    Contract(
        "attn_probs_fwd",
        ("s", "mask"),
        ints=("heads",),
        rules=(
            Rule(
                "s.dim() == 3 && s.is_contiguous() && cpu(s) && floating(s)",
                "scores must be a contiguous floating-point CPU [BH, Sq, Sk]",
            ),
            Rule("s.size(2) > 0 && heads > 0 && s.size(0) % heads == 0", "at least one key, and BH a multiple of H"),
            _PROBS_MASK,
        ),
    )
)

PROBS_BWD = register_contract(
    Contract(
        "attn_probs_bwd",
        ("s", "dp", "mask", "lse", "delta"),
        ints=("heads",),
        rules=(
            *PROBS_FWD.rules,
            Rule(
                "dp.is_contiguous() && same_shape(dp, s) && same_dtype(dp, s)",
                "dp must be shaped and typed as the scores",
            ),
            Rule(
                "lse.is_contiguous() && f32(lse) && lse.numel() == s.size(0) * s.size(1) && (delta.numel() == 0 || "
                "(delta.is_contiguous() && f32(delta) && delta.numel() == lse.numel()))",
                "lse must be a contiguous fp32 [BH, Sq], delta one too or empty (computed from each row)",
            ),
        ),
    )
)
