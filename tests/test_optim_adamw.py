"""FusedAdamW and optimizer_step: parity with torch.optim.AdamW, accumulation, clipping, resume."""

from __future__ import annotations

import copy

import pytest
import torch

from graphtrain.config.sections import OptimConfig
from graphtrain.optim import FusedAdamW, build_optimizer, optimizer_step, param_groups

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 5))


def batches(n, seed=1, size=16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 12, generator=g), torch.randint(0, 5, (size,), generator=g)) for _ in range(n)]


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def train(model, opt, data, grad_clip=None, accum=1):
    infos = []
    for x, y in data:
        for xs, ys in zip(x.chunk(accum), y.chunk(accum)):
            (loss_of(model, xs, ys) / accum).backward()
        infos.append(optimizer_step(opt, model.parameters(), grad_clip=grad_clip))
        opt.zero_grad(set_to_none=True)
    return infos


def test_fused_adamw_matches_torch_adamw_over_100_steps():
    cfg = OptimConfig(name="adamw", lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    ours, ref = tiny_model(), tiny_model()
    opt = build_optimizer(ours, cfg)
    assert isinstance(opt, FusedAdamW) and opt.implementation == "fused"
    ref_opt = torch.optim.AdamW(param_groups(ref, 0.1), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    data = batches(100)
    train(ours, opt, data)
    train(ref, ref_opt, data)
    for (n, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert not torch.allclose(ours[0].weight, tiny_model()[0].weight)


def test_gradient_accumulation_equals_one_big_batch():
    a, b = tiny_model(), tiny_model()
    opt_a, opt_b = FusedAdamW(a.parameters(), lr=1e-2), FusedAdamW(b.parameters(), lr=1e-2)
    data = batches(5)
    train(a, opt_a, data, accum=1)
    train(b, opt_b, data, accum=4)  # 4 micro-batches of 4, each loss / 4
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_clipping_by_global_norm():
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: only the gradients' clipping is observed
    x, y = batches(1)[0]
    (loss_of(model, x, y) * 1000).backward()
    norm_before = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    info = optimizer_step(opt, model.parameters(), grad_clip=0.5)
    norm_after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert info["skipped"] is False and info["scale"] is None
    assert info["grad_norm"] == pytest.approx(float(norm_before), rel=1e-5)
    assert float(norm_after) == pytest.approx(0.5, rel=1e-4)
    info = optimizer_step(opt, model.parameters(), grad_clip=10.0)  # under the limit: unchanged
    assert info["grad_norm"] == pytest.approx(0.5, rel=1e-4)
    with pytest.raises(ValueError, match="grad_clip"):
        optimizer_step(opt, model.parameters(), grad_clip=0.0)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        optimizer_step(model, model.parameters())


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_state_dict_round_trip_continues_identically(name):
    cfg = OptimConfig(name=name, lr=1e-2)
    data = batches(20)
    full = tiny_model()
    train(full, build_optimizer(full, cfg), data, grad_clip=1.0)
    part = tiny_model()
    opt = build_optimizer(part, cfg)
    train(part, opt, data[:10], grad_clip=1.0)
    saved_model, saved_opt = copy.deepcopy(part.state_dict()), copy.deepcopy(opt.state_dict())
    resumed = tiny_model(seed=5)
    resumed.load_state_dict(saved_model)
    opt2 = build_optimizer(resumed, cfg)
    opt2.load_state_dict(saved_opt)
    train(resumed, opt2, data[10:], grad_clip=1.0)
    for a, b in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(a, b)


def test_build_optimizer_unfused_and_errors():
    model = tiny_model()
    opt = build_optimizer(model, OptimConfig(name="adamw", fused=False))
    assert type(opt) is torch.optim.AdamW and opt.defaults["foreach"] is False
    with pytest.raises(TypeError, match="nn.Module"):
        build_optimizer("model", OptimConfig())
    with pytest.raises(TypeError, match="param-group"):
        FusedAdamW([1.0, 2.0])
