"""Recompute modes: bitwise parity with eager (dropout on), RNG handling, saved bytes, auto's budget."""

from __future__ import annotations

import copy

import pytest
import torch

from graphtrain.config.sections import EngineConfig, ModelConfig
from graphtrain.frontend.capture import capture_graphs, compile_train_step
from graphtrain.memory.predict import MiB
from graphtrain.models import build_model
from graphtrain.testing import assert_close


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    m = build_model(ModelConfig(name="gpt2-tiny", dropout=0.1)).train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 512, (4, 64), generator=g), torch.randint(0, 512, (4, 64), generator=g)
    return m, (x, y)


def _eager(m, batch):
    torch.manual_seed(7)
    loss = m(*batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}, torch.get_rng_state()


def test_native_dropout_output_is_x_times_mask_times_scale():
    x = torch.randn(257, 129)
    out, mask = torch.ops.aten.native_dropout(x, 0.1, True)
    assert mask.dtype == torch.bool
    assert torch.equal(out, torch.ops.aten.mul.Tensor(torch.ops.aten.mul.Tensor(x, mask), 1.0 / 0.9))


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_recompute_bitwise_parity_with_eager_dropout_on(tiny, mode):
    m, batch = tiny
    loss_e, grads_e, rng_e = _eager(copy.deepcopy(m), batch)
    m2 = copy.deepcopy(m)
    records = []
    step = compile_train_step(m2, EngineConfig(recompute=mode), records=records)
    torch.manual_seed(7)
    loss = step(*batch)
    loss.backward()
    assert_close(loss.detach(), loss_e, name="loss", bitwise=True)
    for n, p in m2.named_parameters():
        assert_close(p.grad, grads_e[n], name=f"grad of {n}", bitwise=True)
    # the backward draws no random numbers: the next step's dropout matches eager's
    assert torch.equal(torch.get_rng_state(), rng_e)
    assert records[-1].mode == mode and records[-1].chosen == mode
    if mode != "none":
        assert records[-1].dropout_rewrites == 7  # embedding dropout + (attention, attn-out, mlp-out) x 2 layers


def test_dead_random_ops_dropped_from_backward(tiny):
    m, batch = tiny
    cap = capture_graphs(m, batch, EngineConfig(recompute="none"))
    assert cap.records[-1].dead_random_dropped > 0  # AOTAutograd's default_partition left them there
    assert not any(n.target is torch.ops.aten.native_dropout.default for n in cap.bw_gm.graph.nodes)


def test_saved_bytes_monotone_and_recorded(tiny):
    m, batch = tiny
    saved = {}
    for mode in ("none", "selective", "full"):
        cap = capture_graphs(m, batch, EngineConfig(recompute=mode))
        rec = cap.records[-1]
        saved[mode] = rec.choices[-1].saved_bytes
        if mode != "none":
            assert rec.choices[-1].flops_added > 0 and rec.choices[-1].recomputed_ops
            if mode == "selective":  # matmuls: only the attention cores' q @ k^T (bmm)
                assert not {"mm", "addmm", "matmul"} & set(rec.choices[-1].recomputed_ops)
            assert rec.choices[-1].bytes_saved == saved["none"] - saved[mode]
    assert saved["none"] > saved["selective"] >= saved["full"], saved


def test_auto_fits_budget_at_least_recompute(tiny):
    m, batch = tiny
    cap = capture_graphs(m, batch, EngineConfig(recompute="auto", memory_budget=1e12))
    # a generous budget: auto keeps mode none (no recompute at all)
    assert cap.records[-1].chosen == "none" and cap.records[-1].choices[0].fits
    # a budget under what none needs: auto recomputes, and what it picks fits
    budget = cap.records[-1].choices[0].predicted_peak * 0.9
    cap = capture_graphs(m, batch, EngineConfig(recompute="auto", memory_budget=budget))
    rec = cap.records[-1]
    chosen = next(c for c in rec.choices if c.name == rec.chosen)
    assert rec.chosen != "none" and chosen.fits and chosen.predicted_peak <= budget
    assert [c.fits for c in rec.choices[:-1]] == [False] * (len(rec.choices) - 1)  # stopped at the first fit
    assert "chose" in str(rec) and f"{budget / MiB:,.0f} MiB" in str(rec)


