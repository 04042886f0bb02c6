"""The memory optimizer inside the engine: recompute partitioner (every mode), RNG parity with eager, boxed
backward, resolved provider for stage passes, recompute/peak-memory report, report_for_config.

The models here compile as one graph (compile_blocks=False): these tests compare the partitioner's modes on a
whole model's graph; tests/test_engine_blocks.py covers models compiled block by block."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import graphtrain
from graphtrain.config.fallback import GraphtrainCaptureError
from graphtrain.config.sections import Config, ModelConfig
from graphtrain.memory.recompute import is_random
from graphtrain.models import build_model
from graphtrain.testing import assert_close, assert_grads_close

# Fusion passes are other engineers' (with their own parity tests); these tests check the memory wiring.
NO_FUSION = {
    n: False
    for n in (
        "fuse_attention",
        "fuse_cross_entropy",
        "fuse_linear_cross_entropy",
        "fuse_bias_dropout_add",
        "fuse_bias_gelu",
        "fuse_layer_norm",
        "fuse_rms_norm",
    )
}


@pytest.fixture(autouse=True)
def _many_instances():
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


class MLP(nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.drop(torch.nn.functional.gelu(self.b(torch.relu(self.a(x))))))


def _passes(**extra):
    from graphtrain.passes.manager import registered_passes

    return {k: v for k, v in {**NO_FUSION, **extra}.items() if k in registered_passes()}


@pytest.fixture
def boxed_graphs(monkeypatch):
    """Every fw/bw graph the aten provider hands to to_boxed (after the stage passes)."""
    import graphtrain.pipeline.stages as pipeline

    seen: list[torch.fx.GraphModule] = []
    real = pipeline.to_boxed

    def spy(gm):
        seen.append(gm)
        return real(gm)

    monkeypatch.setattr(pipeline, "to_boxed", spy)
    return seen


def _gpt2_tiny():
    torch.manual_seed(0)
    return build_model(ModelConfig(name="gpt2-tiny", dropout=0.1)).train()


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 512, (2, 32), generator=g), torch.randint(0, 512, (2, 32), generator=g)


def _train(model, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(11)
    losses, rng = [], []
    for step in range(steps):
        loss = model(*_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        rng.append(torch.get_rng_state())
    return torch.stack(losses), rng


def test_aten_dropout_rng_matches_eager_and_backward_has_no_random_op(boxed_graphs):
    """A random op in the backward would re-draw numbers there: the RNG state after a step would differ from
    eager's and so would step 2's dropout. The recompute partitioner drops dead random ops that AOTAutograd's
    partitioners copy into the backward (rewrites.drop_dead_random_ops)."""
    ref = _gpt2_tiny()
    m = graphtrain.accelerate(
        copy.deepcopy(ref), compile_blocks=False, provider="aten", fallback="error", passes=_passes()
    )
    losses_e, rng_e = _train(ref, 2)
    losses_g, rng_g = _train(m, 2)
    assert torch.equal(rng_g[0], rng_e[0])  # after one training step
    assert_close(losses_g, losses_e, name="losses", bitwise=True)  # step 2's dropout masks are eager's
    backward = [
        g for g in boxed_graphs if any(n.op == "placeholder" and n.name.startswith("tangents_") for n in g.graph.nodes)
    ]
    assert backward and not [n for g in backward for n in g.graph.nodes if is_random(n)]
    assert all(g._boxed_call for g in boxed_graphs)  # the backward frees saved activations at last use
    rec = graphtrain.report(m).graphs[0]
    assert rec["recompute"]["mode"] == "none" and rec["recompute"]["chosen"] == "none", rec["recompute"]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_modes_through_accelerate(mode):
    ref = _gpt2_tiny()
    m = graphtrain.accelerate(
        copy.deepcopy(ref), compile_blocks=False, provider="aten", fallback="error", recompute=mode, passes=_passes()
    )
    for mod in (ref, m):
        torch.manual_seed(5)
        mod(*_batch(0)).backward()
    assert_grads_close(m, ref, bitwise=True)
    rep = graphtrain.report(m)
    r = rep.graphs[0]["recompute"]
    assert r["mode"] == mode and r["chosen"] == mode
    assert [c["name"] for c in r["choices"]] == [mode], r
    assert f"recompute: mode {mode}" in str(rep) and "less than none" in str(rep)


def test_stage_passes_see_the_resolved_provider(monkeypatch):
    """With provider=auto choosing aten, inplace_elementwise (aten only) must run."""
    from graphtrain.runtime import provider_auto as choose
    from graphtrain.runtime import providers

    monkeypatch.setattr(providers, "resolve_provider", lambda config, ins: "aten")
    monkeypatch.setattr(choose, "CANDIDATES", ("aten",))
    torch.manual_seed(0)
    ref = MLP()
    m = graphtrain.accelerate(copy.deepcopy(ref), compile_blocks=False, provider="auto", fallback="error")
    x = torch.randn(4, 8)
    for mod in (ref, m):
        (mod(x) * 2 + 1).relu().sum().backward()
    assert_grads_close(m, ref, bitwise=True)
    rep = graphtrain.report(m)
    assert rep.graphs[0]["provider"] == "aten"
    assert sum(p["rewrites"] for p in rep.passes if p["name"] == "inplace_elementwise") > 0, str(rep)


def test_report_shows_predicted_peak_by_component():
    from graphtrain.memory.predict import param_bytes

    m = graphtrain.accelerate(_gpt2_tiny(), compile_blocks=False, provider="aten", fallback="error", passes=_passes())
    m(*_batch(0)).backward()
    rep = graphtrain.report(m)
    mem = rep.graphs[0]["predicted_memory"]
    assert mem["params"] == param_bytes(m.parameters()) and mem["optimizer_state"] == 2 * mem["params"]
    assert mem["batch_inputs"] == 2 * 2 * 32 * 8  # input_ids + labels, int64
    assert mem["peak"] == max(mem["phase_totals"].values()) and mem["saved_activations"] > 0
    assert "predicted step peak" in str(rep) and "adamw state" in str(rep)


def test_inductor_recompute_mode_uses_graphtrain_partitioner():
    # ATen's dropout is not given to Inductor on CPU (providers.compile_inductor); graphtrain's own fused dropout
    # (hash RNG, drawn from torch's generator) is. The reference is the same graph on aten without recompute.
    torch.manual_seed(0)
    base = MLP(0.1).train()
    passes = _passes(fuse_bias_dropout_add=True)
    ref = graphtrain.accelerate(
        copy.deepcopy(base), compile_blocks=False, provider="aten", fallback="error", passes=passes
    )
    m = graphtrain.accelerate(
        copy.deepcopy(base),
        compile_blocks=False,
        provider="inductor",
        fallback="error",
        recompute="selective",
        passes=passes,
    )
    x = torch.randn(16, 8)
    fx_cache = dict(counters["inductor"])
    for mod in (ref, m):
        torch.manual_seed(3)
        mod(x).square().mean().backward()
    assert_grads_close(m, ref)
    # Inductor's FX-graph cache takes the partitioner (pickled as its uuid): before, its key failed to pickle, the
    # cache was bypassed with a warning per graph and a recompute job never started warm
    used = {
        k: counters["inductor"][k] - fx_cache.get(k, 0)
        for k in ("fxgraph_cache_miss", "fxgraph_cache_hit", "fxgraph_cache_bypass")
    }
    assert used["fxgraph_cache_miss"] + used["fxgraph_cache_hit"] > 0 and not used["fxgraph_cache_bypass"], used
    assert sum(r["rewrites"] for r in graphtrain.report(m).passes if r["name"] == "fuse_bias_dropout_add") >= 1
    g = graphtrain.report(m).graphs[0]
    assert g["provider"] == "inductor" and g["partitioner"] == "min_cut (recompute=selective)"
    assert g["recompute"] is None or g["recompute"]["mode"] == "selective"  # None on a compile-cache hit


def test_inductor_refuses_aten_dropout_on_cpu_with_the_fix():
    m = graphtrain.accelerate(
        MLP(0.1).train(), compile_blocks=False, provider="inductor", fallback="error", passes=_passes()
    )
    with pytest.raises(GraphtrainCaptureError, match="fuse_bias_dropout_add"):
        m(torch.randn(16, 8)).sum().backward()
    # provider auto leaves Inductor out of such a graph by rule (a note, not a fallback: no error, no warning);
    # measured before the first step here (the background compile's path: test_engine_tiered.py)
    m = graphtrain.accelerate(
        MLP(0.1).train(),
        compile_blocks=False,
        provider="auto",
        fallback="error",
        passes=_passes(),
        compile_in_background=False,
    )
    m(torch.randn(16, 8)).sum().backward()
    rep = graphtrain.report(m)
    assert rep.graphs[0]["provider"] == "aten" and not rep.fallbacks
    assert any("inductor is not a candidate" in n for n in rep.graphs[0]["notes"]), rep.graphs[0]["notes"]


def test_report_for_config(tmp_path, monkeypatch):
    from graphtrain.cli.jobs import report_for_config

    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(tmp_path))
    cfg = {"model": {"name": "gpt2-tiny"}, "data": {"max_bytes": 300000, "vocab_size": 512}}
    # gpt2-tiny has 64 positions and data.seq_len defaults to 128: the Trainer's error, before any compile
    with pytest.raises(ValueError, match="model.max_seq_len=128"):
        report_for_config(Config.from_dict(cfg))
    cfg["data"]["seq_len"] = 64
    cfg["engine"] = {"provider": "aten"}
    rep = report_for_config(Config.from_dict(cfg))
    text = str(rep)
    assert rep.calls == 1 and rep.graphs and rep.graphs[0]["provider"] == "aten" and not rep.fallbacks, text
    assert rep.graphs[0]["recompute"]["mode"] == "none" and rep.graphs[0]["predicted_memory"]["peak"] > 0
    assert "predicted step peak" in text and "recompute: mode none" in text


@pytest.mark.parametrize("model", ["gpt2-tiny", "bert-tiny"])
def test_recompute_modes_with_default_fusion_bitwise_equal_to_none(model):
    """With the default passes (hash-RNG fused dropout and attention), selective and full recompute fused ops
    in the backward. Before memory/seeded.py, `full` re-ran graphtrain::bias_dropout_add there, drawing a new
    seed: gradients differed from `none` by up to 4e-2. Now every mode gives none's bits, and the RNG state."""
    torch.manual_seed(0)
    ref = build_model(ModelConfig(name=model, dropout=0.1)).train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 512, (2, 32), generator=g), torch.randint(0, 512, (2, 32), generator=g)
    args = (x, None, None, y) if ref.family == "bert" else (x, y)
    out = {}
    for mode in ("none", "selective", "full"):
        m = graphtrain.accelerate(
            copy.deepcopy(ref), compile_blocks=False, provider="aten", fallback="error", recompute=mode
        )
        torch.manual_seed(5)
        loss = m(*args)
        loss.backward()
        out[mode] = (
            loss.detach(),
            {n: p.grad for n, p in m.named_parameters()},
            torch.get_rng_state(),
            graphtrain.report(m),
        )
    for mode in ("selective", "full"):
        assert_close(out[mode][0], out["none"][0], name=f"{mode} loss", bitwise=True)
        for n, gr in out[mode][1].items():
            assert_close(gr, out["none"][1][n], name=f"{mode} grad of {n}", bitwise=True)
        assert torch.equal(out[mode][2], out["none"][2])
    for mode in ("selective", "full"):  # the fused LM head + loss is compute-bound: saved, never run again
        ops = out[mode][3].graphs[0]["recompute"]["choices"][0]["recomputed_ops"]
        assert not [op for op in ops if "cross_entropy" in op], (mode, ops)
    rec = out["full"][3].graphs[0]["recompute"]
    assert rec["seeded_dropouts"] > 0 and "1 of 2 layers checkpointed" in rec["choices"][0]["what"], rec
    saved = {k: v[3].graphs[0]["saved_activation_bytes"] for k, v in out.items()}
    assert saved["none"] > saved["selective"] > saved["full"], saved
    assert "layers checkpointed" in str(out["full"][3])


