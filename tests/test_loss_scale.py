"""Dynamic loss scaling: scale/unscale/check, backoff with hysteresis, growth, state, a forced overflow."""

from __future__ import annotations

import math

import pytest
import torch

from graphtrain.config.sections import EngineConfig, ModelConfig
from graphtrain.models import build_model
from graphtrain.optim import DynamicLossScaler, FusedAdamW, make_loss_scaler, optimizer_step
from graphtrain.passes import PassContext
from graphtrain.passes.mixed_precision import apply_mixed_precision_pass
from graphtrain.pipeline.functional import module_as_function
from graphtrain.pipeline.trace import trace_aten_forward

pytestmark = pytest.mark.usefixtures("one_thread")


def params_with_grads(*grads):
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    return ps


def test_unscale_and_check_in_one_pass():
    s = DynamicLossScaler(init_scale=1024.0)
    assert float(s.scale(torch.tensor(2.0))) == 2048.0
    ps = params_with_grads(torch.full((3,), 1024.0), torch.full((2, 2), -512.0))
    assert s.unscale_and_check(ps) is True
    assert torch.equal(ps[0].grad, torch.ones(3)) and torch.equal(ps[1].grad, torch.full((2, 2), -0.5))
    for bad in (math.inf, -math.inf, math.nan):
        ps = params_with_grads(torch.ones(3), torch.tensor([1.0, bad]))
        assert s.unscale_and_check(ps) is False
    with pytest.raises(TypeError, match="loss tensor"):
        s.scale(1.0)


def test_backoff_hysteresis_growth_and_min_scale():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=3, hysteresis=2, min_scale=2.0)
    s.update(True)
    assert s.scale_value == 8.0  # first overflow tolerated (hysteresis 2)
    s.update(True)
    assert s.scale_value == 4.0  # second backs off
    s.update(True)
    assert s.scale_value == 2.0  # and each further one until the scale grows again
    s.update(True)
    assert s.scale_value == 2.0  # never below min_scale
    for _ in range(3):
        s.update(False)
    assert s.scale_value == 4.0 and s.skipped_steps == 4 and s.steps == 7
    s.update(True)
    assert s.scale_value == 4.0  # hysteresis restored by the growth
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="min_scale"):
        DynamicLossScaler(init_scale=1.0, min_scale=2.0)


def test_the_graph_and_the_eager_scaler_follow_one_rule():
    """optim.functional.loss_scale_update on tensors (what compile_step's graph runs) gives the eager
    DynamicLossScaler's scale, growth count and hysteresis after every step of an overflow pattern."""
    from graphtrain.optim.functional import loss_scale_update

    kw = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2, min_scale=2.0)
    eager = DynamicLossScaler(init_scale=8.0, **kw)
    scale, tracker, hyst = torch.tensor(8.0), torch.tensor(0), torch.tensor(2)
    for overflow in [True, False, True, True, True, True, False, False, False, True, False, False, False, False]:
        eager.update(overflow)
        scale, tracker, hyst = loss_scale_update(scale, tracker, hyst, torch.tensor(overflow), **kw)
        assert (float(scale), int(tracker), int(hyst)) == (
            eager.scale_value,
            eager._growth_tracker,
            eager._hysteresis_left,
        ), overflow


def test_state_dict_round_trip_and_config():
    s = DynamicLossScaler(init_scale=16.0, growth_interval=2, hysteresis=1)
    s.update(False)
    s.update(True)
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert (
        t.state_dict()
        == s.state_dict()
        == {"scale": 8.0, "growth_tracker": 0, "hysteresis_left": 0, "skipped_steps": 1, "steps": 2}
    )
    with pytest.raises(ValueError, match="missing"):
        t.load_state_dict({"scale": 1.0})
    assert make_loss_scaler(EngineConfig(precision="bf16")) is None  # bf16 has fp32's range: no scaling
    assert make_loss_scaler(EngineConfig(precision="fp32")) is None
    sc = make_loss_scaler(EngineConfig(precision="fp16", loss_scale_init=1024.0, loss_scale_hysteresis=3))
    assert sc.scale_value == 1024.0 and sc.hysteresis == 3 and sc.growth_interval == 2000
    with pytest.raises(TypeError, match="EngineConfig"):
        make_loss_scaler({"precision": "fp16"})


def test_fp16_run_skips_exactly_the_overflowing_step():
    """gpt2-tiny through the fp16 mixed-precision graph; step 6's loss is blown up so fp16 overflows."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (4, 32), generator=g)
    labels = torch.roll(ids, -1, 1)
    f, tensors, kinds = module_as_function(model)
    gm = trace_aten_forward(f, [*tensors, ids, labels])
    cfg = EngineConfig(precision="fp16", loss_scale_init=1024.0, loss_scale_hysteresis=1, loss_scale_interval=1000)
    gm = apply_mixed_precision_pass(gm, PassContext(config=cfg, stage="pre_autodiff"))
    params = list(model.parameters())
    assert len(params) == len(tensors) and all(a is b for a, b in zip(params, tensors))
    opt, scaler = FusedAdamW(params, lr=3e-3), make_loss_scaler(cfg)
    losses, infos, overflow_step = [], [], 6
    for step in range(12):
        loss = gm(*params, ids, labels)
        blow_up = 1e6 if step == overflow_step else 1.0  # gradients ~1e9 * scale: inf in fp16
        scaler.scale(loss * blow_up).backward()
        before = [p.detach().clone() for p in params]
        infos.append(optimizer_step(opt, params, scaler=scaler, grad_clip=1.0))
        opt.zero_grad(set_to_none=True)
        changed = any(not torch.equal(b, p) for b, p in zip(before, params))
        assert changed == (step != overflow_step), step
        losses.append(float(loss.detach()))
    assert [i["skipped"] for i in infos] == [s == overflow_step for s in range(12)]
    assert [i["scale"] for i in infos] == [1024.0] * overflow_step + [512.0] * (12 - overflow_step)
    assert scaler.skipped_steps == 1 and math.isnan(infos[overflow_step]["grad_norm"])
    assert all(math.isfinite(i["grad_norm"]) for s, i in enumerate(infos) if s != overflow_step)
    assert losses[overflow_step + 1] == losses[overflow_step]  # weights unchanged by the skipped step
    assert losses[-1] < losses[0] - 0.05  # and training went on
