"""graphtrain plot: one self-contained HTML page, one curve per run, the config differences, clear errors."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from graphtrain.config import Config

def _run(folder, lr, losses):
    """A run directory as the trainer writes it: config.yaml and metrics.jsonl records."""
    folder.mkdir(parents=True)
    cfg = Config().with_overrides([f"optim.lr={lr}", f"train.out_dir={folder}"])
    (folder / "config.yaml").write_text(cfg.to_yaml())
    recs = [{"kind": "train", "step": i + 1, "loss": x, "lr": lr, "tokens_per_s": 1000.0 + i,
             "peak_mem_bytes": 2**20 * (10 + i)} for i, x in enumerate(losses)]
    recs.append({"kind": "eval", "step": len(losses), "val_loss": losses[-1] + 0.1})
    recs.append({"kind": "summary", "step": len(losses), "train_loss": losses[-1], "val_loss": losses[-1] + 0.1,
                 "tokens_per_s": 1001.0, "ms_per_step": 12.0, "peak_mem_bytes": 2**24, "steps": len(losses)})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "tr')  # torn line
    return folder

def test_two_runs_one_page_one_curve_each(tmp_path):
    a = _run(tmp_path / "lr-small", 1e-4, [5.0, 4.8, 4.7])
    b = _run(tmp_path / "lr-big", 1e-3, [5.0, 4.2, 3.9])
    out = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "graphtrain", "plot", str(a), str(b), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    page = out.read_text()
    assert page.count("data:image/png;base64,") == 4  # loss, throughput, memory, learning rate
    series = json.loads(re.search(r'id="graphtrain-series">(.*?)</script>', page, re.S).group(1))
    assert sorted(k for k in series["loss"] if k.endswith("train/loss")) == ["lr-big:train/loss",
                                                                              "lr-small:train/loss"]
    assert series["loss"]["lr-big:train/loss"]["value"] == [5.0, 4.2, 3.9]
    assert "optim.lr" in page and "train.out_dir" not in page  # only the keys that differ
    assert "3.9" in page  # final figures

def test_plot_of_a_folder_that_is_not_a_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "graphtrain", "plot", str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "is not a graphtrain run directory" in proc.stderr, proc.stderr