def test_full_size_attention_mask_not_saved():
    """fuse_attention passes a causal mask built as masked_fill(zeros_like(scores), ...): batch x heads x seq x
    seq floats that the backward reads. The partitioner rebuilds it at the bool mask's size (seq x seq)."""
    torch.manual_seed(0)
    m = graphtrain.accelerate(
        build_model(ModelConfig(name="gpt2-tiny", dropout=0.1)).train(),
        compile_blocks=False,
        provider="aten",
        fallback="error",
    )
    B, T = 4, 64
    x = torch.randint(0, 512, (B, T))
    m(x, x).backward()
    g = graphtrain.report(m).graphs[0]
    if not any(p["name"] == "fuse_attention" and p["rewrites"] for p in graphtrain.report(m).passes):
        pytest.skip("fuse_attention did not run")
    assert g["recompute"]["masks_shrunk"] == 2, g["recompute"]


def test_auto_through_accelerate_picks_the_first_mode_that_fits():
    torch.manual_seed(0)
    ref = build_model(ModelConfig(name="gpt2-tiny", dropout=0.1)).train()
    x = torch.randint(0, 512, (8, 64))
    m = graphtrain.accelerate(
        copy.deepcopy(ref),
        compile_blocks=False,
        provider="aten",
        fallback="error",
        recompute="auto",
        memory_budget=1e12,
    )
    m(x, x).backward()
    r = graphtrain.report(m).graphs[0]["recompute"]
    assert r["chosen"] == "none" and [c["name"] for c in r["choices"]] == ["none"]
    peaks = {}
    for mode in ("none", "selective", "full"):
        mm = graphtrain.accelerate(
            copy.deepcopy(ref), compile_blocks=False, provider="aten", fallback="error", recompute=mode
        )
        mm(x, x).backward()
        peaks[mode] = graphtrain.report(mm).graphs[0]["predicted_memory"]["peak"]
    assert peaks["none"] > peaks["selective"] > peaks["full"], peaks
    budget = (peaks["selective"] + peaks["full"]) / 2  # only full fits
    m = graphtrain.accelerate(
        copy.deepcopy(ref),
        compile_blocks=False,
        provider="aten",
        fallback="error",
        recompute="auto",
        memory_budget=budget,
    )
    m(x, x).backward()
    r = graphtrain.report(m).graphs[0]["recompute"]
    assert [c["name"] for c in r["choices"]] == ["none", "selective", "full"] and r["chosen"] == "full", r
    assert [c["fits"] for c in r["choices"]] == [False, False, True]
    assert "chose full" in str(graphtrain.report(m))


