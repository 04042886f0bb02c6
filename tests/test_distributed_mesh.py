"""Mesh/layout errors, fault handling, and the shared helpers of the distributed tests.

Every distributed test builds the single-device reference from the same weights on every rank
and compares (torchtitan's habit). Ranks are gloo processes on 127.0.0.1 (graphtrain.distributed.spawn).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from graphtrain.config.sections import ModelConfig, OptimConfig, ParallelConfig
from graphtrain.distributed.mesh import check_layout, init_distributed
from graphtrain.distributed.spawn import free_port

pytestmark = pytest.mark.dist

# fp32 tolerance for results whose reduction order changes (sharded matmuls, all-reduce sums of partial
# gradients): a few ulps of the largest term, far below anything a wrong shard/scale would give (>1e-2).
RTOL, ATOL = 1e-4, 1e-6


def tiny(name: str = "gpt2-tiny") -> torch.nn.Module:
    """The reference tiny model, same weights on every caller (dropout off: shards must see equal masks)."""
    from graphtrain.models import build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(name=name, dropout=0.0))


def batch(n: int = 4, t: int = 16, vocab: int = 512, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, t), generator=g), torch.randint(0, vocab, (n, t), generator=g)


def optim_factory(lr: float = 1e-2):
    from graphtrain.optim import build_optimizer

    cfg = OptimConfig(lr=lr)
    return lambda m: build_optimizer(m, cfg)


def train_reference(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process AdamW steps of `model` on (ids, labels) batches: per-step losses and step-0 gradients.
    Models returning an output object (Hugging Face) give their `.loss`."""
    opt = optim_factory()(model)
    losses, grads0 = [], {}
    for s, (ids, labels) in enumerate(batches):
        out = model(input_ids=ids, labels=labels)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        if s == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads0


def reference_run(steps: int, n: int = 4, name: str = "gpt2-tiny") -> tuple[torch.nn.Module, list[float]]:
    """Single-process AdamW run on the full batch of each step; returns the model and per-step losses."""
    model = tiny(name)
    losses, _ = train_reference(model, [batch(n, seed=s) for s in range(steps)])
    return model, losses


def test_layout_must_match_world_size(monkeypatch):
    with pytest.raises(ValueError, match=r"pp=1 x dp=2 x tp=2 = 4 ranks.*world size 2.*set parallel.dp=1"):
        check_layout(ParallelConfig(dp=2, tp=2), 2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"world size 3: choose dp, tp, pp whose product is 3.*--nproc 2"):
        init_distributed(ParallelConfig(dp=1, tp=2))


_DYING_RANK = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    from graphtrain.config.sections import ParallelConfig
    from graphtrain.distributed.mesh import init_distributed
    env = init_distributed(ParallelConfig(dp=2, timeout_s=5))
    if env.rank == 1:
        os._exit(3)  # dies without a word, as a crashed/killed worker would
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        dist.barrier()
    except Exception as e:
        print(f"ERROR after {time.monotonic() - t0:.1f}s: {type(e).__name__}", flush=True)
        # os._exit, not sys.exit: interpreter teardown with gloo's thread still joinable sometimes aborts
        # ("terminate called without an active exception", SIGABRT), which hides the exit code checked here.
        os._exit(1)
    print("NO ERROR", flush=True)
""")


def test_dead_rank_raises_within_timeout():
    port = str(free_port())
    procs = []
    for r in range(2):
        env = dict(
            os.environ,
            RANK=str(r),
            LOCAL_RANK=str(r),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _DYING_RANK],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    t0 = time.monotonic()
    try:
        out0, _ = procs[0].communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        procs[1].wait()
    assert procs[1].returncode == 3
    assert procs[0].returncode == 1 and "ERROR after" in out0, out0
    assert time.monotonic() - t0 < 60