def _pretend_a_gpu(monkeypatch, total_memory: int) -> None:
    """torch.cuda as graphtrain's memory code would see it on a machine with a GPU of `total_memory` bytes (nothing
    runs on it; torch's own callers, AOTAutograd's RNG bookkeeping among them, keep seeing no CUDA)."""
    import sys
    import types

    real = torch.cuda.is_available
    monkeypatch.setattr(
        torch.cuda,
        "is_available",
        lambda: sys._getframe(1).f_globals.get("__name__", "").startswith("graphtrain.memory") or real(),
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device=None: types.SimpleNamespace(total_memory=total_memory, name="pretend GPU"),
    )


def test_a_fractional_budget_is_of_the_memory_of_the_device_the_run_uses(monkeypatch):
    import os

    from graphtrain.memory.budget import budget_bytes

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    _pretend_a_gpu(monkeypatch, 3 * 2**30)
    assert budget_bytes(0.5, torch.device("cpu")) == 0.5 * ram  # a CPU run: RAM, though CUDA is "available"
    assert budget_bytes(0.5, "cuda:0") == 0.5 * 3 * 2**30  # a GPU run: the GPU's memory
    assert budget_bytes(4e9, "cpu") == budget_bytes(4e9, "cuda") == 4e9  # bytes as given
    with pytest.raises(ValueError, match="must be positive"):
        budget_bytes(0.0, "cpu")


def test_recompute_budget_fraction_on_cpu_is_of_ram_even_with_cuda(tiny, monkeypatch):
    import os

    m, batch = tiny
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    _pretend_a_gpu(monkeypatch, 3 * 2**30)
    cap = capture_graphs(m, batch, EngineConfig(recompute="auto", memory_budget=0.5))
    assert cap.records[-1].budget == 0.5 * ram


def test_auto_without_budget_is_a_user_error():
    from graphtrain.memory.recompute import make_partition_fn

    with pytest.raises(ValueError, match="memory_budget"):
        make_partition_fn(EngineConfig(recompute="auto"))


def test_fused_dropout_split_is_bitwise_and_draws_the_same_seed():
    """graphtrain::bias_dropout_add == dropout_seed + bias_dropout_add_seeded, RNG state included."""
    import graphtrain.memory.seeded  # noqa: F401  (registers the ops)

    x, b, r = torch.randn(64, 96), torch.randn(96), torch.randn(64, 96)
    torch.manual_seed(3)
    out, seed = torch.ops.graphtrain.bias_dropout_add(x, b, r, 0.1)
    rng = torch.get_rng_state()
    torch.manual_seed(3)
    seed2 = torch.ops.graphtrain.dropout_seed(0)
    out2 = torch.ops.graphtrain.bias_dropout_add_seeded(x, b, r, 0.1, seed2)
    assert torch.equal(seed, seed2) and torch.equal(out, out2) and torch.equal(rng, torch.get_rng_state())
    assert torch.Tag.nondeterministic_seeded in torch.ops.graphtrain.dropout_seed.default.tags


def test_selective_recomputes_attention_cores(tiny):
    """Megatron's selective recompute: q @ k^T, scale, mask, softmax, dropout are rebuilt in the backward
    (one bmm and one softmax per layer), no other matmul, and nothing seq x seq is saved."""
    m, batch = tiny
    cap = capture_graphs(m, batch, EngineConfig(recompute="selective"))
    c = cap.records[-1].choices[-1]
    assert c.what == "2 attention cores recomputed", c
    assert c.recomputed_ops.get("bmm") == 2 and c.recomputed_ops.get("_softmax") == 2, c.recomputed_ops
    assert not {"mm", "addmm"} & set(c.recomputed_ops), c.recomputed_ops
    (B, T), H = batch[0].shape, m.spec.n_head
    out = next(n for n in cap.fw_gm.graph.nodes if n.op == "output")
    saved = [a for a in out.args[0][1:] if isinstance(a, torch.fx.Node)]
    float_sxs = [
        a
        for a in saved
        if a.meta["val"].dtype.is_floating_point
        and a.meta["val"].numel() == B * H * T * T
        and not getattr(a.target, "is_view", False)
    ]  # a view of a parameter is not an activation
    assert not float_sxs, [a.name for a in float_sxs]  # only the 1-byte dropout masks of aten dropout remain


