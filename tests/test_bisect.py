"""graphtrain.bisect: a healthy model passes every configuration; a broken pass, a broken fused-op fast path and
a random stream that legitimately differs are each named (or not) as they should be; the CLI."""

from __future__ import annotations

import importlib
import json
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import graphtrain
from graphtrain.passes.manager import _REGISTRY, register_pass, registered_passes
from graphtrain.tools.bisect import bisect
from graphtrain.tools.bisect_run import compare, switch_off_dropout

pytestmark = pytest.mark.usefixtures("one_thread")


class Small(nn.Module):
    """Embedding, LayerNorm, a GELU MLP with a residual dropout, an LM head and cross-entropy: few ops (fast to
    compile many times) but something for the LayerNorm, GELU, dropout and linear-cross-entropy fusions."""

    def __init__(self, vocab: int = 64, d: int = 32, p: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.drop(self.out(F.gelu(self.fc(self.ln(x)))))
        logits = self.head(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def small() -> Small:
    torch.manual_seed(0)
    return Small()


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"idx": torch.randint(0, 64, (4, 16), generator=g), "labels": torch.randint(0, 64, (4, 16), generator=g)}


def only(*names: str) -> dict:
    """Engine settings with every pass off but `names`: fewer configurations to compile where a test needs only
    these (each configuration is a fresh compile, ~1.5 s here)."""
    return {"passes": {n: n in names for n in registered_passes()}}


def rows(rep, kind):
    return [c for c in rep.configs if c.kind == kind]


def test_healthy_model_every_configuration_within_tolerance():
    rep = bisect(small, batch(), steps=2)
    assert rep.ok and rep.culprit is None, str(rep)
    assert rep.configs[0].kind == "engine" and rep.configs[0].status == "bitwise"  # capture + AOTAutograd, aten
    assert {c.status for c in rep.configs} <= {"bitwise", "ok", "no rewrites"}, str(rep)
    ran = [c.target for c in rows(rep, "pass") if c.status != "no rewrites"]
    assert {"fuse_layer_norm", "fuse_bias_gelu", "fuse_linear_cross_entropy"} <= set(ran), str(rep)
    assert rows(rep, "fused op"), str(rep)  # at least one fast path was compared with its reference
    assert rep.configs[-1].fast_ops  # ... and the last row runs the fast paths
    assert "drop (Dropout)" in rep.dropout and rep.tolerances == {"fp32": (1e-4, 1e-5)}
    text = str(rep)
    assert "no culprit" in text and "+ fuse_layer_norm" in text and "max abs" in text
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["ok"] and d["culprit"] is None and len(d["configs"]) == len(rep.configs)


@pytest.fixture
def broken_pass():
    """A test-only pass that scales every LayerNorm output by 1.001 (0.1%, ten times fp32's rtol)."""
    lns = {torch.ops.aten.native_layer_norm, torch.ops.graphtrain.layer_norm}

    def scale_layer_norm_for_test_pass(gm: fx.GraphModule, ctx) -> fx.GraphModule:
        for n in list(gm.graph.nodes):
            src = n.args[0] if n.op == "call_function" and n.target is operator.getitem else None
            if isinstance(src, fx.Node) and getattr(src.target, "overloadpacket", None) in lns and n.args[1] == 0:
                with gm.graph.inserting_after(n):
                    scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (n, 1.001))
                scaled.meta["val"] = n.meta.get("val")
                n.replace_all_uses_with(scaled, delete_user_cb=lambda u, scaled=scaled: u is not scaled)
                ctx.count()
        return gm

    register_pass("pre_autodiff", phase="fuse", after="fuse_layer_norm", before="fuse_bias_gelu")(
        scale_layer_norm_for_test_pass
    )
    try:
        yield "scale_layer_norm_for_test"
    finally:
        _REGISTRY.pop("scale_layer_norm_for_test", None)


def test_broken_pass_is_named_with_tensor_and_error(broken_pass):
    rep = bisect(small, batch(), steps=2, alone=True, engine=only("fuse_layer_norm", "fuse_bias_gelu", broken_pass))
    c = rep.culprit
    assert c is not None and c.kind == "pass" and c.target == broken_pass, str(rep)
    assert rep.configs.index(c) > 1  # after the engine row and fuse_layer_norm, which pass
    assert all(r.status in ("bitwise", "ok", "no rewrites") for r in rep.configs[: c.index]), str(rep)
    f = c.first_failure
    assert f.step == 0 and not f.ok and f.ratio > 1 and f.max_abs > 0 and f.rel > 1e-4
    assert f.tensor == "loss" or f.tensor.startswith("grad of "), f
    # the culprit is switched off again: the rows after it are judged on their own change, and pass
    assert rep.culprits == [c] and broken_pass not in rep.configs[-1].passes
    alone = next(r for r in rows(rep, "pass alone") if r.target == broken_pass)
    assert alone.status == "FAIL" and not alone.culprit  # on its own too; informational
    text = str(rep)
    assert f"CULPRIT: row {c.index}, pass {broken_pass}: {f.tensor} at step 0" in text, text
    assert f"engine.passes.{broken_pass}=false" in text


