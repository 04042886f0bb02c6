"""Preemption: SIGTERM/SIGINT finish the step in flight, write its checkpoint within train.preempt_grace_s and
exit with status 75; `--resume auto` continues the run bitwise; past the grace period the step is abandoned;
a second Ctrl-C stops at once. In process (signals sent from inside a step), through the CLI as a subprocess,
and (slow) a 2-rank run under torchrun where the ranks agree on the step they save."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from graphtrain.config.sections import Config
from graphtrain.trainer import Trainer, TrainingPreempted, list_checkpoints

TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=4",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.accelerate=false",
    "train.progress=false",
    "train.threads=1",
    "train.deterministic=true",
    "train.sample_tokens=0",
    "optim.warmup_steps=2",
]


pytestmark = pytest.mark.usefixtures("tiny_env")  # conftest.py: shared data cache, settings restored


def tiny(out_dir, *overrides: str) -> Config:
    return Config().with_overrides([*TINY, f"train.out_dir={out_dir}", *overrides])


def at_step(trainer: Trainer, step: int, action) -> None:
    """Run `action()` when (1-based) step `step` draws its first batch: in the middle of training."""
    get_batch = trainer.data.train.get_batch

    def hooked(index, batch_size):
        if index == (step - 1) * trainer.config.train.grad_accum:
            action()
        return get_batch(index, batch_size)

    trainer.data.train.get_batch = hooked


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def test_sigterm_finishes_the_step_saves_it_and_resume_continues_bitwise(tmp_path):
    full = Trainer(tiny(tmp_path / "full", "train.steps=6", "train.ckpt_every=0"))
    full.fit()

    run = Trainer(tiny(tmp_path / "run", "train.steps=6", "train.ckpt_every=0"))  # no periodic checkpoint
    at_step(run, 3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(TrainingPreempted) as info:
        run.fit()
    e = info.value
    assert e.signal_name == "SIGTERM" and e.step == 3 and e.checkpoint == tmp_path / "run" / "ckpt-0000003.pt"
    assert 0 <= e.saved_after_s < 30 and "stopped by SIGTERM at step 3" in str(e)
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [3]  # the step in flight, finished and saved
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kind"] == "preempted" and rows[-1]["step"] == 3

    resumed = Trainer(tiny(tmp_path / "run", "train.steps=6", "train.ckpt_every=0"), resume=True)
    assert resumed.fit()["steps"] == 6
    assert_same_weights(full.model.state_dict(), resumed.model.state_dict())


def test_a_step_outliving_the_grace_period_is_abandoned(tmp_path):
    run = Trainer(tiny(tmp_path / "run", "train.steps=6", "train.ckpt_every=1", "train.preempt_grace_s=0.3"))

    def slow_step():  # the signal arrives, then the step needs longer than the grace period
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)

    at_step(run, 3, slow_step)
    t0 = time.monotonic()
    with pytest.raises(
        TrainingPreempted,
        match=r"step 3 did not finish within train.preempt_grace_s=0.3s and was "
        r"abandoned; .*ckpt-0000002.pt is the latest checkpoint",
    ) as info:
        run.fit()
    assert time.monotonic() - t0 < 4  # did not wait for the step
    assert info.value.saved_after_s is None and info.value.step == 2
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [1, 2]


def test_second_ctrl_c_stops_at_once(tmp_path):
    run = Trainer(tiny(tmp_path / "run", "train.steps=6", "train.ckpt_every=1"))

    def two_ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    at_step(run, 3, two_ctrl_c)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN in a background job (nohup, CI)
    with pytest.raises(KeyboardInterrupt):
        run.fit()
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [1, 2]
    assert signal.getsignal(signal.SIGINT) is before  # the guard restored what was there


def _cli(out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-u",
        "-m",
        "graphtrain",
        "train",
        *TINY,
        "train.steps=40",
        "train.ckpt_every=0",
        "--out",
        str(out),
        *extra,
    ]


def _sigterm_when_training(proc: subprocess.Popen, after_step: int) -> float:
    """Wait until the run has logged step `after_step`, send SIGTERM; returns seconds from the signal to the exit."""
    for line in proc.stdout:
        m = re.match(r"step +(\d+)/", line)
        if m and int(m.group(1)) >= after_step:
            break
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    return time.monotonic() - t0


def test_sigterm_to_the_cli_exits_75_and_resume_auto_continues_bitwise(tmp_path):
    full = Trainer(tiny(tmp_path / "full", "train.steps=40", "train.ckpt_every=0"))
    full.fit()
    out = tmp_path / "run"
    proc = subprocess.Popen(_cli(out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latency = _sigterm_when_training(proc, after_step=3)
    err = proc.stderr.read()
    assert proc.returncode == 75, err
    assert "preempted: stopped by SIGTERM at step" in err and "--resume auto" in err and "Traceback" not in err
    ((step, ckpt),) = list_checkpoints(out)  # ckpt_every=0: the preemption's own save
    assert 3 <= step < 40
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["kind"] == "preempted" and record["step"] == step and record["checkpoint"] == str(ckpt)
    assert record["seconds_after_signal"] < 30 and latency < 30
    print(
        f"SIGTERM at step {step}: checkpoint written {record['seconds_after_signal']:.3f}s after the signal, "
        f"process gone {latency:.2f}s after it"
    )

    done = subprocess.run(_cli(out, "--resume", "auto"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "done: 40 steps" in done.stdout
    state = torch.load(list_checkpoints(out)[-1][1], weights_only=True)["model"]
    assert_same_weights(full.model.state_dict(), state)


@pytest.mark.slow
@pytest.mark.dist
def test_sigterm_to_a_two_rank_run_saves_the_agreed_step_and_resume_auto_continues(tmp_path):
    """`graphtrain train --nproc 2`: SIGTERM to the launching process (torchrun's agent, which forwards it to both
    workers); both ranks stop after the same step, the sharded checkpoint of that step is written, the command
    exits 75, and the same command with --resume auto finishes the run."""
    out = tmp_path / "run"
    dp = ["parallel.dp=2", "--nproc", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_cli(out, *dp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    latency = _sigterm_when_training(proc, after_step=3)
    err = proc.stderr.read()
    assert proc.returncode == 75, err[-3000:]
    ((step, ckpt),) = list_checkpoints(out)
    assert ckpt.is_dir() and 3 <= step < 40  # the sharded folder of the agreed step
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["kind"] == "preempted" and record["step"] == step and record["seconds_after_signal"] < 30
    assert f"preempted: SIGTERM at step {step}" in err and "Traceback" not in err
    print(
        f"2 ranks, SIGTERM at step {step}: sharded checkpoint written {record['seconds_after_signal']:.3f}s after "
        f"the signal, launcher gone {latency:.2f}s after it"
    )
    done = subprocess.run(_cli(out, *dp, "--resume", "auto"), capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: 40 steps" in done.stdout and f"resumed from {ckpt}" in done.stdout
