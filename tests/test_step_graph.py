"""graphtrain.compile_step: forward, loss, backward, clipping, AdamW and loss scaling as one graph, checked
against eager PyTorch with graphtrain's optimizer step (FusedAdamW = torch.optim.AdamW(fused=True))."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphtrain
from graphtrain.config.sections import Config, ModelConfig, OptimConfig
from graphtrain.models import build_model
from graphtrain.optim import build_optimizer, optimizer_step
from graphtrain.testing import assert_close
from test_engine_autograd_functions import ScaledSiLU  # old-style (ctx in forward), twice SiLU's derivative

pytestmark = pytest.mark.usefixtures("one_thread")
NO_FUSIONS = {
    n: False
    for n in (
        "fuse_attention",
        "fuse_layer_norm",
        "fuse_bias_gelu",
        "fuse_cross_entropy",
        "fuse_linear_cross_entropy",
        "fuse_bias_dropout_add",
    )
}


def _batch(seed=0, shape=(4, 32)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, shape, generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


def _eager_steps(model, batches, cfg, lrs):
    opt = build_optimizer(model, cfg.optim)
    out = []
    for b, lr in zip(batches, lrs):
        for g in opt.param_groups:
            g["lr"] = lr
        loss = model(**b)
        loss.backward()
        info = optimizer_step(opt, model.parameters(), grad_clip=cfg.optim.grad_clip)
        opt.zero_grad(set_to_none=True)
        out.append((loss.detach(), info["grad_norm"]))
    return out


def _trains_like_eager(step, model, ref, cfg, batch, steps=2, **loss_tol):
    """`steps` steps of `step` (compile_step of `model`) against eager AdamW on `ref` (a copy of `model` taken before
    the first step), one batch: the loss of every step (dtype tolerance unless `loss_tol`), then every weight."""
    opt = build_optimizer(ref, cfg.optim)
    for i in range(steps):
        got = step(**batch)
        out = ref(**batch)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        optimizer_step(opt, ref.parameters(), grad_clip=cfg.optim.grad_clip)
        opt.zero_grad(set_to_none=True)
        assert_close(got["loss"], loss.detach(), name=f"loss of step {i}", **loss_tol)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, name=f"weight {n}", atol=1e-6, rtol=1e-5)


# inductor: slow (56 s on the 2-core AVX2 EPYC, the default suite's slowest test): the aten case checks the whole-step
# graph itself; Inductor compiling graphs is checked by the default suite elsewhere (fusion, tiered compile tests).
# blocks: the model's graphs compiled block by block, then the update graph (a model with repeated blocks, the
# default); one graph: the whole step traced as one (engine.compile_blocks false).
@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "one-graph"])
@pytest.mark.parametrize("provider", ["aten", pytest.param("inductor", marks=pytest.mark.slow)])
def test_whole_step_matches_eager_adamw_with_clipping(provider, blocks):
    torch.manual_seed(0)
    cfg = Config(optim=OptimConfig(lr=3e-3, grad_clip=0.5))  # small clip: clipping is active every step
    model = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))
    ref = copy.deepcopy(model)
    step = graphtrain.compile_step(model, cfg, provider=provider, passes=NO_FUSIONS, compile_blocks=blocks)
    assert step.by_blocks == blocks
    batches, lrs = [_batch(i % 2) for i in range(4)], [3e-3, 2e-3, 1e-3, 1e-3]
    expect = _eager_steps(ref, batches, cfg, lrs)
    for b, lr, (le, ne) in zip(batches, lrs, expect):
        out = step(lr=lr, **b)
        assert_close(out["loss"], le, name=f"{provider} loss")
        assert_close(out["grad_norm"], torch.tensor(ne), name=f"{provider} grad norm")
        assert ne > 0.5 and out["skipped"] is False
    # Weights after 4 AdamW steps: Adam divides by sqrt(v) + eps, so for a near-zero gradient an fp32
    # reduction-order difference in g moves the update by a visible fraction of lr. Measured worst case:
    # 2.3e-5 on one of 16,384 elements (Inductor, AMD EPYC AVX-512); 2e-5 held on an AMX Xeon.
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, name=f"{provider} weight {n}", atol=5e-5, rtol=1e-4)
    assert step.provider == provider
    targets = {str(n.target) for n in step.graph.graph.nodes if n.op == "call_function"}
    if blocks:  # each block compiled once; the update graph after the backward, torch's fused AdamW in it
        rep = graphtrain.report(model)
        assert rep.blocks == ["blocks (2 x Block)"] and len(rep.graphs) == 3, (rep.blocks, len(rep.graphs))
        assert [g["calls_per_step"] for g in rep.graphs] == [1, 2, 1]
        assert "aten._fused_adamw_.tensor_lr" in targets and "aten._foreach_norm.Scalar" in targets
        assert not any("mm" in t for t in targets)
    elif provider == "aten":  # one graph holds the backward and the update
        assert "aten._fused_adamw_.tensor_lr" in targets and "aten._foreach_norm.Scalar" in targets
        assert any("mm" in t for t in targets)


def test_recompute_partitions_the_step_and_trains_as_eager():
    """Regression: under engine.recompute full or auto, compile_step built one graph of the whole step, which has no
    forward/backward partition for recompute to act on: the setting was silently ignored (gpt2-mini, b8 s256,
    recompute full: 793 MB peak against 816 without; 635 MB now). The step now trains through the model's graphs,
    compiled with the recompute partitioner, and the update graph."""
    torch.manual_seed(0)
    cfg = Config(optim=OptimConfig(lr=3e-3, grad_clip=0.5))
    model = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))
    ref = copy.deepcopy(model)
    step = graphtrain.compile_step(model, cfg, provider="aten", recompute="full", fallback="error", passes=NO_FUSIONS)
    _trains_like_eager(step, model, ref, cfg, _batch())
    (rec,) = model._graphtrain.recompute
    assert rec.chosen == "full" and "layers checkpointed" in rec.choices[-1].what, rec
    assert step.through_model and step.provider == "aten"


def test_dynamic_step_by_blocks_compiles_once_for_every_length():
    """engine.dynamic=true used to take the whole step as one graph, traced anew for every batch shape. By blocks,
    the model's graphs are symbolic in the length: three lengths, one block graph, no recompile, each step as
    eager's."""
    torch.manual_seed(0)
    cfg = Config(optim=OptimConfig(lr=3e-3, grad_clip=0.5))
    model = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))
    ref = copy.deepcopy(model)
    step = graphtrain.compile_step(model, cfg, provider="aten", passes=NO_FUSIONS, dynamic=True)
    assert step.by_blocks
    batches, lrs = [_batch(i, shape=(2, length)) for i, length in enumerate((16, 9, 23))], [3e-3, 2e-3, 1e-3]
    for b, lr, (le, ne) in zip(batches, lrs, _eager_steps(ref, batches, cfg, lrs)):
        out = step(lr=lr, **b)
        assert_close(out["loss"], le, name="loss")
        assert_close(out["grad_norm"], torch.tensor(ne), name="grad norm")
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, name=f"weight {n}", atol=5e-5, rtol=1e-4)
    rep = graphtrain.report(model)
    assert rep.blocks == ["blocks (2 x Block)"] and not rep.recompiles and not rep.fallbacks, str(rep)
    assert [g["calls_per_step"] for g in rep.graphs] == [1, 2, 1], str(rep)


