"""The mixed-precision pass: policy on the graph, one cast per parameter, cast cleanup, numerics."""

from __future__ import annotations

import copy

import pytest
import torch

from graphtrain.config.sections import EngineConfig, ModelConfig
from graphtrain.kernels.registry import op_descriptor
from graphtrain.models import build_model
from graphtrain.passes import PassContext, pipeline
from graphtrain.passes.mixed_precision import (
    FOLLOW,
    FP32,
    LOW,
    PRECISION_POLICY,
    apply_mixed_precision_pass,
    count_casts,
    is_cast,
    policy_of,
    set_precision_policy,
)
from graphtrain.pipeline.functional import module_as_function
from graphtrain.pipeline.trace import trace_aten_forward

pytestmark = pytest.mark.usefixtures("one_thread")


LOW_DTYPES = (torch.bfloat16, torch.float16)


def tiny_gpt(attention="explicit", seed=0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(name="gpt2-tiny", attention=attention, dropout=0.0))


def batch(model, B=2, T=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.wte.num_embeddings, (B, T), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def traced(model, inputs, precision="bf16"):
    """(graph after the pass, pass context, parameter tensors) for `model(*inputs)`."""
    f, tensors, kinds = module_as_function(model)
    gm = trace_aten_forward(f, [*tensors, *inputs])
    ctx = PassContext(
        config=EngineConfig(precision=precision), stage="pre_autodiff", input_kinds=kinds + ["input"] * len(inputs)
    )
    return apply_mixed_precision_pass(gm, ctx), ctx, tensors


def loss_and_grads(gm, tensors, inputs):
    params = [t.detach().clone().requires_grad_(True) for t in tensors]
    loss = gm(*params, *inputs)
    return loss.detach(), [g.detach() for g in torch.autograd.grad(loss, params)]


def floating_vals(node):
    vals = torch.utils._pytree.tree_leaves(node.meta.get("val"))
    return [v for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()]


def test_pass_is_registered_after_fusions_and_does_nothing_in_fp32():
    names = [s.name for s in pipeline("pre_autodiff", EngineConfig(precision="bf16"))]
    assert names[-1] == "apply_mixed_precision" or "apply_mixed_precision" in names
    spec = next(s for s in pipeline("pre_autodiff", EngineConfig()) if s.name == "apply_mixed_precision")
    assert spec.changes_numerics and spec.phase == "precision"
    model = tiny_gpt()
    ids, labels = batch(model)
    gm, ctx, _ = traced(model, (ids, labels), precision="fp32")
    assert ctx.rewrites == 0 and "graphtrain_casts" not in gm.meta and count_casts(gm) == 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_policy_on_the_graph(precision, attention):
    model = tiny_gpt(attention)
    ids, labels = batch(model)
    gm, ctx, tensors = traced(model, (ids, labels), precision)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    seen = {LOW: 0, FP32: 0}
    for n in gm.graph.nodes:
        if n.op != "call_function" or is_cast(n):
            continue
        pol = policy_of(n)
        ins = [v for a in n.all_input_nodes for v in floating_vals(a)]
        if pol == FP32 and ins:  # normalization, softmax, reductions, the loss: fp32 in and out
            seen[FP32] += 1
            assert all(v.dtype == torch.float32 for v in ins + floating_vals(n)), n.format_node()
        if pol == LOW:  # matmuls / attention: every floating operand and the result in the low dtype
            seen[LOW] += 1  # (SDPA's second output, the logsumexp, is fp32 by definition)
            assert all(v.dtype == low for v in ins + floating_vals(n)[:1]), n.format_node()
    names = {str(n.target) for n in gm.graph.nodes}
    assert seen[LOW] >= 2 * 4 + 1 and seen[FP32] >= 3  # 4 linears per layer + lm head; 3 layer norms + loss
    assert any("native_layer_norm" in s for s in names) and any("nll_loss" in s for s in names)
    # gelu follows its (low) matmul input: the bulk of elementwise work runs low too
    gelus = [n for n in gm.graph.nodes if "gelu" in str(n.target)]
    assert gelus and all(floating_vals(n)[0].dtype == low for n in gelus)
    # the output signature is unchanged and the graph runs
    out = gm(*tensors, ids, labels)
    assert out.dtype == torch.float32 and out.dim() == 0 and torch.isfinite(out)
    assert ctx.rewrites == gm.meta["graphtrain_casts"]["low_ops"] + gm.meta["graphtrain_casts"]["removed"] > 0


def test_each_parameter_is_cast_once():
    model = tiny_gpt()
    ids, labels = batch(model)
    gm, _, _ = traced(model, (ids, labels))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_params = len(list(model.parameters()))
    casts_per_param = {p: sum(is_cast(u) for u in p.users) for p in placeholders[:n_params]}
    assert max(casts_per_param.values()) == 1
    # every linear weight and bias (and the tied wte/lm-head matrix) gets its one low-precision copy
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    linear_params = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear) for _ in m.parameters(False))
    assert n_linear >= 9
    casts = gm.meta["graphtrain_casts"]
    assert casts["parameter_casts"] == sum(casts_per_param.values()) >= linear_params - 1  # lm head tied to wte
    assert casts["before"] == 0 and casts["after"] == count_casts(gm) > casts["parameter_casts"]


