"""Buffer reuse: in-place elementwise pass, boxed backward frees saved activations, grad buffers."""

from __future__ import annotations

import copy

import pytest
import torch

from graphtrain.config.sections import EngineConfig, ModelConfig
from graphtrain.frontend.capture import capture_graphs, compile_train_step
from graphtrain.memory.predict import graph_liveness, placeholder_keys
from graphtrain.models import build_model
from graphtrain.passes.manager import registered_passes
from graphtrain.passes.memory_inplace import inplace_candidates, inplace_elementwise_pass
from graphtrain.testing import assert_close

ATEN = EngineConfig(provider="aten")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    m = build_model(ModelConfig(name="gpt2-tiny", dropout=0.1)).train()
    g = torch.Generator().manual_seed(1)
    return m, (torch.randint(0, 512, (4, 64), generator=g), torch.randint(0, 512, (4, 64), generator=g))


def test_pass_is_registered_for_both_stages():
    spec = registered_passes()["inplace_elementwise"]
    assert spec.stages == ("forward", "backward") and not spec.changes_numerics


def test_inplace_rules_on_a_small_graph():
    def f(x, w):
        a = x @ w  # produced here, one user -> relu may write into it
        b = torch.relu(a)
        c = b + x  # b: one user -> add_ writes into b
        v = c.view(-1)  # c has a view: not rewritten
        d = torch.gelu(c) if False else torch.tanh(c)
        return d, v, x.exp()  # x is a graph input: exp stays out of place

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(f, tracing_mode="fake")(torch.randn(8, 8), torch.randn(8, 8))
    names = [str(n.target) for n in inplace_candidates(gm)]
    assert names == ["aten.relu.default", "aten.add.Tensor"], names


@pytest.mark.parametrize("mode", ["none", "full"])
def test_inplace_bitwise_and_counts(tiny, mode):
    m, batch = tiny
    ref = copy.deepcopy(m)
    step_ref = compile_train_step(ref, EngineConfig(recompute=mode))
    torch.manual_seed(3)
    l_ref = step_ref(*batch)
    l_ref.backward()
    m2 = copy.deepcopy(m)
    rewrites: dict[str, int] = {}
    step = compile_train_step(
        m2,
        EngineConfig(recompute=mode, provider="aten"),
        fw_passes=[inplace_elementwise_pass],
        bw_passes=[inplace_elementwise_pass],
        rewrites=rewrites,
    )
    torch.manual_seed(3)
    loss = step(*batch)
    loss.backward()
    assert rewrites["forward/inplace_elementwise_pass"] > 0 and rewrites["backward/inplace_elementwise_pass"] > 0
    assert_close(loss.detach(), l_ref.detach(), name="loss", bitwise=True)
    for (n, p), q in zip(m2.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, name=f"grad of {n}", bitwise=True)


def test_inplace_skipped_for_inductor(tiny):
    m, batch = tiny
    cap = capture_graphs(m, batch, EngineConfig(recompute="none"))
    from graphtrain.passes.manager import PassContext

    ctx = PassContext(config=EngineConfig(provider="inductor"), stage="forward")
    inplace_elementwise_pass(cap.fw_gm, ctx)
    assert ctx.rewrites == 0


def test_inplace_allocates_less(tiny):
    m, batch = tiny
    plain = capture_graphs(m, batch, ATEN)
    inpl = capture_graphs(m, batch, ATEN, fw_passes=[inplace_elementwise_pass], bw_passes=[inplace_elementwise_pass])

    def peaks(cap):
        ext = set().union(*placeholder_keys(cap.fw_gm))  # parameters and batch: not the graphs' bytes
        fw, bw = graph_liveness(cap.fw_gm, ext, free_inputs=False), graph_liveness(cap.bw_gm, ext)
        return fw.peak_bytes, bw.peak_bytes, fw.allocated_bytes + bw.allocated_bytes

    (fw0, bw0, a0), (fw1, bw1, a1) = peaks(plain), peaks(inpl)
    # gpt2-tiny's peak sits at log_softmax's backward, which the pass cannot touch; it allocates less
    assert fw1 <= fw0 and bw1 <= bw0 and a1 < a0, (fw0, fw1, bw0, bw1, a0, a1)


def test_boxed_backward_frees_saved_activations_early(tiny):
    m, batch = tiny
    cap = capture_graphs(m, batch, ATEN)
    ext = set().union(*placeholder_keys(cap.fw_gm))
    held = graph_liveness(cap.bw_gm, ext, free_inputs=False)
    freed = graph_liveness(cap.bw_gm, ext, free_inputs=True)
    assert freed.peak_bytes <= held.peak_bytes and freed.output_bytes == held.output_bytes


def test_grad_buffers_reused_across_steps(tiny):
    """autograd's AccumulateGrad: with .grad kept (zero_grad(set_to_none=False)) the backward's new
    gradient is added in place into the same buffer every step; with set_to_none=True the graph's
    output buffer is stolen as .grad (no copy). Either way no second persistent gradient copy."""
    m, batch = tiny
    m2 = copy.deepcopy(m)
    step = compile_train_step(m2, ATEN)
    step(*batch).backward()
    ptrs = [p.grad.data_ptr() for p in m2.parameters()]
    m2.zero_grad(set_to_none=False)
    step(*batch).backward()
    assert ptrs == [p.grad.data_ptr() for p in m2.parameters()]
