"""LAMB against a plain per-parameter reference (apex FusedLAMB semantics), both implementations."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from graphtrain.config.sections import OptimConfig
from graphtrain.optim import LAMB, build_optimizer

pytestmark = pytest.mark.usefixtures("one_thread")


SHAPES = [(33, 17), (17,), (8, 4, 3), (5,), (1,)]


def reference_lamb(params, grads_seq, groups_wd, lr, betas, eps, max_grad_norm, use_nvlamb=False):
    """Straightforward LAMB, one parameter at a time, in Python scalars where possible."""
    b1, b2 = betas
    params = [p.clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_seq, start=1):
        scale = 1.0
        if max_grad_norm > 0:
            global_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
            scale = max(1.0, global_norm / max_grad_norm)
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g / scale
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1**t)
            v_hat = v[i] / (1 - b2**t)
            update = m_hat / (v_hat.sqrt() + eps) + groups_wd[i] * p
            ratio = 1.0
            if groups_wd[i] != 0 or use_nvlamb:
                w_norm, u_norm = float(p.norm()), float(update.norm())
                if w_norm > 0 and u_norm > 0:
                    ratio = w_norm / u_norm
            params[i] = p - lr * ratio * update
    return params


def make_problem(seed=0, steps=100):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) * 0.5 for s in SHAPES]
    params[3].zero_()  # ||w|| = 0: the trust ratio falls back to 1
    grads_seq = []
    for t in range(steps):
        grads = [torch.randn(s, generator=g) * (0.1 + 2.0 * (t % 7 == 0)) for s in SHAPES]  # some steps clip
        grads_seq.append(grads)
    wd = [0.01 if len(s) >= 2 else 0.0 for s in SHAPES]
    return params, grads_seq, wd


def run_lamb(params, grads_seq, wd, fused, **kw):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    groups = [
        {"params": [p for p, w in zip(ps, wd) if w], "weight_decay": 0.01},
        {"params": [p for p, w in zip(ps, wd) if not w], "weight_decay": 0.0},
    ]
    opt = LAMB(groups, fused=fused, **kw)
    for grads in grads_seq:
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        opt.step()
    return ps, opt


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0])
def test_lamb_matches_reference_over_100_steps(fused, max_grad_norm):
    params, grads_seq, wd = make_problem()
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, max_grad_norm=max_grad_norm)
    ours, _ = run_lamb(params, grads_seq, wd, fused, **kw)
    ref = reference_lamb(params, grads_seq, wd, **kw)
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a.detach(), b, rtol=1e-6, atol=1e-6, msg=lambda m, i=i: f"param {i}: {m}")
    assert not torch.equal(ours[0].detach(), params[0])  # it did train


def test_lamb_nvlamb_applies_trust_ratio_without_weight_decay():
    params, grads_seq, wd = make_problem(steps=20)
    ours, _ = run_lamb(params, grads_seq, wd, True, lr=1e-2, use_nvlamb=True)
    ref = reference_lamb(
        params, grads_seq, wd, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, max_grad_norm=0.0, use_nvlamb=True
    )
    plain = reference_lamb(params, grads_seq, wd, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, max_grad_norm=0.0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(ref[1], plain[1])  # the bias (no decay) moved differently


@pytest.mark.parametrize("fused", [True, False])
def test_lamb_state_dict_round_trip_continues_identically(fused):
    params, grads_seq, wd = make_problem(steps=30)
    full, _ = run_lamb(params, grads_seq, wd, fused, lr=1e-2, max_grad_norm=1.0)
    first, opt = run_lamb(params, grads_seq[:15], wd, fused, lr=1e-2, max_grad_norm=1.0)
    state = copy.deepcopy(opt.state_dict())
    ps = [torch.nn.Parameter(p.detach().clone()) for p in first]
    groups = [
        {"params": [p for p, w in zip(ps, wd) if w], "weight_decay": 0.01},
        {"params": [p for p, w in zip(ps, wd) if not w], "weight_decay": 0.0},
    ]
    opt2 = LAMB(groups, lr=5.0, fused=fused)  # lr and max_grad_norm come back from the state
    opt2.load_state_dict(state)
    assert opt2.max_grad_norm == 1.0
    for grads in grads_seq[15:]:
        for p, gr in zip(ps, grads):
            p.grad = gr.clone()
        opt2.step()
    for a, b in zip(ps, full):
        assert torch.equal(a, b)


def test_build_optimizer_lamb_groups_and_errors():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = build_optimizer(model, OptimConfig(name="lamb", lr=1e-3, weight_decay=0.01))
    assert isinstance(opt, LAMB) and opt.fused
    decay, no_decay = opt.param_groups
    assert {p.dim() for p in decay["params"]} == {2} and decay["weight_decay"] == 0.01
    assert {p.dim() for p in no_decay["params"]} == {1} and no_decay["weight_decay"] == 0.0
    assert not build_optimizer(model, OptimConfig(name="lamb", fused=False)).fused
    with pytest.raises(ValueError, match="lr must be positive"):
        LAMB(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        LAMB(model.parameters(), max_grad_norm=-1.0)
    with pytest.raises(TypeError, match="OptimConfig"):
        build_optimizer(model, {"name": "lamb"})
