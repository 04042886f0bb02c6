"""How the command line becomes a job (`[CONFIG.yaml] [section.key=value ...]`: load_config), and the commands that
inspect a configured job without training it: `graphtrain report`, `graphtrain precompile`, `graphtrain bisect` (their
arguments, what they run and the ``*_for_config`` functions behind them; cli/main.py registers them)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from graphtrain.config.sections import Config

# Imports inside functions: import cost: the command line registers these verbs without loading torch; each loads its
# machinery when it runs.


def add_config_items(p: argparse.ArgumentParser) -> None:
    p.usage = f"{p.prog} [CONFIG.yaml] [section.key=value ...] [options]"
    p.add_argument(
        "items",
        nargs="*",
        metavar="CONFIG.yaml | section.key=value",
        help="an optional YAML job file, then overrides such as train.steps=50 model.name=gpt2-tiny "
        "(values are parsed as YAML)",
    )


def load_config(items: list[str]) -> Config:
    """`[CONFIG.yaml] [section.key=value ...]` -> a validated Config."""
    path, overrides = None, []
    for i, item in enumerate(items):
        if "=" in item:
            overrides.append(item)
        elif i == 0:
            path = item
        else:
            raise ValueError(
                f"unexpected argument {item!r}: give at most one CONFIG.yaml, first, then section.key=value overrides"
            )
    config = Config.from_yaml(path) if path is not None else Config()
    return config.with_overrides(overrides) if overrides else config


# ---------------------------------------------------------------------------------- report ----


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    add_config_items(p)
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

    from graphtrain.frontend.accelerate import accelerate
    from graphtrain.models import build_model
    from graphtrain.tools.report import report

    torch.manual_seed(_check_job(config, "report_for_config").train.seed)
    data = _job_data(config)
    model = build_model(config.model, vocab_size=data.vocab_size)
    model.train()
    model = accelerate(model, config)
    loss = model(**_first_batch(config, data))
    loss.backward()
    return report(model)


def add_precompile_arguments(p: argparse.ArgumentParser) -> None:
    add_config_items(p)
    p.add_argument("--json", action="store_true", help="print the engine's report as JSON instead of text")


def run_precompile(args: argparse.Namespace) -> int:
    import json

    rep, seconds = precompile_for_config(load_config(args.items))
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2, default=str))
        return 0
    c = rep.cache or {}
    print(
        f"precompiled in {seconds:.1f} s: {len(rep.graphs)} graphs into {c.get('folder')}\n"
        f"  graphtrain pass results stored: {c.get('passes_miss', 0)} (already there: {c.get('passes_hit', 0)}); "
        f"Inductor FX graphs compiled: {c.get('fxgraph_miss', 0)} (already there: {c.get('fxgraph_hit', 0)})\n"
        f"  a `graphtrain train` of the same job on this machine now starts from the cache"
    )
    print(rep.summary())
    return 0


def precompile_for_config(config: Config) -> tuple[Any, float]:
    """Fill the compile caches for `config`'s job (``graphtrain precompile CONFIG``): the job's own Trainer runs one
    training step and one evaluation in a scratch folder, so exactly the graphs `graphtrain train` compiles
    (training step, eval forward, whole step) are compiled and cached, then the folder is removed. Returns (the
    engine's report, seconds)."""
    import contextlib
    import shutil
    import tempfile
    import time

    from graphtrain.tools.report import report
    from graphtrain.trainer import Trainer

    if config.parallel.world_size > 1:
        raise ValueError(
            f"graphtrain precompile runs one process; parallel.dp*tp*pp = {config.parallel.world_size}: "
            f"each rank compiles its own graphs at the start of the job"
        )
    if not config.train.accelerate:
        raise ValueError("train.accelerate is false: the job compiles nothing, there is nothing to precompile")
    scratch = tempfile.mkdtemp(prefix="graphtrain-precompile-")
    try:
        job = config.with_overrides(
            {
                "train.steps": 1,
                "train.eval_every": 0,
                "train.eval_batches": 1,
                "train.ckpt_every": 0,
                "train.out_dir": scratch,
                "train.progress": False,
                "train.sample_tokens": 0,
                "train.init_from": None,
                "engine.compile_in_background": False,
            }
        )  # provider auto: both now
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # the scratch run's log is not the command's output
            trainer = Trainer(job)
            trainer.fit()
        return report(trainer.model), time.perf_counter() - t0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _check_job(config: Config, who: str) -> Config:
    """The Trainer's checks, before anything is built or compiled."""
    from graphtrain.models import resolve_spec

    if not isinstance(config, Config):
        raise TypeError(f"{who} expects a graphtrain.Config, got {type(config).__name__}")
    spec = resolve_spec(config.model)
    if config.data.seq_len > spec.max_seq_len:
        raise ValueError(
            f"data.seq_len={config.data.seq_len} is longer than model {config.model.label!r} supports "
            f"(max_seq_len={spec.max_seq_len}): lower data.seq_len, or set "
            f"model.max_seq_len={config.data.seq_len}"
        )
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
    add_config_items(p)
    p.add_argument("--steps", type=int, default=3, metavar="N", help="SGD steps compared per configuration (default 3)")
    p.add_argument(
        "--provider",
        choices=("aten", "inductor"),
        help="the provider to end on (default: the config's engine.provider; auto is inductor)",
    )
    p.add_argument(
        "--keep-dropout",
        action="store_true",
        help="keep dropout on; configurations whose random stream differs from eager's are then reported, not judged",
    )
    p.add_argument("--alone", action="store_true", help="also run each pass on its own")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of text")


def run_bisect(args: argparse.Namespace) -> int:
    import json

    rep = bisect_for_config(
        load_config(args.items),
        steps=args.steps,
        provider=args.provider,
        keep_dropout=args.keep_dropout,
        alone=args.alone,
    )
    print(json.dumps(rep.to_dict(), indent=2, default=str) if args.json else rep)
    return 0 if rep.ok else 1


def bisect_for_config(
    config: Config, *, steps: int = 3, provider: str | None = None, keep_dropout: bool = False, alone: bool = False
) -> Any:
    """Bisect the configured model on the first batch of its data (``graphtrain bisect CONFIG``), model and batch
    built as ``report_for_config`` builds them; `provider` None means the config's engine.provider."""
    import torch

    from graphtrain.models import build_model
    from graphtrain.tools.bisect import bisect

    data = _job_data(_check_job(config, "bisect_for_config"))

    def factory() -> torch.nn.Module:
        torch.manual_seed(config.train.seed)
        return build_model(config.model, vocab_size=data.vocab_size)

    return bisect(
        factory,
        _first_batch(config, data),
        steps=steps,
        provider=provider or config.engine.provider,
        precision=config.engine.precision,
        seed=config.train.seed,
        keep_dropout=keep_dropout,
        alone=alone,
        engine=config.engine,
        name=config.model.name,
    )
