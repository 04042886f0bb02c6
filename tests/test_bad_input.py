"""The bad-input table: every mistake a user can make on `graphtrain train` gets one `error: ...` line naming the
problem and the fix, no traceback, and the exit status of its kind (cli/main.py's docstring): 2 usage error (the
command can never run as given), 1 runtime failure (the job started and failed: diverged, out of memory, disk
full). Preemption (75) is in test_preemption.py. In process (cli.main) for speed; a few as subprocesses to see
that nothing but the one line reaches the terminal. docs/design/reliability.md lists every case with this test name."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphtrain.cli.main import main

TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=4",
    "train.steps=2",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.ckpt_every=1",
    "train.progress=false",
    "train.threads=1",
    "train.sample_tokens=0",
]


pytestmark = pytest.mark.usefixtures("tiny_env")  # conftest.py: shared data cache, settings restored


# name: (arguments after `graphtrain train` ({tmp}: the test's folder; TINY and --no-accelerate --out {tmp}/run are
# added unless the case starts with a YAML path or has --out), exit status, text the one error line must hold)
USAGE, FAILURE = 2, 1
CASES: dict[str, tuple[list[str], int, str]] = {
    # ---- config keys and values
    "unknown key": (["train.stepz=3"], USAGE, "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
    "unknown section": (["trian.steps=3"], USAGE, "'trian' is not a section"),
    "wrong type": (["train.steps=many"], USAGE, "train.steps must be an integer"),
    "bad choice": (["optim.schedule=cosin"], USAGE, "optim.schedule must be one of"),
    "override without =": (["train.steps"], USAGE, "unexpected argument 'train.steps': give at most one CONFIG.yaml"),
    "lr nan": (["optim.lr=.nan"], USAGE, "optim.lr must be a finite number, got nan"),
    "lr inf": (["optim.lr=inf"], USAGE, "optim.lr must be a finite number, got inf"),
    "lr negative": (["optim.lr=-0.001"], USAGE, "optim.lr must be positive, got -0.001"),
    "lr zero": (["optim.lr=0"], USAGE, "optim.lr must be positive"),
    "grad_clip negative": (["optim.grad_clip=-1"], USAGE, "optim.grad_clip must be positive"),
    "grad_clip nan": (["optim.grad_clip=.nan"], USAGE, "optim.grad_clip must be a finite number"),
    "min_lr_ratio > 1": (["optim.min_lr_ratio=1.5"], USAGE, "optim.min_lr_ratio must be in [0, 1]"),
    "min_lr_ratio < 0": (["optim.min_lr_ratio=-0.1"], USAGE, "optim.min_lr_ratio must be in [0, 1]"),
    "betas out of range": (["optim.betas=[0.9,1.0]"], USAGE, "optim.betas must be in [0, 1)"),
    "betas wrong length": (["optim.betas=[0.9]"], USAGE, "optim.betas must be a list of 2 values"),
    "eps zero": (["optim.eps=0"], USAGE, "optim.eps must be positive"),
    "weight_decay negative": (["optim.weight_decay=-0.1"], USAGE, "optim.weight_decay must be >= 0"),
    "memory_budget zero": (["engine.memory_budget=0"], USAGE, "engine.memory_budget=0 is out of range"),
    "memory_budget negative": (["engine.memory_budget=-5"], USAGE, "engine.memory_budget=-5 is out of range"),
    "memory_budget 1.5 (neither fraction nor bytes)": (
        ["engine.memory_budget=1.5"],
        USAGE,
        "a fraction of device memory in (0, 1]",
    ),
    "memory_budget inf": (["engine.memory_budget=.inf"], USAGE, "engine.memory_budget must be a finite number"),
    "steps zero": (["train.steps=0"], USAGE, "train.steps must be >= 1, got 0"),
    "batch_size zero": (["train.batch_size=0"], USAGE, "train.batch_size must be >= 1 or 'auto'"),
    "batch_size auto without budget": (
        ["train.batch_size=auto"],
        USAGE,
        "train.batch_size=auto needs a memory budget: set engine.memory_budget",
    ),
    "grad_accum zero": (["train.grad_accum=0"], USAGE, "train.grad_accum must be >= 1"),
    "ckpt_every negative": (["train.ckpt_every=-1"], USAGE, "train.ckpt_every must be >= 0 (0: only at the end)"),
    "threads zero": (["train.threads=0"], USAGE, "train.threads must be >= 1 or null"),
    "preempt_grace_s zero": (["train.preempt_grace_s=0"], USAGE, "train.preempt_grace_s must be positive"),
    "max_bad_steps zero": (["train.max_bad_steps=0"], USAGE, "train.max_bad_steps must be >= 1"),
    "loss_spike_factor <= 1": (["train.loss_spike_factor=0.5"], USAGE, "train.loss_spike_factor must be > 1"),
    "val_fraction 1": (["data.val_fraction=1"], USAGE, "data.val_fraction must be in (0, 1)"),
    "vocab too small": (["data.vocab_size=100"], USAGE, "data.vocab_size must be at least 260"),
    "dropout 1": (["model.dropout=1.0"], USAGE, "model.dropout must be in [0, 1)"),
    "unknown model": (["model.name=gpt5"], USAGE, "gpt5"),
    "seq_len too long": (["data.seq_len=128"], USAGE, "data.seq_len=128 is longer than model 'gpt2-tiny' supports"),
    "whole_step with grad_accum": (
        ["train.accelerate=true", "train.whole_step=true", "train.grad_accum=2"],
        USAGE,
        "train.whole_step=true needs train.grad_accum=1",
    ),
    "zero-1 with tp": (["parallel.tp=2", "parallel.zero_stage=1"], USAGE, "parallel.zero_stage=1 with parallel.tp>1"),
    "fp16 distributed": (
        ["parallel.dp=2", "engine.precision=fp16", "--nproc", "2"],
        USAGE,
        "engine.precision=fp16 (dynamic loss scaling) is not supported in distributed runs",
    ),
    "dp without torchrun": (["parallel.dp=2"], USAGE, "--nproc 2"),
    "recompute auto without a budget": (["engine.recompute=auto"], USAGE, "which is not set: give it as bytes"),
    # ---- files and folders
    "missing config file": (["{tmp}/nope.yaml"], USAGE, "nope.yaml' does not exist"),
    "invalid YAML syntax": (["{tmp}/broken.yaml"], USAGE, "is not valid YAML at line 2, column 6"),
    "YAML not a mapping": (["{tmp}/list.yaml"], USAGE, "must hold a mapping of sections"),
    "YAML section not a mapping": (["{tmp}/section.yaml"], USAGE, "config section 'train' must be a mapping"),
    "missing data folder": (["data.path={tmp}/nowhere"], USAGE, "nowhere' does not exist"),
    "data path is a file": (["data.path={tmp}/list.yaml"], USAGE, "is a .yaml file: graphtrain reads a folder"),
    "empty data folder": (["data.path={tmp}/empty"], USAGE, "holds no readable UTF-8 text files"),
    "out_dir under a file": (["--out", "{tmp}/list.yaml/run"], USAGE, "cannot be written"),
    "out_dir in a read-only file system": (["--out", "/proc/graphtrain-run"], USAGE, "cannot be written"),
    "out_dir already holds a run": (["--out", "{tmp}/done"], USAGE, "already holds checkpoints"),
    "tokenizer cache from another corpus": (["data.cache_dir={tmp}/cache"], USAGE, "was built from another corpus"),
    "init_from missing": (["train.init_from={tmp}/nope"], USAGE, "train.init_from="),
    # ---- resume flags
    "--resume with --resume-from": (
        ["--resume", "--resume-from", "{tmp}/x.pt"],
        USAGE,
        "give either --resume (latest checkpoint in out_dir) or --resume-from CKPT",
    ),
    "--resume without a checkpoint": (["--resume"], USAGE, "no checkpoint"),
    "--resume-from missing file": (["--resume-from", "{tmp}/x.pt"], USAGE, "x.pt' does not exist"),
    "--resume-from corrupt file": (["--resume-from", "{tmp}/ckpt-0000002.pt"], USAGE, "is unreadable or corrupt"),
    "--resume with init_from": (
        ["--resume", "train.init_from={tmp}/done"],
        USAGE,
        "train.init_from and --resume cannot be combined",
    ),
    "--allow-config-change unknown key": (
        ["--resume", "auto", "--allow-config-change", "train.stepz"],
        USAGE,
        "allow_config_change: unknown config key 'train.stepz'",
    ),
    # ---- flags
    "unknown flag": (["--stepz", "3"], USAGE, "unrecognized arguments: --stepz (see `graphtrain train --help`)"),
    "flag value not a number": (["--steps", "many"], USAGE, "argument --steps: invalid int value: 'many'"),
    "--nproc without layout": (["--nproc", "2"], USAGE, "--nproc 2 but parallel.dp*tp*pp = 1: set parallel.dp=2"),
    "--nproc zero": (["--nproc", "0"], USAGE, "--nproc must be >= 1"),
    "--max-restarts negative": (["--max-restarts", "-1"], USAGE, "--max-restarts must be >= 0"),
    # ---- runtime failures: the job started
    "disk full during a save": (
        ["--out", "{tmp}/full"],
        FAILURE,
        "could not write the checkpoint of step 2: the disk is full",
    ),
    "out of memory at the first step": ([], FAILURE, "out of memory at the first step"),
    "training diverges": (["train.max_bad_steps=2"], FAILURE, "training diverged at step 2: 2 bad steps in a row"),
}


def _prepare(case: str, tmp: Path, monkeypatch) -> None:
    (tmp / "broken.yaml").write_text("model: {name: gpt2-tiny\ntrain: 3\n")
    (tmp / "list.yaml").write_text("- model\n- train\n")
    (tmp / "section.yaml").write_text("train: 5\n")
    (tmp / "empty").mkdir()
    (tmp / "ckpt-0000002.pt").write_bytes(b"\x00" * 64)
    if case in ("out_dir already holds a run", "--resume with init_from"):
        assert main(["train", *TINY, "--no-accelerate", "--out", str(tmp / "done")]) == 0
    if case == "tokenizer cache from another corpus":
        _cache_of_another_corpus(tmp)
    if case == "disk full during a save":
        fsync = os.fsync

        def full_disk(fd):  # the second checkpoint's data does not fit on the disk
            if "ckpt-0000002" in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return fsync(fd)

        monkeypatch.setattr(os, "fsync", full_disk)
    if case == "out of memory at the first step":
        from graphtrain.trainer.strategies import SingleProcessStep

        def oom(self, micro_batches, lr, max_loss=float("inf")):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        monkeypatch.setattr(SingleProcessStep, "step", oom)
    if case == "training diverges":
        from graphtrain.trainer.strategies import SingleProcessStep

        step = SingleProcessStep.step

        def nan_weights(self, micro_batches, lr, max_loss=float("inf")):
            with torch.no_grad():
                next(self.module.parameters()).fill_(float("nan"))
            return step(self, micro_batches, lr, max_loss)

        monkeypatch.setattr(SingleProcessStep, "step", nan_weights)


def _cache_of_another_corpus(tmp: Path) -> None:
    """A data cache whose folder (named by the hash of this corpus) holds the tokenizer and tokens of another
    corpus: e.g. copied from another machine or run."""
    import shutil

    from graphtrain.config.sections import Config
    from graphtrain.data.corpus import list_files
    from graphtrain.data.tokenizer import cache_key, load_or_build

    other = tmp / "other"
    other.mkdir()
    (other / "a.py").write_text("def other(x):\n    return x * 2\n" * 400)
    cfg = (
        Config()
        .with_overrides(
            [
                "data.vocab_size=512",
                "data.max_bytes=300000",
                f"data.path={other}",
                f"data.cache_dir={tmp / 'cache-other'}",
            ]
        )
        .data
    )
    built = load_or_build(cfg)
    mine = (
        Config()
        .with_overrides(["data.vocab_size=512", "data.max_bytes=300000", f"data.cache_dir={tmp / 'cache'}"])
        .data
    )
    root, files = list_files(mine)
    shutil.copytree(built.cache_dir, tmp / "cache" / cache_key(mine, root, files))


def _argv(case: str, tmp: Path) -> list[str]:
    extra, _, _ = CASES[case]
    extra = [a.replace("{tmp}", str(tmp)) for a in extra]
    if extra and extra[0].endswith(".yaml"):
        return [extra[0], *TINY, "--no-accelerate", "--out", str(tmp / "run"), *extra[1:]]
    out = [] if "--out" in extra else ["--out", str(tmp / "run")]
    return [*TINY, "--no-accelerate", *out, *extra]


def test_the_table_is_big_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_error_line(case, tmp_path, capsys, monkeypatch):
    _prepare(case, tmp_path, monkeypatch)
    capsys.readouterr()
    code = main(["train", *_argv(case, tmp_path)])
    out, err = capsys.readouterr()
    _, expected_code, expected = CASES[case]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]
    assert code == expected_code, err
    assert "Traceback" not in out + err


@pytest.mark.parametrize("case", ["invalid YAML syntax", "lr nan", "flag value not a number"])
def test_as_a_subprocess_nothing_but_the_error_line(case, tmp_path):
    """What a user sees in a terminal: stderr is exactly the one error line (no warnings, no traceback)."""
    _prepare(case, tmp_path, None)
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrain", "train", *_argv(case, tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert proc.returncode == CASES[case][1]
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert CASES[case][2] in proc.stderr


def test_a_refused_resume_changes_nothing_on_disk(tmp_path, capsys):
    """Resuming a run with another model is refused after its checkpoints were read, and no file of the run
    (checkpoints, metrics, saved config) is deleted or rewritten."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--no-accelerate", "--out", str(run)]) == 0

    def files():  # the TensorBoard events included
        return {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}

    before = files()
    code = main(["train", *TINY, "--no-accelerate", "--out", str(run), "model.max_seq_len=48", "--resume"])
    assert code == USAGE and "model.max_seq_len" in capsys.readouterr().err
    assert files() == before
