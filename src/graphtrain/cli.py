"""The `graphtrain` command line (also `python -m graphtrain`).

    graphtrain train                              train the default job (gpt2-mini on the Python stdlib)
    graphtrain train configs/x.yaml train.steps=50 --out runs/x
    graphtrain train --out runs/x --resume        continue that run from its latest checkpoint
    graphtrain config                             every config key with its default and documentation
    graphtrain bisect configs/x.yaml              the first optimization that leaves eager's tolerance

Subcommands live in `SUBCOMMANDS`: name -> (help, add_arguments, run). Adding one is one entry
and two functions. A user mistake (bad config key or value, missing data, corrupt checkpoint...)
prints one ``error: ...`` line and exits with code 2; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple

from graphtrain.config import Config, describe_all

EXIT_USAGE = 2


class Subcommand(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ----------------------------------------------------------------------------- shared bits ----

def _add_config_items(p: argparse.ArgumentParser) -> None:
    p.usage = f"{p.prog} [CONFIG.yaml] [section.key=value ...] [options]"
    p.add_argument("items", nargs="*", metavar="CONFIG.yaml | section.key=value",
                   help="an optional YAML job file, then overrides such as train.steps=50 model.name=gpt2-tiny "
                        "(values are parsed as YAML)")


def load_config(items: list[str]) -> Config:
    """`[CONFIG.yaml] [section.key=value ...]` -> a validated Config."""
    path, overrides = None, []
    for i, item in enumerate(items):
        if "=" in item:
            overrides.append(item)
        elif i == 0:
            path = item
        else:
            raise ValueError(f"unexpected argument {item!r}: give at most one CONFIG.yaml, first, then "
                             f"section.key=value overrides")
    config = Config.from_yaml(path) if path is not None else Config()
    return config.with_overrides(overrides) if overrides else config


# ----------------------------------------------------------------------------------- train ----

TRAIN_EPILOG = """\
Every config key can be set as section.key=value after the optional CONFIG.yaml; run
`graphtrain config` to list all of them with their defaults and documentation.

examples:
  graphtrain train                                     the default job: gpt2-mini, Python stdlib corpus
  graphtrain train configs/gpt2-tiny-test.yaml         a few-second smoke run
  graphtrain train model.name=gpt2-tiny data.seq_len=64 train.steps=50 --out runs/tiny
  graphtrain train --out runs/tiny --resume --steps 100   continue runs/tiny up to step 100
  graphtrain train data.path=~/src/myproject           train on your own folder of text/code files
  graphtrain train configs/x.yaml parallel.dp=2 --nproc 2   data-parallel on 2 processes (torchrun)

output: out_dir/ckpt-NNNNNNN.pt (last 3 kept; distributed runs: sharded ckpt-NNNNNNN/ folders),
out_dir/metrics.jsonl, out_dir/config.yaml
"""


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    _add_config_items(p)
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in out_dir (weights, optimizer, step, RNG)")
    p.add_argument("--resume-from", metavar="CKPT",
                   help="continue from this checkpoint file (or the latest one in this run folder)")
    p.add_argument("--no-accelerate", action="store_true",
                   help="train with plain eager PyTorch instead of the graphtrain engine (train.accelerate=false)")
    p.add_argument("--out", metavar="DIR", help="output folder for checkpoints and metrics (train.out_dir)")
    p.add_argument("--steps", type=int, metavar="N", help="optimizer steps in total (train.steps)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="run on N local processes under torchrun (parallel.dp*tp*pp must equal N, e.g. "
                        "parallel.dp=N); the same command runs in every worker, without --nproc")


def _worker_argv(args: argparse.Namespace) -> list[str]:
    """The `graphtrain train` arguments each torchrun worker gets: this command's, minus --nproc."""
    argv = list(args.items)
    for flag, value in (("--resume-from", args.resume_from), ("--out", args.out), ("--steps", args.steps)):
        if value is not None:
            argv += [flag, str(value)]
    argv += [flag for flag, on in (("--resume", args.resume), ("--no-accelerate", args.no_accelerate)) if on]
    if getattr(args, "debug", False):
        argv.append("--debug")
    return argv


