"""A training step under a user's TorchDispatchMode (FlopCounterMode, a logging or debug mode), through each entry
point: the mode sees every op of the step, as in eager PyTorch; the steps after it run compiled again; training
matches eager's.

Dynamo compiles nothing while such a mode is on the stack, and torch 2.11 to 2.13 then marked the model's code
"skip" for good (pytorch/pytorch#190286): one FLOP count of one step left graphtrain's model eager, in fp32, for the
rest of the run, without a word (HF Llama mini bf16: 230 -> 440 ms a step, measured on 2.13.0)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import graphtrain
from graphtrain.config.sections import Config, ModelConfig, OptimConfig
from graphtrain.config.torch_compat import user_dispatch_mode
from graphtrain.models import build_model
from graphtrain.optim import build_optimizer, optimizer_step
from graphtrain.testing import assert_close

CFG = Config(optim=OptimConfig(lr=3e-3, grad_clip=1.0))


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(name="gpt2-tiny", dropout=0.0))


def _loop(run_step, mode_step: int = 1, steps: int = 3) -> tuple[list[torch.Tensor], int, list[str]]:
    """`steps` steps of `run_step(batch) -> loss tensor (with its graph, or detached)`, the `mode_step`-th under
    FlopCounterMode; returns the losses, the FLOPs the mode counted and each step's loss grad_fn name."""
    losses, flops, grad_fns = [], 0, []
    for i in range(steps):
        if i == mode_step:
            with FlopCounterMode(display=False) as counter:
                assert user_dispatch_mode() is not None
                loss = run_step(_batch(i))
            flops = counter.get_total_flops()
        else:
            loss = run_step(_batch(i))
        grad_fns.append(loss.grad_fn.name() if loss.grad_fn is not None else "")
        losses.append(loss.detach())
    return losses, flops, grad_fns


def _module_step(module: torch.nn.Module, opt: torch.optim.Optimizer, params) -> object:
    def run(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = module(**batch)
        loss.backward()
        optimizer_step(opt, params, grad_clip=CFG.optim.grad_clip)
        opt.zero_grad(set_to_none=True)
        return loss

    return run


def _eager(model: torch.nn.Module, mode_step: int = 1) -> tuple[list[torch.Tensor], int]:
    run = _module_step(model, build_optimizer(model, CFG.optim), list(model.parameters()))
    losses, flops, _ = _loop(run, mode_step)
    return losses, flops


def _same_training(model, ref, losses, ref_losses) -> None:
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close(a, b, name=f"loss of step {i}")
    # AdamW's division by sqrt(v): tolerance as tests/test_step_graph.py's whole-step test
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, name=f"weight {n}", atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("entry", ["accelerate", "backend"])
def test_a_step_under_a_dispatch_mode_runs_eagerly_and_the_next_runs_compiled(entry):
    """Regression (torch 2.13): after one step under FlopCounterMode, every later step ran eagerly. The mode now
    counts eager's FLOPs for its step, and the step after it is the compiled graph's again (its loss comes out of a
    compiled autograd function), through `accelerate` and through `torch.compile(backend="graphtrain")`."""
    model = _model()
    ref = copy.deepcopy(model)
    if entry == "accelerate":
        wrapped = graphtrain.accelerate(model, provider="aten")
    else:
        from graphtrain.runtime.backend import DISPATCH_MODE_SKIPS_ONE_CALL

        if not DISPATCH_MODE_SKIPS_ONE_CALL:
            pytest.skip(f"torch {torch.__version__}: Dynamo has not got the skip this test changes")
        wrapped = torch.compile(model, backend="graphtrain", options={"provider": "aten"})
    losses, flops, grad_fns = _loop(_module_step(wrapped, build_optimizer(model, CFG.optim), list(model.parameters())))
    ref_losses, ref_flops = _eager(ref)
    assert flops == ref_flops > 0
    assert grad_fns[0] == grad_fns[2] == "CompiledFunctionBackward", grad_fns
    assert grad_fns[1] != "CompiledFunctionBackward"  # eager's own autograd graph, which the mode saw
    _same_training(model, ref, losses, ref_losses)
    if entry == "accelerate":
        rep = graphtrain.report(model)
        assert not rep.fallbacks and any("TorchDispatchMode (FlopCounterMode)" in n for n in rep.notes), rep.notes


@pytest.mark.parametrize("first", [False, True], ids=["built", "first-call"])
@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "one-graph"])
def test_compile_step_under_a_dispatch_mode_runs_uncompiled_for_that_step(blocks, first):
    """compile_step under a mode: that step runs uncompiled (the model, autograd and AdamW op by op), so the mode
    counts every FLOP eager's step has; the optimizer state is the compiled step's, and the next step runs compiled.
    Its first call under the mode built nothing: the build had traced under the mode, failed, and left the step
    uncompiled for good ("A leaf node was passed to _will_engine_execute_node")."""
    model = _model()
    ref = copy.deepcopy(model)
    step = graphtrain.compile_step(model, CFG, provider="aten", compile_blocks=blocks)
    mode_step = 0 if first else 1
    losses, flops, _ = _loop(lambda batch: step(**batch)["loss"], mode_step)
    ref_losses, ref_flops = _eager(ref, mode_step)
    assert flops == ref_flops > 0
    assert step.provider == "aten" and not graphtrain.report(model).fallbacks
    assert any("TorchDispatchMode (FlopCounterMode)" in n for n in step.state.notes)
    _same_training(model, ref, losses, ref_losses)
