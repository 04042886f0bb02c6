"""The interactive page of `graphtrain plot` (runs/plot.py builds the figures): Plotly, inlined, so the file opens
offline, plus a few lines of script for the controls Plotly has no widget for across several charts.

Controls, applied to every chart at once: the x axis (optimizer steps, tokens seen or wall time since the run
started), exponential smoothing (TensorBoard's: debiased, 0 = raw values) and a log y axis. Zoom, pan and hover
are Plotly's own (double-click a chart to zoom back out). Each trace carries its x variants and its raw y values in
``meta``, so the controls never lose the data.

When the charts are drawn the page sets ``data-traces-drawn`` on ``<body>`` to the number of traces Plotly rendered
(a headless browser reads it back in tests/test_ops_plot.py), and writes any script error into
``#graphtrain-errors``.
"""

from __future__ import annotations

import html
import json
from typing import Any

SCRIPT = r"""
(function () {
  var errors = document.getElementById('graphtrain-errors');
  function fail(msg) { errors.textContent += msg + '\n'; errors.style.display = 'block'; }
  window.addEventListener('error', function (e) { fail('error: ' + e.message); });
  var figures = [], axisTitles = {};
  var xSelect = document.getElementById('gt-x'), smooth = document.getElementById('gt-smooth');
  var smoothOut = document.getElementById('gt-smooth-value'), logY = document.getElementById('gt-logy');

  function ema(ys, w) {  // TensorBoard's smoothing: an exponential moving average, debiased at the start
    if (!(w > 0)) return ys.slice();
    var out = [], last = 0, n = 0;
    for (var i = 0; i < ys.length; i++) {
      if (ys[i] === null || !isFinite(ys[i])) { out.push(ys[i]); continue; }
      last = last * w + (1 - w) * ys[i]; n++;
      out.push(last / (1 - Math.pow(w, n)));
    }
    return out;
  }

  function divs() { return figures.map(function (f) { return document.getElementById(f.id); }); }

  function apply() {
    var mode = xSelect.value, w = parseFloat(smooth.value);
    smoothOut.textContent = w.toFixed(2);
    divs().forEach(function (div, k) {
      var data = div.data, xs = [], ys = [];
      for (var i = 0; i < data.length; i++) {
        xs.push(data[i].meta.x[mode]);
        ys.push(data[i].meta.smooth ? ema(data[i].meta.y, w) : data[i].meta.y);
      }
      var fmt = figures[k].x_formats[mode];
      Plotly.update(div, {x: xs, y: ys, xhoverformat: fmt},
                    {'xaxis.title.text': axisTitles[mode], 'xaxis.tickformat': fmt, 'xaxis.autorange': true,
                     'yaxis.type': logY.checked ? 'log' : 'linear', 'yaxis.autorange': true});
    });
  }

  try {
    figures = JSON.parse(document.getElementById('graphtrain-figures').textContent);
    axisTitles = JSON.parse(document.getElementById('graphtrain-x-titles').textContent);
    figures.forEach(function (f) {
      Plotly.newPlot(f.id, f.figure.data, f.figure.layout, {responsive: true, displaylogo: false});
    });
    xSelect.addEventListener('change', apply);
    smooth.addEventListener('input', apply);
    logY.addEventListener('change', apply);
    apply();
    document.body.setAttribute('data-traces-drawn',
                               String(document.querySelectorAll('.plot-container .scatterlayer .trace').length));
  } catch (e) {
    fail('error: ' + e.message);
  }
})();
"""

STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em 2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.8em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:13px}
th{background:#f5f5f5}.controls{position:sticky;top:0;background:#fff;padding:.6em 0;border-bottom:1px solid #ddd;
z-index:10;font-size:14px}.controls label{margin-right:1.6em}.chart{height:360px}.note{color:#555;font-size:13px}
#graphtrain-errors{display:none;color:#a00;white-space:pre-wrap}"""


def render(
    title: str,
    figures: list[dict[str, Any]],
    x_titles: dict[str, str],
    x_choices: list[tuple[str, str, bool]],
    tables_html: str,
    notes: list[str],
    plotly_js: str,
) -> str:
    """The whole page. `figures`: {id, title, figure (Plotly's JSON), x_formats}; `x_choices`: (value, label,
    available) for the x selector; `plotly_js`: plotly.min.js, inlined."""

    def dump(v: Any) -> str:  # JSON inside <script>: no closing tag can appear
        return json.dumps(v, allow_nan=False).replace("</", "<\\/")

    options = "".join(
        f'<option value="{v}"{"" if ok else " disabled"}>{html.escape(label)}</option>' for v, label, ok in x_choices
    )
    charts = "".join(
        f"<h2>{html.escape(f['title'])}</h2>"
        + (f'<p class="note">{html.escape(f["note"])}</p>' if f.get("note") else "")
        + f'<div class="chart" id="{f["id"]}"></div>'
        for f in figures
    )
    note_html = "".join(f'<p class="note">{html.escape(n)}</p>' for n in notes)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{STYLE}</style>
<script type="text/javascript">{plotly_js}</script></head>
<body><h1>{html.escape(title)}</h1>
<pre id="graphtrain-errors"></pre>
{tables_html}
{note_html}
<div class="controls">
<label>x axis <select id="gt-x">{options}</select></label>
<label>smoothing <input id="gt-smooth" type="range" min="0" max="0.99" step="0.01" value="0">
<span id="gt-smooth-value">0.00</span></label>
<label><input id="gt-logy" type="checkbox"> log y</label>
<span class="note">drag to zoom, double-click to reset, hover for values</span>
</div>
{charts}
<script type="application/json" id="graphtrain-figures">{dump(figures)}</script>
<script type="application/json" id="graphtrain-x-titles">{dump(x_titles)}</script>
<script type="text/javascript">{SCRIPT}</script>
</body></html>
"""