@pytest.mark.parametrize("op, which", [("layer_norm_backward", 1), ("bias_gelu", None)])
def test_broken_fused_op_fast_path_is_named(monkeypatch, op, which):
    """Break one fast implementation (its closure, as dispatch receives it): its reference stays right."""
    module = importlib.import_module("graphtrain.kernels." + op.removesuffix("_backward"))
    real = module.dispatch

    def perturb(out):
        if which is None:
            return out * 1.001
        return tuple(t * 1.01 if i == which else t for i, t in enumerate(out))  # only the weight's gradient

    def broken_dispatch(name, candidates, reference):
        if name == op:
            candidates = [(impl, ok, lambda fn=fn: perturb(fn())) for impl, ok, fn in candidates]
        return real(name, candidates, reference)

    monkeypatch.setattr(module, "dispatch", broken_dispatch)
    rep = bisect(small, batch(), steps=2, engine=only("fuse_layer_norm", "fuse_bias_gelu"))
    c = rep.culprit
    assert c is not None and c.kind == "fused op" and c.target == op, str(rep)
    assert not any(r.failed for r in rows(rep, "pass")), str(rep)  # the fusion pass itself is fine
    if which is not None:  # backward only: the forward alone was tried, passed, and the pair's row is named
        assert c.first_failure.tensor == "grad of ln.weight", str(rep)
        assert "the forward alone is within tolerance" in " ".join(c.notes)
    else:
        assert c.label.strip().endswith("alone")
    assert op not in rep.configs[-1].fast_ops
    assert f"fused op {op}" in str(rep)


def test_keep_dropout_reports_a_changed_random_stream_without_blaming_it():
    """With dropout on, fuse_bias_dropout_add draws its mask from graphtrain's hash RNG: not eager's stream."""
    rep = bisect(small, batch(), steps=2, keep_dropout=True, engine=only("fuse_bias_dropout_add", "fuse_bias_gelu"))
    assert rep.ok, str(rep)
    assert rep.configs[0].status == "bitwise"  # no passes: eager's generator, eager's masks
    fused = next(c for c in rep.configs if c.target == "fuse_bias_dropout_add")
    assert fused.status == "rng differs" and not fused.culprit, str(rep)
    assert rep.dropout.startswith("kept")


def test_switch_off_dropout_finds_modules_attributes_and_configs():
    class Cfg:  # as Hugging Face configs hold them: instance attributes
        def __init__(self):
            self.attention_dropout, self.hidden_dropout_prob, self.hidden_size = 0.1, 0.2, 8

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Cfg()
            self.d = nn.Dropout(0.3)
            self.dropout_p, self.scale = 0.1, 0.5

    m = M()
    changed = switch_off_dropout(m)
    assert m.d.p == 0 and m.dropout_p == 0 and m.scale == 0.5
    assert m.config.attention_dropout == 0 and m.config.hidden_dropout_prob == 0 and m.config.hidden_size == 8
    assert len(changed) == 4


def test_compare_follows_the_tolerance_rule():
    e = torch.tensor([1.0, 0.0, 2.0])
    assert compare("t", 0, e.clone(), e, 1e-4, 1e-5).max_abs == 0
    err = compare("t", 0, e + torch.tensor([0.0, 2e-5, 0.0]), e, 1e-4, 1e-5)
    assert not err.ok and err.ratio == pytest.approx(2.0) and err.max_abs == pytest.approx(2e-5)
    assert compare("t", 0, torch.tensor([1.0, float("nan"), 2.0]), e, 1e-4, 1e-5).ratio == float("inf")
    assert compare("t", 0, None, e, 1e-4, 1e-5).ratio == float("inf")


def test_bad_input_is_explained():
    with pytest.raises(ValueError, match="provider must be one of aten, inductor"):
        bisect(small, batch(), provider="tensorrt")
    with pytest.raises(TypeError, match="returned Tensor|not a scalar"):
        bisect(small, {"idx": batch()["idx"]})  # no labels: the model returns logits, not a loss
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        bisect(small, batch(), steps=0)
    m = small()
    with pytest.raises(ValueError, match="must build a new one each call"):
        bisect(lambda: m, batch())
    assert graphtrain.bisect is bisect


def test_cli_rejects_an_unknown_provider(capsys):
    from graphtrain.cli.main import main

    assert main(["bisect", "configs/gpt2-tiny-test.yaml", "--provider", "tensorrt"]) == 2
    assert "invalid choice: 'tensorrt'" in capsys.readouterr().err


@pytest.mark.slow  # bert-tiny: ~12 compiles of the aten provider
def test_reference_bert_tiny_is_healthy():
    """The masked-LM head (sparse labels, attention mask, tied decoder) through every pass and fast path."""
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 32), generator=g)
    labels = torch.where(torch.rand(2, 32, generator=g) < 0.15, ids, torch.full_like(ids, -100))
    rep = bisect(
        lambda: build_model(ModelConfig(name="bert-tiny")),
        {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)},
    )
    assert rep.ok, str(rep)
    assert [c.target for c in rows(rep, "pass") if c.status != "no rewrites"], str(rep)
    assert rows(rep, "fused op"), str(rep)


@pytest.mark.slow  # gpt2-tiny: ~15 compiles of the aten provider, measured ~90 s on the shared 2-core box
def test_cli_on_the_tiny_config_prints_the_table(tmp_path, monkeypatch, capsys):
    from graphtrain.cli.main import main

    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(tmp_path / "cache"))
    code = main(
        [
            "bisect",
            "configs/gpt2-tiny-test.yaml",
            "data.seq_len=32",
            "train.batch_size=2",
            "--steps",
            "2",
            "--provider",
            "aten",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "graphtrain bisect: gpt2-tiny" in out and "engine, no passes" in out and "+ fuse_attention" in out
    assert "fast attention" in out and "no culprit" in out
