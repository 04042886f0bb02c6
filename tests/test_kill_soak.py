"""Kill -9 anywhere, nothing lost: a tiny deterministic run through `graphtrain train --resume auto` is killed with
SIGKILL mid-step, mid-save and mid-eval (and, in the slow version, at 20 random moments, startup and compile
included), restarted with the same command each time, and must end with weights bitwise equal to an
uninterrupted run's, every checkpoint on disk loadable after every kill, each step's metrics once, and no
temporary file left over.

The worker is the real command, `python -m graphtrain train ...`, instrumented from the outside only: a
`sitecustomize` on its PYTHONPATH (so torchrun's workers get it too) prints a marker when a step, a checkpoint's
fsync or an evaluation starts and holds that phase open for a moment, so that a kill sent on the marker lands
inside it (a tiny model's save takes ~5 ms: without the pause a kill would land after it). Mid-save kills leave the temporary file of the unfinished checkpoint behind; the next start must clean it.
The short version runs through the graph engine (aten provider: ~3 s of graph capture per start on this AVX2
box, the compile cost a restart pays in real runs); the 2-rank version runs eager (each start pays two ranks'
imports already).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from graphtrain.config.sections import Config
from graphtrain.trainer import Trainer, list_checkpoints
from graphtrain.trainer.checkpoint import load_checkpoint, load_sharded_meta, verify_checkpoint

TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=4",
    "train.eval_every=3",
    "train.eval_batches=2",
    "train.log_every=1",
    "train.ckpt_every=1",
    "train.progress=false",
    "train.threads=1",
    "train.deterministic=true",
    "train.sample_tokens=0",
    "optim.warmup_steps=2",
]
ENGINE = ["train.accelerate=true", "engine.provider=aten", "engine.fallback=error"]
PAUSE_S = 0.3  # how long the wrapper holds a marked phase open

# Markers around the phases a kill should land in, loaded by every worker process at start-up. Test code only.
HOOKS = r"""
import os, time
from graphtrain.trainer import strategies
PAUSE = float(os.environ["SOAK_PAUSE_S"])

def marked(name, fn):
    def wrapper(*args, **kwargs):
        print(f"@{name}", flush=True)
        time.sleep(PAUSE)
        return fn(*args, **kwargs)
    return wrapper

for cls in (strategies.SingleProcessStep, strategies.DistributedStep):
    cls.step = marked("step", cls.step)
    cls.eval_loss = marked("eval", cls.eval_loss)
fsync = os.fsync
def fsync_marked(fd):  # a checkpoint's data is written, not yet durable nor renamed into place
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = ""
    if "ckpt-" in target and not os.path.isdir(target):
        print("@save", flush=True)
        time.sleep(PAUSE)
    return fsync(fd)
os.fsync = fsync_marked
import torch
save = torch.save
def save_marked(obj, f, *args, **kwargs):  # sharded checkpoints: the shards are written, extra.pt comes last
    if isinstance(f, (str, os.PathLike)) and str(f).endswith("extra.pt") and ".tmp" in str(f):
        print("@save", flush=True)
        time.sleep(PAUSE)
    return save(obj, f, *args, **kwargs)
torch.save = save_marked

DIE_AT = int(os.environ.get("SOAK_DIE_AT_STEP", "0"))  # the first attempt under torchrun kills itself there
if DIE_AT and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    import signal
    calls = [0]
    def dying(fn):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == DIE_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return wrapper
    strategies.SingleProcessStep.step = dying(strategies.SingleProcessStep.step)
