"""The `graphtrain` command line (also `python -m graphtrain`).

    graphtrain train                              train the default job (gpt2-mini on the Python stdlib)
    graphtrain train configs/x.yaml train.steps=50 --out runs/x
    graphtrain train --out runs/x --resume        continue that run from its latest checkpoint
    graphtrain train --out runs/x --resume auto   continue it if it has a valid checkpoint, else start it
    graphtrain config                             every config key with its default and documentation
    graphtrain bisect configs/x.yaml              the first optimization that leaves eager's tolerance

Subcommands live in `SUBCOMMANDS`: name -> (help, add_arguments, run). Adding one is one entry
and two functions (train: cli/train.py; report, precompile and bisect: cli/jobs.py; plot, sweep and export:
cli/runs.py).

Exit status (cli/exits.py), so that a scheduler can tell what to do:
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
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

from graphtrain.bench import conformance
from graphtrain.cli import runs as cli_runs
from graphtrain.cli.exits import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE
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
from graphtrain.cli.train import TRAIN_EPILOG, add_train_arguments, run_train
from graphtrain.config.sections import describe_all

# Imports inside functions: import cost: `graphtrain --help` and the light verbs never load torch; each verb imports
# its machinery when it runs.


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
INTERRUPTED = {"train": "interrupted: checkpoints already saved are kept; continue with --resume auto"}
"""What Ctrl-C prints, by command (others: `interrupted`; `bench` says where its finished cases are itself)."""


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
        print(INTERRUPTED.get(args.command, "interrupted"), file=sys.stderr)
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
