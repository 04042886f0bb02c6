"""``graphtrain plot RUN_DIR [RUN_DIR...]``: one self-contained, interactive HTML page comparing runs.

Each run directory holds ``metrics.jsonl`` (the trainer's records: train, eval, summary), ``config.yaml`` and
``run.json`` (trainer/runinfo.py: when, where and from which commit it ran). The page shows, one line per run:

- loss (train solid, validation dashed), throughput, MFU, gradient norm, peak memory and learning rate, drawn with
  Plotly (zoom, pan, hover), its plotly.min.js inlined so the file opens offline (runs/plot_page.py);
- controls for all charts at once: x as steps, tokens or wall time; smoothing; a log y axis;
- a table per run: date, duration, commit, machine, device, provider, steady-state throughput (the first logged
  window, which holds graph capture and compilation, apart), the first step's time, final losses, peak memory;
- the config keys that differ between the runs.

Numbers print in units people read (25.0k tok/s, 584.1 MiB, 3 min 05 s). The figures are embedded as JSON in
``<script type="application/json" id="graphtrain-figures">`` (each trace's x variants and raw values in ``meta``),
for tools and tests.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

from graphtrain.config.jobfile import read_yaml_file
from graphtrain.runs.plot_page import render
from graphtrain.trainer.console import human, human_bytes, human_seconds
from graphtrain.trainer.runinfo import read_run_info

# (id, title, y axis title, [(record kind, field, dash, label suffix)], y format (d3), smoothed, steady state)
# steady state: the run's first logged training window (graph capture and compilation) is left out of the curve.
CHARTS = (
    (
        "loss",
        "loss",
        "loss",
        [("train", "loss", "solid", ""), ("eval", "val_loss", "dash", " (val)")],
        ".4f",
        True,
        False,
    ),
    ("throughput", "throughput", "tokens/s", [("train", "tokens_per_s", "solid", "")], ".3s", True, True),
    ("mfu", "MFU (model FLOPs utilization)", "MFU", [("train", "mfu", "solid", "")], ".2%", True, True),
    (
        "grad_norm",
        "gradient norm (before clipping)",
        "gradient norm",
        [("train", "grad_norm", "solid", "")],
        ".3g",
        True,
        False,
    ),
    ("memory", "peak memory", "bytes", [("train", "peak_mem_bytes", "solid", "")], ".3s", False, False),
    ("lr", "learning rate", "learning rate", [("train", "lr", "solid", "")], ".2e", False, False),
)
X_TITLES = {"step": "optimizer step", "tokens": "tokens seen", "time": "wall time since the run started (s)"}
X_FORMATS = {"step": "", "tokens": ".3s", "time": ".1f"}  # d3 formats; "": Plotly's own
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def load_run(folder: str | Path) -> dict[str, Any]:
    """A run directory's records and config; ValueError naming what is missing when it is not one."""
    folder = Path(folder)
    metrics = folder / "metrics.jsonl"
    if not folder.is_dir() or not metrics.is_file():
        raise ValueError(
            f"{str(folder)!r} is not a graphtrain run directory: a run directory holds metrics.jsonl "
            f"and config.yaml (the train.out_dir of a `graphtrain train`)"
        )
    records = read_records(metrics)
    config_file = folder / "config.yaml"
    config = (
        read_yaml_file(
            config_file, "the run's config", "fix or delete that file (the run's checkpoints hold their config too)"
        )
        if config_file.is_file()
        else {}
    )
    return {
        "name": folder.name or str(folder),
        "path": str(folder),
        "records": records,
        "config": config if isinstance(config, dict) else {},
        "info": read_run_info(folder),
    }


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
            raise ValueError(
                f"{str(path)!r} line {i} is not a metrics record (a JSON object with a string kind and "
                f"an integer step, as graphtrain writes them): fix or delete that line"
            )
        records.append(r)
    return records


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _summary(run: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in reversed(run["records"]) if r.get("kind") == "summary"), None)