"""


pytestmark = pytest.mark.usefixtures("tiny_env")  # conftest.py: shared data cache, settings restored


def _worker(
    out: Path,
    steps: int,
    extra: list[str],
    nproc: int = 1,
    resume: tuple[str, ...] = ("--resume", "auto"),
    **env_extra: str,
) -> subprocess.Popen:
    argv = ["train", *TINY, f"train.steps={steps}", *extra, "--out", str(out), *resume]
    if nproc > 1:
        argv += [f"parallel.dp={nproc}", "--nproc", str(nproc)]
    hooks = out.parent / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(HOOKS)
    path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "SOAK_PAUSE_S": str(PAUSE_S), "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **env_extra}
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "graphtrain", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _kill_at(proc: subprocess.Popen, target: str | None, rng: random.Random, delay_s: float = 0.0) -> str:
    """SIGKILL the worker (its whole process group: torchrun's workers too) when `target` ("step", "save", "eval")
    begins after at least one step ran in this process, at a random moment of the held phase; target None: after
    `delay_s` from the start. Returns where it was killed ("finished" when the run ended first)."""
    if target is None:
        try:
            proc.wait(timeout=delay_s)
            return "finished"
        except subprocess.TimeoutExpired:
            where = "random moment"
    else:
        stepped = False
        for line in proc.stdout:
            if line.startswith("@step"):
                stepped = True
            if stepped and line.startswith(f"@{target}"):
                time.sleep(rng.uniform(0, PAUSE_S * 0.8))
                where = f"mid-{target}"
                break
        else:
            proc.wait()
            return "finished"
    _kill_tree(proc.pid)
    proc.wait()
    return where


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (torchrun starts its workers in sessions of their own, so a
    process-group kill would miss them): what a machine going away does to a run."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    doomed, todo = [], [pid]
    while todo:
        p = todo.pop()
        doomed.append(p)
        todo += children.get(p, [])
    for p in doomed:  # the agent first: it must not see its workers die and restart them
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _leftovers(out: Path) -> list[str]:
    return [p.name for p in out.rglob("*") if p.name.endswith((".tmp", ".old")) or ".tmp." in p.name]


def _check_after_kill(out: Path, where: str) -> None:
    """Every checkpoint on disk is complete and loadable; a kill mid-save really landed in the save (its
    temporary file is there, for the next start to clean)."""
    if where == "mid-save":
        assert _leftovers(out), "the kill meant for the middle of a save missed it"
    for _, path in list_checkpoints(out):
        verify_checkpoint(path)  # its SHA-256s (raises naming the file that differs)
        if path.is_file():
            load_checkpoint(path)
        else:
            load_sharded_meta(path)


def _finish(out: Path, steps: int, extra: list[str], nproc: int = 1) -> None:
    proc = _worker(out, steps, extra, nproc)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    assert f"done: {steps} steps" in log


def _check_nothing_lost(out: Path, steps: int) -> None:
    assert _leftovers(out) == [], f"temporary files left over: {_leftovers(out)}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, steps + 1))  # each step once


def _reference(tmp_path: Path, steps: int, extra: list[str]) -> dict[str, torch.Tensor]:
    """The uninterrupted run, in this process."""
    config = Config().with_overrides([*TINY, f"train.steps={steps}", *extra, f"train.out_dir={tmp_path / 'ref'}"])
    trainer = Trainer(config)
    trainer.fit()
    return {k: v.detach().clone() for k, v in trainer.strategy.module.state_dict().items()}


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(list_checkpoints(out)[-1][1], weights_only=True)["model"]


def _soak(tmp_path: Path, steps: int, extra: list[str], targets: list[str | None], seed: int) -> list[str]:
    rng = random.Random(seed)
    out = tmp_path / "run"
    where = []
    for target in targets:
        proc = _worker(out, steps, extra)
        where.append(_kill_at(proc, target, rng, delay_s=rng.uniform(1.0, 12.0)))
        _check_after_kill(out, where[-1])
    _finish(out, steps, extra)
    _check_nothing_lost(out, steps)
    return where


def test_sigkill_mid_step_save_and_eval_then_resume_auto_is_bitwise(tmp_path):
    steps = 7
    ref = _reference(tmp_path, steps, ENGINE)
    where = _soak(tmp_path, steps, ENGINE, ["save", "step", "eval"], seed=0)
    assert where == ["mid-save", "mid-step", "mid-eval"]
    final = _final_weights(tmp_path / "run")
    for name in ref:
        assert torch.equal(ref[name], final[name]), f"{name} differs from the uninterrupted run"


@pytest.mark.slow
def test_twenty_random_sigkills_lose_nothing(tmp_path):
    """20 kills: targeted at each phase in turn and at random moments from the start (imports, data, compile)."""
    steps = 30
    seed = int(os.environ.get("SOAK_SEED", "20"))
    rng = random.Random(seed)
    targets = [rng.choice(["step", "save", "eval", None]) for _ in range(20)]
    ref = _reference(tmp_path, steps, ENGINE)
    where = _soak(tmp_path, steps, ENGINE, targets, seed=seed)
    print(f"seed {seed}: kills {where}")
    assert sum(w != "finished" for w in where) == 20
    final = _final_weights(tmp_path / "run")
    for name in ref:
        assert torch.equal(ref[name], final[name]), f"{name} differs from the uninterrupted run"


@pytest.mark.slow
@pytest.mark.dist
def test_two_rank_data_parallel_sigkills_lose_nothing(tmp_path):
    """2 gloo ranks under torchrun, sharded checkpoints: kills mid-step, mid-save (the agent and both workers
    die together, as when a machine goes away), resumed with the same command; final weights equal an
    uninterrupted 2-rank run's within the distributed tolerance (test_trainer_distributed.py: rel 1e-4), and
    bitwise in practice on gloo."""
    steps = 8
    extra = ["train.accelerate=false", "model.dropout=0.0"]
    rng = random.Random(2)
    ref_out = tmp_path / "ref"
    _finish(ref_out, steps, extra, nproc=2)
    out = tmp_path / "run"
    where = []
    for target in ["step", "save", "eval", "step"]:
        proc = _worker(out, steps, extra, nproc=2)
        where.append(_kill_at(proc, target, rng))
        _check_after_kill(out, where[-1])
    assert "finished" not in where
    _finish(out, steps, extra, nproc=2)
    _check_nothing_lost(out, steps)
    from graphtrain.distributed.checkpoint import load_model_weights_local
    from graphtrain.models import build_model

    config = Config().with_overrides([*TINY, *extra])
    weights = []
    for run in (ref_out, out):
        model = build_model(config.model, vocab_size=512)
        load_model_weights_local(list_checkpoints(run)[-1][1], model)
        weights.append(model.state_dict())
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-4, atol=1e-6, msg=name)
    bitwise = all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    print(f"2 ranks: kills {where}; final weights {'bitwise equal' if bitwise else 'within rel 1e-4'}")


def test_elastic_restart_resumes_from_the_last_checkpoint(tmp_path):
    """`--max-restarts 1`: torchrun's elastic agent runs the (one) worker; the worker dies by SIGKILL in step 5 of its
    first attempt; the agent restarts it, the restarted worker (TORCHELASTIC_RESTART_COUNT=1) continues from
    ckpt-4 by itself, and the run ends with exit 0 and the weights of an uninterrupted run."""
    steps, extra = 7, ["train.accelerate=false"]
    ref = _reference(tmp_path, steps, extra)
    out = tmp_path / "run"
    proc = _worker(out, steps, extra, resume=("--max-restarts", "1"), SOAK_PAUSE_S="0", SOAK_DIE_AT_STEP="5")
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, log[-3000:]
    assert "resumed from" in log and "ckpt-0000004.pt at step 4" in log and f"done: {steps} steps" in log
    final = _final_weights(out)
    for name in ref:
        assert torch.equal(ref[name], final[name]), f"{name} differs from the uninterrupted run"
    _check_nothing_lost(out, steps)
