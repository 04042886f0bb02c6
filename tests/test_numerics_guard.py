"""Bad steps never reach the weights: a non-finite loss or gradient norm (or a loss spike) skips the update,
is counted, and `train.max_bad_steps` in a row stop the run naming the step. Eager, graph engine (fp32, bf16),
whole-step graph and 2-rank data parallel."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from graphtrain.config.sections import Config
from graphtrain.trainer import Trainer, TrainingFailed
from graphtrain.trainer.faults import NumericsGuard, rejection

TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=4",
    "train.steps=4",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.ckpt_every=0",
    "train.accelerate=false",
    "train.progress=false",
    "train.threads=1",
    "train.deterministic=true",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "model.dropout=0.0",
]


pytestmark = pytest.mark.usefixtures("tiny_env")  # conftest.py: shared data cache, settings restored


def tiny(out_dir, *overrides: str) -> Config:
    return Config().with_overrides([*TINY, f"train.out_dir={out_dir}", *overrides])


def poison(trainer: Trainer, bad: set[int], where: str = "grad") -> None:
    """Make the (1-based) steps in `bad` produce a NaN gradient ("grad": a hook on one weight's gradient, what an
    overflowing backward does) or a NaN loss ("loss": the forward's result). Weights are not touched."""
    step = {"now": 0}
    split, accum = trainer.data.train, trainer.config.train.grad_accum
    get_batch = split.get_batch

    def counting(index, batch_size):
        step["now"] = index // accum + 1
        return get_batch(index, batch_size)

    split.get_batch = counting
    if where == "grad":
        weight = next(trainer.strategy.module.parameters())
        weight.register_hook(lambda g: g * float("nan") if step["now"] in bad else g)
    else:

        class NanLoss(nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, **batch):
                loss = self.inner(**batch)
                return loss * float("nan") if step["now"] in bad else loss

        trainer.strategy.model = NanLoss(trainer.strategy.model)


def records(out_dir, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.strategy.module.state_dict().items()}


# ---------------------------------------------------------------------------------- units ----


def test_rejection_and_guard_units():
    assert rejection(2.0, 1.0, math.inf, False) is None
    assert rejection(math.nan, 1.0, math.inf, False) == "the loss is nan"
    assert rejection(2.0, math.inf, math.inf, False) == "the gradient norm is inf"
    assert rejection(2.0, math.inf, math.inf, True) is None  # fp16 overflow: the loss scaler's business
    assert rejection(9.0, 1.0, 6.0, False).startswith("loss spike: 9 > 6")
    guard = NumericsGuard(max_bad_steps=3, spike_factor=3.0)
    assert guard.max_loss() == math.inf  # warming up
    for step in range(1, 11):
        guard.record(step, 2.0 + 0.01 * step, None)
    assert guard.max_loss() == pytest.approx(3 * 2.055)  # 3 x the median
    guard.record(11, math.nan, "the loss is nan")
    guard.record(12, 2.0, None)  # a good step resets the run of bad ones
    guard.record(13, math.nan, "the loss is nan")
    guard.record(14, math.nan, "the loss is nan")
    with pytest.raises(TrainingFailed, match=r"training diverged at step 15: 3 bad steps in a row \(steps 13-15"):
        guard.record(15, math.nan, "the loss is nan")
    assert guard.total == 4
    assert NumericsGuard(5, None).max_loss() == math.inf


# ------------------------------------------------------------------------------ the Trainer ----


def test_nonfinite_gradient_skips_the_update_exactly(tmp_path):
    """Step 2's gradient is NaN: its update is skipped, so two steps with a bad second one leave the weights and
    AdamW's state bitwise where one good step left them (constant learning rate, no dropout)."""
    one = Trainer(tiny(tmp_path / "one", "train.steps=1"))
    one.fit()
    two = Trainer(tiny(tmp_path / "two", "train.steps=2"))
    poison(two, {2})
    two.fit()
    for (name, a), b in zip(weights(one).items(), weights(two).values()):
        assert torch.equal(a, b), name
    sa, sb = one.optimizer.state_dict()["state"], two.optimizer.state_dict()["state"]
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]), f"optimizer state {i}.{k}"
    (skip,) = records(tmp_path / "two", "skip")
    assert skip["step"] == 2 and skip["reason"] == "the gradient norm is nan"
    last = records(tmp_path / "two", "train")[-1]
    assert last["skipped"] == 1 and last["bad_steps"] == 1 and last["loss"] is None  # no updated step to average


