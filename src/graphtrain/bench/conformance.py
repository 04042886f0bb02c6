"""`graphtrain conformance`: the conformance matrix, models x entry points x precisions x providers, each cell
trained a few steps against eager PyTorch (what a cell runs and compares: bench/conformance_cells.py).

    graphtrain conformance                                    every row, the four entry points at fp32/aten
    graphtrain conformance --rows gpt2,llama-gqa --cols 'accelerate/*,backend/*'
    graphtrain conformance --cols all --isolate --markdown docs/design/conformance.md
    graphtrain conformance --list                             the rows and columns
    graphtrain conformance --bisect llama-gqa:accelerate/bf16/aten   graphtrain.bisect on that cell's model

Each cell is ``pass`` (loss of every step and every gradient within graphtrain.testing's tolerance table),
``fallback`` (within tolerance, but part of it ran outside graphtrain; the reason is listed under the table),
``fail`` (out of tolerance, an exception, or under --isolate a signal or a timeout) or ``n/a``. ``--isolate`` runs
each cell in a child process (``python -m graphtrain.bench.conformance --cell ROW:COLUMN``), so a crash in native
code (SIGSEGV, SIGABRT) is one failed cell, named by its signal, and the matrix goes on. Exit status 0 when no cell
failed, 1 otherwise, 2 for a usage error.

``--bisect ROW:COLUMN`` runs ``graphtrain.bisect`` (tools/bisect.py) on the cell's model and batch with its
precision, provider and recompute: the first pass, fused op or provider out of tolerance. bisect trains through
``accelerate`` in this process: a cell that fails only through another entry point is bisected as accelerate runs
it, and a crash inside bisect ends it (its configurations are not isolated).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

# Imports inside functions: import cost: the command line imports this module to register `graphtrain conformance` and
# must stay free of torch; the cells (conformance_cells.py) load when the verb runs.

if TYPE_CHECKING:
    from graphtrain.bench.conformance_cells import Column, Result

DEFAULT_STEPS = 3
"""--steps' default: conformance_cells.STEPS (tests/test_conformance.py holds them equal)."""


def _cells():
    """bench/conformance_cells.py, imported on first use: it imports torch and transformers (seconds), and every
    `graphtrain` command, `--help` too, builds this verb's parser."""
    from graphtrain.bench import conformance_cells

    return conformance_cells


DEFAULT_COLS = "*/fp32/aten"
MARK = "conformance-result: "
SHORT = {"pass": "pass", "fallback": "fallback", "fail": "FAIL", "n/a": "n/a"}


# ------------------------------------------------------------------------------------------ selection ----


def _matches(pattern: str, names: list[str], what: str) -> list[str]:
    hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    if not hits:
        raise ValueError(f"--{what} {pattern!r} matches no {what[:-1]}: see `graphtrain conformance --list`")
    return hits


def _parts(spec: str) -> list[str]:
    return [p.strip() for p in spec.split(",") if p.strip()]


def select(rows: str | None, cols: str | None) -> tuple[list[str], list[Column]]:
    """The rows and columns named by --rows/--cols: names or shell patterns, comma-separated; `all`: every one in
    the matrix. A test-only row is taken only by its full name; a column outside the matrix's list may be named in
    full (``trainer/bf16/auto/recompute/frozen-emb``)."""
    all_rows = _cells().ROWS
    visible = [n for n, r in all_rows.items() if not r.hidden]
    row_names: list[str] = []
    for part in _parts("*" if rows in (None, "all") else rows):
        found_rows = [part] if part in all_rows else _matches(part, visible, "rows")
        row_names += [n for n in found_rows if n not in row_names]
    columns: list[Column] = []
    for part in _parts({None: DEFAULT_COLS, "all": "*"}.get(cols, cols)):
        if part in _cells().COLUMNS:
            found = [_cells().COLUMNS[part]]
        elif "*" in part or "?" in part or "[" in part:
            found = [_cells().COLUMNS[n] for n in _matches(part, list(_cells().COLUMNS), "cols")]
        else:
            found = [_cells().parse_column(part)]
        columns += [c for c in found if c not in columns]
    if not row_names or not columns:
        raise ValueError("--rows and --cols must name at least one row and one column")
    return row_names, columns


# ------------------------------------------------------------------------------------------- running ----