def test_full_checkpoints_every_layer_but_the_last(tiny):
    m, batch = tiny
    sel = capture_graphs(m, batch, EngineConfig(recompute="selective")).records[-1].choices[-1]
    cap = capture_graphs(m, batch, EngineConfig(recompute="full"))
    full = cap.records[-1].choices[-1]
    assert full.what == "1 of 2 layers checkpointed (the last is not)", full
    assert full.saved_bytes < sel.saved_bytes
    assert full.recomputed_ops.get("addmm", 0) >= 2  # the layer's matmuls are recomputed (qkv, fc ...)
    # the checkpointed layer keeps its input, no [B, T, 4 * d] MLP activation
    d = m.spec.d_model
    out = next(n for n in cap.fw_gm.graph.nodes if n.op == "output")
    mlp_sized = [
        a
        for a in out.args[0][1:]
        if isinstance(a, torch.fx.Node)
        and a.op == "call_function"
        and not getattr(a.target, "is_view", False)
        and a.meta["val"].shape[-1] == 4 * d
    ]
    assert len(mlp_sized) <= 2, [a.name for a in mlp_sized]  # the last layer's fc output and GELU output only


def test_full_saves_a_post_norm_layers_output_so_recompute_stops_at_the_layer():
    """A post-norm layer (BERT) ends in a layer norm, a multi-output op whose output the next layer reads: the
    checkpoint boundary. Marking only that output's getitem MUST_SAVE was ignored by the min-cut, which then
    recomputed the norm, and from it the previous layer, back to the embeddings: every layer's forward re-ran at
    the start of the backward (BERT-Large, batch 16 -> 46: 166 MiB of peak per sample, 5x what it saved)."""
    import dataclasses
    import operator

    from graphtrain.models import BERT, PRESETS

    torch.manual_seed(0)
    m = BERT(dataclasses.replace(PRESETS["bert-tiny"], n_layer=4, dropout=0.1)).train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 512, (4, 64), generator=g), torch.randint(0, 512, (4, 64), generator=g)
    cap = capture_graphs(m, (x, None, None, y), EngineConfig(recompute="full"))
    assert cap.records[-1].choices[-1].what == "3 of 4 layers checkpointed (the last is not)"
    out = next(n for n in cap.fw_gm.graph.nodes if n.op == "output")
    norm_outputs_saved = [
        a
        for a in out.args[0]
        if isinstance(a, torch.fx.Node)
        and a.target is operator.getitem
        and a.args[1] == 0
        and a.args[0].target is torch.ops.aten.native_layer_norm.default
    ]
    assert len(norm_outputs_saved) >= 2, [a.name for a in norm_outputs_saved]  # was 0