def run_train(args: argparse.Namespace) -> int:
    from graphtrain.trainer import Trainer

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
    if args.resume and args.resume_from:
        raise ValueError("give either --resume (latest checkpoint in out_dir) or --resume-from CKPT, not both")
    resume: bool | Path = Path(args.resume_from) if args.resume_from else args.resume
    if args.nproc is not None:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        if config.parallel.world_size != args.nproc:
            raise ValueError(f"--nproc {args.nproc} but parallel.dp*tp*pp = {config.parallel.world_size}: set "
                             f"parallel.dp={args.nproc} (or a dp, tp, pp whose product is {args.nproc})")
        if args.nproc > 1:
            from graphtrain.distributed.launch import launch
            return launch(args.nproc, _worker_argv(args))

    trainer = Trainer(config, resume=resume)
    try:
        s = trainer.fit()
        if trainer.is_main:
            _report(trainer, s)
    finally:
        trainer.close()
    return 0


def _report(trainer, s: dict) -> None:
    print(f"\ndone: {s['steps']} steps, train loss {_num(s['train_loss'])}, val loss {_num(s['val_loss'])}, "
          f"{_num(s['tokens_per_s'], ',.0f')} tok/s, {_num(s['ms_per_step'], '.0f')} ms/step, "
          f"peak mem {_mb(s['peak_mem_bytes'])}")
    print(f"checkpoint: {s['checkpoint']}\nmetrics: {Path(s['out_dir']) / 'metrics.jsonl'}")
    if hasattr(trainer.model, "_graphtrain"):
        from graphtrain.engine.report import report
        print(report(trainer.model).summary())
    tc = trainer.config.train
    if trainer.family == "gpt2" and tc.sample_tokens > 0 and trainer.config.parallel.tp == 1:
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
    _add_config_items(p)


def run_config(args: argparse.Namespace) -> int:
    if args.items:  # show the job that would run
        print(load_config(args.items).to_yaml(), end="")
    else:
        print(describe_all())
    return 0


# ---------------------------------------------------------------------------------- report ----

