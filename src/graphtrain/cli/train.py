"""`graphtrain train`: its arguments, the checks before anything is written (the run folder, the job file,
`--resume`), the SIGTERM rule before the first step (early_preempt), the launch of workers under `--nproc`, and the
report at the end. cli/main.py registers it."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from graphtrain.cli.exits import EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE
from graphtrain.cli.jobs import add_config_items, load_config
from graphtrain.config.sections import Config
from graphtrain.early_preempt import before_first_step

if TYPE_CHECKING:
    from graphtrain.trainer import Trainer

# Imports inside functions: import cost: `graphtrain --help` never loads torch; the train verb imports the trainer
# when it runs.


# ----------------------------------------------------------------------------------- train ----

TRAIN_EPILOG = """\
Every config key can be set as section.key=value after the optional CONFIG.yaml; run
`graphtrain config` to list all of them with their defaults and documentation.

examples:
  graphtrain train                                     the default job: gpt2-mini, Python stdlib corpus
  graphtrain train configs/gpt2-tiny-test.yaml         a few-second smoke run
  graphtrain train model.name=gpt2-tiny data.seq_len=64 train.steps=50 --out runs/tiny
  graphtrain train --out runs/tiny --resume --steps 100   continue runs/tiny up to step 100
  graphtrain train configs/x.yaml --out runs/x --resume auto   the same command starts or continues
                                                       the run: what a scheduler re-runs after preemption
  graphtrain train configs/x.yaml parallel.dp=2 --nproc 2 --max-restarts 3   restart crashed workers (up to
                                                       3 times); they continue from the last checkpoint
  graphtrain train data.path=~/src/myproject           train on your own folder of text/code files
  graphtrain train configs/x.yaml parallel.dp=2 --nproc 2   data-parallel on 2 processes (torchrun)

output: out_dir/ckpt-NNNNNNN.pt (last 3 kept; distributed runs: sharded ckpt-NNNNNNN/ folders),
out_dir/metrics.jsonl, out_dir/config.yaml

