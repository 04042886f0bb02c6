"""graphtrain plot: one self-contained interactive page (Plotly inlined), one curve per run and metric, the run
metadata and steady-state throughput, the config differences, clear errors; and the page checked in a real headless
browser (Debian's chromium), skipped where there is none."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys

import pytest

from graphtrain.config.sections import Config

T0 = 1795852400.0


def _run(folder, lr, losses, info=True):
    """A run directory as the trainer writes it: config.yaml, metrics.jsonl records and run.json."""
    folder.mkdir(parents=True)
    cfg = Config().with_overrides(
        [f"optim.lr={lr}", f"train.out_dir={folder}", "train.batch_size=4", "data.seq_len=64"]
    )
    (folder / "config.yaml").write_text(cfg.to_yaml())
    recs = [
        {
            "kind": "train",
            "step": i + 1,
            "loss": x,
            "lr": lr,
            "tokens_per_s": 12.5 if i == 0 else 25012.0 + i,
            "ms_per_step": 4000.0 if i == 0 else 10.2,
            "grad_norm": 1.5 - 0.1 * i,
            "mfu": None if i == 0 else 0.41,
            "peak_mem_bytes": 2**20 * (10 + i),
            "time": T0 + 4 + 0.5 * i,
        }
        for i, x in enumerate(losses)
    ]
    recs.append({"kind": "eval", "step": len(losses), "val_loss": losses[-1] + 0.1, "time": T0 + 9})
    recs.append(
        {
            "kind": "summary",
            "step": len(losses),
            "train_loss": losses[-1],
            "val_loss": losses[-1] + 0.1,
            "tokens_per_s": 25012.3,
            "ms_per_step": 10.2,
            "first_step_ms": 4000.0,
            "peak_mem_bytes": 2**24,
            "steps": len(losses),
            "tokens_per_step": 256,
            "time": T0 + 10,
        }
    )
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "tr')  # torn line
    if info:
        (folder / "run.json").write_text(
            json.dumps(
                {
                    "format": 1,
                    "sessions": [
                        {
                            "started_unix": T0,
                            "finished_unix": T0 + 185.0,
                            "host": "box7",
                            "cpu": "AMD EPYC 9654",
                            "gpu": None,
                            "device": "cpu",
                            "threads": 2,
                            "world_size": 1,
                            "provider": "auto",
                            "providers_used": ["aten"],
                            "commit": "0123456789abcdef0123 (dirty)",
                            "graphtrain": "0.1.0",
                            "torch": "2.13.0",
                            "tokens_per_step": 256,
                        }
                    ],
                }
            )
        )
    return folder


def _plot(tmp_path, *runs):
    out = tmp_path / "report.html"
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrain", "plot", *map(str, runs), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return out


def _figures(page):
    return json.loads(re.search(r'id="graphtrain-figures">(.*?)</script>', page, re.S).group(1))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plot")
    a = _run(tmp / "lr-small", 1e-4, [5.0, 4.8, 4.7])
    b = _run(tmp / "lr-big", 1e-3, [5.0, 4.2, 3.9], info=False)  # a run from before run.json: the records' times
    return tmp, _plot(tmp, a, b)


def test_two_runs_one_page_one_curve_each(two_runs):
    _, out = two_runs
    page = out.read_text()
    figures = {f["id"]: f["figure"]["data"] for f in _figures(page)}
    assert list(figures) == [
        "chart-loss",
        "chart-throughput",
        "chart-mfu",
        "chart-grad_norm",
        "chart-memory",
        "chart-lr",
    ]
    assert sum(map(len, figures.values())) == 14  # 2 runs x (train loss, val loss, tok/s, MFU, grad norm, memory, lr)
    loss = {t["name"]: t for t in figures["chart-loss"]}
    assert sorted(loss) == ["lr-big", "lr-big (val)", "lr-small", "lr-small (val)"]
    assert loss["lr-big"]["meta"]["y"] == [5.0, 4.2, 3.9] and loss["lr-big (val)"]["line"]["dash"] == "dash"
    x = loss["lr-small"]["meta"]["x"]
    assert x["step"] == [1, 2, 3] and x["tokens"] == [256, 512, 768] and x["time"] == [4.0, 4.5, 5.0]
    assert loss["lr-big"]["meta"]["x"]["time"] == [4.0, 4.5, 5.0]  # no run.json: its first record less its window
    speed = {t["name"]: t["meta"]["y"] for t in figures["chart-throughput"]}
    assert speed == {"lr-small": [25013.0, 25014.0], "lr-big": [25013.0, 25014.0]}  # the compile window left out
    assert "optim.lr" in page and "train.out_dir" not in page  # only the keys that differ
    assert "<script src" not in page and page.count("plotly.js v") >= 1  # Plotly inlined: the page works offline


def test_the_runs_table_reads_like_a_report(two_runs):
    _, out = two_runs
    page = out.read_text()
    table = page[page.index("<h2>Runs</h2>") : page.index("<h2>Config differences</h2>")]
    cells = {
        m.group(1): re.findall(r"<td>(.*?)</td>", m.group(2))
        for m in re.finditer(r"<tr><th>(.*?)</th>(.*?)</tr>", table)
    }
    assert cells["throughput (steady state)"][0].startswith("25.0k tok/s")
    assert cells["first step (capture + compile)"] == ["4.0 s", "4.0 s"]
    assert cells["duration"] == ["3 min 05 s", "10.0 s"]
    assert cells["started"][0] == "2026-11-28 07:53 UTC"
    assert cells["commit"] == ["0123456789ab (dirty)", "n/a"]
    assert cells["machine"][0] == "box7 / AMD EPYC 9654" and cells["provider"][0] == "auto (ran aten)"
    assert cells["peak memory"] == ["16.0 MiB", "16.0 MiB"] and cells["tokens/step"] == ["256", "256"]
    assert cells["MFU (median, steady state)"] == ["41.00%", "41.00%"]
    assert not re.search(r"\de[+-]\d", table), table  # no 2.501e+04


def test_plot_of_a_folder_that_is_not_a_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrain", "plot", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2 and "is not a graphtrain run directory" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------------ in a real browser ----
CHROMIUM = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "chrome") if shutil.which(n)), None
)
needs_browser = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no headless browser: the page is checked in Debian's "
    "chromium (apt-get install -y chromium); none is on PATH",
)

# Before the page's own scripts: record console errors and uncaught exceptions. After them, once loaded: use the
# controls (x as tokens, smoothing, log y) and write what the page drew into <body data-probe="...">.
PROBE_HEAD = """<script>window.__errors = [];
var __ce = console.error; console.error = function () { __errors.push([].map.call(arguments, String).join(' '));
  __ce.apply(console, arguments); };
