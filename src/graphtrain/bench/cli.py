"""The `graphtrain bench` subcommand: `add_arguments(parser)` and `run(args) -> int`.

graphtrain bench SUITE [--out DIR] [--variants ...] [--steps N] [--repeats R] [--cap-gib G]
                       [--device cpu|cuda] [--cases PATTERN ...] [--maxbatch] [--docs PATH]
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from graphtrain.bench.suites import DEFAULT_VARIANTS, SUITES, VARIANTS

EXIT_INTERRUPTED = 130
"""Ctrl-C's exit status: the command line's (cli/exits.py, a layer above bench; tests/test_bench.py holds them equal)."""

# Imports inside functions: import cost: `graphtrain bench --help` and the suite listing stay free of torch.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "suite", nargs="?", choices=list(SUITES), help="; ".join(f"{s.name}: {s.doc}" for s in SUITES.values())
    )
    parser.add_argument(
        "--out",
        default="bench_results",
        metavar="DIR",
        help="results folder: <suite>-<time>.json/.md, <suite>-latest.md, results.jsonl, logs/",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        metavar="NAME",
        choices=list(VARIANTS),
        help=f"variants to compare (default: the suite's; for most {' '.join(DEFAULT_VARIANTS)}); "
        + "; ".join(f"{v.name}: {v.doc}" for v in VARIANTS.values()),
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="PATTERN",
        help="only cases whose name contains one of these or matches it as a glob, e.g. gpt2-small, "
        "'b8 s128' or 'hf-llama-*'",
    )
    parser.add_argument("--steps", type=int, help="steps per timed block (default: the suite's)")
    parser.add_argument(
        "--repeats", type=int, help="interleaved rounds, one block per variant each (default: the suite's)"
    )
    parser.add_argument("--warmup", type=int, help="untimed steps after the first step (default: the suite's)")
    parser.add_argument("--cap-gib", type=float, help="memory cap for the largest-batch search (default: the suite's)")
    parser.add_argument(
        "--alone",
        action="store_true",
        help="one variant's process at a time, alone on the machine, its rounds back to back (the "
        "default interleaves rounds across variants whose processes stay alive together)",
    )
    mb = parser.add_mutually_exclusive_group()
    mb.add_argument(
        "--maxbatch",
        dest="maxbatch",
        action="store_true",
        default=None,
        help="search the largest batch under --cap-gib for every case (suite `seed` does by default)",
    )
    mb.add_argument("--no-maxbatch", dest="maxbatch", action="store_false", help="skip the largest-batch search")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where to run the steps (default: the suite's: cuda for gpu, else cpu)",
    )
    parser.add_argument(
        "--docs",
        metavar="PATH",
        help="afterwards, regenerate this page (e.g. docs/design/benchmarks.md) from the latest run of each "
        "suite in --out; with no SUITE, only regenerate it",
    )
    parser.add_argument(
        "--partial",
        action="store_true",
        help="with --docs: also use an interrupted run's cases (<suite>-<time>.partial.json)",
    )
    parser.add_argument(
        "--allow-slow-bf16",
        action="store_true",
        help="run bf16 variants on a CPU without native bf16 too (emulated: ~30x slower than fp32 on "
        "an AVX2 EPYC; skipped by default with the reason)",
    )
    parser.add_argument(
        "--gemm-floor",
        action="store_true",
        help="after the timed rounds, time each matmul of eager's step alone at its own shape and layout: the "
        "report's roofline then says how fast these matmuls can go here (adds ~10-60 s per eager variant)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--list", action="store_true", help="list suites, cases and variants, then exit")


def run(args: argparse.Namespace) -> int:
    from graphtrain.bench import report, runner, suites

    if args.list:
        for s in SUITES.values():
            print(f"{s.name}: {s.doc}\n  steps {s.steps} x repeats {s.repeats}, warmup {s.warmup}, cap {s.cap_gib} GiB")
            for c in s.cases:
                print(f"    {c.name}{'  (+ max batch)' if c.maxbatch else ''}")
        print("variants: " + ", ".join(VARIANTS))
        return 0
    if args.suite is None:
        if args.docs:
            return _write_docs(Path(args.out), Path(args.docs), args.partial)
        print("graphtrain bench: name a suite (" + ", ".join(SUITES) + ") or pass --docs PATH", file=sys.stderr)
        return 2
    for name in ("steps", "repeats", "cap_gib"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            print(f"graphtrain bench: --{name.replace('_', '-')} must be positive, got {value}", file=sys.stderr)
            return 2
    if args.warmup is not None and args.warmup < 0:
        print(f"graphtrain bench: --warmup must be >= 0, got {args.warmup}", file=sys.stderr)
        return 2
    device = args.device or SUITES[args.suite].device
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            flag = "--device cuda" if args.device else f"suite {args.suite} runs on CUDA"
            print(
                f"graphtrain bench: {flag}, but torch.cuda.is_available() is False; run it on a machine with an "
                "NVIDIA GPU and a CUDA build of torch, or pass --device cpu",
                file=sys.stderr,
            )
            return 2
    try:
        suite = suites.with_overrides(
            suites.get_suite(args.suite),
            steps=args.steps,
            repeats=args.repeats,
            warmup=args.warmup,
            cap_gib=args.cap_gib,
            max_workers=1 if args.alone else None,
        )
        variants = suites.resolve_variants(args.variants, suite)
        cases = suites.select_cases(suite, args.cases)
    except ValueError as e:
        print(f"graphtrain bench: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    argv = argv[1:] if argv[:1] == ["bench"] else argv  # as a subcommand of `graphtrain`
    command = "graphtrain bench " + " ".join(shlex.quote(a) for a in argv)
    saved: list[Path] = []
    try:
        result = runner.run_suite(
            suite,
            variants,
            cases,
            device=device,
            out_dir=out,
            maxbatch=args.maxbatch,
            progress=not args.no_progress,
            command=command,
            on_case=lambda partial: saved.append(report.save_partial(partial, out)),
            allow_slow_bf16=args.allow_slow_bf16,
            gemm_floor=args.gemm_floor,
        )
    except KeyboardInterrupt:
        print(
            f"interrupted: the cases finished so far are in {saved[-1]} (`graphtrain bench --out {out} --docs PAGE "
            "--partial` renders them)"
            if saved
            else "interrupted before the first case finished: nothing was saved",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    paths = report.save(result, out)
    print(report.terminal_table(result))
    print(f"results: {paths['json']}\nreport:  {paths['md']}\nlogs:    {result['log_dir']}")
    if args.docs:
        _write_docs(out, Path(args.docs), args.partial)
    failed = [r for r in report.summarize(result) if r["status"] == "error"]
    for r in failed:
        print(f"error: {r['case']} / {r['variant']}: {r['reason']}", file=sys.stderr)
    return 1 if failed else 0


def _write_docs(out: Path, path: Path, partial: bool = False) -> int:
    from graphtrain.bench import report

    runs = report.latest_runs(out, include_partial=partial)
    if not runs:
        print(f"graphtrain bench: no runs in {out / 'results.jsonl'}; run a suite first", file=sys.stderr)
        return 2
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = report.kept_sections(path.read_text()) if path.exists() else []
    path.write_text(report.render_docs(runs, kept))
    print(f"docs:    {path} (suites: {', '.join(r for r in report.SUITE_ORDER if r in runs)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="graphtrain bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    return run(args)
