"""A user's torch.autograd.Function inside a captured graph (passes/autograd_functions.py): held opaque through the
trace to aten and the pre-autodiff passes, restored before autodiff, so the passes run on the graph around it and
the step runs the function's own backward. Checked against eager PyTorch with a backward that is deliberately not
the forward's derivative (a passes-era inlining of the forward would give autograd's gradient instead)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import graphtrain
from graphtrain.testing import assert_close, assert_grads_close

pytestmark = pytest.mark.usefixtures("one_thread")


class ScaledSiLU(torch.autograd.Function):
    """x * sigmoid(x) forward; its backward is twice the derivative (as a gradient-scaling or straight-through
    function differs from autograd's own)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s)) * 2.0


class HalvedSiLU(ScaledSiLU):
    """The same forward; half the derivative."""

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s)) * 0.5


class Block(nn.Module):
    def __init__(self, d: int, fn: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.norm, self.up, self.down, self.fn = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.fn.apply(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self, d: int = 16, n: int = 3, fn: type[torch.autograd.Function] = ScaledSiLU) -> None:
        super().__init__()
        self.h = nn.ModuleList(Block(d, fn) for _ in range(n))
        self.head = nn.Linear(d, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.h:
            x = b(x)
        return self.head(x).logsumexp(-1).mean()


def _x() -> torch.Tensor:
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))


def _one_step(provider: str, tmp_path, fn=ScaledSiLU, **engine):
    torch.manual_seed(0)
    eager = Stack(fn=fn)
    model = graphtrain.accelerate(
        copy.deepcopy(eager), provider=provider, **{"fallback": "error", **engine}, cache_dir=str(tmp_path / "cache")
    )
    for m in (eager, model):
        m.loss = m(_x())
        m.loss.backward()
    assert_close(model.loss, eager.loss, name="loss")
    assert_grads_close(model, eager)
    return graphtrain.report(model)


def test_the_functions_own_backward_runs_and_the_passes_run_around_it(tmp_path):
    rep = _one_step("aten", tmp_path)
    assert not rep.fallbacks, rep.fallbacks
    assert any("autograd.Function call(s) held opaque" in n for g in rep.graphs for n in g["notes"]), rep.graphs
    # the layer norms around the function were fused: the passes ran on these graphs
    assert any(p["name"] == "fuse_layer_norm" and p["rewrites"] >= 3 for p in rep.passes), rep.passes
    (rec,) = [p for p in rep.passes if p["name"] == "hide_autograd_functions"]
    assert rec["stage"] == "dynamo" and rec["rewrites"] == 3, rec  # one block body, run by three layers


def test_switched_off_the_graph_cannot_be_traced_and_keeps_the_function(tmp_path):
    """engine.passes: {hide_autograd_functions: false}: the trace to aten fails on the function (reported), the graph
    is compiled without pre-autodiff passes and still runs the function's own backward."""
    rep = _one_step("aten", tmp_path, fallback="silent", passes={"hide_autograd_functions": False})
    assert any(part.startswith("tracing ") for part, _ in rep.fallbacks), rep.fallbacks
    assert not any("held opaque" in n for g in rep.graphs for n in g["notes"]), rep.graphs
    assert not [p for p in rep.passes if p["name"] == "hide_autograd_functions"], rep.passes
    assert not [p for p in rep.passes if p["name"] == "fuse_layer_norm" and p["rewrites"]], rep.passes
    assert "switched off (engine.passes): hide_autograd_functions" in str(rep)


def test_a_second_compile_loads_the_graph_with_its_function_from_the_pass_cache(tmp_path):
    """The pass cache stores the restored graph, bodies included; a later compile of the same model loads it (no
    trace, no passes) and still runs the function's own backward."""
    _one_step("aten", tmp_path)
    torch._dynamo.reset()
    rep = _one_step("aten", tmp_path)
    assert rep.graphs and all(g["pass_cache"] == "hit" for g in rep.graphs), [g["pass_cache"] for g in rep.graphs]


@pytest.mark.slow
def test_under_inductor(tmp_path):
    rep = _one_step("inductor", tmp_path)
    assert not rep.fallbacks, rep.fallbacks


def _dynamo_graph(fn: type[torch.autograd.Function]) -> tuple[torch.fx.GraphModule, list[torch.Tensor], Block]:
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block(16, fn)
    torch.compile(block, backend=backend, fullgraph=True)(_x())
    ((gm, inputs),) = seen
    return gm, inputs, block


def test_two_functions_that_differ_only_in_their_bodies_get_different_cache_keys():
    """Regression: the pass cache's key hashed the graph's code, which names an autograd.Function's bodies
    (self.fwd_body_0) but not what they compute."""
    from graphtrain.config.sections import EngineConfig
    from graphtrain.pipeline.cache import pass_cache_key

    keys = []
    for fn in (ScaledSiLU, HalvedSiLU):
        gm, inputs, _ = _dynamo_graph(fn)
        keys.append(pass_cache_key(gm, inputs, ["input"] * len(inputs), EngineConfig()))
    assert keys[0] != keys[1]


def test_a_graph_with_a_function_is_plain_data():
    """What the background compile receives: the graph encoded (bodies included) runs the same forward and the
    function's own backward after a pickle round trip."""
    from graphtrain.pipeline.cache import _decode_graph, _encode_graph

    gm, inputs, block = _dynamo_graph(ScaledSiLU)
    loaded = _decode_graph(pickle.loads(pickle.dumps(_encode_graph(gm))))
    args = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    (out,) = loaded(*args)
    ref = block(_x())
    assert_close(out, ref, name="forward")
    out.square().sum().backward()
    ref.square().sum().backward()
    grads = {tuple(a.shape): a.grad for a in args if a.grad is not None}
    assert_close(grads[tuple(block.up.weight.shape)], block.up.weight.grad, name="up.weight grad")


def test_hide_leaves_the_captured_graph_alone_and_the_op_has_no_gradient_of_its_own():
    """hide() works on a copy (the eager fallback runs the captured graph); the opaque op never reaches autograd
    silently: un-restored, its backward is an error, not a gradient through the forward."""
    from graphtrain.passes import autograd_functions as af

    gm, inputs, _ = _dynamo_graph(ScaledSiLU)
    hidden, n = af.hide(gm)
    assert n == 1 and af.has_autograd_functions(gm) and not af.has_autograd_functions(hidden)
    args = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    (out,) = hidden(*args)
    with pytest.raises(RuntimeError, match="autograd"):
        out.sum().backward()
    assert af.restore(hidden) == 1 and af.has_autograd_functions(hidden)
    with pytest.raises(RuntimeError, match="no such function in this process"):
        torch.ops.graphtrain.autograd_function("0" * 64, [torch.ones(2)])