def tokens_per_step(run: dict[str, Any]) -> int | None:
    """From the summary record, else run.json, else the config (batch_size x grad_accum x seq_len); None if unknown."""
    summary = _summary(run) or {}
    sessions = run.get("info", {}).get("sessions") or [{}]
    for v in (summary.get("tokens_per_step"), sessions[-1].get("tokens_per_step")):
        if isinstance(v, int) and v > 0:
            return v
    cfg = run["config"]
    try:
        n = cfg["train"]["batch_size"] * cfg["train"].get("grad_accum", 1) * cfg["data"]["seq_len"]
    except (KeyError, TypeError):
        return None
    return n if isinstance(n, int) and n > 0 else None


def run_start(run: dict[str, Any]) -> float | None:
    """When the run started (unix seconds): run.json's first session; without one (a run from before run.json), its
    first record's time less the steps that record's window timed."""
    sessions = run.get("info", {}).get("sessions") or []
    if sessions and _finite(sessions[0].get("started_unix")):
        return float(sessions[0]["started_unix"])
    first = next((r for r in run["records"] if _finite(r.get("time"))), None)
    if first is None:
        return None
    window = first.get("ms_per_step", 0) * first.get("step", 0) / 1000 if _finite(first.get("ms_per_step")) else 0
    return first["time"] - window


def _train(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in run["records"] if r.get("kind") == "train"]


def points(run: dict[str, Any], kind: str, field: str, steady: bool = False) -> dict[str, list[Any]]:
    """One curve: the step, tokens, time (seconds since the run started) and value of each record of `kind` that
    holds `field`. steady: without the run's first training window (capture and compilation) when it has others."""
    recs = [r for r in run["records"] if r.get("kind") == kind and _finite(r.get(field))]
    train = _train(run)
    if steady and len(train) > 1:
        recs = [r for r in recs if r is not train[0]]
    tps, t0 = tokens_per_step(run), run_start(run)
    return {
        "step": [r["step"] for r in recs],
        "tokens": [r["step"] * tps if tps else None for r in recs],
        "time": [round(r["time"] - t0, 3) if t0 is not None and _finite(r.get("time")) else None for r in recs],
        "value": [r[field] for r in recs],
    }


def steady_throughput(run: dict[str, Any]) -> tuple[float | None, float | None, str]:
    """(tokens/s without the first step, the first step's seconds, where the figure comes from)."""
    summary = _summary(run)
    if summary is not None and _finite(summary.get("tokens_per_s")):
        first = summary.get("first_step_ms")
        return summary["tokens_per_s"], first / 1000 if _finite(first) else None, "over the run after the first step"
    windows = [r["tokens_per_s"] for r in _train(run)[1:] if _finite(r.get("tokens_per_s"))]
    return (statistics.median(windows) if windows else None), None, "median of the logged windows after the first"


def _date(ts: Any) -> str:
    if not _finite(ts):
        return "n/a"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _duration(run: dict[str, Any]) -> float | None:
    """Wall time the run's sessions took (a session still running or killed: until its last record)."""
    sessions = run.get("info", {}).get("sessions") or []
    times = [r["time"] for r in run["records"] if _finite(r.get("time"))]
    if not sessions:
        t0 = run_start(run)
        return max(times) - t0 if times and t0 is not None else None
    total = 0.0
    for i, s in enumerate(sessions):
        start = s.get("started_unix")
        if not _finite(start):
            continue
        end = s.get("finished_unix")
        if not _finite(end):  # until the last record before the next session (or at all)
            nxt = sessions[i + 1].get("started_unix") if i + 1 < len(sessions) else math.inf
            inside = [t for t in times if start <= t < (nxt if _finite(nxt) else math.inf)]
            end = max(inside) if inside else start
        total += end - start
    return total


def _joined(values: list[Any]) -> str:
    seen = list(dict.fromkeys(str(v) for v in values if v not in (None, "", [])))
    return ", ".join(seen) if seen else "n/a"