def run_isolated(row: str, col: Column, steps: int, timeout: float) -> Result:
    """The cell in a child process: its result, or a failed cell naming the signal, exit status or timeout."""
    cmd = [sys.executable, "-m", "graphtrain.bench.conformance", "--cell", f"{row}:{col.name}", "--steps", str(steps)]
    env = {**os.environ, "GRAPHTRAIN_BACKGROUND_AT_EXIT": "stop"}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return _cells().Result(
            row,
            col.name,
            "fail",
            f"timeout: no result after {timeout:.0f} s (child killed)",
            seconds=time.perf_counter() - t0,
        )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return _cells().Result.from_json(line[len(MARK) :])
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        why = f"crashed: killed by {name}"
    else:
        why = f"child exited with status {proc.returncode} without a result"
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:]
    return _cells().Result(
        row,
        col.name,
        "fail",
        why + (f" (last stderr line: {tail[0][:200]})" if tail else ""),
        seconds=time.perf_counter() - t0,
    )


def run_matrix(
    rows: list[str],
    cols: list[Column],
    *,
    steps: int = DEFAULT_STEPS,
    isolate: bool = False,
    timeout: float = 900.0,
    progress: bool = True,
) -> list[Result]:
    results = []
    for r in rows:
        for c in cols:
            res = run_isolated(r, c, steps, timeout) if isolate else _cells().run_cell(_cells().ROWS[r], c, steps)
            results.append(res)
            if progress:
                diff = "" if res.max_loss_diff is None else f"loss diff {res.max_loss_diff:.1e}  "
                print(
                    f"  {r:<12} {c.name:<36} {res.status:<8} {res.seconds:6.1f} s  {diff}{res.reason[:90]}",
                    file=sys.stderr,
                    flush=True,
                )
    return results


# ------------------------------------------------------------------------------------------ printing ----


def table(results: list[Result], rows: list[str], cols: list[Column], markdown: bool = False) -> str:
    """The grid (rows x columns) of verdicts, then each failure's and fallback's reason, then the counts."""
    by = {(r.row, r.column): r for r in results}
    notes: list[str] = []

    def cell(r: str, c: Column) -> str:
        res = by.get((r, c.name))
        if res is None:
            return "-"
        text = SHORT[res.status]
        if markdown and res.status in ("pass", "fallback") and res.fused_ops is not None:
            text += f" ({res.fused_ops} fused, {res.providers})"
        if res.status in ("fail", "fallback"):
            notes.append(
                f"[{len(notes) + 1}] {r} x {c.name}: {res.status}: "
                + "; ".join([res.reason] + [f for f in res.fallbacks if f != res.reason])
            )
            text += f" [{len(notes)}]"
        return text

    grid = [[r] + [cell(r, c) for c in cols] for r in rows]
    head = ["row"] + [c.name for c in cols]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(g) + " |" for g in grid]
    else:
        widths = [max(len(x) for x in col) for col in zip(head, *grid)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *grid]]
    counts = {s: sum(r.status == s for r in results) for s in SHORT}
    ran = [r for r in results if r.status in ("pass", "fallback")]
    lines += [
        "",
        f"{len(results)} cells: " + ", ".join(f"{n} {s}" for s, n in counts.items()),
        f"of the {len(ran)} that ran within tolerance, {sum(bool(r.fused_ops) for r in ran)} ran graphtrain's "
        f"fused ops (the count in a cell: ops the passes put into its graphs, per graph)",
        f"time: {sum(r.seconds for r in results):.0f} s",
    ]
    if notes:
        lines += [""] + [("- " if markdown else "") + n for n in notes]
    return "\n".join(lines)


