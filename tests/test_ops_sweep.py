"""graphtrain sweep: trials as runs, pruning from the reported validation loss, the summary; bad sweep files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphtrain.runs.sweep import load_sweep

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
    path = _file(
        tmp_path,
        f"""
space: {{optim.lr: {{choices: [3.0e-2, 1.0e-9]}}}}
trials: 2
parallel: 1
sampler: random
pruner: median
startup_trials: 1
seed: 10
out: {tmp_path / "out"}
""",
    )
    env = {**os.environ, "GRAPHTRAIN_CACHE": os.environ.get("GRAPHTRAIN_CACHE", str(tmp_path / "cache"))}
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrain", "sweep", str(path)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    states = {r["trial"]: (r["state"], r["params"]["optim.lr"], r["steps"]) for r in summary["trials"]}
    assert summary["counts"]["pruned"] >= 1, states
    assert all(lr == 1.0e-9 and steps < 6 for state, lr, steps in states.values() if state == "pruned"), states
    assert summary["best"]["params"]["optim.lr"] == 3.0e-2
    best = (tmp_path / "out" / "best.yaml").read_text()
    assert "lr: 0.03" in best and "graphtrain train" in best
    assert (tmp_path / "out" / "report.html").is_file()
    again = subprocess.run(
        [sys.executable, "-m", "graphtrain", "sweep", str(path), "--summary"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert again.returncode == 0 and "pruned" in again.stdout and "best: trial" in again.stdout


@pytest.mark.parametrize(
    "space,message",
    [
        ("{optim.lrr: {log_uniform: [1.0e-4, 1.0e-2]}}", "sweep space optim.lrr"),
        ("{optim.lr: {log_uniform: [1.0e-2, 1.0e-4]}}", "low 0.01 is above its high 0.0001"),
        ("{optim.lr: {log_uniform: [0, 1.0e-2]}}", "log_uniform range must be positive"),
        ("{optim.lr: {normal: [0, 1]}}", "give one of"),
        ("{train.steps: {int: [1.5, 4]}}", "int range takes integers"),
    ],
)
def test_bad_space_is_one_clear_error(tmp_path, space, message):
    with pytest.raises(ValueError, match=message):
        load_sweep(_file(tmp_path, f"space: {space}\n"))


def test_bad_sampler_or_pruner(tmp_path):
    with pytest.raises(ValueError, match="sampler 'grid' is unknown"):
        load_sweep(_file(tmp_path, "space: {optim.lr: {choices: [0.1]}}\nsampler: grid\n"))
    with pytest.raises(ValueError, match="pruner 'hyperband' is unknown"):
        load_sweep(_file(tmp_path, "space: {optim.lr: {choices: [0.1]}}\npruner: hyperband\n"))


def test_edge_warnings_name_the_parameter_and_the_next_range():
    from graphtrain.runs.sweep import edge_warnings

    space = {
        "optim.lr": ("log_uniform", [1.0e-5, 3.0e-2]),
        "optim.weight_decay": ("uniform", [0.0, 0.1]),
        "optim.warmup_steps": ("int", [0, 100]),
        "train.batch_size": ("choices", [2, 4, 8]),
        "model.attention": ("choices", ["sdpa", "explicit", "flash"]),
    }
    inside = {
        "optim.lr": 1e-3,
        "optim.weight_decay": 0.05,
        "optim.warmup_steps": 50,
        "train.batch_size": 4,
        "model.attention": "sdpa",
    }
    assert edge_warnings(space, inside) == []
    edges = {
        "optim.lr": 2.9e-2,
        "optim.weight_decay": 0.001,
        "optim.warmup_steps": 100,
        "train.batch_size": 8,
        "model.attention": "flash",
    }
    lines = edge_warnings(space, edges)
    assert len(lines) == 4, lines  # not the strings: their choices have no order
    lr, wd, warm, bs = lines
    assert "optim.lr=0.029 is at the high edge of its range [1e-05, 0.03]" in lr and "[0.0164, 54.8]" not in lr
    assert "{log_uniform: [0.000548, 1.64]}" in lr  # shifted up by sqrt(3000), in log space
    assert "low edge" in wd and "{uniform: [-0.05, 0.05]}" in wd
    assert "high edge" in warm and "{int: [50, 150]}" in warm
    assert "highest of its choices [2, 4, 8]" in bs and "above 8" in bs
    # log space: 1e-4 is 23% of the way from 1e-5 to 3e-2 on a log scale (0.3% on a linear one): no warning
    assert edge_warnings({"optim.lr": ("log_uniform", [1.0e-5, 3.0e-2])}, {"optim.lr": 1e-4}) == []


def test_summary_warns_when_the_best_trial_sits_at_an_edge(tmp_path):
    """write_summary on a real Optuna study: the best trial's lr at the top of its range is one warning line, in
    the log and in summary.json; the second-best trial's edge value is not the best's and says nothing."""
    import optuna

    from graphtrain.runs.sweep import _study, write_summary

    sweep = load_sweep(
        _file(tmp_path, f"space: {{optim.lr: {{log_uniform: [1.0e-5, 3.0e-2]}}}}\nout: {tmp_path / 'out'}\n")
    )
    study = _study(sweep)
    dist = {"optim.lr": optuna.distributions.FloatDistribution(1e-5, 3e-2, log=True)}
    for lr, loss in [(1.1e-5, 6.0), (2.95e-2, 4.0), (1e-3, 5.0)]:
        study.add_trial(optuna.trial.create_trial(params={"optim.lr": lr}, distributions=dist, value=loss))
    lines = []
    summary = write_summary(sweep, study, lines.append)
    warned = [line for line in lines if line.startswith("warning:")]
    assert len(warned) == 1 and "optim.lr=0.0295 is at the high edge" in warned[0], lines
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["edge_warnings"] == summary["edge_warnings"]


@pytest.mark.slow  # one real trial in a subprocess: 2 minutes on the shared 2-core machine
def test_command_line_overrides_trials_parallel_and_out(tmp_path):
    """--trials, --parallel and --out replace the file's (5 trials, parallel 2, out elsewhere): one trial runs, in
    the --out folder; an int range of width one puts any best value at its edge, which the summary says."""
    path = _file(
        tmp_path,
        f"""
