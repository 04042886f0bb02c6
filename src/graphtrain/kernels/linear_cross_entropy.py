"""graphtrain::linear_cross_entropy: cross_entropy(hidden @ weight^T, target), chunked over rows.

The LM-head logits [N, V] are never materialized in full: each chunk of rows computes its logits,
their logsumexp and loss, and at once the gradient of the loss w.r.t. the chunk's logits, which it
turns into d hidden (chunk) and accumulates into d weight (Liger's fused-linear-CE scheme).
Forward therefore returns (loss, d_hidden, d_weight) for a unit upstream gradient and backward only
scales them: the same matmul FLOPs as eager (3 per token: logits, d hidden, d weight), peak memory
O(chunk x V) instead of O(N x V) logits + log-probs + their grads (a bf16/fp16 head on CPU that would need an
fp32 d weight accumulator larger than its whole N x V logits runs as one chunk instead: train_chunk_rows).
Reductions: mean (over non-ignored rows) or sum. The op computes gradients in forward, so it is meant for training graphs.
graphtrain::linear_cross_entropy_loss is its evaluation form (the pass loss_only_lm_head puts it in graphs
compiled under no_grad): the loss alone, one matmul per chunk instead of three, no d hidden or d weight, and
chunks of ~8 MiB of logits instead of ~32 (no gradient to accumulate, so smaller chunks cost nothing).

With `skip_ignored` (the pass sparse_lm_head sets it; the public functional's default), rows whose target
is ignore_index are dropped before the loop (their gradient rows are zero): masked-LM heads then run on
the ~15% of positions that carry a label, the sparse-prediction trick of NVIDIA's and ORT's BERT
pretraining, found here from the labels at run time instead of written into the model.

Implementations: a chunk loop (matmuls in the input dtype through gemm.matmul, i.e. oneDNN for fp32 on
CPUs where it wins, written straight into d hidden / accumulated into d weight); per chunk the softmax
cross-entropy and its gradient in one C++ call on CPU (_cpu_ext.ce_fwd_bwd_inplace: fp32 math, the
logits overwritten by their gradient), the plain-PyTorch reference math without the C++ module, and
Triton row kernels on CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphtrain.kernels import _cpu_ext
from graphtrain.kernels._common import dense_empty, dispatch
from graphtrain.kernels._cpu_ext import CE_INPLACE
from graphtrain.kernels.contract import Layout
from graphtrain.kernels.cross_entropy import REDUCTIONS, _supports_triton, ce_bwd_triton, ce_fwd_triton
from graphtrain.kernels.gemm import matmul, mm_into, mm_low, onednn_gemm_wins
from graphtrain.kernels.registry import (
    COMPUTE_BOUND,
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


def _loss_dtype(hidden: Tensor) -> torch.dtype:
    """The loss comes out in fp32 for bf16/fp16 inputs (as under autocast: the matmuls run in the low
    precision, the softmax cross-entropy and its result in fp32), else in the inputs' dtype."""
    return torch.float32 if hidden.dtype in (torch.bfloat16, torch.float16) else hidden.dtype


def linear_cross_entropy_reference(
    hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, reduction: int, bias: Tensor | None = None
) -> Tensor:
    logits = hidden @ weight.t()
    logits = (logits if bias is None else logits + bias).to(_acc(hidden))
    return torch.nn.functional.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction={1: "mean", 2: "sum"}[reduction]
    ).to(_loss_dtype(hidden))


def _default_chunk(hidden: Tensor, weight: Tensor) -> int:
    return train_chunk_rows(
        hidden.shape[0], weight.shape[0], weight.shape[1], hidden.element_size(), hidden.device.type == "cpu"
    )


CHUNK_BYTES = 32 << 20
LOSS_ONLY_CHUNK_BYTES = 8 << 20
"""The loss-only op's chunk: its logits buffer is all the memory it needs, and an evaluation between training steps
under the ``keep`` allocator takes its blocks from the heap the steps left; a 32 MiB block that none of its holes
fits grows the process (gpt2-mini's default job on a 2-core Zen 5: +19 and +32 MB at an evaluation)."""