def test_redundant_casts_are_removed():
    def f(x, w1, w2):
        h = (x @ w1).to(torch.bfloat16).float()  # a cast back and forth, as user code often has
        return (h @ w2).softmax(-1)[:, 0].sum()

    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 16), torch.randn(16, 4)
    gm = trace_aten_forward(f, [x, w1, w2])
    assert count_casts(gm) == 2
    ctx = PassContext(config=EngineConfig(precision="bf16"), stage="pre_autodiff")
    gm = apply_mixed_precision_pass(gm, ctx)
    casts = [n for n in gm.graph.nodes if is_cast(n)]
    # x, w1, w2 down once each, the second matmul's output up once for softmax; no cast of a cast
    assert len(casts) == 4 and gm.meta["graphtrain_casts"] == {**gm.meta["graphtrain_casts"], "before": 2, "after": 4}
    assert not any(is_cast(c.args[0]) for c in casts)
    assert gm.meta["graphtrain_casts"]["removed"] >= 1
    torch.testing.assert_close(gm(x, w1, w2), f(x, w1, w2), rtol=2e-2, atol=2e-2)


def test_policy_table_is_extensible_and_validated():
    model = tiny_gpt()
    ids, labels = batch(model)
    old = PRECISION_POLICY.get("aten::gelu")
    set_precision_policy(torch.ops.aten.gelu.default, FP32)
    try:
        gm, _, _ = traced(model, (ids, labels))
        gelus = [n for n in gm.graph.nodes if "gelu" in str(n.target)]
        assert gelus and all(floating_vals(n)[0].dtype == torch.float32 for n in gelus)
    finally:
        if old is None:
            PRECISION_POLICY.pop("aten::gelu")
        else:
            PRECISION_POLICY["aten::gelu"] = old
    # graphtrain's fused ops: from their descriptors (rms_norm like layer_norm: normalization statistics in fp32)
    policy = {name: op_descriptor(name).precision for name in ("layer_norm", "rms_norm", "attention", "bias_gelu")}
    assert policy == {"layer_norm": FP32, "rms_norm": FP32, "attention": LOW, "bias_gelu": FOLLOW}
    assert not [k for k in PRECISION_POLICY if k.startswith("graphtrain::")]
    with pytest.raises(ValueError, match="descriptor"):
        set_precision_policy("graphtrain::layer_norm", LOW)
    with pytest.raises(ValueError, match="policy must be"):
        set_precision_policy("aten::mm", "half")
    with pytest.raises(ValueError, match="namespace"):
        set_precision_policy("mm", LOW)
    with pytest.raises(TypeError, match="op or a"):
        set_precision_policy(3, LOW)


def relative_error(x, ref):
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_error_against_fp64_no_larger_than_autocast(attention):
    model = tiny_gpt(attention)
    ids, labels = batch(model, B=4, T=64)
    gm, _, tensors = traced(model, (ids, labels))
    loss, grads = loss_and_grads(gm, tensors, (ids, labels))

    ref_model = copy.deepcopy(model).double()
    ref_loss = ref_model(ids, labels)
    ref_grads = torch.autograd.grad(ref_loss, list(ref_model.parameters()))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        ac_loss = model(ids, labels)
    ac_grads = torch.autograd.grad(ac_loss, list(model.parameters()))

    ref_loss, ac_loss = ref_loss.detach(), ac_loss.detach()
    ours_loss_err, ac_loss_err = abs(float(loss) - float(ref_loss)), abs(float(ac_loss) - float(ref_loss))
    ours_grad_err = sum(relative_error(g, r) for g, r in zip(grads, ref_grads)) / len(grads)
    ac_grad_err = sum(relative_error(g, r) for g, r in zip(ac_grads, ref_grads)) / len(grads)
    # Same bf16 roundings as autocast (matmul operands and outputs, follow-the-inputs elementwise),
    # so the errors nearly coincide: measured ours/autocast 0.99-1.01 over 4 seeds x both attention
    # kinds. 1.1x (+ 5e-6, ~10 fp32 ulps of a loss of 6) absorbs fp32 summation-order noise;
    # letting layer norm or softmax run in bf16 raises our error well past it.
    assert ours_loss_err <= 1.1 * ac_loss_err + 5e-6, (ours_loss_err, ac_loss_err)
    assert ours_grad_err <= 1.1 * ac_grad_err, (ours_grad_err, ac_grad_err)
    assert all(g.dtype == torch.float32 for g in grads)  # master weights get fp32 gradients


