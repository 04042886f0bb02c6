"""Recompute modes: bitwise parity with eager (dropout on), RNG handling, saved bytes, auto's budget."""
from __future__ import annotations

import copy

import pytest
import torch

from graphtrain.config import EngineConfig, ModelConfig
from graphtrain.memory.capture import capture_graphs, compile_train_step
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
            assert "matmul" not in str(rec.choices[-1].recomputed_ops) and "mm" not in rec.choices[-1].recomputed_ops
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


def test_auto_without_budget_is_a_user_error():
    from graphtrain.memory.recompute import make_partition_fn
    with pytest.raises(ValueError, match="memory_budget"):
        make_partition_fn(EngineConfig(recompute="auto"))
