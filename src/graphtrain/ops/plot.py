"""``graphtrain plot RUN_DIR [RUN_DIR...]``: one self-contained HTML page comparing runs.

Each run directory holds ``metrics.jsonl`` (the trainer's records: train, eval, summary) and ``config.yaml``.
The page has the loss (train solid, validation dashed), throughput, memory and learning-rate curves with one
line per run, and a table of the config keys that differ between the runs and each run's final figures.
Figures are matplotlib PNGs (Agg backend, no display needed) embedded as base64, so the file opens anywhere
offline; the plotted series are embedded too, as JSON in a ``<script type="application/json">`` block, for
tools and tests.
"""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from graphtrain.jobfile import read_yaml_file

CURVES = (  # (title, [(record kind, field, line style)], y label)
    ("loss", [("train", "loss", "-"), ("eval", "val_loss", "--")], "loss (train solid, validation dashed)"),
    ("throughput", [("train", "tokens_per_s", "-")], "tokens/s"),
    ("memory", [("train", "peak_mem_bytes", "-")], "peak memory (MiB)"),
    ("learning rate", [("train", "lr", "-")], "learning rate"),
)


def load_run(folder: str | Path) -> dict[str, Any]:
    """A run directory's records and config; ValueError naming what is missing when it is not one."""
    folder = Path(folder)
    metrics = folder / "metrics.jsonl"
    if not folder.is_dir() or not metrics.is_file():
        raise ValueError(f"{str(folder)!r} is not a graphtrain run directory: a run directory holds metrics.jsonl "
                         f"and config.yaml (the train.out_dir of a `graphtrain train`)")
    records = read_records(metrics)
    config_file = folder / "config.yaml"
    config = read_yaml_file(config_file, "the run's config", "fix or delete that file (the run's checkpoints hold "
                            "their config too)") if config_file.is_file() else {}
    return {"name": folder.name or str(folder), "path": str(folder), "records": records,
            "config": config if isinstance(config, dict) else {}}


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl: JSON objects with an integer step. A line that is not JSON is skipped (the
    torn last line of a killed run); a JSON value that is not a record is a ValueError naming the file, the line and
    the fix (a malformed record once ended `graphtrain plot` in an AttributeError traceback)."""
    records = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            r = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if not (isinstance(r, dict) and isinstance(r.get("step", 0), int) and isinstance(r.get("kind", ""), str)):
            raise ValueError(f"{str(path)!r} line {i} is not a metrics record (a JSON object with a string kind and "
                             f"an integer step, as graphtrain writes them): fix or delete that line")
        records.append(r)
    return records


def series(run: dict[str, Any], kind: str, field: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[field]) for r in run["records"]
              if r.get("kind") == kind and isinstance(r.get(field), (int, float))]
    if field == "peak_mem_bytes":
        points = [(s, v / 2**20) for s, v in points]
    return [s for s, _ in points], [v for _, v in points]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(runs: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """(key, value per run) for the config keys whose values differ between the runs (the out_dir aside)."""
    flat = [_flatten(r["config"]) for r in runs]
    keys = sorted(set().union(*flat)) if flat else []
    return [(k, [f.get(k) for f in flat]) for k in keys
            if k != "train.out_dir" and len({json.dumps(f.get(k), default=str) for f in flat}) > 1]


def final_figures(run: dict[str, Any]) -> dict[str, Any]:
    summary = next((r for r in reversed(run["records"]) if r.get("kind") == "summary"), None)
    if summary is not None:
        out = {k: summary.get(k) for k in ("steps", "train_loss", "val_loss", "tokens_per_s", "ms_per_step")}
        mem = summary.get("peak_mem_bytes")
        return {**out, "peak_mem_MiB": mem / 2**20 if isinstance(mem, (int, float)) else None}
    last = {}
    for r in run["records"]:  # a run that has not finished: its latest figures
        last.update({k: v for k, v in r.items() if k not in ("kind", "time")})
    mem = last.get("peak_mem_bytes")
    return {"steps": last.get("step"), "train_loss": last.get("loss"), "val_loss": last.get("val_loss"),
            "tokens_per_s": last.get("tokens_per_s"), "ms_per_step": last.get("ms_per_step"),
            "peak_mem_MiB": mem / 2**20 if isinstance(mem, (int, float)) else None}


def _figure(title: str, lines: list[tuple[str, list, list, str, str]], ylabel: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=100)
    for label, xs, ys, style, color in lines:
        ax.plot(xs, ys, style, label=label, color=color, marker="." if len(xs) < 30 else None)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(fontsize=8)
    return _png(fig)


def _png(fig: Any) -> str:
    """A matplotlib figure as base64 PNG (the figure is closed)."""
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    return html.escape(json.dumps(v, default=str) if isinstance(v, (list, dict)) else str(v))


def write_report(run_dirs: list[str | Path], out: str | Path, title: str | None = None) -> Path:
    """Write the HTML page comparing `run_dirs` to `out`; returns its path."""
    if not run_dirs:
        raise ValueError("graphtrain plot needs at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    names = [r["name"] for r in runs]
    if len(set(names)) < len(names):  # two runs named alike (a/run, b/run): their paths tell them apart
        names = [r["path"] for r in runs]
    plotted: dict[str, dict[str, Any]] = {}
    images = []
    for name, specs, ylabel in CURVES:
        lines = []
        for i, (run, label) in enumerate(zip(runs, names)):
            for kind, field, style in specs:  # one color per run, train and validation alike
                xs, ys = series(run, kind, field)
                if xs:
                    lines.append((f"{label}{' (val)' if kind == 'eval' else ''}", xs, ys, style, f"C{i % 10}"))
                    plotted.setdefault(name, {})[f"{label}:{kind}/{field}"] = {"step": xs, "value": ys}
        if lines:
            images.append((name, _figure(name, lines, ylabel)))
    title = title or f"graphtrain runs: {', '.join(names)}"
    rows = "".join(f"<tr><th>{html.escape(k)}</th>{''.join(f'<td>{_fmt(v)}</td>' for v in vals)}</tr>"
                   for k, vals in config_differences(runs))
    finals = [final_figures(r) for r in runs]
    final_rows = "".join(f"<tr><th>{k}</th>{''.join(f'<td>{_fmt(f.get(k))}</td>' for f in finals)}</tr>"
                         for k in finals[0])
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    data = json.dumps(plotted).replace("</", "<\\/")  # JSON inside <script>: no closing tag can appear
    page = _page(title, f"""<h2>Final figures</h2><table><tr><th></th>{head}</tr>{final_rows}</table>
