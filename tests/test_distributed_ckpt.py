"""Sharded DCP checkpoints: saved under dp=2, resumed under dp=1 and tp=2 with the same next-step loss."""

from __future__ import annotations

import sys

import pytest
import torch

from graphtrain.config.sections import ParallelConfig
from graphtrain.distributed import parallelize
from graphtrain.distributed.checkpoint import load_checkpoint
from graphtrain.distributed.launch import torchrun_command
from graphtrain.distributed.spawn import run_ranks
from test_distributed_mesh import RTOL, batch, optim_factory, reference_run, tiny

pytestmark = pytest.mark.dist


def _train_and_save(path: str, layout: dict, steps: int) -> None:
    par = parallelize(tiny(), optim_factory(), ParallelConfig(timeout_s=60, **layout))
    for s in range(steps):
        ids, labels = batch(4, seed=s)
        r, n = par.env.dp_rank, par.env.parallel.dp
        per = 4 // n
        par.forward_backward(ids[r * per : (r + 1) * per], labels[r * per : (r + 1) * per])
        par.optimizer.step()
        par.optimizer.zero_grad()
    par.save(path, extra={"step": steps})


def _resume_one_step(path: str, layout: dict, step: int) -> float:
    par = parallelize(tiny(), optim_factory(), ParallelConfig(timeout_s=60, **layout))
    assert par.load(path)["step"] == step
    ids, labels = batch(4, seed=step)
    loss = par.forward_backward(ids, labels)
    par.optimizer.step()  # the restored Adam moments take part: the step after must match too
    par.optimizer.zero_grad()
    ids, labels = batch(4, seed=step + 1)
    return [loss.item(), par.forward_backward(ids, labels).item()]


def test_checkpoint_reshards_dp2_to_dp1_and_tp2(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_train_and_save, 2, path, {"dp": 2, "zero_stage": 1}, 2)
    assert (tmp_path / "ckpt" / ".metadata").is_file() and not (tmp_path / "ckpt.tmp").exists()
    _, ref_losses = reference_run(4)
    _resume_here(path, ref_losses)
    for r, got in enumerate(run_ranks(_resume_one_step, 2, path, {"tp": 2}, 2)):
        torch.testing.assert_close(got, ref_losses[2:], rtol=RTOL, atol=0, msg=f"tp rank {r}")


def _resume_here(path: str, ref_losses: list[float]) -> None:
    """dp=1: load into this process (no process group) and check steps 2 and 3 against the reference."""
    model = tiny()
    opt = optim_factory()(model)
    load_checkpoint(path, model, opt)
    losses = []
    for s in (2, 3):
        ids, labels = batch(4, seed=s)
        loss = model(ids, labels=labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.testing.assert_close(losses, ref_losses[2:], rtol=RTOL, atol=0)


def test_checkpoint_saved_under_tp2_x_pp2_resumes_in_one_process(tmp_path):
    """4 ranks on the (pp=2, dp=1, tp=2) mesh each save their stage's tp shard (the last stage its shard of the
    tied head copy); one process loads the whole model and optimizer and continues the reference run."""
    path = str(tmp_path / "ckpt")
    run_ranks(_train_and_save, 4, path, {"tp": 2, "pp": 2, "microbatches": 2}, 2)
    _resume_here(path, reference_run(4)[1])


def test_incomplete_checkpoint_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match="not a complete graphtrain checkpoint"):
        load_checkpoint(tmp_path / "ckpt", tiny())


def test_launch_command():
    cmd = torchrun_command(2, ["--config", "x.yaml"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--standalone" in cmd
    assert cmd[-5:] == ["-m", "graphtrain", "train", "--config", "x.yaml"]
    multi = torchrun_command(16, [], nnodes=4, rdzv_endpoint="node0:29500")
    assert "--rdzv-backend=c10d" in multi and "--rdzv-endpoint=node0:29500" in multi and "--nnodes=4" in multi
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_command(16, [], nnodes=4)