space: {{train.batch_size: {{int: [2, 3]}}}}
config: {{train.steps: 2, train.eval_every: 2, train.log_every: 2}}
trials: 5
parallel: 2
sampler: random
pruner: none
out: {tmp_path / "file-out"}
""",
    )
    env = {**os.environ, "GRAPHTRAIN_CACHE": os.environ.get("GRAPHTRAIN_CACHE", str(tmp_path / "cache"))}
    out = tmp_path / "cli-out"
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrain", "sweep", str(path), "--trials", "1", "--parallel", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["trial"] for r in summary["trials"]] == [0] and summary["counts"]["complete"] == 1
    assert not (tmp_path / "file-out").exists()
    assert "warning: the best train.batch_size=" in proc.stdout and "edge of its range [2, 3]" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "graphtrain", "sweep", str(path), "--trials", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and "--trials: must be a positive integer, got '0'" in bad.stderr, bad.stderr
    assert not (tmp_path / "file-out").exists()


def test_command_line_out_and_counts_reach_the_sweep(tmp_path):
    """The fast half of the test above: --trials/--parallel replace the file's values (load_sweep), a bad count is
    one usage error, and `sweep --summary --out DIR` reads the study in DIR (written here by real Optuna), printing
    the edge warning, while the file's own out: stays untouched."""
    import optuna

    from graphtrain.runs.sweep import _study

    path = _file(
        tmp_path,
        f"space: {{optim.lr: {{log_uniform: [1.0e-5, 3.0e-2]}}}}\ntrials: 5\nparallel: 2\n"
        f"out: {tmp_path / 'file-out'}\n",
    )
    sweep = load_sweep(path, trials=1, parallel=3, out=tmp_path / "cli-out")
    assert (sweep.trials, sweep.parallel, sweep.out) == (1, 3, tmp_path / "cli-out")
    with pytest.raises(ValueError, match="sweep trials must be a positive integer, got 0"):
        load_sweep(path, trials=0)
    study = _study(sweep)
    dist = {"optim.lr": optuna.distributions.FloatDistribution(1e-5, 3e-2, log=True)}
    study.add_trial(optuna.trial.create_trial(params={"optim.lr": 1.2e-5}, distributions=dist, value=5.0))
    env = {**os.environ, "GRAPHTRAIN_CACHE": os.environ.get("GRAPHTRAIN_CACHE", str(tmp_path / "cache"))}
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrain", "sweep", str(path), "--summary", "--out", str(tmp_path / "cli-out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: the best optim.lr=1.2e-05 is at the low edge" in proc.stdout, proc.stdout
    assert (tmp_path / "cli-out" / "summary.json").is_file() and not (tmp_path / "file-out").exists()


@pytest.mark.parametrize("flag,value", [("--parallel", "two"), ("--trials", "0"), ("--trials", "-3")])
def test_bad_sweep_counts_are_one_usage_error(tmp_path, capsys, flag, value):
    from graphtrain.cli.main import main

    path = _file(tmp_path, f"space: {{optim.lr: {{choices: [0.1]}}}}\nout: {tmp_path / 'out'}\n")
    assert main(["sweep", str(path), flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: must be a positive integer, got '{value}'" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
