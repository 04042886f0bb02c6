"""The commands that work on finished runs: `graphtrain plot`, `graphtrain sweep`, `graphtrain export` (their
arguments and what they run; cli/main.py registers them)."""

from __future__ import annotations

import argparse
from pathlib import Path

# Imports inside functions: import cost: the command line registers these verbs without loading torch; each loads its
# machinery when it runs.


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (a train.out_dir each)")
    p.add_argument("--out", default="report.html", metavar="PATH", help="the HTML file to write (report.html)")
    p.add_argument("--title", help="the page's title")


def run_plot(args: argparse.Namespace) -> int:
    from graphtrain.runs.plot import write_report

    _check_page_path(args.out)
    out = write_report(args.runs, args.out, args.title)
    print(f"wrote {out} ({len(args.runs)} run{'s' if len(args.runs) > 1 else ''}): open it in a browser")
    return 0


def _check_page_path(out: str) -> None:
    """`plot --out` writes an HTML page: refuse any other name (it could be a run's config.yaml, metrics.jsonl or a
    checkpoint, which the page would replace) and a folder (usage errors)."""
    path = Path(out).expanduser()
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(
            f"--out {out!r}: graphtrain plot writes an HTML page, and replaces the file it names; give "
            f"it a name ending in .html (e.g. --out report.html)"
        )
    if path.is_dir():
        raise ValueError(f"--out {out!r} is a folder: name the page's file, e.g. --out {str(path / 'report.html')!r}")


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", metavar="SWEEP.yaml", help="the sweep file (job, space, trials, parallel, sampler, pruner)")
    p.add_argument("--summary", action="store_true", help="only print the summary of the trials run so far")
    p.add_argument(
        "--trials",
        type=_positive_int,
        metavar="N",
        help="trials in all, replacing the file's trials: (a continued sweep counts those it has run)",
    )
    p.add_argument(
        "--parallel",
        type=_positive_int,
        metavar="N",
        help="trials run at once, each its own process, replacing the file's parallel:",
    )
    p.add_argument(
        "--out", metavar="DIR", help="the sweep's folder (trials, study.db, summary), replacing the file's out:"
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def run_sweep(args: argparse.Namespace) -> int:
    from graphtrain.runs.sweep import run_sweep as sweep

    sweep(args.sweep, summary_only=args.summary, trials=args.trials, parallel=args.parallel, out=args.out)
    return 0


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (its train.out_dir)")
    p.add_argument(
        "--format",
        required=True,
        choices=("safetensors", "hf", "onnx"),
        help="safetensors: the weights; hf: a Hugging Face model folder; onnx: an inference graph",
    )
    p.add_argument("--out", metavar="PATH", help="the folder to write (default RUN_DIR/export-FORMAT)")
    p.add_argument(
        "--checkpoint",
        default="latest",
        metavar="latest|best|STEP|PATH",
        help="which checkpoint (default: the latest that verifies; best: train.keep_best's ckpt-best)",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")


def run_export(args: argparse.Namespace) -> int:
    from graphtrain.runs.export import export_run

    r = export_run(args.run_dir, args.format, args.out, checkpoint=args.checkpoint, force=args.force)
    extra = f", {r['class']}" if "class" in r else ""
    print(
        f"exported {r['checkpoint']} as {r['format']}{extra} to {r['out']}: reloaded with its consumer library, "
        f"max abs logit difference {r['max_abs_diff']:.2e}"
    )
    return 0