def test_max_bad_steps_in_a_row_stop_the_run_naming_the_step(tmp_path):
    trainer = Trainer(tiny(tmp_path / "run", "train.steps=8", "train.max_bad_steps=3", "train.ckpt_every=2"))
    poison(trainer, {2, 4, 5, 6, 7, 8}, where="loss")
    with pytest.raises(
        TrainingFailed,
        match=r"training diverged at step 6: 3 bad steps in a row \(steps 4-6; last: "
        r"the loss is nan\).*Lower optim.lr.*--resume auto",
    ):
        trainer.fit()
    assert all(torch.isfinite(w).all() for w in weights(trainer).values())
    assert [r["step"] for r in records(tmp_path / "run", "skip")] == [2, 4, 5, 6]
    saved = torch.load(tmp_path / "run" / "ckpt-0000004.pt", weights_only=True)["model"]  # written mid-streak
    assert all(torch.isfinite(v).all() for v in saved.values())


def test_loss_spike_guard_skips_spikes_only(tmp_path):
    trainer = Trainer(tiny(tmp_path / "run", "train.steps=14", "train.loss_spike_factor=3"))
    step = {"now": 0}
    get_batch = trainer.data.train.get_batch

    def counting(index, batch_size):
        step["now"] = index + 1
        return get_batch(index, batch_size)

    trainer.data.train.get_batch = counting

    class Spiky(nn.Module):  # step 12's loss is 10x: a spike
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **batch):
            loss = self.inner(**batch)
            return loss * 10 if step["now"] == 12 else loss

    trainer.strategy.model = Spiky(trainer.strategy.model)
    trainer.fit()
    (skip,) = records(tmp_path / "run", "skip")
    assert skip["step"] == 12 and skip["reason"].startswith("loss spike")
    assert trainer.optimizer.state_dict()["state"][0]["step"].item() == 13  # 14 steps, 13 updates


@pytest.mark.filterwarnings("ignore:graphtrain. precision=bf16 will be much slower")  # no native bf16 here
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_engine_path_never_writes_nan(tmp_path, precision):
    """Through graphtrain.accelerate (aten provider: the engine's graphs without Inductor's compile time)."""
    trainer = Trainer(
        tiny(
            tmp_path / precision,
            "train.steps=3",
            "train.accelerate=true",
            "engine.provider=aten",
            f"engine.precision={precision}",
            "engine.fallback=error",
        )
    )
    assert hasattr(trainer.strategy.module, "_graphtrain")
    poison(trainer, {2})
    trainer.fit()
    assert all(torch.isfinite(w).all() for w in weights(trainer).values())
    assert [r["step"] for r in records(tmp_path / precision, "skip")] == [2]
    assert trainer.optimizer.state_dict()["state"][0]["step"].item() == 2


def test_whole_step_graph_skips_nonfinite_and_spiking_steps():
    """graphtrain.compile_step (fp32): a NaN loss or one above max_loss leaves weights, moments and step counts."""
    from graphtrain.frontend.compile_step import compile_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x, y):
            return ((self.net(x) - y) ** 2).mean()

    reg = Regression()
    step = compile_step(reg, Config().with_overrides(["engine.provider=aten", "engine.fallback=error"]))
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    out = step(lr=1e-2, x=x, y=y)
    assert not out["skipped"]

    def snapshot():
        return [t.clone() for t in [*reg.parameters(), *step.exp_avg, *step.exp_avg_sq, *step.state_steps]]

    before = snapshot()
    out = step(lr=1e-2, x=x.clone().fill_(float("nan")), y=y)  # NaN loss, NaN gradients
    assert out["skipped"] and math.isnan(out["loss"].item())
    out2 = step(lr=1e-2, max_loss=1e-9, x=x, y=y)  # a finite loss above the limit
    assert out2["skipped"]
    for a, b in zip(before, snapshot()):
        assert torch.equal(a, b)
    assert not step(lr=1e-2, x=x, y=y)["skipped"] and step.state_steps[0].item() == 2


@pytest.mark.dist
def test_data_parallel_ranks_skip_together(tmp_path):
    """2 gloo ranks: a NaN gradient on rank 1 alone reaches both through the all-reduce; both skip step 2."""
    from graphtrain.distributed.spawn import run_ranks

    out = run_ranks(_dp_rank, 2, str(tmp_path), str(tmp_path.parent / "graphtrain-cache"))
    (w0, skips0), (w1, skips1) = out
    assert skips0 == [2]
    for name in w0:
        assert torch.isfinite(w0[name]).all() and torch.equal(w0[name], w1[name]), name


def _dp_rank(out_dir: str, cache: str):
    import os

    os.environ["GRAPHTRAIN_CACHE"] = cache
    trainer = Trainer(tiny(out_dir, "parallel.dp=2", "train.steps=3"))
    if trainer.env.rank == 1:
        poison(trainer, {2})
    else:
        poison(trainer, set())
    trainer.fit()
    skips = [r["step"] for r in records(trainer.out_dir, "skip")] if trainer.is_main else None
    state = {k: v.detach().clone() for k, v in trainer.strategy.module.state_dict().items()}
    trainer.close()
    return state, skips
