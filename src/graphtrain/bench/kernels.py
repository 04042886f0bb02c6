"""Kernel microbenchmarks: each fused op vs the eager sequence it replaces and vs torch.compile of it.

    python -m graphtrain.bench.kernels [--ops attention,layer_norm] [--no-compile] [--repeats 5]

CPU, fp32, realistic shapes of the GPT-2/BERT small presets ([8*128, 512] rows, [8, 8, 128, 64]
attention). Variants run interleaved (A B C A B C ...) and we report the median over repeats and the
spread (max/min), forward and forward+backward time, the MiB autograd saves for backward (activation
memory; not measurable this way for compiled code), and achieved GB/s
(bytes of the minimal read/write traffic) or GFLOP/s for the matmul ops (attention 4*B*H*S*S*D fwd;
linears 2*M*K*N fwd, x3 fwd+bwd), against the machine's peaks (``python -m graphtrain.kernels.flops``:
on the 2-core Zen 5 EPYC fp32 ~220 GFLOP/s through aten/MKL, ~480 through oneDNN; bf16 ~870).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import graphtrain.kernels as K


def _setup(name, dtype=torch.float32):
    """name -> (fused fn, eager fn, inputs, bytes moved fwd, flops fwd); float inputs in `dtype`."""
    torch.manual_seed(0)

    def _randn(*shape):
        return torch.randn(*shape, dtype=dtype)

    esize = torch.finfo(dtype).bits // 8
    R, N = 8 * 128, 512
    if name == "layer_norm":
        x, w, b = _randn(R, N), _randn(N), _randn(N)
        return (
            lambda x, w, b: K.layer_norm(x, w, b),
            lambda x, w, b: F.layer_norm(x, (N,), w, b),
            [x, w, b],
            2 * R * N * esize,
            0,
        )
    if name == "layer_norm_handwritten":
        x, w, b = _randn(R, N), _randn(N), _randn(N)

        def eager(x, w, b):
            mu = x.mean(-1, keepdim=True)
            return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + 1e-5) * w + b

        return (lambda x, w, b: K.layer_norm(x, w, b), eager, [x, w, b], 2 * R * N * esize, 0)
    if name == "rms_norm":
        x, w = _randn(R, N), _randn(N)
        return (lambda x, w: K.rms_norm(x, w), lambda x, w: F.rms_norm(x, (N,), w, 1e-6), [x, w], 2 * R * N * esize, 0)
    if name in ("bias_gelu_tanh", "bias_gelu_erf"):
        a = "tanh" if name.endswith("tanh") else "none"
        x, b = _randn(R, 4 * N), _randn(4 * N)

        def eager(x, b):
            h = x + b
            if a == "tanh":  # HF GPT-2 NewGELU spelling
                return 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))
            return F.gelu(h)

        return (lambda x, b: K.bias_gelu(x, b, a), eager, [x, b], 2 * R * 4 * N * esize, 0)
    if name == "bias_dropout_add":
        x, b, r = _randn(R, N), _randn(N), _randn(R, N)
        return (
            lambda x, b, r: K.bias_dropout_add(x, b, r, 0.1),
            lambda x, b, r: F.dropout(x + b, 0.1, True) + r,
            [x, b, r],
            3 * R * N * esize,
            0,
        )
    if name in ("attention_dropout", "attention_nodropout"):
        p = 0.1 if name == "attention_dropout" else 0.0
        B, H, S, D = 8, 8, 128, 64
        q, k, v = (_randn(B, H, S, D) for _ in range(3))
        mask = torch.zeros(S, S).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")).to(dtype)

        def eager(q, k, v):  # graphtrain GPT-2's explicit attention
            return F.dropout(F.softmax(q @ k.transpose(-2, -1) * D**-0.5 + mask, -1), p, True) @ v

        return (
            lambda q, k, v: K.attention(q, k, v, mask, D**-0.5, False, p),
            eager,
            [q, k, v],
            0,
            4 * B * H * S * S * D,
        )
    if name == "cross_entropy":
        x, t = _randn(R, 16384), torch.randint(0, 16384, (R,))
        return (lambda x: K.cross_entropy(x, t), lambda x: F.cross_entropy(x, t), [x], R * 16384 * esize, 0)
    if name == "linear_cross_entropy":
        h, w, t = _randn(R, N), _randn(16384, N), torch.randint(0, 16384, (R,))
        return (
            lambda h, w: K.linear_cross_entropy(h, w, t),
            lambda h, w: F.cross_entropy(h @ w.t(), t),
            [h, w],
            0,
            2 * R * N * 16384,
        )
    if name == "linear_cross_entropy_mlm":  # BERT's MLM labels: 15% of rows carry a target
        h, w, t = _randn(R, N), _randn(16384, N), torch.randint(0, 16384, (R,))
        t[torch.rand(R) > 0.15] = -100
        return (
            lambda h, w: K.linear_cross_entropy(h, w, t),
            lambda h, w: F.cross_entropy(h @ w.t(), t),
            [h, w],
            0,
            2 * R * N * 16384,
        )
    if name in ("gemm_linear", "gemm_lm_head"):  # a Linear's addmm (d_ff = 4 d_model), the LM head's mm
        n_out = 4 * N if name == "gemm_linear" else 16384
        x, w, b = _randn(R, N), _randn(n_out, N), _randn(n_out)
        if name == "gemm_lm_head":
            return (lambda x, w: K.gemm(x, w.t()), lambda x, w: x @ w.t(), [x, w], 0, 2 * R * N * n_out)
        return (lambda x, w, b: K.gemm(x, w.t(), b), lambda x, w, b: F.linear(x, w, b), [x, w, b], 0, 2 * R * N * n_out)
    raise ValueError(f"unknown benchmark {name!r}")


OPS = [
    "layer_norm",
    "layer_norm_handwritten",
    "rms_norm",
    "bias_gelu_erf",
    "bias_gelu_tanh",
    "bias_dropout_add",
    "attention_nodropout",
    "attention_dropout",
    "cross_entropy",
    "linear_cross_entropy",
    "linear_cross_entropy_mlm",
    "gemm_linear",
    "gemm_lm_head",
]


def _time(fn, inputs, backward, iters):
    ins = [x.detach().requires_grad_(backward) if x.is_floating_point() else x for x in inputs]
    t0 = time.perf_counter()
    for _ in range(iters):
        y = fn(*ins)
        if backward:
            y.backward(torch.ones_like(y))
    return (time.perf_counter() - t0) / iters


def _saved_mib(fn, inputs):
    """MiB of tensors autograd saves for backward in one forward (the activation memory the op costs)."""
    ins = [x.detach().requires_grad_(True) if x.is_floating_point() else x for x in inputs]
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen and not any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for x in ins):
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*ins)
    return total[0] / 2**20


def run(ops, compile_too, repeats, iters, dtype=torch.float32):
    print(
        f"torch {torch.__version__}, {dtype}, {torch.get_num_threads()} threads; median of {repeats} interleaved repeats "
        f"x {iters} iters; spread = max/min"
    )
    print(
        f"{'op':24s} {'variant':9s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'spread':>6s} {'speedup':>8s} "
        f"{'saved MiB':>9s} {'rate':>16s}"
    )
    for name in ops:
        fused, eager, inputs, nbytes, flops = _setup(name, dtype)
        variants = {"eager": eager, "fused": fused}
        if compile_too:
            variants["compile"] = torch.compile(eager)
        for fn in variants.values():  # warm up (and compile)
            _time(fn, inputs, True, 2)
        res = {k: ([], []) for k in variants}
        for _ in range(repeats):
            for k, fn in variants.items():
                res[k][0].append(_time(fn, inputs, False, iters))
                res[k][1].append(_time(fn, inputs, True, iters))
        base = statistics.median(res["eager"][1])
        saved = {k: (_saved_mib(fn, inputs) if k != "compile" else float("nan")) for k, fn in variants.items()}
        for k, (f, fb) in res.items():
            mf, mfb = statistics.median(f), statistics.median(fb)
            rate = f"{flops / mf / 1e9:6.1f} GFLOP/s fwd" if flops else f"{nbytes / mf / 1e9:6.1f} GB/s fwd"
            print(
                f"{name:24s} {k:9s} {mf * 1e3:8.2f} {mfb * 1e3:11.2f} {max(fb) / min(fb):6.2f} "
                f"{base / mfb:7.2f}x {saved[k]:9.1f} {rate:>16s}"
            )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    a = ap.parse_args(argv)
    run(
        [o for o in a.ops.split(",") if o],
        not a.no_compile,
        a.repeats,
        a.iters,
        torch.bfloat16 if a.dtype == "bf16" else torch.float32,
    )


if __name__ == "__main__":
    main()