<h2>Config differences</h2>{'<table><tr><th>key</th>' + head + '</tr>' + rows + '</table>' if rows else
                            '<p>The runs share one config.</p>'}
{''.join(f'<h2>{html.escape(n)}</h2><img alt="{html.escape(n)}" src="data:image/png;base64,{b}">' for n, b in images)}
<script type="application/json" id="graphtrain-series">{data}</script>""")
    return _write(page, out)


def write_bar_page(title: str, groups: dict[str, list[tuple[str, float, float, float]]], out: str | Path,
                   intro: str = "", table_html: str = "") -> Path:
    """A page of horizontal bars, one figure per group (a benchmark case): (label, ratio, low, high) per bar,
    the ratio with its spread over interleaved repeats as an error bar and a line at 1.0 (no change).
    `graphtrain bench` writes one per suite run; the bars are embedded as JSON too."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = []
    for case, bars in groups.items():
        if not bars:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(bars) + 1.2), dpi=100)
        labels = [b[0] for b in bars]
        values = [b[1] for b in bars]
        err = [[max(v - lo, 0) for _, v, lo, _ in bars], [max(hi - v, 0) for _, v, _, hi in bars]]
        ax.barh(range(len(bars)), values, xerr=err, color=["C2" if v >= 1 else "C3" for v in values], capsize=3)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(range(len(bars)), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("speed vs eager (x, higher is faster; bars: median, whiskers: min-max over repeats)")
        ax.set_title(case, fontsize=10)
        for i, v in enumerate(values):
            ax.text(v, i, f" {v:.2f}x", va="center", fontsize=8)
        images.append((case, _png(fig)))
    data = json.dumps(groups).replace("</", "<\\/")
    page = _page(title, f"""<p>{html.escape(intro)}</p>
{''.join(f'<h2>{html.escape(c)}</h2><img alt="{html.escape(c)}" src="data:image/png;base64,{b}">' for c, b in images)}
{table_html}
<script type="application/json" id="graphtrain-bars">{data}</script>""")
    return _write(page, out)


def _page(title: str, body: str) -> str:
    """A self-contained HTML page: the title, a small stylesheet, `body`."""
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left;font-size:13px}} img{{max-width:100%}}</style></head>
<body><h1>{html.escape(title)}</h1>
{body}
</body></html>
"""


def _write(page: str, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out