def run_facts(run: dict[str, Any]) -> dict[str, str]:
    """The run's metadata and final figures, as the page's table shows them."""
    sessions = run.get("info", {}).get("sessions") or []
    summary = _summary(run) or {}
    last = {}
    for r in run["records"]:  # a run that has not finished: its latest figures
        last.update({k: v for k, v in r.items() if k not in ("kind", "time")})
    tok_s, first_s, how = steady_throughput(run)
    mfu = [r["mfu"] for r in _train(run)[1:] if _finite(r.get("mfu"))]
    machine = _joined([" / ".join(x for x in (s.get("host"), s.get("gpu") or s.get("cpu")) if x) for s in sessions])
    device = _joined(
        [
            f"{s.get('device')}, {s.get('threads')} thread{'' if s.get('threads') == 1 else 's'}"
            + (f", {s['world_size']} ranks" if (s.get("world_size") or 1) > 1 else "")
            for s in sessions
        ]
    )
    provider = _joined(
        [
            (s.get("provider") or "?") + (f" (ran {'/'.join(s['providers_used'])})" if s.get("providers_used") else "")
            for s in sessions
        ]
    )
    mem = summary.get("peak_mem_bytes", last.get("peak_mem_bytes"))
    tps = tokens_per_step(run)
    return {
        "started": _date(run_start(run)),
        "duration": human_seconds(_duration(run)) + (f" ({len(sessions)} sessions)" if len(sessions) > 1 else ""),
        "commit": _joined(
            [
                (s.get("commit") or "")[:12] + (" (dirty)" if "(dirty)" in (s.get("commit") or "") else "")
                for s in sessions
            ]
        ),
        "graphtrain": _joined(
            [
                f"{s.get('graphtrain')}" + (f" @ {s['graphtrain_commit'][:12]}" if s.get("graphtrain_commit") else "")
                for s in sessions
            ]
        ),
        "torch": _joined([s.get("torch") for s in sessions]),
        "machine": machine,
        "device": device,
        "provider": provider,
        "steps": str(summary.get("steps", last.get("step", "n/a"))),
        "tokens/step": human(tps) if tps else "n/a",
        "throughput (steady state)": f"{human(tok_s, 'tok/s')} ({how})" if tok_s is not None else "n/a",
        "first step (capture + compile)": human_seconds(first_s),
        "ms/step": f"{summary['ms_per_step']:.1f}" if _finite(summary.get("ms_per_step")) else "n/a",
        "MFU (median, steady state)": f"{100 * statistics.median(mfu):.2f}%" if mfu else "n/a",
        "train loss": _num(summary.get("train_loss", last.get("loss"))),
        "val loss": _num(summary.get("val_loss", last.get("val_loss"))),
        "peak memory": human_bytes(mem),
    }


def _num(v: Any) -> str:
    return f"{v:.4f}" if _finite(v) else "n/a"


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
    return [
        (k, [f.get(k) for f in flat])
        for k in keys
        if k != "train.out_dir" and len({json.dumps(f.get(k), default=str) for f in flat}) > 1
    ]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}"
    return html.escape(json.dumps(v, default=str) if isinstance(v, (list, dict)) else str(v))


def _plotly() -> tuple[Any, str]:
    try:
        import plotly.graph_objects as go
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise ValueError(
            "graphtrain plot draws with Plotly, which is not installed: pip install plotly (or "
            "pip install 'graphtrain[ops]')"
        ) from None
    return go, get_plotlyjs()


def _chart(go: Any, spec: tuple, runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any] | None:
    """One chart's Plotly figure (one trace per run and record kind), None when no run logged its fields."""
    cid, title, ytitle, lines, yfmt, smooth, steady = spec
    fig = go.Figure()
    for i, (run, name) in enumerate(zip(runs, names)):
        for kind, field, dash, suffix in lines:
            p = points(run, kind, field, steady)
            if not p["step"]:
                continue
            fig.add_trace(
                go.Scatter(
                    x=p["step"],
                    y=p["value"],
                    name=name + suffix,
                    mode="lines+markers" if len(p["step"]) < 40 else "lines",
                    line={"color": COLORS[i % len(COLORS)], "dash": dash},
                    marker={"size": 5},
                    yhoverformat=yfmt,
                    xhoverformat=X_FORMATS["step"],
                    meta={"x": {k: p[k] for k in X_TITLES}, "y": p["value"], "smooth": smooth},
                )
            )
    if not fig.data:
        return None
    fig.update_layout(
        template="plotly_white",
        hovermode="x unified",
        margin={"l": 70, "r": 20, "t": 10, "b": 45},
        legend={"orientation": "h", "y": -0.22},
        yaxis={"title": {"text": ytitle}, "tickformat": yfmt},
        xaxis={"title": {"text": X_TITLES["step"]}},
    )
    return {"id": f"chart-{cid}", "title": title, "figure": json.loads(fig.to_json()), "x_formats": X_FORMATS}


