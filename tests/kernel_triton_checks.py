"""Triton kernels vs references under TRITON_INTERPRET=1 (run in a subprocess by test_kernels_triton.py).

TRITON_INTERPRET must be set before triton is imported, so this runs as its own process. On a GPU
(GRAPHTRAIN_CHECK_DEVICE=cuda, tests/test_cuda.py) the same checks run the compiled kernels on CUDA tensors, in the
dtypes GRAPHTRAIN_CHECK_DTYPES names (float32 by default, TF32 off: the fp32 table)."""

import os
import sys

DEVICE = os.environ.get("GRAPHTRAIN_CHECK_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from graphtrain.kernels import KERNELS  # noqa: E402
from graphtrain.kernels.attention import attention_backward_reference, attention_reference  # noqa: E402
from graphtrain.kernels.bias_dropout_add import bias_dropout_add_reference, dropout_backward_reference  # noqa: E402
from graphtrain.kernels.bias_gelu import bias_gelu_backward_reference, bias_gelu_reference  # noqa: E402
from graphtrain.kernels.cross_entropy import cross_entropy_reference  # noqa: E402
from graphtrain.kernels.layer_norm import layer_norm_backward_reference, layer_norm_reference  # noqa: E402
from graphtrain.kernels.linear_cross_entropy import linear_cross_entropy_reference  # noqa: E402
from graphtrain.kernels.rms_norm import rms_norm_backward_reference, rms_norm_reference  # noqa: E402
from graphtrain.testing import assert_close  # noqa: E402

ops = torch.ops.graphtrain


def check_layer_norm(dtype):
    x = torch.randn(5, 37, dtype=dtype)
    w, b = torch.randn(37, dtype=dtype), torch.randn(37, dtype=dtype)
    assert KERNELS["layer_norm"].implementation_for("cuda", x, w, b) == "triton"
    y, mean, rstd = ops.layer_norm(x, w, b, 1e-5)
    yr, mr, rr = layer_norm_reference(x, w, b, 1e-5)
    assert_close(y, yr, name="ln y")
    assert_close(rstd, rr, name="ln rstd")
    dy = torch.randn_like(x)
    dx, dw, db = ops.layer_norm_backward(dy, x, w, b, mean, rstd)
    dxr, dwr, dbr = layer_norm_backward_reference(dy, x, w, mr, rr)
    assert_close(dx, dxr, name="ln dx")
    assert_close(dw, dwr, name="ln dw")
    assert_close(db, dbr.to(dtype), name="ln db")


def check_rms_norm(dtype):
    x, w = torch.randn(3, 1, 19, dtype=dtype), torch.randn(19, dtype=dtype)
    y, rstd = ops.rms_norm(x, w, 1e-6)
    yr, rr = rms_norm_reference(x, w, 1e-6)
    assert_close(y, yr, name="rms y")
    dy = torch.randn_like(x)
    dx, dw = ops.rms_norm_backward(dy, x, w, rstd)
    dxr, dwr = rms_norm_backward_reference(dy, x, w, rr)
    assert_close(dx, dxr, name="rms dx")
    assert_close(dw, dwr.to(dtype), name="rms dw")


def check_bias_gelu(dtype):
    for approx in ("none", "tanh"):
        x, b = torch.randn(4, 33, dtype=dtype), torch.randn(33, dtype=dtype)
        assert_close(ops.bias_gelu(x, b, approx), bias_gelu_reference(x, b, approx), name=f"gelu {approx}")
        dy = torch.randn_like(x)
        assert_close(
            ops.bias_gelu_backward(dy, x, None, approx),
            bias_gelu_backward_reference(dy, x, None, approx),
            name=f"gelu bwd {approx}",
        )


def check_bias_dropout_add(dtype):
    x, b, r = torch.randn(6, 45, dtype=dtype), torch.randn(45, dtype=dtype), torch.randn(6, 45, dtype=dtype)
    out, seed = ops.bias_dropout_add(x, b, r, 0.3)
    assert_close(out, bias_dropout_add_reference(x, b, r, 0.3, seed), name="bda")  # same hash, same mask
    g = torch.randn_like(x)
    assert_close(ops.dropout_backward(g, 0.3, seed), dropout_backward_reference(g, 0.3, seed), name="bda bwd")


def check_cross_entropy(dtype):
    x = torch.randn(7, 53, dtype=dtype)
    t = torch.randint(0, 53, (7,))
    t[2] = -100
    for red in (0, 1, 2):
        loss, lse = ops.cross_entropy(x, t, -100, red)
        lr, _ = cross_entropy_reference(x, t, -100, red)
        assert_close(loss, lr, name=f"ce loss r{red}")
    xg = x.clone().requires_grad_()
    ops.cross_entropy(xg, t, -100, 1)[0].backward()
    xr = x.clone().requires_grad_()
    torch.nn.functional.cross_entropy(xr.float(), t).backward()
    assert_close(xg.grad, xr.grad.to(dtype), name="ce grad")
    h, w = torch.randn(9, 16, dtype=dtype, requires_grad=True), torch.randn(53, 16, dtype=dtype, requires_grad=True)
    t9 = torch.randint(0, 53, (9,))
    loss = ops.linear_cross_entropy(h, w, t9, -100, 1, 4)[0]
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lr = linear_cross_entropy_reference(h2, w2, t9, -100, 1)
    lr.backward()
    assert_close(loss, lr, name="lce loss")
    assert_close(h.grad, h2.grad, name="lce dh")
    assert_close(w.grad, w2.grad, name="lce dw")
    # a returned head (its logits an output too): the Triton row kernels on copies of the logits' rows
    t9[3] = -100
    h3, w3 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss3, _, _, logits = ops.linear_cross_entropy_logits(h3, w3, t9, -100, 1, 4, True)
    loss3.backward()
    h4, w4 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    lr4 = linear_cross_entropy_reference(h4, w4, t9, -100, 1)
    lr4.backward()
    assert_close(logits, (h.detach() @ w.detach().t()).to(dtype), name="lce logits")
    assert_close(loss3, lr4, name="lce-logits loss")
    assert_close(h3.grad, h4.grad, name="lce-logits dh")
    assert_close(w3.grad, w4.grad, name="lce-logits dw")


def check_attention(dtype):
    for p, causal, mask_shape in (
        (0.0, False, None),
        (0.0, True, (2, 1, 1, 11)),
        (0.25, False, (11, 11)),
        (0.25, True, None),
    ):
        q = torch.randn(2, 3, 11, 8, dtype=dtype)
        k = torch.randn(2, 3, 11, 8, dtype=dtype)
        v = torch.randn(2, 3, 11, 6, dtype=dtype)
        mask = torch.randn(mask_shape, dtype=dtype) if mask_shape else None
        assert KERNELS["attention"].implementation_for("cuda", q, k, v, mask) == "triton flash"
        out, lse, seed = ops.attention(q, k, v, mask, 0.35, causal, p)
        outr, lser = attention_reference(q, k, v, mask, 0.35, causal, p, seed)
        assert_close(out, outr, name=f"attn out p={p} causal={causal}")
        assert_close(lse, lser, name="attn lse")
        do = torch.randn_like(out)
        got = ops.attention_backward(do, q, k, v, mask, out, lse, seed, 0.35, causal, p)
        ref = attention_backward_reference(do, q, k, v, mask, outr, lser, 0.35, causal, p, seed)
        for a, e, n in zip(got, ref, "qkv"):
            assert_close(a, e, name=f"attn d{n} p={p} causal={causal}")
    for p, causal, hkv in ((0.0, True, 1), (0.25, False, 2)):  # grouped-query: 4 query heads, 1 or 2 key/value heads
        q = torch.randn(2, 4, 11, 8, dtype=dtype)
        k, v = torch.randn(2, hkv, 11, 8, dtype=dtype), torch.randn(2, hkv, 11, 6, dtype=dtype)
        assert KERNELS["attention"].implementation_for("cuda", q, k, v, None) == "triton flash"
        out, lse, seed = ops.attention(q, k, v, None, 0.35, causal, p)
        outr, lser = attention_reference(q, k, v, None, 0.35, causal, p, seed)
        assert_close(out, outr, name=f"gqa attn out p={p} hkv={hkv}")
        do = torch.randn_like(out)
        got = ops.attention_backward(do, q, k, v, None, out, lse, seed, 0.35, causal, p)
        ref = attention_backward_reference(do, q, k, v, None, outr, lser, 0.35, causal, p, seed)
        for a, e, n in zip(got, ref, "qkv"):
            assert a.shape == e.shape, (n, a.shape, e.shape)
            assert_close(a, e, name=f"gqa attn d{n} p={p} hkv={hkv}")


if __name__ == "__main__":
    torch.manual_seed(0)
    if DEVICE == "cuda":
        torch.set_default_device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
    names = sys.argv[1:] or ["layer_norm", "rms_norm", "bias_gelu", "bias_dropout_add", "cross_entropy", "attention"]
    for name in names:
        for dtype in os.environ.get("GRAPHTRAIN_CHECK_DTYPES", "float32").split(","):
            globals()[f"check_{name}"](getattr(torch, dtype))
        print("ok", name, flush=True)
