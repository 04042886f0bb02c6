"""Trainer: LR schedule values, a short fit with its outputs, bitwise resume, refusing to clobber."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from graphtrain.config.sections import Config, OptimConfig
from graphtrain.trainer import Trainer, TrainingFailed, list_checkpoints, lr_at
from graphtrain.trainer.strategies import WholeStepGraph

TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=4",
    "train.steps=6",
    "train.eval_every=3",
    "train.eval_batches=2",
    "train.log_every=2",
    "train.ckpt_every=3",
    "train.accelerate=false",
    "train.progress=false",
    "train.threads=1",
    "optim.warmup_steps=2",
]


pytestmark = pytest.mark.usefixtures("tiny_env")  # conftest.py: shared data cache, settings restored


def tiny(out_dir, *overrides: str) -> Config:
    return Config().with_overrides([*TINY, f"train.out_dir={out_dir}", *overrides])


# -------------------------------------------------------------------------------- schedule ----


def test_schedule_warmup_then_cosine_to_min():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, schedule="cosine")
    assert [lr_at(s, cfg, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg, 14) == 1.0  # decay starts at the peak
    assert lr_at(13, cfg, 14) == pytest.approx(0.1)  # the last step reaches lr * min_lr_ratio
    assert lr_at(9, cfg, 15) == pytest.approx(0.55)  # decay midpoint: (peak + min) / 2
    assert lr_at(100, cfg, 14) == pytest.approx(0.1)  # clamped after the end
    lrs = [lr_at(s, cfg, 14) for s in range(4, 14)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


@pytest.mark.parametrize("schedule,mid", [("linear", 0.55), ("poly", 0.1 + 0.9 * 0.25), ("constant", 1.0)])
def test_schedule_shapes(schedule, mid):
    cfg = OptimConfig(lr=1.0, warmup_steps=0, min_lr_ratio=0.1, schedule=schedule, poly_power=2.0)
    assert lr_at(0, cfg, 11) == 1.0
    assert lr_at(5, cfg, 11) == pytest.approx(mid)
    assert lr_at(10, cfg, 11) == pytest.approx(1.0 if schedule == "constant" else 0.1)


def test_schedule_edge_cases():
    cfg = OptimConfig(lr=2.0, warmup_steps=0)
    assert lr_at(0, cfg, 1) == pytest.approx(0.2)  # a 1-step run decays immediately
    assert lr_at(9, OptimConfig(lr=2.0, warmup_steps=50), 10) == pytest.approx(0.4)  # still warming up
    with pytest.raises(ValueError):
        lr_at(-1, cfg, 10)
    with pytest.raises(ValueError):
        lr_at(0, cfg, 0)


# ------------------------------------------------------------------------------------- fit ----


def test_fit_writes_metrics_config_checkpoints_and_samples(tmp_path):
    config = tiny(tmp_path / "run", "train.steps=10", "train.ckpt_every=2")
    trainer = Trainer(config)
    summary = trainer.fit()
    assert summary["steps"] == 10
    for key in ("train_loss", "val_loss", "tokens_per_s", "ms_per_step", "peak_mem_bytes"):
        assert math.isfinite(summary[key]) and summary[key] > 0, key
    assert summary["val_loss"] == pytest.approx(trainer.evaluate())
    assert summary["val_loss"] < math.log(trainer.data.vocab_size)  # it learned something
    out = tmp_path / "run"
    assert [s for s, _ in list_checkpoints(out)] == [6, 8, 10]  # the last 3 kept
    assert Config.from_yaml(out / "config.yaml") == config
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("train") == 5 and kinds.count("eval") == 4 and kinds[-1] == "summary"
    assert {"loss", "lr", "tokens_per_s", "ms_per_step", "peak_mem_bytes"} <= set(records[0])

    text = trainer.sample("def ", 8)
    assert text.startswith("def ") and text == trainer.sample("def ", 8)
    assert trainer.sample("def ", 8, temperature=0.0) == trainer.sample("def ", 8, temperature=0.0, seed=5)

    with pytest.raises(ValueError, match="--resume"):  # never clobbers a run
        Trainer(config).fit()


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the high-water mark restarts on Linux only")
def test_a_cold_data_preparations_peak_is_shown_apart_from_the_trainings(tmp_path):
    """A cold data cache trains the tokenizer in the training process: its peak is reported on its own and the
    steps' "peak mem" restarts after it. A transient 256 MB block before the Trainer stands in for that peak."""
    import numpy as np

    from graphtrain.memory.process import rss_bytes

    block = np.ones(256 << 17)  # 256 MiB of float64, every page written
    del block
    before = rss_bytes("VmHWM")
    config = tiny(tmp_path / "run", f"data.cache_dir={tmp_path / 'data'}", "train.steps=2")
    trainer = Trainer(config)
    assert trainer.data_peak_bytes is not None and trainer.data_peak_bytes >= before
    summary = trainer.fit()
    assert summary["data_peak_mem_bytes"] == trainer.data_peak_bytes
    assert summary["peak_mem_bytes"] < before - (128 << 20), (summary["peak_mem_bytes"], before)
    # the same data again, from the cache: nothing prepared, the mark left alone
    assert Trainer(tiny(tmp_path / "run2", f"data.cache_dir={tmp_path / 'data'}")).data_peak_bytes is None


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path):
    overrides = ("train.deterministic=true", "train.grad_accum=2", "model.dropout=0.1")
    full = Trainer(tiny(tmp_path / "full", *overrides))
    full.fit()

    crashed = Trainer(tiny(tmp_path / "crash", *overrides))
    get_batch = crashed.data.train.get_batch

    def dies_at_step_4(index, batch_size):
        if index == 4 * 2:  # the first micro-batch of step 4 (0-based): after ckpt-3 was written
            raise KeyboardInterrupt("killed")
        return get_batch(index, batch_size)

    crashed.data.train.get_batch = dies_at_step_4
    with pytest.raises(KeyboardInterrupt):
        crashed.fit()
    assert [s for s, _ in list_checkpoints(tmp_path / "crash")] == [3]

    resumed = Trainer(tiny(tmp_path / "crash", *overrides), resume=True)
    summary = resumed.fit()
    assert summary["steps"] == 6
    for (name, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), f"{name} differs after resume"
    sa, sb = full.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), f"optimizer state {i}.{k} differs"
    steps = [
        r["step"]
        for r in map(json.loads, (tmp_path / "crash" / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "train"
    ]
    assert steps == [2, 4, 6]  # no duplicated records from the interrupted run


def test_deterministic_runs_settle_every_provider_before_the_first_step():
    """train.deterministic turns provider auto's background compile off (a resumed run must run every step on the
    providers the uninterrupted run used); other runs keep the engine settings as configured."""
    from graphtrain.trainer.strategies import engine_config

    det = Config.from_dict({"train": {"deterministic": True}})
    assert engine_config(det).compile_in_background is False
    assert engine_config(det).provider == det.engine.provider
    plain = Config()
    assert engine_config(plain) is plain.engine and plain.engine.compile_in_background


def test_resume_errors(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint"):
        Trainer(tiny(tmp_path / "empty"), resume=True).fit()
    Trainer(tiny(tmp_path / "run", "train.steps=3")).fit()
    with pytest.raises(ValueError, match=r"model.max_seq_len: checkpoint None, current 128.*model.max_seq_len=null"):
        Trainer(tiny(tmp_path / "run", "model.max_seq_len=128"), resume=True).fit()
    with pytest.raises(ValueError, match="past train.steps=2"):
        Trainer(tiny(tmp_path / "run", "train.steps=2"), resume=True).fit()
    summary = Trainer(tiny(tmp_path / "run", "train.steps=3"), resume=True).fit()  # already done: just evaluates
    assert summary["steps"] == 3 and math.isfinite(summary["val_loss"])


def test_user_mistakes_are_clear(tmp_path):
    with pytest.raises(ValueError, match=r"data.seq_len=128 .*max_seq_len=64.*model.max_seq_len=128"):
        Trainer(tiny(tmp_path, "data.seq_len=128"))
    with pytest.raises(ValueError, match="batch_size=auto needs a memory budget: set engine.memory_budget"):
        Trainer(tiny(tmp_path, "train.batch_size=auto"))
    with pytest.raises(ValueError, match="parallel.zero_stage=1 with parallel.tp>1 is not supported yet"):
        Trainer(tiny(tmp_path, "parallel.tp=2", "parallel.zero_stage=1"))
    with pytest.raises(ValueError, match=r"world size 1.*--nproc 2"):  # dp=2 without torchrun
        Trainer(tiny(tmp_path, "parallel.dp=2"))
    with pytest.raises(TypeError, match="graphtrain.Config"):
        Trainer({"model": {"name": "gpt2-tiny"}})
    diverging = Trainer(tiny(tmp_path / "nan", "train.max_bad_steps=2"))
    with torch.no_grad():
        next(diverging.model.parameters()).fill_(float("nan"))
    with pytest.raises(
        TrainingFailed,
        match=r"training diverged at step 2: 2 bad steps in a row \(steps 1-2; "
        r"last: the loss is nan\).*Lower optim.lr",
    ):
        diverging.fit()
    assert list_checkpoints(tmp_path / "nan") == []
    bert = Trainer(tiny(tmp_path, "model.name=bert-tiny"))
    with pytest.raises(ValueError, match="GPT model"):
        bert.sample("def ", 4)


def test_shipped_configs_load():
    configs = Path(__file__).resolve().parent.parent / "configs"
    assert Config.from_yaml(configs / "default.yaml") == Config()  # the documented job is the default
    tiny_job = Config.from_yaml(configs / "gpt2-tiny-test.yaml")
    assert tiny_job.model.name == "gpt2-tiny" and tiny_job.data.seq_len <= 64


def test_auto_batch_size_fits_the_budget(tmp_path):
    budget = 8_000_000
    trainer = Trainer(
        tiny(tmp_path, "train.batch_size=auto", f"engine.memory_budget={budget}", "train.grad_accum=2", "train.steps=1")
    )
    chosen = trainer.config.train.batch_size
    assert isinstance(chosen, int) and chosen > 1 and trainer.config.train.grad_accum == 2  # accum kept
    from graphtrain.models import build_model
    from graphtrain.tools.autobatch import pick_batch_size

    plan = pick_batch_size(lambda: build_model(trainer.config.model, vocab_size=512), 32, budget)
    assert plan.micro_batch == chosen and plan.predicted_peak <= budget
    summary = trainer.fit()
    assert summary["tokens_per_step"] == chosen * 2 * 32
    assert f"batch_size: {chosen}" in (tmp_path / "config.yaml").read_text()  # resolved in the saved config
    # same weights as a run with that number set explicitly: picking does not move the seed
    explicit = Trainer(tiny(tmp_path / "explicit", f"train.batch_size={chosen}", "train.grad_accum=2"))
    for (n, a), b in zip(
        explicit.model.state_dict().items(),
        Trainer(tiny(tmp_path / "auto2", "train.batch_size=auto", f"engine.memory_budget={budget}"))
        .model.state_dict()
        .values(),
    ):
        assert torch.equal(a, b), n


@pytest.mark.parametrize(
    "precision,accelerate,bf16_fast,peak",
    [
        ("auto", "true", True, "bf16"),  # auto runs bf16 where the hardware has it: MFU against the bf16 peak
        ("auto", "true", False, "fp32"),  # and fp32 elsewhere
        ("bf16", "true", False, "bf16"),  # bf16 asked for runs bf16 (slowly) even without native support
        ("bf16", "false", True, "fp32"),  # without the engine nothing runs in bf16: the fp32 peak
    ],
)
def test_mfu_is_against_the_peak_of_the_precision_that_runs(
    tmp_path, monkeypatch, precision, accelerate, bf16_fast, peak
):
    from graphtrain.kernels import capability

    peaks = {"fp32": 1e11, "bf16": 4e11}
    monkeypatch.setattr(capability, "peek_probe", lambda name, **kw: dict(peaks))
    monkeypatch.setattr(capability, "bf16_is_fast", lambda device="cpu": (bf16_fast, "monkeypatched"))
    trainer = Trainer(
        tiny(tmp_path, f"engine.precision={precision}", f"train.accelerate={accelerate}", "engine.provider=aten")
    )
    assert trainer._peak == peaks[peak]
    # a GPU's cached peak carries its datasheet bf16 figure (kernels/flops.py): bf16 runs are held to it, as in the bench
    peaks["bf16_datasheet"] = 9e11
    again = Trainer(
        tiny(
            tmp_path / "gpu", f"engine.precision={precision}", f"train.accelerate={accelerate}", "engine.provider=aten"
        )
    )
    assert again._peak == (9e11 if peak == "bf16" else peaks["fp32"])


def test_init_from_loads_weights_only(tmp_path):
    Trainer(tiny(tmp_path / "a", "train.steps=3", "model.max_seq_len=64")).fit()
    src = torch.load(list_checkpoints(tmp_path / "a")[-1][1], weights_only=True)["model"]
    # a run folder (its latest checkpoint), a longer data.seq_len, step 0 and a fresh optimizer
    b = Trainer(
        tiny(
            tmp_path / "b",
            "train.steps=1",
            "model.max_seq_len=64",
            "data.seq_len=64",
            f"train.init_from={tmp_path / 'a'}",
        )
    )
    for k, v in b.model.state_dict().items():
        assert torch.equal(v, src[k]), k
    assert b.step == 0 and not b.optimizer.state
    assert b.fit()["steps"] == 1
    with pytest.raises(ValueError, match=r"model.max_seq_len: checkpoint 64, current None"):  # positions differ
        Trainer(tiny(tmp_path / "c", f"train.init_from={tmp_path / 'a'}"))
    with pytest.raises(ValueError, match="train.init_from=.*does not exist"):
        Trainer(tiny(tmp_path / "c", f"train.init_from={tmp_path / 'nope'}"))
    with pytest.raises(ValueError, match="init_from and --resume cannot be combined.*train.init_from=null"):
        Trainer(tiny(tmp_path / "b", f"train.init_from={tmp_path / 'a'}", "model.max_seq_len=64"), resume=True)
    with pytest.raises(ValueError, match="train.init_from must be"):
        tiny(tmp_path, "train.init_from=' '")


def test_bert_phase_configs_chain(tmp_path):
    """configs/bert-pretrain-phase1.yaml then phase2.yaml (init_from phase 1), shrunk to bert-tiny."""
    configs = Path(__file__).resolve().parent.parent / "configs"
    small = [
        "model.name=bert-tiny",
        "model.max_seq_len=64",
        "data.vocab_size=512",
        "data.max_bytes=300000",
        "train.steps=2",
        "train.batch_size=4",
        "train.eval_batches=1",
        "train.accelerate=false",
        "train.progress=false",
        "train.threads=1",
        "engine.precision=fp32",
    ]
    one = Config.from_yaml(configs / "bert-pretrain-phase1.yaml").with_overrides(
        [*small, "data.seq_len=32", f"train.out_dir={tmp_path / 'p1'}"]
    )
    assert math.isfinite(Trainer(one).fit()["val_loss"])
    two = Config.from_yaml(configs / "bert-pretrain-phase2.yaml")
    assert two.train.init_from == Config.from_yaml(configs / "bert-pretrain-phase1.yaml").train.out_dir
    two = two.with_overrides(
        [*small, "data.seq_len=64", f"train.out_dir={tmp_path / 'p2'}", f"train.init_from={tmp_path / 'p1'}"]
    )
    trainer = Trainer(two)
    assert trainer.init_source == list_checkpoints(tmp_path / "p1")[-1][1]
    assert trainer.fit()["steps"] == 2


@pytest.mark.slow
def test_accelerated_run_matches_eager(tmp_path):
    """Through the graph engine (compiles: minutes on a busy CPU), the same losses as eager PyTorch."""
    common = ("train.steps=3", "model.dropout=0.0", "train.eval_every=0", "train.log_every=1")
    eager = Trainer(tiny(tmp_path / "eager", *common)).fit()
    fast = Trainer(tiny(tmp_path / "fast", *common, "train.accelerate=true", "engine.fallback=error"))
    assert hasattr(fast.model, "_graphtrain")  # really went through graphtrain.accelerate
    summary = fast.fit()
    assert summary["train_loss"] == pytest.approx(eager["train_loss"], rel=1e-4)
    assert summary["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-4)


def _train_losses(out_dir: Path) -> list[float]:
    rows = map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in rows if r["kind"] == "train"]


def test_whole_step_graph_matches_eager_and_resumes_exactly(tmp_path):
    """train.whole_step: the step graph (aten provider: torch's fused AdamW kernel inside the graph) gives
    eager's losses; killed after a checkpoint and resumed, it continues bitwise like an uninterrupted run."""
    common = ("model.dropout=0.0", "train.log_every=1", "train.deterministic=true", "engine.provider=aten")
    eager = Trainer(tiny(tmp_path / "eager", *common))
    eager.fit()
    whole = Trainer(
        tiny(tmp_path / "whole", *common, "train.accelerate=true", "train.whole_step=true", "engine.fallback=error")
    )
    assert isinstance(whole.strategy, WholeStepGraph)
    whole.fit()
    assert _train_losses(tmp_path / "whole") == pytest.approx(_train_losses(tmp_path / "eager"), rel=1e-4)
    for (name, a), b in zip(eager.model.state_dict().items(), whole.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)

    crashed = Trainer(tiny(tmp_path / "crash", *common, "train.accelerate=true", "train.whole_step=true"))
    get_batch = crashed.data.train.get_batch

    def dies_at_step_4(index, batch_size):
        if index == 4:
            raise KeyboardInterrupt("killed")
        return get_batch(index, batch_size)

    crashed.data.train.get_batch = dies_at_step_4
    with pytest.raises(KeyboardInterrupt):
        crashed.fit()
    resumed = Trainer(tiny(tmp_path / "crash", *common, "train.accelerate=true", "train.whole_step=true"), resume=True)
    resumed.fit()
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after resume"
    assert _train_losses(tmp_path / "crash") == _train_losses(tmp_path / "whole")


def test_whole_step_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="train.grad_accum=1"):
        Trainer(tiny(tmp_path, "train.accelerate=true", "train.whole_step=true", "train.grad_accum=2"))
    with pytest.raises(ValueError, match="optim.name=adamw"):
        Trainer(tiny(tmp_path, "train.accelerate=true", "train.whole_step=true", "optim.name=lamb"))
    with pytest.raises(ValueError, match=r"one process \(parallel.dp=tp=pp=1\)"):  # before any process group
        Trainer(tiny(tmp_path, "train.accelerate=true", "train.whole_step=true", "parallel.dp=2"))


def test_rank_seeds_differ_per_replica_and_stage_and_agree_across_tp():
    """Every data-parallel replica and pipeline stage draws its own dropout stream (a shared one would repeat
    stage 0's hash masks in stage 1's layers); tensor-parallel ranks are seeded alike (the seed does not take the
    tp rank); rank (0, 0) keeps the single-process stream."""
    from graphtrain.trainer.runtime import rank_seed

    seeds = {(dp, pp): rank_seed(1337, dp, pp) for dp in range(8) for pp in range(8)}
    assert len(set(seeds.values())) == len(seeds) and seeds[0, 0] == 1337
    with pytest.raises(ValueError, match="stages"):
        rank_seed(1, 0, 5000)


def test_compile_wait_policy():
    """train.compile_wait auto, for a cold cache's background compile: on a CPU wait for it with 100+ steps left and
    give it up with fewer; on a GPU train beside it."""
    from graphtrain.trainer.compile_wait import COMPILE_WAIT_MIN_STEPS, compile_wait_action

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = Config().train
    assert compile_wait_action(auto, cpu, COMPILE_WAIT_MIN_STEPS) == "wait"
    assert compile_wait_action(auto, cpu, COMPILE_WAIT_MIN_STEPS - 1) == "skip"  # too short to pay for the compile
    assert compile_wait_action(auto, cuda, 10_000) == "beside"  # a GPU's steps leave the CPU to the compile
    on = Config().with_overrides(["train.compile_wait=true"]).train
    off = Config().with_overrides(["train.compile_wait=false"]).train
    assert compile_wait_action(on, cuda, 1) == "wait" and compile_wait_action(off, cpu, 10_000) == "beside"
    with pytest.raises(TypeError, match="train.compile_wait"):
        Config().with_overrides(["train.compile_wait=sometimes"])


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_eager_runs_under_autocast_for_its_precision(tmp_path, precision):
    """train.accelerate=false with engine.precision=bf16 trains under torch.autocast (the baseline a user gets
    with one line), so eager and the engine compare at the same precision; fp32 stays fp32."""
    trainer = Trainer(tiny(tmp_path, f"engine.precision={precision}", "train.steps=1", "train.eval_every=0"))
    seen: list[torch.dtype] = []
    for m in trainer.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    trainer.fit()
    want = torch.bfloat16 if precision == "bf16" else torch.float32
    assert seen and set(seen) == {want}, set(seen)