SIGTERM or Ctrl-C: the current step finishes, its checkpoint is written (within train.preempt_grace_s)
and the run exits with status 75; continue with --resume auto. Exit status: 0 done, 1 runtime failure
(diverged, out of memory, disk full), 2 usage error, 75 preempted, 130 a second Ctrl-C.
"""


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    add_config_items(p)
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="auto",
        help="continue from the latest checkpoint in out_dir (weights, optimizer, step, RNG); "
        "`--resume auto`: continue from the latest valid checkpoint if there is one, else "
        "start fresh (the same command starts and continues a run)",
    )
    p.add_argument(
        "--resume-from",
        metavar="CKPT",
        help="continue from this checkpoint file (or the latest one in this run folder)",
    )
    p.add_argument(
        "--no-accelerate",
        action="store_true",
        help="train with plain eager PyTorch instead of the graphtrain engine (train.accelerate=false)",
    )
    p.add_argument("--out", metavar="DIR", help="output folder for checkpoints and metrics (train.out_dir)")
    p.add_argument("--steps", type=int, metavar="N", help="optimizer steps in total (train.steps)")
    p.add_argument(
        "--allow-config-change",
        metavar="KEY[,KEY]",
        help="when resuming, accept these config keys differing from the checkpoint's (e.g. "
        "train.steps,optim.lr); any other difference refuses the resume",
    )
    p.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="run on N local processes under torchrun (parallel.dp*tp*pp must equal N, e.g. "
        "parallel.dp=N); the same command runs in every worker, without --nproc",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        metavar="K",
        help="torchrun's elastic agent restarts the workers up to K times when one crashes (a signal, "
        "exit 1), never after a usage error (exit 2); restarted workers continue from the latest "
        "valid checkpoint this launch wrote (--resume auto), or do what the command asked when it "
        "wrote none. Default 0; without --nproc, N is parallel.dp*tp*pp",
    )


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The `graphtrain train` arguments each torchrun worker gets: this command's, minus --nproc and
    --max-restarts. (A restarted worker resumes by itself: see `_resume_mode`.)"""
    argv = list(args.items)
    for flag, value in (
        ("--resume-from", args.resume_from),
        ("--out", args.out),
        ("--steps", args.steps),
        ("--allow-config-change", args.allow_config_change),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if args.resume == "auto":
        argv += ["--resume", "auto"]
    elif args.resume is not None:
        argv.append("--resume")
    if args.no_accelerate:
        argv.append("--no-accelerate")
    if getattr(args, "debug", False):
        argv.append("--debug")
    return argv


def _resume_mode(args: argparse.Namespace, out_dir: str) -> bool | str | Path:
    """What Trainer(resume=) gets. A worker that torchrun's elastic agent restarted after a crash continues from the
    latest valid checkpoint once this launch has written one (it is the same run, started again); before that it
    does what the command asked, so that --resume-from CKPT still means CKPT (distributed/launch.py)."""
    if args.resume is not None and args.resume_from:
        raise ValueError("give either --resume (latest checkpoint in out_dir) or --resume-from CKPT, not both")
    from graphtrain.distributed import launch

    if launch.restart_count() > 0 and launch.written_since_launch(out_dir):
        return "auto"
    if args.resume_from:
        return Path(args.resume_from)
    return {"latest": True, "auto": "auto", None: False}[args.resume]


def _check_out_dir(out_dir: str) -> None:
    """The output folder must be creatable and writable before anything is trained (usage error otherwise)."""
    path = Path(out_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(
            f"train.out_dir {str(path)!r} cannot be written ({e.strerror or e}): choose a folder you "
            f"can write with --out DIR (or train.out_dir=...)"
        ) from None


def _check_job_file(items: list[str], config: Config) -> None:
    """A job file that is the run folder's own config.yaml: the run writes its resolved config there (no comments,
    every key), so a file the user wrote would be lost. Refused, unless it is itself such a resolved config (a run's
    saved config given back to continue it, with overrides or not: nothing in it is the user's own writing)."""
    target = Path(config.train.out_dir).expanduser() / "config.yaml"
    for item in items:
        job = Path(item).expanduser()
        if "=" in item or not job.is_file() or not target.exists() or not job.samefile(target):
            continue
        if job.read_text() != load_config([item]).to_yaml():
            raise ValueError(
                f"the job file {item!r} is the run folder's config.yaml, which the run overwrites with "
                f"its resolved config (your comments and layout would be lost): move the job file out "
                f"of {str(target.parent)!r} or choose another --out DIR"
            )


def _check_resume_from(resume: bool | str | Path, out_dir: str) -> None:
    """--resume-from a checkpoint of another folder continues that history in out_dir: refused when out_dir holds
    checkpoints of its own (another history: the later ones would move aside, and pruning would delete the
    earlier ones once the new history has saved three)."""
    if not isinstance(resume, Path):
        return
    from graphtrain.trainer.checkpoint import is_sharded, list_checkpoints

    source, folder = resume.expanduser().resolve(), Path(out_dir).expanduser().resolve()
    home = source if source.is_dir() and not is_sharded(source) else source.parent
    found = list_checkpoints(folder)
    if not found or home.is_relative_to(folder):
        return
    raise ValueError(
        f"--resume-from {str(resume)!r} is outside train.out_dir {str(folder)!r}, which holds checkpoints "
        f"of its own (latest {found[-1][1].name}): continuing another run there would mix two histories "
        f"and pruning would delete its checkpoints. Choose an empty folder with --out DIR, or continue "
        f"the run in {str(folder)!r} with --resume"
    )


_LOCKED_ENV = "GRAPHTRAIN_RUN_LOCKED"  # the run folder the launching process holds the lock of, for its workers


def _lock_out_dir(out_dir: str) -> None:
    """One run per folder (trainer/resume.py, `lock_run_folder`): taken before anything touches the folder. Under
    `graphtrain train --nproc/--max-restarts` the launching process holds it for its workers; under a torchrun
    started by hand, global rank 0 takes it."""
    from graphtrain.trainer.resume import lock_run_folder

    folder = str(Path(out_dir).expanduser().resolve())
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:
        if os.environ.get(_LOCKED_ENV) == folder or os.environ.get("RANK", "0") != "0":
            return
    lock_run_folder(folder)


def run_train(args: argparse.Namespace) -> int:
    """`graphtrain train`. SIGTERM from its first line until fit() begins (torch imported, data prepared, model
    built) exits 75 saying nothing was lost (early_preempt); fit()'s PreemptionGuard takes over from there."""
    with before_first_step():
        then = _prepare_train(args)
    return then if isinstance(then, int) else then()


def _prepare_train(args: argparse.Namespace) -> int | Callable[[], int]:
    """run_train up to fit(): an exit status (a refusal), or what runs next (fit, or launching the workers: the
    elastic agent handles SIGTERM itself) returning the command's exit status."""
    from graphtrain.distributed import launch

    if launch.refused_earlier() is not None:  # a restart after a refusal: the command still cannot run
        if os.environ.get("RANK", "0") == "0":
            print(
                "error: not restarted: an earlier attempt refused this command (its error is above); a restart is "
                "for a crash, never for a usage error: fix the command and run it again",
                file=sys.stderr,
            )
        return EXIT_USAGE
    from graphtrain.trainer import Trainer
    from graphtrain.trainer.resume import allowed_keys

    overrides: dict[str, object] = {}
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    if args.out is not None:
        overrides["train.out_dir"] = args.out
    if args.no_accelerate:
        overrides["train.accelerate"] = False
    config = load_config(args.items)
    if overrides:
        config = config.with_overrides(overrides)
    resume = _resume_mode(args, config.train.out_dir)
    _check_job_file(args.items, config)
    _check_resume_from(resume, config.train.out_dir)
    # checked here too, so that a typo under --nproc is one error line, not one per worker
    allowed = allowed_keys(args.allow_config_change or (), config)
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.nproc is not None or args.max_restarts:
        nproc = args.nproc if args.nproc is not None else config.parallel.world_size
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        if config.parallel.world_size != nproc:
            raise ValueError(
                f"--nproc {nproc} but parallel.dp*tp*pp = {config.parallel.world_size}: set "
                f"parallel.dp={nproc} (or a dp, tp, pp whose product is {nproc})"
            )
        if nproc > 1 or args.max_restarts:
            from graphtrain.trainer.runtime import check_supported

            check_supported(config)  # here, once, rather than as an error line from every worker
            _check_out_dir(config.train.out_dir)
            _lock_out_dir(config.train.out_dir)
            return lambda: _launch(nproc, args, config)
    _check_out_dir(config.train.out_dir)
    _lock_out_dir(config.train.out_dir)
    launch.record_checkpoints(config.train.out_dir)  # under torchrun: what a restart must not mistake for its own
    if config.train.loggers != ["jsonl"]:  # the MFU curve's denominator, measured once per machine and device
        from graphtrain.kernels.flops import ensure_machine_peak
        from graphtrain.trainer.runtime import pick_device

        # the device the Trainer picks (a GPU where there is one): the CPU's peak never divides a GPU run's FLOPs
        ensure_machine_peak(pick_device().type, log=lambda m: print(m, file=sys.stderr, flush=True))
    trainer = Trainer(config, resume=resume, allow_config_change=allowed)
    from graphtrain.runs.sweep import pruning_callback

    prune = pruning_callback()  # a trial of `graphtrain sweep` (its environment says so): report, maybe stop early
    if prune is not None:
        trainer.eval_callbacks.append(prune)
    return lambda: _fit(trainer)


def _fit(trainer: Trainer) -> int:
    from graphtrain.trainer import TrainingPreempted  # loaded with the trainer by now: no import cost

    try:
        s = trainer.fit()
        if trainer.is_main:
            _report(trainer, s)
    except TrainingPreempted as e:
        if trainer.is_main:
            print(f"preempted: {e}; continue with --resume auto", file=sys.stderr)
        return EXIT_PREEMPTED
    finally:
        trainer.close()
    return 0


def _launch(nproc: int, args: argparse.Namespace, config: Config) -> int:
    """Run the workers under torchrun's elastic agent (in this process: it forwards SIGTERM/SIGINT to them and
    waits train.preempt_grace_s plus a margin before killing them); returns this command's exit status."""
    import time

    from graphtrain.distributed.launch import launch

    started = time.time()
    os.environ[_LOCKED_ENV] = str(Path(config.train.out_dir).expanduser().resolve())  # the workers inherit it
    code = launch(
        nproc,
        _worker_argv(args),
        out_dir=config.train.out_dir,
        max_restarts=args.max_restarts or 0,
        shutdown_timeout_s=math.ceil(config.train.preempt_grace_s) + 15,
    )
    if code in (EXIT_OK, EXIT_USAGE, EXIT_FAILURE):  # the workers said why (one error line each)
        return code
    record = _last_record(Path(config.train.out_dir) / "metrics.jsonl", since=started)
    if record is not None and record.get("kind") == "preempted":
        where = record.get("checkpoint") or "no checkpoint"
        print(
            f"preempted: {record.get('signal')} at step {record['step']}, {where}; continue with --resume auto",
            file=sys.stderr,
        )
        return EXIT_PREEMPTED
    if code in (EXIT_PREEMPTED, 128 + signal.SIGTERM, 128 + signal.SIGINT):  # stopped before training began
        print("preempted before the first step; continue with --resume auto", file=sys.stderr)
        return EXIT_PREEMPTED
    print(
        f"error: the workers stopped with status {code} (torchrun's log above says which rank and why); the "
        f"checkpoints already written are kept: continue with --resume auto",
        file=sys.stderr,
    )
    return EXIT_FAILURE


def _last_record(path: Path, since: float) -> dict | None:
    """The last complete record of metrics.jsonl written after `since` (time.time()), if any."""
    import json

    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        return record if record.get("time", 0) >= since else None
    return None


def _report(trainer, s: dict) -> None:
    print(
        f"\ndone: {s['steps']} steps, train loss {_num(s['train_loss'])}, val loss {_num(s['val_loss'])}, "
        f"{_num(s['tokens_per_s'], ',.0f')} tok/s, {_num(s['ms_per_step'], '.0f')} ms/step, "
        f"peak mem {_mb(s['peak_mem_bytes'])}"
    )
    if s.get("data_peak_mem_bytes"):
        print(
            f"data preparation (tokenizer trained, corpus tokenized; cached for later runs): peak mem "
            f"{_mb(s['data_peak_mem_bytes'])}, before the first step and not counted above"
        )
    print(f"checkpoint: {s['checkpoint']}\nmetrics: {Path(s['out_dir']) / 'metrics.jsonl'}")
    if hasattr(trainer.model, "_graphtrain"):
        from graphtrain.tools.report import report

        print(report(trainer.model).summary())
    tc = trainer.config.train
    if (
        trainer.family == "gpt2"
        and tc.sample_tokens > 0
        and trainer.config.parallel.tp == 1
        and trainer.data.tokenizer is not None
    ):
        print(f"\ncompletion of {tc.sample_prompt!r} ({tc.sample_tokens} tokens, top-k 20, T 0.8, seed {tc.seed}):")
        print("-" * 60)
        print(trainer.sample(tc.sample_prompt, tc.sample_tokens))
        print("-" * 60)


def _num(x: float | None, fmt: str = ".4f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MB"
