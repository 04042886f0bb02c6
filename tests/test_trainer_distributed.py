"""The Trainer under torchrun: `graphtrain train --nproc 2 parallel.dp=2` matches one process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from graphtrain.trainer import list_checkpoints

pytestmark = pytest.mark.dist

TINY = ["data.max_bytes=300000", "data.vocab_size=512", "data.seq_len=32", "model.name=gpt2-tiny",
        "model.dropout=0.0",  # dropout masks differ between one process and two ranks
        "train.steps=3", "train.batch_size=4", "train.eval_every=0", "train.eval_batches=2", "train.log_every=1",
        "train.sample_tokens=0", "train.progress=false", "train.accelerate=false"]


def _train(tmp_path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {**os.environ, "GRAPHTRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / name
    proc = subprocess.run([sys.executable, "-m", "graphtrain", "train", *TINY, "--out", str(out), *extra],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc, records


def test_nproc_2_data_parallel_matches_single_process(tmp_path):
    _, single = _train(tmp_path, "single", "train.threads=1")  # also builds the shared data cache
    proc, dist = _train(tmp_path, "dp2", "parallel.dp=2", "--nproc", "2")
    loss = {r["step"]: r["loss"] for r in single if r["kind"] == "train"}
    dloss = {r["step"]: r["loss"] for r in dist if r["kind"] == "train"}
    assert sorted(dloss) == [1, 2, 3]  # rank 0 alone writes metrics: one record per step
    assert dloss[1] == pytest.approx(loss[1], rel=1e-5, abs=1e-6)
    assert dloss[3] == pytest.approx(loss[3], rel=1e-3)  # after two updates: still the same run
    val = [r["val_loss"] for r in single + dist if r["kind"] == "eval"]
    assert len(val) == 2 and val[1] == pytest.approx(val[0], rel=1e-3)  # eval reduced over the dp ranks
    assert proc.stdout.count("done: 3 steps") == 1  # only rank 0 prints
    ckpts = list_checkpoints(tmp_path / "dp2")
    assert [s for s, _ in ckpts] == [3] and ckpts[0][1].is_dir()  # sharded, atomically renamed folder

    # resume the sharded checkpoint under the same layout: one more step, records continue
    proc, dist = _train(tmp_path, "dp2", "parallel.dp=2", "train.steps=4", "--resume", "--nproc", "2")
    assert "resumed from" in proc.stdout and "done: 4 steps" in proc.stdout
    assert [r["step"] for r in dist if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [s for s, _ in list_checkpoints(tmp_path / "dp2")] == [3, 4]