def add_report_arguments(p: argparse.ArgumentParser) -> None:
    _add_config_items(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of text")


def run_report(args: argparse.Namespace) -> int:
    import json

    rep = report_for_config(load_config(args.items))
    print(json.dumps(rep.to_dict(), indent=2, default=str) if args.json else rep)
    return 0


def report_for_config(config: Config) -> Any:
    """Build the configured model, accelerate it, run one training step on real data, return the engine's
    report (``graphtrain report CONFIG``)."""
    import torch

    from graphtrain.engine.api import accelerate
    from graphtrain.engine.report import report
    from graphtrain.models import build_model

    torch.manual_seed(_check_job(config, "report_for_config").train.seed)
    data = _job_data(config)
    model = build_model(config.model, vocab_size=data.vocab_size)
    model.train()
    model = accelerate(model, config)
    loss = model(**_first_batch(config, data))
    loss.backward()
    return report(model)


def _check_job(config: Config, who: str) -> Config:
    """The Trainer's checks, before anything is built or compiled."""
    from graphtrain.models import resolve_spec

    if not isinstance(config, Config):
        raise TypeError(f"{who} expects a graphtrain.Config, got {type(config).__name__}")
    spec = resolve_spec(config.model)
    if config.data.seq_len > spec.max_seq_len:
        raise ValueError(f"data.seq_len={config.data.seq_len} is longer than model {config.model.name!r} supports "
                         f"(max_seq_len={spec.max_seq_len}): lower data.seq_len, or set "
                         f"model.max_seq_len={config.data.seq_len}")
    return config


def _job_data(config: Config) -> Any:
    from graphtrain.data import build_data
    from graphtrain.models import resolve_spec
    return build_data(config, family=resolve_spec(config.model).family)


def _first_batch(config: Config, data: Any) -> dict:
    """The first training batch `report` and `bisect` run (`train.batch_size: auto`: 8)."""
    return data.train.get_batch(0, config.train.batch_size if config.train.batch_size != "auto" else 8)


# ---------------------------------------------------------------------------------- bisect ----

BISECT_EPILOG = """\
Runs a few SGD steps of the configured model on the first batch of its data in eager PyTorch, then with
the engine's optimizations switched on one at a time (no passes; each pass of the pipeline; each fused
op's fast implementation; the provider), comparing the loss and every gradient with eager at each step
under graphtrain.testing.TOLERANCES. Dropout is switched off unless --keep-dropout: graphtrain's fused
dropout draws its masks from its own RNG. Exit status: 0 when every configuration is within tolerance,
1 when a culprit is named, 2 on a usage error.

examples:
  graphtrain bisect configs/gpt2-tiny-test.yaml --provider aten
  graphtrain bisect configs/x.yaml engine.precision=bf16 --steps 2 --json
"""


def add_bisect_arguments(p: argparse.ArgumentParser) -> None:
    _add_config_items(p)
    p.add_argument("--steps", type=int, default=3, metavar="N",
                   help="SGD steps compared per configuration (default 3)")
    p.add_argument("--provider", choices=("aten", "inductor"),
                   help="the provider to end on (default: the config's engine.provider; auto is inductor)")
    p.add_argument("--keep-dropout", action="store_true",
                   help="keep dropout on; configurations whose random stream differs from eager's are then "
                        "reported, not judged")
    p.add_argument("--alone", action="store_true", help="also run each pass on its own")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")


def run_bisect(args: argparse.Namespace) -> int:
    import json

    rep = bisect_for_config(load_config(args.items), steps=args.steps, provider=args.provider,
                            keep_dropout=args.keep_dropout, alone=args.alone)
    print(json.dumps(rep.to_dict(), indent=2, default=str) if args.json else rep)
    return 0 if rep.ok else 1


def bisect_for_config(config: Config, *, steps: int = 3, provider: str | None = None, keep_dropout: bool = False,
                      alone: bool = False) -> Any:
    """Bisect the configured model on the first batch of its data (``graphtrain bisect CONFIG``), model and batch
    built as ``report_for_config`` builds them; `provider` None means the config's engine.provider."""
    import torch

    from graphtrain.engine.bisect import bisect
    from graphtrain.models import build_model

    data = _job_data(_check_job(config, "bisect_for_config"))

    def factory() -> torch.nn.Module:
        torch.manual_seed(config.train.seed)
        return build_model(config.model, vocab_size=data.vocab_size)

    return bisect(factory, _first_batch(config, data), steps=steps, provider=provider or config.engine.provider,
                  precision=config.engine.precision, seed=config.train.seed, keep_dropout=keep_dropout, alone=alone,
                  engine=config.engine, name=config.model.name)


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    from graphtrain.bench import cli as bench_cli
    bench_cli.add_arguments(p)


def _bench_run(args: argparse.Namespace) -> int:
    from graphtrain.bench import cli as bench_cli
    return bench_cli.run(args)


# ------------------------------------------------------------------------------------ main ----

SUBCOMMANDS: dict[str, Subcommand] = {
    "train": Subcommand("train a model (default: gpt2-mini on the Python standard library's source)",
                        add_train_arguments, run_train),
    "config": Subcommand("list every config key with its default and documentation; with a CONFIG.yaml "
                         "and/or overrides, print the resolved job instead", add_config_arguments, run_config),
    "report": Subcommand("build the configured model, run one accelerated training step and print what the engine "
                         "did: graphs, breaks, passes, providers, memory", add_report_arguments, run_report),
    "bisect": Subcommand("find the first pass, fused op or provider that takes the configured model's loss or "
                         "gradients out of tolerance of eager PyTorch", add_bisect_arguments, run_bisect),
    "bench": Subcommand("compare eager PyTorch, torch.compile and graphtrain training steps side by side",
                        _bench_arguments, _bench_run),
}
EPILOGS = {"train": TRAIN_EPILOG, "bisect": BISECT_EPILOG}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphtrain", description="Faster PyTorch training by capturing the "
                                     "training step as one optimized static graph.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help, epilog=EPILOGS.get(name),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show full tracebacks for errors")
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
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if extra:
            args.items += extra
    except SystemExit as e:  # --help (0) or an argparse usage error (2, message already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("interrupted: checkpoints already saved are kept; continue with --resume", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