def machine() -> dict[str, str]:
    """The commit, CPU, the ISA torch dispatches to (and the simulation variables when set), torch's version."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    try:
        where = Path(__file__).parent
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=where, timeout=10
            ).stdout.strip()
            or "unknown"
        )
        if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "."], cwd=where.parent, timeout=10).returncode:
            commit += " (the package had uncommitted changes)"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    isa = torch.backends.cpu.get_cpu_capability()
    sim = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(k)]
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = "not installed"
    return {
        "commit": commit,
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "isa": isa + (f" (simulated: {', '.join(sim)})" if sim else ""),
        "torch": torch.__version__,
        "transformers": tf,
    }


def markdown(results: list[Result], rows: list[str], cols: list[Column], command: str) -> str:
    m = machine()
    head = [
        "# Conformance matrix",
        "",
        f"Generated by `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); regenerate it with the "
        f"same command. What a cell runs and compares: `src/graphtrain/bench/conformance_cells.py`.",
        "",
        f"- commit: {m['commit']}",
        f"- machine: {m['cpu']}; torch CPU capability {m['isa']}",
        f"- torch {m['torch']}, transformers {m['transformers']}",
        "",
        "Rows: " + "; ".join(f"`{r}` {_cells().ROWS[r].what}" for r in rows) + ".",
        "",
        "",
    ]
    return "\n".join(head) + table(results, rows, cols, markdown=True) + "\n"


# ------------------------------------------------------------------------------------------- the CLI ----


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", metavar="NAMES", help="comma-separated rows or shell patterns (default: all; see --list)")
    p.add_argument(
        "--cols",
        metavar="NAMES",
        help=f"comma-separated columns ENTRY/PRECISION/PROVIDER[/recompute]"
        f"[/frozen-emb][/one-graph] or patterns, `all` for the whole matrix (default: {DEFAULT_COLS!r})",
    )
    p.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"training steps per cell (default {DEFAULT_STEPS})"
    )
    p.add_argument(
        "--isolate",
        action="store_true",
        help="run each cell in a child process: a crash is a failed cell named by its signal",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="--isolate: seconds a cell may take before it is killed and failed (default 900)",
    )
    p.add_argument("--markdown", metavar="FILE", help="also write the table, with the commit and machine, to FILE")
    p.add_argument("--list", action="store_true", help="list the rows and columns and exit")
    p.add_argument("--bisect", metavar="ROW:COLUMN", help="run graphtrain.bisect on that cell's model instead")
    p.add_argument("--cell", metavar="ROW:COLUMN", help=argparse.SUPPRESS)  # the child of --isolate


def _cell(spec: str) -> tuple[str, Column]:
    row, sep, col = spec.partition(":")
    if not sep or row not in _cells().ROWS:
        raise ValueError(f"cell {spec!r} must be ROW:COLUMN with ROW one of {', '.join(_cells().ROWS)}")
    return row, _cells().COLUMNS.get(col) or _cells().parse_column(col)


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.cell:
        row, col = _cell(args.cell)
        print(MARK + _cells().run_cell(_cells().ROWS[row], col, args.steps).to_json(), flush=True)
        return 0
    if args.list:
        print("rows:\n" + "\n".join(f"  {n:<12} {r.what}" for n, r in _cells().ROWS.items()))
        print("columns (--cols all):\n" + "\n".join(f"  {c}" for c in _cells().COLUMNS))
        return 0
    if args.bisect:
        return _bisect(*_cell(args.bisect), steps=args.steps)
    rows, cols = select(args.rows, args.cols)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GRAPHTRAIN_BACKGROUND_AT_EXIT", "stop")  # many short jobs: no compile outlives one
    print(
        f"conformance: {len(rows)} rows x {len(cols)} columns, {args.steps} steps per cell"
        f"{', each in a child process' if args.isolate else ''}",
        file=sys.stderr,
        flush=True,
    )
    results = run_matrix(rows, cols, steps=args.steps, isolate=args.isolate, timeout=args.timeout)
    print(table(results, rows, cols))
    if args.markdown:
        command = "graphtrain conformance " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["conformance"] else [])
        Path(args.markdown).write_text(markdown(results, rows, cols, command.strip()))
        print(f"written: {args.markdown}")
    return 1 if any(r.status == "fail" for r in results) else 0


def _bisect(row: str, col: Column, steps: int) -> int:
    import graphtrain
    from graphtrain.bench.conformance_cells import _freeze_embedding

    def factory():
        model, _ = _cells().ROWS[row].build()
        if col.frozen:
            _freeze_embedding(model)
        return model

    _, batch = _cells().ROWS[row].build()
    engine = {k: v for k, v in col.engine().items() if k in ("recompute", "memory_budget")}
    if col.entry != "accelerate":
        print(f"note: bisect trains through accelerate; this cell's entry point is {col.entry}", file=sys.stderr)
    rep = graphtrain.bisect(
        factory,
        batch,
        steps=steps,
        provider=col.provider,
        precision=col.precision,
        engine=engine,
        name=f"{row} ({col.name})",
    )
    print(rep)
    return 0 if rep.ok else 1  # as `graphtrain bisect`


def main(argv: list[str] | None = None) -> int:
    """``python -m graphtrain.bench.conformance``: the same arguments as ``graphtrain conformance``."""
    p = argparse.ArgumentParser(prog="python -m graphtrain.bench.conformance", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
