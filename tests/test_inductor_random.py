"""Functional random ops (aten.rand / randn: stochastic depth, noise) go to Inductor on CPU, and the graph draws
what eager draws: same seed, same values, forward and backward. The in-place bernoulli_ that Inductor misordered
stays refused (tests/test_kernels_gemm.py, tests/test_engine_tiered.py)."""

from __future__ import annotations

import copy

import torch

import graphtrain
from graphtrain.testing import assert_close, assert_grads_close


class DropPathBlock(torch.nn.Module):
    """A residual block with Hugging Face's / timm's drop_path (aten.rand) and additive noise (aten.randn_like)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = 0.8
        r = (keep + torch.rand((x.shape[0], 1, 1), dtype=x.dtype)).floor_()
        h = x + self.a(x).relu().div(keep) * r
        return self.b(h + 0.01 * torch.randn_like(h))


def test_drop_path_runs_on_inductor_with_eagers_draws():
    torch.manual_seed(0)
    ref = DropPathBlock()
    m = graphtrain.accelerate(copy.deepcopy(ref), provider="inductor", fallback="error")
    x = torch.randn(16, 4, 32)
    for step in range(2):
        outs = []
        for mod in (ref, m):
            mod.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            out = mod(x)
            out.square().mean().backward()
            outs.append(out.detach())
        assert_close(outs[1], outs[0], name=f"step {step} output")
        assert_grads_close(m, ref)
    assert [g["provider"] for g in graphtrain.report(m).graphs] == ["inductor"]