def test_trainer_config_selects_layer_checkpointing(tmp_path, monkeypatch):
    """engine.recompute in a job config reaches the partitioner through the Trainer (report_for_config)."""
    from graphtrain.cli.jobs import report_for_config

    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(tmp_path))
    cfg = {
        "model": {"name": "gpt2-tiny"},
        "data": {"max_bytes": 300000, "vocab_size": 512, "seq_len": 64},
        "engine": {"provider": "aten", "recompute": "full"},
    }
    rep = report_for_config(Config.from_dict(cfg))
    r = rep.graphs[0]["recompute"]
    assert r["mode"] == "full" and r["chosen"] == "full" and "1 of 2 layers checkpointed" in r["choices"][0]["what"]
    assert "layers checkpointed" in str(rep)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_recompute_auto_on_hugging_face_gpt2_at_a_tight_budget():
    """recompute auto at a tight budget (every rung of the ladder) on a tiny HF GPT-2 matches eager. Regression:
    torch's budget search returned a multi-output fused op itself as a saved value, and AOTAutograd refused the
    tuple (memory/recompute.py, `_no_tuples_saved`). And the model is one graph with the fused LM head and loss: a
    graph break kept at HF's `warning_once` under recompute full/auto put the loss in a graph of its own, with an
    [N, V] gradient."""
    import transformers

    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=512,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg).train()
    m = copy.deepcopy(ref)
    m = graphtrain.accelerate(m, provider="aten", fallback="error", recompute="auto", memory_budget=2**20)
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(1))  # > 1 MiB of activations
    losses = [mod(input_ids=ids, labels=ids).loss for mod in (ref, m)]
    for loss in losses:
        loss.backward()
    assert_close(losses[1], losses[0], name="loss", rtol=1e-5, atol=1e-6)
    assert_grads_close(m, ref, rtol=1e-4, atol=1e-5)
    rep = graphtrain.report(m)
    assert any(g["recompute"] and len(g["recompute"]["choices"]) > 1 for g in rep.graphs), str(rep)  # modes tried
    assert not rep.fallbacks and not rep.eager_only, str(rep)
    assert len(rep.graphs) == 1 and not rep.graph_breaks, str(rep)
    assert any(f["name"] == "linear_cross_entropy_logits" for f in rep.fused_ops), rep.fused_ops


