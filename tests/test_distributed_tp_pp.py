"""Tensor parallel (DTensor Megatron plan) and pipeline parallel (1F1B, GPipe) against one process."""
from __future__ import annotations

import pytest
import torch

from graphtrain.config import ParallelConfig
from graphtrain.distributed import parallelize
from graphtrain.distributed.spawn import run_ranks
from graphtrain.distributed.tensor_parallel import check_tp
from graphtrain.testing import assert_close
from test_distributed_mesh import ATOL, RTOL, batch, optim_factory, reference_run, tiny

pytestmark = pytest.mark.dist
STEPS = 3


def _full_grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by unsharded-model name: DTensors gathered, split q/k/v re-fused into qkv."""
    g = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in module.named_parameters()}
    for n in [n for n in g if ".qkv.q." in n]:
        g[n.replace(".qkv.q.", ".qkv.")] = torch.cat([g.pop(n.replace(".q.", f".{x}.")) for x in "qkv"])
    return g


def _worker(layout: dict, name: str) -> dict:
    par = parallelize(tiny(name), optim_factory(), ParallelConfig(timeout_s=60, **layout))
    out = {"losses": []}
    for s in range(STEPS):
        ids, labels = batch(4, seed=s)
        out["losses"].append(par.forward_backward(ids, labels).item())
        if s == 0:
            out["grads0"] = _full_grads(par.module)
        par.optimizer.step()
        par.optimizer.zero_grad()
    return out


def _check(results: list[dict], name: str = "gpt2-tiny") -> None:
    ref = tiny(name)
    ids, labels = batch(4, seed=0)
    ref(ids, labels=labels).backward()
    _, ref_losses = reference_run(STEPS, name=name)
    ref_grads = dict(ref.named_parameters())
    for r, out in enumerate(results):
        torch.testing.assert_close(out["losses"], ref_losses, rtol=RTOL, atol=0, msg=f"rank {r} losses")
        for n, g in out["grads0"].items():
            if n == "lm_head.weight" and "wte.weight" not in out["grads0"]:
                n = "wte.weight"  # pipeline last stage: its copy of the tied matrix, gradient summed with stage 0's
            assert_close(g, ref_grads[n].grad, name=f"rank {r} grad of {n}", rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny"])
def test_tensor_parallel_matches_single_process(name):
    _check(run_ranks(_worker, 2, {"tp": 2}, name), name)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_matches_single_process(schedule):
    _check(run_ranks(_worker, 2, {"pp": 2, "microbatches": 2, "schedule": schedule}, "gpt2-tiny"))


@pytest.mark.parametrize("layout", [{"tp": 2, "dp": 2}, {"pp": 2, "dp": 2, "microbatches": 2}])
def test_dp_with_tp_or_pp_is_a_clear_error(layout):
    # Run on 4 gloo ranks, DDP could not wrap DTensor parameters (tp) and its reducer asserted under
    # pipelined micro-batches (pp); until FSDP2/replicate composes them, the layout is refused up front.
    with pytest.raises(ValueError, match=r"parallel.dp>1 together with parallel.(tp|pp)>1 is not supported yet"):
        parallelize(tiny(), optim_factory(), ParallelConfig(**layout), env=object())


def test_tp_needs_heads_divisible():
    with pytest.raises(ValueError, match=r"parallel.tp=3 must divide the model's attention heads \(n_head\) = 2: "
                                         r"use parallel.tp=2"):
        check_tp(tiny(), 3)