def test_end_to_end_through_accelerate():
    import graphtrain

    model = tiny_gpt()
    ref = copy.deepcopy(model)
    ids, labels = batch(model)
    graphtrain.accelerate(model, precision="bf16", provider="aten", fallback="error")
    loss = model(ids, labels)
    loss.backward()
    ref_loss = ref(ids, labels)
    ref_loss.backward()
    records = [r for r in model._graphtrain.passes if r.name == "apply_mixed_precision"]
    # one record per graph (the model compiles block by block): the blocks' matmuls are rewritten
    assert records and sum(r.rewrites for r in records) > 0 and all(r.error is None for r in records)
    assert loss.dtype == torch.float32
    # bf16 has 8 bits of mantissa: loss and gradients within bf16 tolerances of fp32 eager
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        rel = float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-12))
        assert rel < 5e-2, (n, rel)


class _MaskedScores(torch.nn.Module):
    """Attention scores masked the way Hugging Face DeBERTa-v2 masks them: with the most negative value of the
    scores' own dtype, which a graph traced in fp32 holds as fp32's -3.4e38."""

    def __init__(self):
        super().__init__()
        self.q, self.k = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x, keep):
        q, k = self.q(x), self.k(x)
        scores = q @ k.transpose(-1, -2)
        scores = scores.masked_fill(~keep, torch.finfo(q.dtype).min)
        return (scores.softmax(-1) @ x).square().mean()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mask_value_beyond_the_low_dtypes_range_fits_it_as_under_autocast(precision):
    """Regression (HF DeBERTa-v2 in bf16): the masked_fill ran in bf16 with fp32's minimum and its kernel raised
    "value cannot be converted to type c10::BFloat16 without overflow"; under fallback=error that was the user's
    error. The fill value is now the low dtype's own minimum, what the model computes under eager autocast."""
    import graphtrain

    torch.manual_seed(0)
    model = _MaskedScores()
    ref = copy.deepcopy(model)
    x, keep = torch.randn(2, 8, 16), torch.rand(2, 8, 8) > 0.3
    graphtrain.accelerate(model, precision=precision, provider="aten", fallback="error")
    loss = model(x, keep)
    loss.backward()
    with torch.autocast("cpu", dtype=LOW_DTYPES[("bf16", "fp16").index(precision)]):
        ref_loss = ref(x, keep)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss.float(), rtol=2e-2, atol=2e-2)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=5e-2, atol=5e-2)


class _ComplexRotary(torch.nn.Module):
    """Rotary position embedding in complex numbers, as Meta's Llama and torchtitan write it
    (`torch.view_as_complex(x.float()...)`), then a spectral mix (an FFT) of a matmul's output."""

    def __init__(self):
        super().__init__()
        self.q, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        angles = torch.outer(torch.arange(8).float(), torch.rand(8))
        self.register_buffer("freqs", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x):
        q = self.q(x)
        qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        q = torch.view_as_real(qc * self.freqs).flatten(-2).type_as(q)
        mixed = torch.fft.rfft(self.out(q), dim=-1).abs()
        return mixed.square().mean()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_complex_numbers_and_ffts_stay_in_fp32_as_under_autocast(precision):
    """Regression: the rotary's `.float()` leaves no cast in a graph traced in fp32, so the pass fed the matmul's
    low-precision output to view_as_complex ("only supported for half, float and double", in bf16) and the whole
    mixed-precision pass fell back. Complex and FFT ops now compute in fp32."""
    import graphtrain

    torch.manual_seed(0)
    model = _ComplexRotary()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 8, 16)
    graphtrain.accelerate(model, precision=precision, provider="aten", fallback="error")
    loss = model(x)
    loss.backward()
    with torch.autocast("cpu", dtype=LOW_DTYPES[("bf16", "fp16").index(precision)]):
        ref_loss = ref(x)
    ref_loss.backward()
    records = [r for r in model._graphtrain.passes if r.name == "apply_mixed_precision"]
    assert records and all(r.error is None for r in records) and sum(r.rewrites for r in records) > 0
    torch.testing.assert_close(loss, ref_loss.float(), rtol=2e-2, atol=2e-2)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=5e-2, atol=5e-2)