def default_chunk_rows(n: int, v: int, itemsize: int = 4, budget: int = CHUNK_BYTES) -> int:
    """Rows per chunk: ~`budget` bytes of logits in the compute dtype per chunk (32 MiB: a few L2-sized matmul
    panels), at least 1."""
    return max(1, min(n, budget // (itemsize * max(v, 1))))


def train_chunk_rows(n: int, v: int, k: int, itemsize: int, cpu: bool) -> int:
    """Rows per chunk of a training head (the ops that return d weight) with `n` rows, vocabulary `v`, width `k`.

    ~CHUNK_BYTES of logits per chunk (default_chunk_rows), except for a low-precision (2-byte) head on CPU that fits
    in one chunk no larger than the fp32 d weight accumulator several chunks need: such heads run as one chunk.
    Several bf16 chunks accumulate d weight in an fp32 [v, k] buffer (4vk bytes), and each chunk's bf16 product is
    a [v, k] temporary cast to fp32 and added (mm_into); one chunk writes d weight with one GEMM in the compute dtype,
    as eager's autocast does, with no accumulator, so its n x v buffer is the smaller when 2n <= 4k. Measured on HF
    Llama's wide head (1024 rows, vocabulary 32768, width 1024, bf16, 2-core AMX Xeon, op + its casts, 7 timed
    calls twice): 284-300 ms in two chunks, 217-221 ms in one."""
    chunk = default_chunk_rows(n, v, itemsize)
    if cpu and itemsize == 2 and chunk < n and n * itemsize <= 4 * k:
        return n
    return chunk


_CPP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def logits_row_stride(v: int, dtype: torch.dtype) -> int:
    """Elements from one row to the next in a CPU head's fp32 logits buffer of width `v`: `v`, plus one 64-byte cache
    line where a row is an even number of lines (a power-of-two vocabulary: 8192, 16384, 32768).

    The weight gradient reads that buffer transposed (d logits^T @ hidden): BLAS packs a column of it, rows one
    stride apart. A stride of 2^k bytes puts all of them in the same few sets of a physically indexed cache once the
    buffer sits on 2 MiB huge pages (4 KiB pages scatter the upper set bits): the packing thrashes. An odd number of
    lines per row spreads them over every set. Measured on a 2-core AVX2 EPYC (Zen 2, 512 KiB 8-way L2), [512, 16384]
    fp32 d logits, hidden width 512, MKL (scripts/huge_page_gemm.py, docs/design/memory.md): with huge pages 190.5
    ms unpadded against 66.4 ms padded, on 4 KiB pages 106.5 against 84.2.
    fp32 only: bf16 heads go through gemm.low_plan's measured plans, which were not measured on a padded buffer."""
    if dtype == torch.float32 and (v * 4) % 128 == 0:
        return v + 16
    return v


def _chunked(
    hidden, weight, target, ignore_index, reduction, chunk, bias=None, skip_ignored=True, logits=None, loss_only=False
):
    """The op on the fastest row kernel that takes these inputs (Triton, C++), guarded by the torch math. `logits`:
    the head's full logits, already computed (the `_logits` ops): each chunk copies its rows instead of computing
    them. `loss_only`: the loss alone (linear_cross_entropy_loss), as a 1-tuple."""
    use_triton = _supports_triton(hidden, target)
    # the C++ kernel's contract for each chunk's logits, targets and losses, as the loop makes them
    rows, targets, losses = (
        Layout.contiguous((chunk, weight.shape[0]), hidden.dtype),
        Layout.contiguous((chunk,), torch.int64),
        Layout.contiguous((chunk,), torch.float32),
    )
    use_cpp = (
        not use_triton
        and hidden.device.type == "cpu"
        and hidden.dtype in _CPP_DTYPES
        and CE_INPLACE.holds(rows, targets, losses)
        and _cpu_ext.load() is not None
    )

    def run(impl):
        return lambda: _chunk_loop(
            hidden, weight, target, ignore_index, reduction, chunk, bias, impl, skip_ignored, logits, loss_only
        )

    return dispatch(
        "linear_cross_entropy", [("triton", use_triton, run("triton")), ("c++", use_cpp, run("c++"))], run("torch")
    )


SPARSE_MIN_SKIPPED = 0.125
"""A sparse head skips the ignored rows of a batch only where they are at least this share of its rows
(`skips_rows`). A causal LM's labels leave out one position per sequence (16 of 2048 rows at b16 s128): skipping
them saves 0.8% of the head's FLOPs for a gather of the other rows, a scatter of their gradients and a host sync.
Measured on HF GPT-2 and Llama mini in bf16 (2-core Zen 4, 3 alternating runs each): within noise, 230.0-235.7
against 234.7-237.0 ms and 211.7-218.8 against 212.3-240.1 ms. What it buys is a plain count: such a head runs
every row, as eager's, so those models' figures include no shortcut. Masked-LM batches (85% ignored) skip."""


def skips_rows(n_valid: int, n: int) -> bool:
    """Whether a sparse head (skip_ignored) runs only the `n_valid` labelled rows of `n`: some, and at least
    SPARSE_MIN_SKIPPED of them ignored. The benchmark's executed-FLOP count asks it too."""
    return 0 < n_valid and n - n_valid >= SPARSE_MIN_SKIPPED * n


def _chunk_loop(
    hidden, weight, target, ignore_index, reduction, chunk, bias, impl, skip_ignored, all_logits=None, loss_only=False
):
    n = hidden.shape[0]
    valid = target != ignore_index
    n_valid = int(valid.sum())
    denom = torch.tensor(float(n_valid), dtype=_acc(hidden)) if reduction == 1 else torch.ones((), dtype=_acc(hidden))
    use_triton, use_cpp = impl == "triton", impl == "c++"
    rows = None
    if skip_ignored and skips_rows(n_valid, n):
        # A row whose target is ignored adds nothing to the loss or to any gradient (its d logits row is 0), so
        # its logits are never computed: for masked-LM labels (15% of rows valid) this skips ~85% of the LM
        # head's three matmuls. Same function, same values up to rounding.
        rows = valid.nonzero()[:, 0]
        hidden, target = hidden.index_select(0, rows), target.index_select(0, rows)
    if all_logits is not None:  # each chunk's rows: the C++ pass reads them, the others work on a copy in place
        picked = rows if rows is not None else torch.arange(n, device=hidden.device)
    if loss_only:
        return (
            (_chunk_losses(hidden, weight, target, ignore_index, chunk, bias, impl) / denom).to(_loss_dtype(hidden)),
        )
    dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    single = hidden.shape[0] <= chunk
    # one chunk: d weight is that chunk's product, in the weight's dtype; several: accumulated (fp32 for fp32/bf16),
    # the first chunk's product written over the uninitialised buffer (no [V, K] zero fill and re-read per call)
    dw = None if single else torch.empty(weight.shape, dtype=_acc(hidden), device=weight.device)
    db = torch.zeros(weight.shape[:1], dtype=_acc(hidden), device=weight.device) if bias is not None else None
    total = torch.zeros((), dtype=_acc(hidden), device=hidden.device)
    # One logits buffer for every chunk: a fresh [chunk, V] block per chunk faulted its pages in anew whenever glibc
    # returned freed blocks to the OS (engine.cpu_allocator "release", what recompute sets). HF Llama, vocabulary
    # 32000, 4096 tokens, recompute selective, 2-core Zen 4: the head's op 2.2 s of CPU a step against 1.66 s now,
    # the step 3.8-4.3 s against 2.97-3.01 s (2.75 s without recompute, unchanged).
    reuse = all_logits is not None or (bias is None and hidden.device.type == "cpu")
    buf: Tensor | None = None
    # the C++ pass reads each chunk's rows from all_logits itself, into the buffer
    cpp_rows = all_logits is not None and use_cpp and all_logits.is_contiguous() and all_logits.dtype == hidden.dtype
    # rows at a padded stride (logits_row_stride) where only the C++ pass and aten's GEMMs touch the buffer: aten's
    # oneDNN matmul (onednn_gemm_wins) copies a padded operand and takes contiguous outputs only
    v, first = weight.shape[0], min(chunk, hidden.shape[0])
    ld = v
    if (
        reuse
        and use_cpp
        and hidden.device.type == "cpu"
        and hidden.dtype == torch.float32
        and (cpp_rows or all_logits is None)
        and not onednn_gemm_wins()
    ):
        ld = logits_row_stride(v, hidden.dtype)
        rows_ok = CE_INPLACE.holds(
            Layout((first, v), (ld, 1), hidden.dtype),
            Layout.contiguous((first,), torch.int64),
            Layout.contiguous((first,), torch.float32),
        )
        ld = ld if rows_ok else v
    padded = ld != v
    for s in range(0, hidden.shape[0], chunk):
        h, t = hidden[s : s + chunk], target[s : s + chunk]
        if reuse and buf is None:
            dtype = all_logits.dtype if all_logits is not None else hidden.dtype
            buf = torch.empty((h.shape[0], ld), dtype=dtype, device=hidden.device)[:, :v]
        rows_buf = buf[: h.shape[0]] if buf is not None else None
        if cpp_rows and rows_buf is not None:
            logits = rows_buf  # filled by the C++ pass below
        elif all_logits is not None and rows_buf is not None:
            logits = torch.index_select(all_logits, 0, picked[s : s + chunk], out=rows_buf)
        elif rows_buf is not None:
            logits = rows_buf
            mm_into(h, weight.t(), logits, accumulate=False)
        else:
            logits = matmul(h, weight.t(), bias)
        if use_triton:
            losses, lse = ce_fwd_triton(logits, t, ignore_index)
            rg = torch.full((h.shape[0],), 1.0, device=h.device) / denom
            dlogits = ce_bwd_triton(rg, logits, t, lse, ignore_index)
        elif use_cpp:
            losses = torch.empty(h.shape[0], dtype=torch.float32)
            scale = 1.0 / float(denom) if float(denom) else float("nan")  # no labelled row: NaN loss, as eager
            if cpp_rows:  # from the returned logits' rows straight into the buffer: no copy of them first
                _cpu_ext.load().ce_fwd_bwd_rows(
                    logits, all_logits, picked[s : s + chunk].contiguous(), t.contiguous(), ignore_index, scale, losses
                )
            else:
                logits = logits if padded else logits.contiguous()
                _cpu_ext.load().ce_fwd_bwd_inplace(logits, t.contiguous(), ignore_index, scale, losses)
            dlogits = logits  # now holds d loss / d logits
        else:
            x = logits.to(_acc(hidden))
            lse = torch.logsumexp(x, -1)
            v = t != ignore_index
            tt = torch.where(v, t, 0)[:, None]
            losses = torch.where(v, lse - x.gather(1, tt)[:, 0], 0.0)
            x.sub_(lse[:, None]).exp_()  # softmax, in place on the chunk's fp32 logits
            x.scatter_add_(1, tt, -torch.ones_like(lse[:, None]))
            dlogits = x.mul_((torch.where(v, 1.0, 0.0) / denom)[:, None]).to(hidden.dtype)
        total += losses.sum()
        # d hidden: a GEMM whose inner dimension is the vocabulary, by its shape's measured plan (bf16 CPU: gemm.low_plan)
        mm_low(dlogits, weight, dh[s : s + chunk])
        if dw is None and dlogits.dtype in (torch.bfloat16, torch.float16) and dlogits.device.type == "cpu":
            # single, low precision: d weight by its shape's measured plan (gemm.low_plan: d logits read transposed)
            dw = torch.empty(weight.shape, dtype=dlogits.dtype)
            mm_low(dlogits.t(), h, dw)
        elif dw is None:  # single: the one chunk's product is d weight
            dw = matmul(dlogits.t(), h)
        else:
            mm_into(dlogits.t(), h, dw, accumulate=s > 0)
        if db is not None:
            db += dlogits.sum(0, dtype=db.dtype)
    if rows is not None:
        dh = torch.zeros((n, hidden.shape[1]), dtype=hidden.dtype, device=hidden.device).index_copy_(0, rows, dh)
    if dw is None:  # no row at all
        dw = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    out = ((total / denom).to(_loss_dtype(hidden)), dh, dw.to(weight.dtype).contiguous())
    return out if db is None else out + (db.to(bias.dtype),)


def _chunk_losses(hidden, weight, target, ignore_index, chunk, bias, impl) -> Tensor:
    """The summed loss of every row (rows already selected), a chunk of logits at a time in one buffer; no gradient.
    The C++ row kernel writes each row's gradient over its logits as it goes: a pass over a buffer that is dropped,
    cheaper than a second kernel."""
    total = torch.zeros((), dtype=_acc(hidden), device=hidden.device)
    buf = None
    for s in range(0, hidden.shape[0], chunk):
        h, t = hidden[s : s + chunk], target[s : s + chunk]
        if bias is None:
            if buf is None:
                buf = torch.empty((h.shape[0], weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
            logits = buf[: h.shape[0]]
            mm_into(h, weight.t(), logits, accumulate=False)
        else:
            logits = matmul(h, weight.t(), bias)
        if impl == "triton":
            losses, _ = ce_fwd_triton(logits, t, ignore_index)
        elif impl == "c++":
            losses = torch.empty(h.shape[0], dtype=torch.float32)
            logits = logits.contiguous()
            _cpu_ext.load().ce_fwd_bwd_inplace(logits, t.contiguous(), ignore_index, 1.0, losses)
        else:
            x = logits.to(_acc(hidden))
            v = t != ignore_index
            tt = torch.where(v, t, 0)[:, None]
            losses = torch.where(v, torch.logsumexp(x, -1) - x.gather(1, tt)[:, 0], 0.0)
        total += losses.sum(dtype=total.dtype)
    return total


@torch.library.custom_op("graphtrain::linear_cross_entropy_loss", mutates_args=())
def _linear_cross_entropy_loss_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: int,
    chunk_rows: int,
    skip_ignored: bool = True,
) -> Tensor:
    """cross_entropy(hidden @ weight^T (+ bias), target) alone, chunked: linear_cross_entropy's evaluation form (a
    graph compiled under no_grad: passes/fuse_cross_entropy.py loss_only_lm_head). No autograd formula: a graph
    that needs the gradient keeps linear_cross_entropy."""
    chunk = chunk_rows if chunk_rows > 0 else _default_loss_chunk(hidden, weight)
    return _chunked(hidden, weight, target, ignore_index, reduction, chunk, bias, skip_ignored, loss_only=True)[0]


@_linear_cross_entropy_loss_op.register_fake
def _(hidden, weight, bias, target, ignore_index, reduction, chunk_rows, skip_ignored=True):
    return hidden.new_empty((), dtype=_loss_dtype(hidden))


def _default_loss_chunk(hidden: Tensor, weight: Tensor) -> int:
    return default_chunk_rows(hidden.shape[0], weight.shape[0], hidden.element_size(), LOSS_ONLY_CHUNK_BYTES)


@torch.library.custom_op("graphtrain::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    ignore_index: int,
    reduction: int,
    chunk_rows: int,
    skip_ignored: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    chunk = chunk_rows if chunk_rows > 0 else _default_chunk(hidden, weight)
    return _chunked(hidden, weight, target, ignore_index, reduction, chunk, skip_ignored=skip_ignored)


@_linear_cross_entropy_op.register_fake
def _(hidden, weight, target, ignore_index, reduction, chunk_rows, skip_ignored=True):
    return hidden.new_empty((), dtype=_loss_dtype(hidden)), dense_empty(hidden), dense_empty(weight)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])


def _backward(ctx, grad, _ddh, _ddw):
    dh, dw = ctx.saved_tensors
    return dh * grad.to(dh.dtype), dw * grad.to(dw.dtype), None, None, None, None, None


_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("graphtrain::linear_bias_cross_entropy", mutates_args=())
def _linear_bias_cross_entropy_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor,
    target: Tensor,
    ignore_index: int,
    reduction: int,
    chunk_rows: int,
    skip_ignored: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """cross_entropy(hidden @ weight^T + bias, target), chunked: BERT's MLM decoder (a tied matrix plus its own
    bias). Outputs (loss, d hidden, d weight, d bias) for a unit upstream gradient, like the op above."""
    chunk = chunk_rows if chunk_rows > 0 else _default_chunk(hidden, weight)
    return _chunked(hidden, weight, target, ignore_index, reduction, chunk, bias, skip_ignored)


@_linear_bias_cross_entropy_op.register_fake
def _(hidden, weight, bias, target, ignore_index, reduction, chunk_rows, skip_ignored=True):
    return (
        hidden.new_empty((), dtype=_loss_dtype(hidden)),
        dense_empty(hidden),
        dense_empty(weight),
        dense_empty(bias),
    )


def _setup_bias(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2], output[3])


def _backward_bias(ctx, grad, _ddh, _ddw, _ddb):
    dh, dw, db = ctx.saved_tensors
    return (dh * grad.to(dh.dtype), dw * grad.to(dw.dtype), db * grad.to(db.dtype), None, None, None, None, None)


_linear_bias_cross_entropy_op.register_autograd(_backward_bias, setup_context=_setup_bias)


# --- The same losses for a head whose logits are also returned (passes/returned_heads.py: a Hugging Face model's
# logits beside its loss). The logits are computed in full (one GEMM: they are an output) and each chunk of rows is
# copied from them, so the [N, V] gradient of the logits is never materialized either: the unfused graph held the
# logits, their softmax cross-entropy gradient and (sparse rows aside) two GEMMs over it. With skip_ignored the
# gradient GEMMs run on the labelled rows only (a masked-LM head: ~15% of them). Fused by fuse_linear_cross_entropy.


def _with_logits(hidden, weight, target, ignore_index, reduction, chunk_rows, skip_ignored, bias=None):
    logits = matmul(hidden, weight.t(), bias).contiguous()
    chunk = chunk_rows if chunk_rows > 0 else _default_chunk(hidden, weight)
    return (*_chunked(hidden, weight, target, ignore_index, reduction, chunk, bias, skip_ignored, logits), logits)


@torch.library.custom_op("graphtrain::linear_cross_entropy_logits", mutates_args=())
def _linear_cross_entropy_logits_op(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    ignore_index: int,
    reduction: int,
    chunk_rows: int,
    skip_ignored: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, d hidden, d weight for a unit upstream gradient, the logits hidden @ weight^T)."""
    return _with_logits(hidden, weight, target, ignore_index, reduction, chunk_rows, skip_ignored)


@_linear_cross_entropy_logits_op.register_fake
def _(hidden, weight, target, ignore_index, reduction, chunk_rows, skip_ignored=True):
    return (
        hidden.new_empty((), dtype=_loss_dtype(hidden)),
        dense_empty(hidden),
        dense_empty(weight),
        dense_empty(hidden, (hidden.shape[0], weight.shape[0])),
    )


def _setup_logits(ctx, inputs, output):
    ctx.mark_non_differentiable(output[3])  # returned detached: its gradient, if any, is _HeadGrad's
    ctx.save_for_backward(output[1], output[2])


def _backward_logits(ctx, grad, _ddh, _ddw, _dlogits):
    return _backward(ctx, grad, _ddh, _ddw)


_linear_cross_entropy_logits_op.register_autograd(_backward_logits, setup_context=_setup_logits)


@torch.library.custom_op("graphtrain::linear_bias_cross_entropy_logits", mutates_args=())
def _linear_bias_cross_entropy_logits_op(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor,
    target: Tensor,
    ignore_index: int,
    reduction: int,
    chunk_rows: int,
    skip_ignored: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, d hidden, d weight, d bias for a unit upstream gradient, the logits hidden @ weight^T + bias)."""
    return _with_logits(hidden, weight, target, ignore_index, reduction, chunk_rows, skip_ignored, bias)


@_linear_bias_cross_entropy_logits_op.register_fake
def _(hidden, weight, bias, target, ignore_index, reduction, chunk_rows, skip_ignored=True):
    return (
        hidden.new_empty((), dtype=_loss_dtype(hidden)),
        dense_empty(hidden),
        dense_empty(weight),
        dense_empty(bias),
        dense_empty(hidden, (hidden.shape[0], weight.shape[0])),
    )


def _setup_bias_logits(ctx, inputs, output):
    ctx.mark_non_differentiable(output[4])
    ctx.save_for_backward(output[1], output[2], output[3])


def _backward_bias_logits(ctx, grad, _ddh, _ddw, _ddb, _dlogits):
    return _backward_bias(ctx, grad, _ddh, _ddw, _ddb)


_linear_bias_cross_entropy_logits_op.register_autograd(_backward_bias_logits, setup_context=_setup_bias_logits)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int = 0,
    bias: Tensor | None = None,
) -> Tensor:
    """cross_entropy(hidden @ weight.T (+ bias), target) without materializing the logits; hidden [..., H],
    weight [V, H], bias [V] or None."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: weight must be [vocab, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"linear_cross_entropy: target shape {tuple(target.shape)} must equal hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    h2, t1 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).long()
    if bias is not None:
        if tuple(bias.shape) != tuple(weight.shape[:1]):
            raise ValueError(f"linear_cross_entropy: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
        return torch.ops.graphtrain.linear_bias_cross_entropy(
            h2, weight, bias, t1, int(ignore_index), REDUCTIONS[reduction], int(chunk_rows)
        )[0]
    return torch.ops.graphtrain.linear_cross_entropy(
        h2, weight, t1, int(ignore_index), REDUCTIONS[reduction], int(chunk_rows)
    )[0]


def _workspace(n: torch.fx.Node, bias: bool) -> int:
    """The logits of one chunk of rows (~32 MiB), which the CPU loop turns into their gradient in place. Without a
    bias every chunk's GEMM writes into one buffer (_chunk_loop): one chunk's worth (gpt2-mini batch 16 x 128, 2
    chunks: the step's VmHWM within 2% of the prediction, 2-core Zen 4). With a bias each chunk gets a new
    product, so at the next chunk's matmul the previous chunk's logits (still referenced) are live too when there
    is more than one chunk, and the product before ``+ bias`` where the bias is added apart (_bias_apart). Rows
    whose label is ignored are skipped at run time: counting every row is an upper bound. On CUDA (Triton) the
    gradient is a second buffer."""
    h, w = input_value(n, 0), input_value(n, 1)
    rows, vocab = hint_int(h.shape[0]), hint_int(w.shape[0])
    if h.device.type != "cpu":
        return 2 * min(rows * vocab * 4, max(1, (32 << 20) // (4 * max(vocab, 1))) * vocab * 4)
    chunk_bytes, chunked = _chunk_bytes(n, bias)
    buffers = 1 if not bias else 1 + chunked + _bias_apart(n)
    return buffers * chunk_bytes + _low_accumulator_bytes(n, chunked)


def _bias_apart(n: torch.fx.Node) -> bool:
    """Whether the head's product and its bias are two results at once: gemm.matmul adds a bias of the operands'
    dtype inside the product (oneDNN, or aten's addmm since 0f7d6a5: until then aten's `a @ b + bias` put
    bert-mini batch 16's chunk on the peak twice, 96 MiB above its graph on an AVX2 EPYC), and one of another dtype
    after it."""
    b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    return isinstance(b, torch.fx.Node) and b.meta["val"].dtype != input_value(n, 0).dtype


def _low_accumulator_bytes(n: torch.fx.Node, chunked: bool) -> int:
    """A low-precision CPU head in several chunks (train_chunk_rows): d weight's fp32 accumulator, and while a chunk
    adds its product, that product and its fp32 copy (mm_into): 4 + 2 + 4 bytes per weight element. 0 otherwise."""
    h, w = input_value(n, 0), input_value(n, 1)
    if not chunked or h.device.type != "cpu" or h.element_size() != 2:
        return 0
    return (8 + h.element_size()) * hint_int(w.shape[0]) * hint_int(w.shape[1])


def _chunk_bytes(n: torch.fx.Node, bias: bool) -> tuple[int, bool]:
    """(bytes of one chunk of the logits, whether there is more than one chunk) for the op at `n`."""
    h, w = input_value(n, 0), input_value(n, 1)
    rows, vocab, item = hint_int(h.shape[0]), hint_int(w.shape[0]), h.element_size()
    width = logits_row_stride(vocab, h.dtype) if h.device.type == "cpu" else vocab  # an upper bound: padded or not
    i_chunk = 6 if bias else 5
    given = n.args[i_chunk] if len(n.args) > i_chunk else n.kwargs.get("chunk_rows", 0)
    chunk = (
        hint_int(given)
        if given and hint_int(given) > 0
        else train_chunk_rows(rows, vocab, hint_int(w.shape[1]), item, h.device.type == "cpu")
    )
    return min(rows, chunk) * width * item, rows > chunk


def _workspace_logits(n: torch.fx.Node, bias: bool) -> int:
    """One chunk of the logits' rows, copied into one buffer (and turned into their gradient in place there) at a
    time; on CUDA Triton's gradient of the chunk is a second buffer."""
    chunk_bytes, chunked = _chunk_bytes(n, bias)
    return (1 + (input_value(n, 0).device.type != "cpu")) * chunk_bytes + _low_accumulator_bytes(n, chunked)


def _workspace_loss(n: torch.fx.Node) -> int:
    """One chunk of logits (~8 MiB) in one buffer; with a bias each chunk's product is new (and the product before
    ``+ bias`` too where the bias is added apart: _bias_apart)."""
    h, w = input_value(n, 0), input_value(n, 1)
    rows, vocab, item = hint_int(h.shape[0]), hint_int(w.shape[0]), h.element_size()
    given = n.args[6] if len(n.args) > 6 else n.kwargs.get("chunk_rows", 0)
    chunk = (
        hint_int(given)
        if given and hint_int(given) > 0
        else default_chunk_rows(rows, vocab, item, LOSS_ONLY_CHUNK_BYTES)
    )
    has_bias = (n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")) is not None
    return (1 + has_bias + (has_bias and _bias_apart(n))) * min(rows, chunk) * vocab * item


SPEC = register_kernel_spec(
    KernelSpec(
        "linear_cross_entropy",
        linear_cross_entropy,
        linear_cross_entropy_reference,
        {"cpu": "chunked torch (reference CE math)", "cuda": "chunked matmul + triton CE"},
        {"cuda": _supports_triton},
        ops=(
            # Each computes its gradients in the forward: the backward only scales them (no backward op).
            # precision=low: the LM head's matmuls in the low precision, the softmax cross-entropy and loss in fp32 inside.
            OpDescriptor(
                "linear_cross_entropy",
                role=FORWARD,
                random=False,
                recompute=COMPUTE_BOUND,
                precision=LOW,
                workspace_bytes=lambda n: _workspace(n, bias=False),
                cpp=("ce_fwd_bwd_inplace", "onednn_matmul"),
            ),
            OpDescriptor(
                "linear_bias_cross_entropy",
                role=FORWARD,
                random=False,
                recompute=COMPUTE_BOUND,
                precision=LOW,
                workspace_bytes=lambda n: _workspace(n, bias=True),
                cpp=("ce_fwd_bwd_inplace", "onednn_matmul"),
            ),
            # The evaluation form: the loss alone (graphs compiled under no_grad), no gradient in the forward.
            OpDescriptor(
                "linear_cross_entropy_loss",
                role=FORWARD,
                random=False,
                recompute=COMPUTE_BOUND,
                precision=LOW,
                workspace_bytes=_workspace_loss,
                cpp=("ce_fwd_bwd_inplace", "onednn_matmul"),
            ),
            # The logits are an output; a chunk of their rows' gradient at a time is the scratch (C++: read from the
            # logits straight into it, ce_fwd_bwd_rows; otherwise the rows are copied there first).
            OpDescriptor(
                "linear_cross_entropy_logits",
                role=FORWARD,
                random=False,
                recompute=COMPUTE_BOUND,
                precision=LOW,
                workspace_bytes=lambda n: _workspace_logits(n, bias=False),
                cpp=("ce_fwd_bwd_rows", "ce_fwd_bwd_inplace", "onednn_matmul"),
            ),
            OpDescriptor(
                "linear_bias_cross_entropy_logits",
                role=FORWARD,
                random=False,
                recompute=COMPUTE_BOUND,
                precision=LOW,
                workspace_bytes=lambda n: _workspace_logits(n, bias=True),
                cpp=("ce_fwd_bwd_rows", "ce_fwd_bwd_inplace", "onednn_matmul"),
            ),
        ),
    )
)