def test_whole_step_bf16_with_default_fusions_trains():
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="gpt2-tiny"))  # dropout on
    step = graphtrain.compile_step(model, Config(), provider="aten", precision="bf16", compile_blocks=False)
    b = _batch()
    losses = [float(step(lr=3e-3, **b)["loss"]) for _ in range(15)]
    assert losses[-1] < losses[0] - 0.5, losses
    done = {r.name: r.rewrites for r in step.pass_records}
    assert done["fuse_attention"] == 2 and done["apply_mixed_precision"] > 0 and done["fuse_layer_norm"] >= 4
    dtypes = {
        n.meta["val"].dtype
        for n in step.graph.graph.nodes
        if n.op == "call_function" and "mm" in str(n.target) and "val" in n.meta
    }
    assert torch.bfloat16 in dtypes


class _BlowUp(nn.Module):
    """Multiplies the loss by a batch input, so one step can be made to overflow in fp16."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, labels, blow):
        return self.inner(input_ids=input_ids, labels=labels) * blow


@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "one-graph"])
def test_fp16_overflow_skips_exactly_that_step_inside_the_graph(blocks):
    torch.manual_seed(0)
    model = _BlowUp(build_model(ModelConfig(name="gpt2-tiny", dropout=0.0)))
    cfg = Config()
    cfg.engine.loss_scale_init, cfg.engine.loss_scale_hysteresis, cfg.engine.loss_scale_interval = 1024.0, 2, 4
    step = graphtrain.compile_step(
        model, cfg, provider="aten", precision="fp16", passes=NO_FUSIONS, compile_blocks=blocks
    )
    assert step.by_blocks == blocks
    b = _batch()
    scales, skipped, losses = [], [], []
    for i in range(12):
        before = [p.detach().clone() for p in model.parameters()]
        counters = [float(t) for t in step.state_steps]
        out = step(lr=3e-3, blow=torch.tensor(1e6 if i in (5, 6) else 1.0), **b)
        changed = any(not torch.equal(x, p) for x, p in zip(before, model.parameters()))
        assert changed == (i not in (5, 6)), i
        assert [float(t) for t in step.state_steps] == [c + (i not in (5, 6)) for c in counters]
        scales.append(out["scale"])
        skipped.append(out["skipped"])
        losses.append(float(out["loss"]) / (1e6 if i in (5, 6) else 1.0))
    assert skipped == [i in (5, 6) for i in range(12)]
    # grows every 4 clean steps (1024 -> 2048 after step 3); hysteresis 2: the first overflow (step 5)
    # keeps the scale, the second (step 6) backs off to 1024; then 4 clean steps (7-10) grow it again.
    assert scales == [1024.0] * 3 + [2048.0] * 3 + [1024.0] * 4 + [2048.0] * 2, scales
    assert step.skipped_steps == 2
    assert losses[-1] < losses[0]


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))
    step = graphtrain.compile_step(model, Config(), provider="aten", passes=NO_FUSIONS)
    b = _batch()
    for _ in range(3):
        step(**b)
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(step.state_dict())
    expect = [float(step(**b)["loss"]) for _ in range(2)]
    other = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))
    other.load_state_dict(weights)
    resumed = graphtrain.compile_step(other, Config(), provider="aten", passes=NO_FUSIONS)
    resumed.load_state_dict(state)
    assert [float(resumed(**b)["loss"]) for _ in range(2)] == expect
    with pytest.raises(ValueError, match="lacks parameters"):
        resumed.load_state_dict({"exp_avg": {}, "exp_avg_sq": {}, "step": {}})


def test_user_errors_are_clear():
    model = build_model(ModelConfig(name="gpt2-tiny"))
    with pytest.raises(ValueError, match="AdamW"):
        graphtrain.compile_step(model, Config(optim=OptimConfig(name="lamb")))
    step = graphtrain.compile_step(model, Config(), provider="aten")
    with pytest.raises(TypeError, match="keyword arguments"):
        step()
    with pytest.raises(TypeError, match="must be tensors"):
        step(input_ids=[1, 2])

    class NoLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return {"out": self.w * x}

    with pytest.raises(TypeError, match="must return the loss"):
        graphtrain.compile_step(NoLoss(), Config(), provider="aten")(x=torch.ones(3))


def test_report_shows_the_step_graph_passes_and_fallbacks(monkeypatch):
    """compile_step records like accelerate: graphtrain.report(model) lists the step graph, its passes and a
    provider fallback (here Inductor made to fail: the step runs on aten, and says so)."""
    from graphtrain.frontend.compile_step import CompiledStep

    torch.manual_seed(0)
    model = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))
    real = CompiledStep._compile

    def broken(graph, args, provider):
        if provider == "inductor":
            raise RuntimeError("inductor is broken in this test")
        return real(graph, args, provider)

    monkeypatch.setattr(CompiledStep, "_compile", staticmethod(broken))
    step = graphtrain.compile_step(model, Config(), provider="inductor", fallback="silent", compile_blocks=False)
    step(**_batch())
    assert step.provider == "aten"
    rep = graphtrain.report(model)
    g = rep.graphs[0]
    assert g["name"] == "step" and g["provider"] == "aten" and g["ops_captured"] > g["ops_pre_autodiff"] > 0
    assert [part for part, _ in rep.fallbacks] == ["provider inductor on step (compile_step(GPT2))"]
    assert "inductor is broken" in str(rep)
    assert {p["name"] for p in rep.passes} >= {"fuse_attention", "fuse_layer_norm"}


def test_the_step_graph_gets_the_inductor_providers_checks():
    """compile_step compiles through runtime/providers.py compile_step_graph, so the Inductor provider's checks hold
    for the whole step too: on CPU, ATen random ops (dropout with graphtrain's dropout fusions off) are refused
    before Inductor compiles (it can run the mask's bernoulli_ after the kernel reading it), and the step runs on
    aten, saying why."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="gpt2-tiny"))  # dropout on
    step = graphtrain.compile_step(
        model, Config(), provider="inductor", passes=NO_FUSIONS, fallback="silent", compile_blocks=False
    )
    out = step(**_batch())
    assert step.provider == "aten" and torch.isfinite(out["loss"])
    ((part, why),) = graphtrain.report(model).fallbacks
    assert part == "provider inductor on step (compile_step(GPT2))" and "ATen random ops" in why, why


def test_a_second_compile_of_the_same_step_loads_it_from_inductors_cache(tmp_path):
    """Regression: the step graph was handed to Inductor with real inputs, whose fake mode had no shape environment,
    so Inductor bypassed its FX-graph cache ("No shape env") and every process compiled the whole step anew."""
    from torch._dynamo.utils import counters

    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden, self.out = nn.Linear(8, 16), nn.Linear(16, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(self.out(torch.tanh(self.hidden(x))), y)

    x, y = torch.randn(6, 8), torch.randn(6, 1)
    seen = []
    for _ in range(2):
        before = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_bypass"]
        torch.manual_seed(0)
        step = graphtrain.compile_step(Regression(), provider="inductor", cache_dir=str(tmp_path / "cache"))
        seen.append(float(step(lr=1e-2, x=x, y=y)["loss"]))
        assert step.provider == "inductor"
        assert counters["inductor"]["fxgraph_cache_bypass"] == before[1]
    assert counters["inductor"]["fxgraph_cache_hit"] > before[0]  # the second compile found the first's
    assert seen[0] == seen[1]


def test_hf_bart_step_compiles_whole_and_trains_as_eager():
    """Regression: HF BART's mask helper (masking_utils._ignore_causal_mask_sdpa) read the padding mask's values to
    decide whether SDPA's is_causal could stand in for the mask; on the trace's fake tensors that raised
    DataDependentOutputException and the whole step ran uncompiled (GPT-2 under recompute too). The trace now runs
    with torch.compiler.is_compiling() true, as torch.export's does, and the helper builds the mask: one step graph,
    matching eager AdamW."""
    pytest.importorskip("transformers")
    from graphtrain.bench.families import build_family

    torch.manual_seed(0)
    model, batch = build_family("bart", hidden=32, layers=1, vocab=101, batch=2, seq=16, dropout=False)
    ref = copy.deepcopy(model)
    cfg = Config(optim=OptimConfig(lr=1e-3, grad_clip=1.0))
    step = graphtrain.compile_step(model, cfg, provider="aten", fallback="error")
    _trains_like_eager(step, model, ref, cfg, batch)
    assert step.provider == "aten" and not graphtrain.report(model).fallbacks


class _NoGradScale(nn.Module):
    """A scale computed from a weight under no_grad: eager gives that weight no gradient through the scale."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.a(x).abs().mean()
        return (self.b(x) * scale + self.a(x)).square().mean()


class _OwnBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(ScaledSiLU.apply(self.a(x))).square().mean()


class _LearnedBias(nn.Module):
    """Swin's pattern: a learned bias added to a fixed window mask, as SDPA's mask; eager's SDPA gives the bias a
    gradient (the math kernel), CPU flash attention cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 48)
        self.bias = nn.Parameter(torch.randn(1, 2, 6, 6) * 0.1)
        self.register_buffer("window", torch.zeros(3, 1, 6, 6).masked_fill(torch.rand(3, 1, 6, 6) < 0.3, -100.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(3, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias + self.window)
        return o.square().mean()


def _one_graph_trains_like_eager(model: nn.Module, fallback: str, steps: int = 3):
    """compile_step of `model` as one step graph on aten against eager AdamW on a copy (`_trains_like_eager`), on
    the [3, 6, 8] input `x` the models above take; returns the step."""
    torch.manual_seed(0)
    ref = copy.deepcopy(model)
    cfg = Config(optim=OptimConfig(lr=1e-2, grad_clip=1.0))
    step = graphtrain.compile_step(model, cfg, provider="aten", compile_blocks=False, fallback=fallback)
    x = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(1))
    _trains_like_eager(step, model, ref, cfg, {"x": x}, steps=steps)
    return step


@pytest.mark.parametrize("make", [_NoGradScale, _OwnBackward, _LearnedBias], ids=["no_grad", "function", "mask"])
def test_the_one_step_graph_sees_the_forward_as_dynamo_records_it(make):
    """Regression: compile_step's one-graph path traced the forward directly, under no_grad, where accelerate
    captures it with Dynamo first. (1) A no_grad block inside the forward was invisible, and the step differentiated
    through it: silently wrong weights. (2) An old-style autograd.Function (HF Bloom's GELU) raised in functorch's
    functionalize, and (3) a learned SDPA mask (HF Swin) reached CPU flash attention, whose backward refuses it: the
    step ran eagerly. The forward is now captured with Dynamo and the dynamo stage's passes run on it."""
    torch.manual_seed(0)
    model = make()
    step = _one_graph_trains_like_eager(model, fallback="error")
    assert step.provider == "aten" and not graphtrain.report(model).fallbacks


def test_a_no_grad_block_dynamo_cannot_capture_runs_eagerly_not_wrong(recwarn):
    """A forward with a graph break cannot be captured whole by Dynamo; compile_step then traces it directly, which
    cannot see a no_grad block. With such a block the step runs eagerly (reported) instead of differentiating
    through it."""

    class Breaks(_NoGradScale):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._dynamo.graph_break()
            return super().forward(x)

    torch.manual_seed(0)
    model = Breaks()
    step = _one_graph_trains_like_eager(model, fallback="warn")
    assert step.provider == "eager"
    ((part, reason),) = graphtrain.report(model).fallbacks
    assert "step graph" in part and "no_grad block" in reason, reason


def test_a_log_call_in_the_forward_does_not_stop_the_capture():
    """A library's log line in the forward (HF GPT-2's warning_once about its loss type) was a graph break, so the
    forward was traced directly; with a no_grad block as well, the step then ran eagerly. The capture skips log calls,
    as torch.export does: one step graph, trained as eager."""
    import logging

    log = logging.getLogger("graphtrain.tests.a_model")

    class Logs(_NoGradScale):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            log.warning("a model's own warning")
            return super().forward(x)

    before = set(getattr(torch._dynamo.config, "ignore_logging_functions", set()))  # transformers adds its own
    torch.manual_seed(0)
    model = Logs()
    step = _one_graph_trains_like_eager(model, fallback="error", steps=2)
    assert step.provider == "aten" and not graphtrain.report(model).fallbacks
    assert getattr(torch._dynamo.config, "ignore_logging_functions", set()) == before  # the user's setting again


@pytest.mark.slow  # an Inductor compile of the step: 10 s on a 2-core Zen 4
def test_a_broadcast_baddbmm_and_an_autograd_function_compile_on_inductor():
    """Regression (HF Bloom under compile_step, provider inductor): the step graph was traced for Inductor on fake
    tensors with symbolic sizes, and torch 2.13's fake baddbmm cannot expand a broadcast input to symbolic sizes
    (Bloom adds its alibi bias that way): the step ran eagerly. The step graph's sizes are static now, as its
    rebuild on every new shape already assumed."""

    class Alibi(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qk, self.bias = nn.Linear(8, 16), nn.Parameter(torch.randn(3, 1, 6) * 0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k = ScaledSiLU.apply(self.qk(x)).chunk(2, -1)
            return torch.baddbmm(self.bias, q, k.transpose(1, 2), alpha=0.25).softmax(-1).square().mean()

    torch.manual_seed(0)
    model = Alibi()
    ref = copy.deepcopy(model)
    cfg = Config(optim=OptimConfig(lr=1e-2, grad_clip=1.0))
    step = graphtrain.compile_step(model, cfg, provider="inductor", compile_blocks=False, fallback="error")
    x = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(1))
    _trains_like_eager(step, model, ref, cfg, {"x": x}, steps=2, atol=1e-6, rtol=1e-5)
    assert step.provider == "inductor" and not graphtrain.report(model).fallbacks


def test_a_step_that_cannot_be_traced_whole_runs_uncompiled_and_says_why(recwarn):
    """A forward whose control flow reads a tensor's value cannot be traced whole on fake tensors
    (DataDependentOutputException). compile_step then runs the same step op by op, matching eager AdamW, with the
    fallback named in the report and one warning; under fallback=error it is one GraphtrainCaptureError line."""
    from graphtrain.config.fallback import GraphtrainCaptureError

    class ReadsAValue(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if h.sum() > 0:  # a branch on a value: no graph holds both sides
                h = torch.relu(h)
            return nn.functional.mse_loss(self.b(h), y)

    torch.manual_seed(0)
    model, x, y = ReadsAValue(), torch.randn(6, 8), torch.randn(6, 1)
    ref = copy.deepcopy(model)
    cfg = Config(optim=OptimConfig(lr=1e-2, grad_clip=1.0))
    step = graphtrain.compile_step(model, cfg, fallback="warn")
    _trains_like_eager(step, model, ref, cfg, {"x": x, "y": y})
    assert step.provider == "eager"
    ((part, reason),) = graphtrain.report(model).fallbacks
    assert "step graph" in part and "DataDependentOutputException" in reason
    assert sum("runs uncompiled" in str(w.message) for w in recwarn) == 1
    strict = graphtrain.compile_step(copy.deepcopy(ref), cfg, fallback="error")
    with pytest.raises(GraphtrainCaptureError, match="DataDependentOutputException"):
        strict(x=x, y=y)


def test_a_view_traced_against_eagers_strides_compiles_on_inductor():
    """Regression (HF T5 under compile_step, provider inductor): the step graph is traced to aten with eager's
    strides, and a reshape that was a view there is recorded as aten.view. Inductor's decompositions then gave the
    concatenation of keys to an empty cache the new keys' strides (cat of one non-empty input becomes its clone),
    the view no longer applied ("Cannot view a tensor with shape ..."), and the whole step fell back to aten. Views
    reach Inductor as reshapes now: it compiles, and it trains as eager does."""

    class EmptyCache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(64, 64)
            self.register_buffer("cache", torch.empty(2, 4, 0, 16), persistent=False)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            k = self.proj(x).view(2, 32, 4, 16).transpose(1, 2)  # [B, H, S, D] over a [B, S, H, D] buffer
            k = torch.cat([self.cache, k], -2)  # eager: a contiguous [B, H, S, D]
            scores = torch.matmul(k, k.transpose(2, 3))  # matmul views k^T as [B * H, D, S]
            return nn.functional.mse_loss(scores.mean(-1), y)

    torch.manual_seed(0)
    model, x, y = EmptyCache(), torch.randn(2, 32, 64), torch.randn(2, 4, 32)
    ref = copy.deepcopy(model)
    cfg = Config(optim=OptimConfig(lr=1e-2))
    step = graphtrain.compile_step(model, cfg, provider="inductor", fallback="error")
    _trains_like_eager(step, model, ref, cfg, {"x": x, "y": y}, atol=1e-6, rtol=1e-5)
    assert step.provider == "inductor"


@pytest.mark.parametrize("blocks", [False, True])
def test_a_channels_last_gradient_updates_its_weight_as_eager(blocks):
    """Regression (HF ViT under compile_step, provider inductor): a convolution's weight gradient comes out
    channels-last when its input is (a channels-last batch here; Inductor's layout optimization in ViT's case), and
    torch._fused_adamw_ walked it as if it had the weight's layout: the weight moved along its gradient permuted,
    silently. Eager's AccumulateGrad gives p.grad the parameter's layout; the step's update now does the same."""

    class Patches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.head = nn.Conv2d(3, 8, 4, stride=4), nn.Linear(8 * 16, 1)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8 * 16, 8 * 16), nn.Tanh()) for _ in range(2))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.conv(x).flatten(1)
            for block in self.blocks:
                h = block(h)
            return nn.functional.mse_loss(self.head(h), y)

    torch.manual_seed(0)
    model, y = Patches(), torch.randn(2, 1)
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    cfg = Config(optim=OptimConfig(lr=1e-2))
    step = graphtrain.compile_step(model, cfg, provider="aten", fallback="error", compile_blocks=blocks)
    _trains_like_eager(step, model, ref, cfg, {"x": x, "y": y}, atol=1e-6, rtol=1e-5)
    assert step.by_blocks == blocks


def test_views_written_through_stay_views_for_inductor():
    """views_as_reshapes (what Inductor is handed) turns a view into a reshape only where nothing writes through it:
    compile_step's graph holds in-place updates, and a reshape that copied would take such a write away from its
    base. A view written directly, or through a view of it, stays aten.view."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphtrain.runtime.providers import views_as_reshapes

    def f(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        p.view(-1).add_(1.0)
        x.view(4, 4).t().mul_(2.0)
        return (x.view(16) * 2).sum()

    gm = make_fx(f)(torch.randn(16), torch.randn(4, 4))
    targets = [n.target for n in views_as_reshapes(gm).graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    assert targets.count(aten.view.default) == 2 and targets.count(aten.reshape.default) == 1, targets
    assert sum(n.target == aten.view.default for n in gm.graph.nodes) == 3  # the module's own graph is unchanged