def write_report(run_dirs: list[str | Path], out: str | Path, title: str | None = None) -> Path:
    """Write the HTML page comparing `run_dirs` to `out`; returns its path."""
    if not run_dirs:
        raise ValueError("graphtrain plot needs at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    go, plotly_js = _plotly()
    names = [r["name"] for r in runs]
    if len(set(names)) < len(names):  # two runs named alike (a/run, b/run): their paths tell them apart
        names = [r["path"] for r in runs]
    figures, missing = [], []
    for spec in CHARTS:
        chart = _chart(go, spec, runs, names)
        if chart is None:
            missing.append(spec[1])
            continue
        if spec[6]:
            firsts = [
                f"{n}: the window to step {t[0]['step']}, {human(t[0].get('tokens_per_s'), 'tok/s')}"
                for n, t in ((n, _train(r)) for n, r in zip(names, runs))
                if len(t) > 1
            ]
            if firsts:
                chart["note"] = (
                    "Steady state: each run's first logged window, which holds graph capture and "
                    "compilation, is left out (" + "; ".join(firsts) + ")."
                )
        figures.append(chart)
    notes = []
    if "MFU (model FLOPs utilization)" in missing:
        notes.append(
            "MFU is not plotted: no run logged it (the trainer logs MFU once this machine's matmul peak "
            "was measured: python -m graphtrain.kernels.flops)."
        )
    if missing:
        notes.append("Not logged by any run, so not drawn: " + ", ".join(missing) + ".")
    facts = [run_facts(r) for r in runs]
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    fact_rows = "".join(
        f"<tr><th>{html.escape(k)}</th>{''.join(f'<td>{html.escape(f[k])}</td>' for f in facts)}</tr>" for k in facts[0]
    )
    diff_rows = "".join(
        f"<tr><th>{html.escape(k)}</th>{''.join(f'<td>{_fmt(v)}</td>' for v in vals)}</tr>"
        for k, vals in config_differences(runs)
    )
    tables = f"<h2>Runs</h2><table><tr><th></th>{head}</tr>{fact_rows}</table><h2>Config differences</h2>" + (
        f"<table><tr><th>key</th>{head}</tr>{diff_rows}</table>"
        if diff_rows
        else "<p>The runs share one config.</p>"
        if len(runs) > 1
        else "<p>One run: its full config is config.yaml in its folder.</p>"
    )
    x_ok = {
        "step": True,
        "tokens": all(tokens_per_step(r) for r in runs),
        "time": all(run_start(r) is not None for r in runs),
    }
    choices = [(k, X_TITLES[k] + ("" if x_ok[k] else " (not known for every run)"), x_ok[k]) for k in X_TITLES]
    page = render(title or f"graphtrain runs: {', '.join(names)}", figures, X_TITLES, choices, tables, notes, plotly_js)
    return _write(page, out)


def _png(fig: Any) -> str:
    """A matplotlib figure as base64 PNG (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def write_bar_page(
    title: str,
    groups: dict[str, list[tuple[str, float, float, float]]],
    out: str | Path,
    intro: str = "",
    table_html: str = "",
) -> Path:
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
    page = _page(
        title,
        f"""<p>{html.escape(intro)}</p>
{"".join(f'<h2>{html.escape(c)}</h2><img alt="{html.escape(c)}" src="data:image/png;base64,{b}">' for c, b in images)}
{table_html}
<script type="application/json" id="graphtrain-bars">{data}</script>""",
    )
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