def test_auto_with_fewer_layers_checkpointed_matches_eager():
    """recompute auto at a budget that only `layers=k` (k < all) meets: the loss and gradients match eager."""
    import dataclasses

    from graphtrain.models import GPT2, PRESETS

    torch.manual_seed(0)
    ref = GPT2(dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=4, dropout=0.0)).train()
    x = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    sel = graphtrain.accelerate(
        copy.deepcopy(ref),
        compile_blocks=False,
        provider="aten",
        fallback="error",
        recompute="selective",
        memory_budget=1e12,
    )
    sel(x, x).backward()
    budget = graphtrain.report(sel).graphs[0]["recompute"]["choices"][0]["predicted_peak"] - 1
    m = graphtrain.accelerate(
        copy.deepcopy(ref),
        compile_blocks=False,
        provider="aten",
        fallback="error",
        recompute="auto",
        memory_budget=budget,
    )
    losses = [mod(x, x) for mod in (ref, m)]
    for loss in losses:
        loss.backward()
    r = graphtrain.report(m).graphs[0]["recompute"]
    assert r["chosen"].startswith("layers="), r["chosen"]
    assert_close(losses[1], losses[0], name="loss", rtol=1e-5, atol=1e-6)
    assert_grads_close(m, ref, rtol=1e-4, atol=1e-5)