window.addEventListener('error', function (e) { __errors.push('uncaught: ' + e.message); });</script>"""
PROBE_TAIL = """<script>window.addEventListener('load', function () { setTimeout(function () {
  var drawn = document.body.getAttribute('data-traces-drawn');
  var sel = document.getElementById('gt-x'); sel.value = 'tokens'; sel.dispatchEvent(new Event('change'));
  var s = document.getElementById('gt-smooth'); s.value = '0.6'; s.dispatchEvent(new Event('input'));
  var log = document.getElementById('gt-logy'); log.checked = true; log.dispatchEvent(new Event('change'));
  setTimeout(function () {
    var loss = document.getElementById('chart-loss'), ok = loss && loss.data && loss.layout;
    document.body.setAttribute('data-probe', JSON.stringify({errors: window.__errors, drawn: drawn,
      svg_traces: document.querySelectorAll('.plot-container .scatterlayer .trace').length,
      x0: ok ? loss.data[0].x : null, y0: ok ? loss.data[0].y : null, ytype: ok ? loss.layout.yaxis.type : null,
      xtitle: ok ? loss.layout.xaxis.title.text : null,
      page_errors: document.getElementById('graphtrain-errors').textContent}));
  }, 500);
}, 500); });</script>"""


def _in_browser(page_text, tmp_path):
    probed = page_text.replace("<head>", "<head>" + PROBE_HEAD, 1).replace("</body>", PROBE_TAIL + "</body>", 1)
    path = tmp_path / "probed.html"
    path.write_text(probed)
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path}/p",
            "--virtual-time-budget=15000",
            "--dump-dom",
            path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    m = re.search(r'data-probe="([^"]*)"', proc.stdout)
    assert m, f"the probe never ran: rc {proc.returncode}, stderr {proc.stderr[-2000:]}"
    return json.loads(html.unescape(m.group(1)))


@needs_browser
def test_the_page_draws_every_trace_in_a_browser_without_errors(two_runs, tmp_path):
    _, out = two_runs
    page = out.read_text()
    want = sum(len(f["figure"]["data"]) for f in _figures(page))
    probe = _in_browser(page, tmp_path)
    assert probe["errors"] == [] and probe["page_errors"] == "", probe
    assert want == 14 and probe["drawn"] == "14" and probe["svg_traces"] == 14, probe
    # the controls work: x as tokens, log y, smoothed values (TensorBoard's debiased EMA at 0.6)
    assert probe["xtitle"] == "tokens seen" and probe["x0"] == [256, 512, 768] and probe["ytype"] == "log"
    ys = [5.0, 4.8, 4.7]  # lr-small's train loss
    ema, smoothed = 0.0, []
    for i, y in enumerate(ys, 1):
        ema = 0.6 * ema + 0.4 * y
        smoothed.append(ema / (1 - 0.6**i))
    assert probe["y0"] == pytest.approx(smoothed) and probe["y0"] != ys


@needs_browser
def test_the_browser_check_sees_a_broken_page(two_runs, tmp_path):
    """The check above can fail: a page whose figures are not valid JSON reports the error it raised."""
    _, out = two_runs
    broken = out.read_text().replace('id="graphtrain-figures">[', 'id="graphtrain-figures">[oops', 1)
    probe = _in_browser(broken, tmp_path)
    assert probe["drawn"] is None and probe["svg_traces"] == 0 and "JSON" in probe["page_errors"], probe
