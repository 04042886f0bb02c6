"""A no_grad region inside a training graph (passes/no_grad_regions.py): lifted, its values detached, so that the
pre-autodiff passes run on the graph (Hugging Face Llama's rotary embedding); a region that mutates is left alone.
Checked against eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import graphtrain
from graphtrain.passes.no_grad_regions import lift_no_grad_regions
from graphtrain.testing import assert_close, assert_grads_close

pytestmark = pytest.mark.usefixtures("one_thread")


class Rotary(nn.Module):
    """A layer norm (a fusion the passes make) after a rotary-like table computed under no_grad, as HF Llama does."""

    def __init__(self, mutate: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 8))
        self.register_buffer("calls", torch.zeros(()))
        self.mutate = mutate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            pos = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.inv_freq
            cos, sin = torch.cat([pos, pos], -1).cos(), torch.cat([pos, pos], -1).sin()
            if self.mutate:
                self.calls.add_(1)
        h = self.proj(x) * cos + x * sin
        return self.norm(h).square().mean()


def _x() -> torch.Tensor:
    return torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))


def test_a_no_grad_region_is_lifted_and_the_passes_run():
    torch.manual_seed(0)
    eager = Rotary()
    model = graphtrain.accelerate(copy.deepcopy(eager), provider="aten", fallback="error")
    x = _x()
    for m in (eager, model):
        m.loss = m(x)
        m.loss.backward()
    assert_close(model.loss, eager.loss, name="loss")
    assert_grads_close(model, eager)
    rep = graphtrain.report(model)
    assert any("no_grad region in a graph: lifted" in n for n in rep.notes), rep.notes
    (g,) = rep.graphs
    assert not any("pre-autodiff passes skipped" in n for n in g["notes"]), g["notes"]
    assert any(p["name"] == "fuse_layer_norm" and p["rewrites"] >= 1 for p in rep.passes), rep.passes
    (rec,) = [p for p in rep.passes if p["name"] == "lift_no_grad_regions"]
    assert rec["stage"] == "dynamo" and rec["rewrites"] == 1, rec


def test_switched_off_the_graph_goes_as_captured():
    """engine.passes: {lift_no_grad_regions: false}: the region stays, the pre-autodiff passes are skipped (the
    graph still trains like eager), and the report says the pass was off."""
    torch.manual_seed(0)
    eager = Rotary()
    model = graphtrain.accelerate(
        copy.deepcopy(eager), provider="aten", fallback="error", passes={"lift_no_grad_regions": False}
    )
    x = _x()
    for m in (eager, model):
        m.loss = m(x)
        m.loss.backward()
    assert_close(model.loss, eager.loss, name="loss")
    assert_grads_close(model, eager)
    rep = graphtrain.report(model)
    assert not any("lifted" in n for n in rep.notes), rep.notes
    assert any("pre-autodiff passes skipped" in n for g in rep.graphs for n in g["notes"])
    assert not [p for p in rep.passes if p["name"] == "lift_no_grad_regions"], rep.passes
    assert "switched off (engine.passes): lift_no_grad_regions" in str(rep)


def test_a_region_that_mutates_is_left_as_captured():
    torch.manual_seed(0)
    eager = Rotary(mutate=True)
    model = graphtrain.accelerate(copy.deepcopy(eager), provider="aten", fallback="error")
    x = _x()
    for m in (eager, model):
        for _ in range(2):
            m.loss = m(x)
            m.loss.backward()
    assert_close(model.loss, eager.loss, name="loss")
    assert_grads_close(model, eager)
    assert model.calls.item() == eager.calls.item() == 2
    rep = graphtrain.report(model)
    assert not any("lifted" in n for n in rep.notes), rep.notes
    assert any("pre-autodiff passes skipped" in n for g in rep.graphs for n in g["notes"])


def test_the_rewrite_itself():
    """On a Dynamo graph: the grad-mode nodes go, the region's values used later pass through detach; a graph whose
    grad-mode changes are not False/True pairs is left unchanged."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    @torch.compile(backend=backend)
    def f(x, w):
        with torch.no_grad():
            a, b = (x * 2).cos().chunk(2, -1)
        return (x @ w + a.sum() + b.repeat(1, 2)).sum()

    f(torch.randn(4, 4), torch.randn(4, 4, requires_grad=True))
    (gm,) = graphs
    assert lift_no_grad_regions(gm) == 1
    nodes = list(gm.graph.nodes)
    assert not any(n.target is torch._C._set_grad_enabled for n in nodes)
    assert sum(n.op == "call_method" and n.target == "detach" for n in nodes) == 2  # a and b
    assert lift_no_grad_regions(gm) == 0  # nothing left to lift

    # by hand: a region left open at the output (no pair) is not rewritten
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_function(torch._C._set_grad_enabled, (False,))
    y = g.call_function(torch.mul, (x, 2))
    g.output((y,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    before = str(gm.graph)
    assert lift_no_grad_regions(gm) == 0 and str(gm.graph) == before
