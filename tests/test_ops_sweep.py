"""graphtrain sweep: trials as runs, pruning from the reported validation loss, the summary; bad sweep files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphtrain.ops.sweep import load_sweep

ROOT = Path(__file__).resolve().parent.parent
BASE = """
job: {job}
config: {{train.steps: 6, train.eval_every: 2, train.eval_batches: 1, train.log_every: 2, train.ckpt_every: 0,
          train.batch_size: 2, data.seq_len: 32, data.max_bytes: 300000, engine.provider: aten}}
"""


def _file(tmp_path, body: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(BASE.format(job=ROOT / "configs" / "gpt2-tiny-test.yaml") + body)
    return path


def test_tiny_sweep_prunes_a_hopeless_trial_and_writes_the_best_job(tmp_path):
    # lr 1e-9 cannot learn: once a trial with a real lr finished, the median pruner stops it at its first eval
    # (the random sampler with seed 10 draws 3e-2, then 1e-9; two trials keep this subprocess test short)
    path = _file(tmp_path, f"""
space: {{optim.lr: {{choices: [3.0e-2, 1.0e-9]}}}}
trials: 2
parallel: 1
sampler: random
pruner: median
startup_trials: 1
seed: 10
out: {tmp_path / 'out'}
""")
    env = {**os.environ, "GRAPHTRAIN_CACHE": os.environ.get("GRAPHTRAIN_CACHE", str(tmp_path / "cache"))}
    proc = subprocess.run([sys.executable, "-m", "graphtrain", "sweep", str(path)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    states = {r["trial"]: (r["state"], r["params"]["optim.lr"], r["steps"]) for r in summary["trials"]}
    assert summary["counts"]["pruned"] >= 1, states
    assert all(lr == 1.0e-9 and steps < 6 for state, lr, steps in states.values() if state == "pruned"), states
    assert summary["best"]["params"]["optim.lr"] == 3.0e-2
    best = (tmp_path / "out" / "best.yaml").read_text()
    assert "lr: 0.03" in best and "graphtrain train" in best
    assert (tmp_path / "out" / "report.html").is_file()
    again = subprocess.run([sys.executable, "-m", "graphtrain", "sweep", str(path), "--summary"],
                           capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "pruned" in again.stdout and "best: trial" in again.stdout


@pytest.mark.parametrize("space,message", [
    ("{optim.lrr: {log_uniform: [1.0e-4, 1.0e-2]}}", "sweep space optim.lrr"),
    ("{optim.lr: {log_uniform: [1.0e-2, 1.0e-4]}}", "low 0.01 is above its high 0.0001"),
    ("{optim.lr: {log_uniform: [0, 1.0e-2]}}", "log_uniform range must be positive"),
    ("{optim.lr: {normal: [0, 1]}}", "give one of"),
    ("{train.steps: {int: [1.5, 4]}}", "int range takes integers"),
])
def test_bad_space_is_one_clear_error(tmp_path, space, message):
    with pytest.raises(ValueError, match=message):
        load_sweep(_file(tmp_path, f"space: {space}\n"))


def test_bad_sampler_or_pruner(tmp_path):
    with pytest.raises(ValueError, match="sampler 'grid' is unknown"):
        load_sweep(_file(tmp_path, "space: {optim.lr: {choices: [0.1]}}\nsampler: grid\n"))
    with pytest.raises(ValueError, match="pruner 'hyperband' is unknown"):
        load_sweep(_file(tmp_path, "space: {optim.lr: {choices: [0.1]}}\npruner: hyperband\n"))