def test_layer_regions_from_module_annotations(tiny):
    """capture.functional_model annotates each nn.ModuleList child; recompute.layer_regions reads it."""
    from graphtrain.memory.recompute import layer_regions

    m, batch = tiny
    seen = {}
    import graphtrain.memory.recompute as R

    real = R.tag_for_recompute

    def spy(joint, how, layers=None):
        seen["regions"] = layer_regions(joint)
        return real(joint, how, layers)

    R.tag_for_recompute = spy
    try:
        capture_graphs(m, batch, EngineConfig(recompute="full"))
    finally:
        R.tag_for_recompute = real
    regions = seen["regions"]
    assert set(regions.values()) == {0, 1}
    mms = [n for n in regions if n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)]
    assert sorted(regions[n] for n in mms) == [0] * (len(mms) // 2) + [1] * (len(mms) // 2)


def test_layers_are_found_in_a_model_called_through_functional_call(tiny):
    """Dynamo names a layer reached through ``torch.func.functional_call`` ``getattr(G['m'].blocks, '0')``, where a
    model compiled as itself gives ``L['self'].blocks.0``; recompute full found no layers in such a graph (a user's
    functional loop under ``torch.compile(backend="graphtrain")``) and checkpointed nothing."""
    from graphtrain.memory.recompute import _layer_key

    m, batch = tiny
    names = [n for n, _ in m.named_parameters()]
    graphs = []

    def grab(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    def step(params, *batch):
        return torch.func.functional_call(m, dict(zip(names, params)), batch)

    torch._dynamo.reset()
    torch.compile(step, backend=grab)([p for _, p in m.named_parameters()], *batch)
    (gm,) = graphs
    stacks = [str(p) for n in gm.graph.nodes for p, _ in n.meta.get("nn_module_stack", {}).values()]
    assert any(p.startswith("getattr(") for p in stacks)  # the spelling this reads
    layers = {_layer_key(n)[1] for n in gm.graph.nodes if n.op == "call_function"} - {None}
    assert len(layers) == 2 and all(k.endswith((".0", ".1")) for k in layers), layers


def test_auto_checkpoints_only_the_layers_the_budget_needs():
    """When `full` is the first mode to fit, auto bisects for the fewest layers to checkpoint (the earliest): a
    budget just under selective's peak needs one layer of 4, not 3 (each costs a re-run of its forward)."""
    import dataclasses

    from graphtrain.models import GPT2, PRESETS

    torch.manual_seed(0)
    m = GPT2(dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=4, dropout=0.1)).train()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 512, (4, 64), generator=g), torch.randint(0, 512, (4, 64), generator=g))
    sel = capture_graphs(m, batch, EngineConfig(recompute="selective", memory_budget=1e12)).records[-1].choices[-1]
    rec = capture_graphs(m, batch, EngineConfig(recompute="auto", memory_budget=sel.predicted_peak - 1)).records[-1]
    names = [c.name for c in rec.choices]
    assert names == ["none", "selective", "full", "layers=2", "layers=1"] and rec.chosen == "layers=1", rec
    by = {c.name: c for c in rec.choices}
    assert by["layers=1"].fits and by["layers=1"].what == "1 of 4 layers checkpointed (the first 1)"
    assert by["full"].what == "3 of 4 layers checkpointed (the last is not)"
    assert (
        by["full"].saved_bytes < by["layers=2"].saved_bytes < by["layers=1"].saved_bytes < by["selective"].saved_bytes
    )
    assert by["layers=1"].flops_added < by["full"].flops_added


def test_auto_stops_the_budget_ladder_once_it_repeats_itself():
    """Nothing fits a 1 MiB budget: auto tries the budget solver at falling budgets and stops once two in a row
    give the same partition (the lower ones would repeat it); it keeps the lowest predicted peak it saw."""
    import dataclasses

    from graphtrain.memory.recompute import AUTO_BUDGETS
    from graphtrain.models import GPT2, PRESETS

    torch.manual_seed(0)
    m = GPT2(dataclasses.replace(PRESETS["gpt2-tiny"], n_layer=4, dropout=0.1)).train()
    batch = (torch.randint(0, 512, (4, 64)), torch.randint(0, 512, (4, 64)))
    rec = capture_graphs(m, batch, EngineConfig(recompute="auto", memory_budget=2**20)).records[-1]
    budgets = [c for c in rec.choices if c.name.startswith("budget=")]
    outcomes = [(c.saved_bytes, c.predicted_peak) for c in budgets]
    assert [c.name for c in rec.choices[:3]] == ["none", "selective", "full"] and not any(c.fits for c in rec.choices)
    assert all(a != b for a, b in zip(outcomes[:-2], outcomes[1:-1])), outcomes  # no repeat before the last pair
    assert len(budgets) == len(AUTO_BUDGETS) or outcomes[-1] == outcomes[-2], outcomes
    assert len(budgets) < len(AUTO_BUDGETS), outcomes  # here the solver saturates early
    lowest = min(rec.choices, key=lambda c: c.predicted_peak)
    assert next(c for c in rec.choices if c.name == rec.chosen).predicted_peak == lowest.predicted_peak
