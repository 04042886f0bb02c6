"""The Trainer under torchrun: `graphtrain train --nproc N parallel...` matches one eager process.

Every distributed run is compared step by step with the single-process eager run of the same config
(same data, same seed, dropout off). Tolerances: the first step's loss is computed from identical weights,
so only the reduction order differs (rel 1e-5); later steps follow AdamW updates of gradients that were
summed in another order (rel 1e-4, fp32).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from graphtrain.config.torch_compat import regions_take_dtensors
from graphtrain.trainer import list_checkpoints

pytestmark = pytest.mark.dist

TINY = [
    "data.max_bytes=300000",
    "data.vocab_size=512",
    "data.seq_len=32",
    "model.name=gpt2-tiny",
    "model.dropout=0.0",  # dropout masks differ between one process and two ranks
    "train.steps=3",
    "train.batch_size=4",
    "train.eval_every=0",
    "train.eval_batches=2",
    "train.log_every=1",
    "train.sample_tokens=0",
    "train.progress=false",
    "train.accelerate=false",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One tokenizer/token cache for the module (built by the first run, read by the others)."""
    return tmp_path_factory.mktemp("cache")


def _train(tmp_path, cache, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env = {**os.environ, "GRAPHTRAIN_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "graphtrain", "train", *TINY, "--out", str(out), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc, records


@pytest.fixture(scope="module")
def single(tmp_path_factory, cache):
    """The single-process eager reference runs, one per distinct set of overrides, shared by the module's tests
    (several compare against the same one; each is a whole CLI run)."""
    runs: dict[tuple[str, ...], tuple[subprocess.CompletedProcess, list[dict]]] = {}

    def run(*extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
        if extra not in runs:
            runs[extra] = _train(tmp_path_factory.mktemp("single"), cache, "single", *extra)
        return runs[extra]

    return run


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _val(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in records if r["kind"] == "eval"}


def _assert_same_run(single: list[dict], dist: list[dict]) -> None:
    loss, dloss = _losses(single), _losses(dist)
    assert sorted(dloss) == sorted(loss)  # rank 0 alone writes metrics: one record per step
    first = min(loss)
    assert dloss[first] == pytest.approx(loss[first], rel=1e-5, abs=1e-6)
    for step in sorted(loss)[1:]:
        assert dloss[step] == pytest.approx(loss[step], rel=1e-4), f"step {step}"
    val, dval = _val(single), _val(dist)
    assert sorted(dval) == sorted(val) and val
    for step in val:
        assert dval[step] == pytest.approx(val[step], rel=1e-4), f"val loss at step {step}"


@pytest.mark.slow  # 18 s; the same launch with the engine (next test) stays in the default suite
def test_nproc_2_data_parallel_matches_single_process(tmp_path, cache, single):
    _, ref = single("train.threads=1")
    proc, dist = _train(tmp_path, cache, "dp2", "parallel.dp=2", "--nproc", "2")
    _assert_same_run(ref, dist)  # eval reduced over the dp ranks too
    assert proc.stdout.count("done: 3 steps") == 1  # only rank 0 prints
    ckpts = list_checkpoints(tmp_path / "dp2")
    assert [s for s, _ in ckpts] == [3] and ckpts[0][1].is_dir()  # sharded, atomically renamed folder

    # resume the sharded checkpoint under the same layout: one more step, records continue
    proc, dist = _train(tmp_path, cache, "dp2", "parallel.dp=2", "train.steps=4", "--resume", "--nproc", "2")
    assert "resumed from" in proc.stdout and "done: 4 steps" in proc.stdout
    assert [r["step"] for r in dist if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [s for s, _ in list_checkpoints(tmp_path / "dp2")] == [3, 4]


def test_nproc_2_data_parallel_with_the_engine_matches_single_eager_process(tmp_path, cache, single):
    """dp=2 with train.accelerate on: the module inside DDP runs through the graph engine (graphs captured on
    every rank, no eager fallback), with gradient accumulation (no_sync on the first micro-step), and the
    losses equal the single-process eager run's. The aten provider keeps the compile short; the model's
    gradients fit one DDP bucket, so DDPOptimizer has nothing to split (the split is tested in
    test_distributed_dp.py)."""
    accum = ("train.grad_accum=2",)
    _, ref = single("train.threads=1", *accum)
    proc, dist = _train(
        tmp_path,
        cache,
        "dp2",
        "parallel.dp=2",
        "train.accelerate=true",
        "engine.provider=aten",
        "engine.fallback=error",
        *accum,
        "--nproc",
        "2",
    )
    assert "params; graphtrain engine (provider aten" in proc.stdout, proc.stdout[-2000:]  # the start banner
    # the embeddings, the block (compiled once for both layers), the head and loss
    assert (
        "graphtrain engine, distributed: 3 graph(s) captured per rank (repeated blocks compiled once: "
        "blocks (2 x Block)" in proc.stdout
    ), proc.stdout[-2000:]
    assert "eager fallbacks on 0 of 2 ranks" in proc.stdout
    _assert_same_run(ref, dist)


@pytest.mark.parametrize(
    "layout",
    [
        # 17 s on a 2-core Zen 2; tp through the engine stays in the default suite (test_distributed_tp_pp: tp x pp
        # and dp x tp with the engine), and the --nproc launch with the engine by the pp layout and the dp test
        pytest.param(("parallel.tp=2",), marks=pytest.mark.slow),
        ("parallel.pp=2", "parallel.microbatches=2"),
    ],
)
def test_nproc_2_tensor_or_pipeline_parallel_with_the_engine_matches_single_eager_process(
    tmp_path, cache, single, layout
):
    """tp=2 or pp=2 with train.accelerate on: each rank's module (tensor-parallel model, pipeline stage) runs
    through the graph engine on every rank with no eager fallback, and the losses equal one eager process's."""
    _, ref = single("train.threads=1")
    proc, dist = _train(
        tmp_path,
        cache,
        "dist",
        *layout,
        "train.accelerate=true",
        "engine.provider=aten",
        "engine.fallback=error",
        "--nproc",
        "2",
    )
    # tp: embeddings, the block (once for both layers), head and loss; pp: each stage holds one block. torch 2.11:
    # tp's blocks compile inside one graph, and pp's stage also compiles its gradient-free first call (2 graphs)
    counts = "[13]" if regions_take_dtensors() else "[12]"
    assert re.search(rf"graphtrain engine, distributed: {counts} graph\(s\) captured per rank", proc.stdout), (
        proc.stdout[-2000:]
    )
    assert "eager fallbacks on 0 of 2 ranks" in proc.stdout
    _assert_same_run(ref, dist)


@pytest.mark.slow  # 19 s; pp=2 through the engine (the layouts test above) stays in the default suite
def test_nproc_2_pipeline_parallel_matches_single_process(tmp_path, cache):
    """pp=2 with 4 micro-batches (1F1B) and 2 accumulation steps through the Trainer: losses logged on rank 0, evaluation through the
    pipeline between training steps (the schedule switches eval <-> train), a sharded DCP checkpoint resumed
    for a fifth step, and rank 0's sample (read from that checkpoint) equal to the single process's."""
    pp = ("parallel.pp=2", "parallel.microbatches=4", "train.eval_every=2", "train.grad_accum=2")
    single_proc, single = _train(
        tmp_path,
        cache,
        "single",
        "train.threads=1",
        "train.steps=5",
        "train.eval_every=2",
        "train.grad_accum=2",
        "train.sample_tokens=8",
    )
    proc, _ = _train(tmp_path, cache, "pp2", *pp, "train.steps=4", "--nproc", "2")
    assert proc.stdout.count("done: 4 steps") == 1  # only rank 0 prints
    ckpts = list_checkpoints(tmp_path / "pp2")
    assert [s for s, _ in ckpts] == [4] and ckpts[0][1].is_dir()
    proc, dist = _train(
        tmp_path, cache, "pp2", *pp, "train.steps=5", "train.sample_tokens=8", "--resume", "--nproc", "2"
    )
    assert "resumed from" in proc.stdout
    _assert_same_run(single, dist)  # steps 1-4 from the first run, 5 after the resume; evals at 2, 4, 5
    assert sorted(_val(dist)) == [2, 4, 5]
    sample = single_proc.stdout[single_proc.stdout.index("completion of") :]
    assert sample in proc.stdout  # same weights on rank 0 after reading the sharded checkpoint


@pytest.mark.slow  # 4 ranks on 2 shared cores: ~15 s each plus the reference
@pytest.mark.parametrize(
    "layout", [("parallel.dp=2", "parallel.tp=2"), ("parallel.dp=2", "parallel.pp=2", "parallel.microbatches=2")]
)
def test_nproc_4_dp_composed_with_tp_or_pp_matches_single_process(tmp_path, cache, single, layout):
    _, ref = single("train.threads=1")
    proc, dist = _train(tmp_path, cache, "dist", *layout, "--nproc", "4")
    _assert_same_run(ref, dist)
    assert proc.stdout.count("done: 3 steps") == 1
