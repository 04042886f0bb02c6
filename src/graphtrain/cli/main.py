"""The `graphtrain` command line (also `python -m graphtrain`).

    graphtrain train                              train the default job (gpt2-mini on the Python stdlib)
    graphtrain train configs/x.yaml train.steps=50 --out runs/x
    graphtrain train --out runs/x --resume        continue that run from its latest checkpoint
    graphtrain train --out runs/x --resume auto   continue it if it has a valid checkpoint, else start it
    graphtrain config                             every config key with its default and documentation
    graphtrain bisect configs/x.yaml              the first optimization that leaves eager's tolerance

Subcommands live in `SUBCOMMANDS`: name -> (help, add_arguments, run). Adding one is one entry
and two functions (report, precompile and bisect: cli/jobs.py; plot, sweep and export: cli/runs.py).

Exit status, so that a scheduler can tell what to do:
    0    done
    2    usage error: the command as given cannot run, whatever the machine (an unknown flag or config
         key, a bad value, a missing or corrupt file it names, an out_dir that cannot be written or
         already holds another run). Found before the first step; fix the command and run it again.
         Raised as ValueError/TypeError (argparse errors too).
    1    runtime failure: the job started and then failed (training diverged, out of memory, disk
         full or another I/O error while saving, a worker died). Raised as TrainingFailed or OSError.
         Checkpoints written before are kept: fix the cause and continue with --resume auto.
    75   preempted (SIGTERM, or a first Ctrl-C): the step in flight finished and its checkpoint was
         written (or, past train.preempt_grace_s, the last checkpoint stands); run the same command with
         --resume auto to continue. 75 is EX_TEMPFAIL of sysexits.h: "try again later".
    130  a second Ctrl-C: stopped at once; checkpoints already written are kept.
Every error is one ``error: ...`` line naming the problem and the fix, without a traceback;
``--debug`` shows the traceback instead. A traceback without --debug is a bug in graphtrain.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from graphtrain.bench import conformance
from graphtrain.cli import runs as cli_runs
from graphtrain.cli.jobs import (
    BISECT_EPILOG,
    add_bisect_arguments,
    add_config_items,
    add_precompile_arguments,
    add_report_arguments,
    load_config,
    run_bisect,
    run_precompile,
    run_report,
)
from graphtrain.config.sections import Config, describe_all
from graphtrain.early_preempt import EXIT_PREEMPTED, before_first_step

# Imports inside functions: import cost: `graphtrain --help` and the light verbs never load torch; each verb imports
# its machinery when it runs.

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class Subcommand(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ----------------------------------------------------------------------------- shared bits ----


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``error: <what> (see graphtrain train --help)``, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


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
    from graphtrain.trainer import Trainer, TrainingPreempted
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
    if config.train.loggers != ["jsonl"]:  # the MFU curve's denominator, measured once per machine
        from graphtrain.kernels.flops import ensure_machine_peak

        ensure_machine_peak(log=lambda m: print(m, file=sys.stderr, flush=True))
    trainer = Trainer(config, resume=resume, allow_config_change=allowed)
    from graphtrain.runs.sweep import pruning_callback

    prune = pruning_callback()  # a trial of `graphtrain sweep` (its environment says so): report, maybe stop early
    if prune is not None:
        trainer.eval_callbacks.append(prune)
    return lambda: _fit(trainer, TrainingPreempted)


def _fit(trainer, TrainingPreempted: type) -> int:
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


# ---------------------------------------------------------------------------------- config ----


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    add_config_items(p)


def run_config(args: argparse.Namespace) -> int:
    if args.items:  # show the job that would run
        print(load_config(args.items).to_yaml(), end="")
    else:
        print(describe_all())
    return 0


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from graphtrain.bench import cli as bench_cli

    bench_cli.add_arguments(p)


def _bench_run(args: argparse.Namespace) -> int:
    from graphtrain.bench import cli as bench_cli

    return bench_cli.run(args)


def _cache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=("list", "stop"),
        help="list: this user's background compile processes; stop: end them (all, or the PIDs given)",
    )
    p.add_argument("pids", nargs="*", type=int, metavar="PID", help="stop only these")


def _cache_run(args: argparse.Namespace) -> int:
    from graphtrain.runtime import background

    if args.action == "stop":
        stopped = background.stop(args.pids)
        print(
            f"stopped {len(stopped)} background compile(s){': pid ' + ', '.join(map(str, stopped)) if stopped else ''}"
        )
        return 0
    rows = background.running()
    for r in rows:
        owner = (
            f"its run (pid {r['parent_pid']}) is running"
            if r["parent_alive"]
            else f"detached: its run (pid {r['parent_pid']}) exited"
        )
        print(
            f"pid {r['pid']}  {r['seconds']:.0f} s  {r['done']}/{r['jobs']} graphs done  {owner}  {r['folder']}"
            f"{'  ' + r['command'] if r['command'] else ''}"
        )
    print(f"{len(rows)} background compile(s) running" + ("; `graphtrain cache stop [PID]` ends them" if rows else ""))
    return 0


# ------------------------------------------------------------------------------------ main ----

SUBCOMMANDS: dict[str, Subcommand] = {
    "train": Subcommand(
        "train a model (default: gpt2-mini on the Python standard library's source)", add_train_arguments, run_train
    ),
    "config": Subcommand(
        "list every config key with its default and documentation; with a CONFIG.yaml "
        "and/or overrides, print the resolved job instead",
        add_config_arguments,
        run_config,
    ),
    "report": Subcommand(
        "build the configured model, run one accelerated training step and print what the engine "
        "did: graphs, breaks, passes, providers, memory",
        add_report_arguments,
        run_report,
    ),
    "precompile": Subcommand(
        "fill the compile cache for a job before it runs (one training step and one "
        "evaluation in a scratch folder); the job then starts from the cache",
        add_precompile_arguments,
        run_precompile,
    ),
    "plot": Subcommand(
        "write one HTML page comparing runs: loss, throughput, memory and learning-rate curves, "
        "config differences and final figures",
        cli_runs.add_plot_arguments,
        cli_runs.run_plot,
    ),
    "sweep": Subcommand(
        "search hyperparameters with Optuna (TPE, median or ASHA pruning of poor trials, trials in "
        "parallel processes, resumable) and write the best job as best.yaml",
        cli_runs.add_sweep_arguments,
        cli_runs.run_sweep,
    ),
    "export": Subcommand(
        "export a run's trained model: safetensors weights, a Hugging Face folder "
        "(from_pretrained), or ONNX (checked with onnxruntime)",
        cli_runs.add_export_arguments,
        cli_runs.run_export,
    ),
    "bisect": Subcommand(
        "find the first pass, fused op or provider that takes the configured model's loss or "
        "gradients out of tolerance of eager PyTorch",
        add_bisect_arguments,
        run_bisect,
    ),
    "bench": Subcommand(
        "compare eager PyTorch, torch.compile and graphtrain training steps side by side", _bench_arguments, _bench_run
    ),
    "cache": Subcommand(
        "list (or stop) the background Inductor compiles still running: those of runs in progress "
        "and those engine.background_at_exit=finish left to finish",
        _cache_arguments,
        _cache_run,
    ),
    "conformance": Subcommand(
        "train tiny models through each entry point, precision and provider against eager "
        "PyTorch and print the pass/fallback/fail table",
        conformance.add_arguments,
        conformance.run,
    ),
}
EPILOGS = {"train": TRAIN_EPILOG, "bisect": BISECT_EPILOG}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="graphtrain",
        description="Faster PyTorch training by capturing the training step as one optimized static graph.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(
            name,
            help=cmd.help,
            description=cmd.help,
            epilog=EPILOGS.get(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks for errors"
        )
        cmd.add_arguments(p)
        p.set_defaults(run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        # parse_known_args + re-attach: lets overrides follow options (`train --out x train.steps=5`),
        # which a plain nargs="*" positional does not allow.
        args, extra = parser.parse_known_args(argv)
        unknown = [a for a in extra if a.startswith("-") or not hasattr(args, "items")]
        if unknown:
            command = f"{parser.prog} {args.command}" if args.command else parser.prog
            print(f"error: unrecognized arguments: {' '.join(unknown)} (see `{command} --help`)", file=sys.stderr)
            return EXIT_USAGE
        if extra:
            args.items += extra
        resume = getattr(args, "resume", None)
        if resume not in (None, "latest", "auto"):  # `--resume job.yaml ...`: argparse took an item as its value
            args.items.insert(1 if "=" in resume and args.items and "=" not in args.items[0] else 0, resume)
            args.resume = "latest"
    except SystemExit as e:  # --help (0) or an argparse usage error (2, message already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted: checkpoints already saved are kept; continue with --resume auto", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        code = exit_status(e)
        if code == EXIT_USAGE and args.command == "train" and os.environ.get("TORCHELASTIC_RUN_ID") is not None:
            from graphtrain.distributed.launch import record_refusal

            record_refusal(_one_line(e))  # torchrun's agent restarts on any failure: its restarts must refuse too
        if code is None or args.debug:
            raise  # a bug in graphtrain (or --debug): the traceback
        print(f"error: {_os_error(e) if isinstance(e, OSError) else _one_line(e)}", file=sys.stderr)
        return code


def program() -> None:
    """The `graphtrain` program (console script and `python -m graphtrain`): `main()`, then exit.

    A worker of a distributed run leaves without interpreter teardown once `main()` has returned: its
    checkpoints and report are written and its process group destroyed by then. About one pipeline-parallel
    CLI run in a dozen aborted at exit after that ("terminate called without an active exception",
    SIGABRT: a gloo thread still joinable when static destructors ran; pytorch/pytorch PR #179291), turning
    a finished run into a failed one. atexit handlers still run (the background compile's, the loggers').
    """
    code = main()
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None and "torch.distributed" in sys.modules:
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    raise SystemExit(code)


def exit_status(e: BaseException) -> int | None:
    """The exit status for an error (the rule in the module docstring); None: not a user-facing error."""
    # The trainer's own exceptions can only come from a command that loaded it (`graphtrain config` stays light).
    faults = sys.modules.get("graphtrain.trainer.faults")
    if faults is not None and isinstance(e, faults.TrainingFailed):
        return EXIT_FAILURE
    if isinstance(e, (ValueError, TypeError)):
        return EXIT_USAGE
    if isinstance(e, OSError):
        return EXIT_FAILURE
    return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _os_error(e: OSError) -> str:
    """An I/O failure while running, with the file and the fix."""
    where = f" {e.filename!r}" if e.filename else ""
    if e.errno == errno.ENOSPC:
        return (
            f"no space left on the device writing{where}: free space or use another folder (--out DIR, "
            f"data.cache_dir); checkpoints written before are kept, continue with --resume auto"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write{where} ({e.strerror}): check its permissions, or use another folder"
    return f"{e.strerror or _one_line(e)}{where}; checkpoints written before are kept, continue with --resume auto"


if __name__ == "__main__":
    program()
