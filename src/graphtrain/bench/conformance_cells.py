"""One cell of the conformance matrix (`graphtrain conformance`, bench/conformance.py): a model (row) trained a few
steps through one graphtrain entry point in one configuration (column), against the same steps in eager PyTorch.

Rows are tiny models built from config, nothing downloaded: Hugging Face families (bench/families.py, width 64, 2
layers, vocabulary 256, dropout off so that both runs compute the same function) and graphtrain's own presets.
Columns are ``entry/precision/provider[/recompute][/frozen-emb][/one-graph]``:

- entry ``accelerate`` (``graphtrain.accelerate(model)``), ``backend`` (``torch.compile(model, backend="graphtrain",
  options=...)``), ``compile_step`` (``graphtrain.compile_step(model, config)``) or ``trainer``
  (``graphtrain.Trainer(config, model=...).fit()``; language models only: the Trainer trains graphtrain's models
  and Hugging Face causal/masked LMs through ``models.hf.HFLanguageModel``);
- precision fp32 or bf16 (``engine.precision``; eager stays fp32, the reference the bf16 table is written against);
- provider aten, inductor or auto (``engine.provider``; auto waits for its background compile after the first
  step, so that the later steps run on the measured winner);
- ``recompute``: ``engine.recompute=auto`` under a 1 MiB ``memory_budget`` (nothing fits, so recompute goes as far
  as it can); ``frozen-emb``: the input embedding's weight does not require grad (tied heads freeze with it);
  ``one-graph``: ``engine.compile_blocks=false``, the model (compile_step: the whole step) as one graph instead of
  block by block.

What is compared, under `graphtrain.testing`'s tolerance table for the column's precision: the loss of every step
(AdamW between steps, grad_clip off) and every trained parameter's gradient of the first step (compile_step: its
first moment after the first step divided by 1 - beta1, which is that gradient; trainer: the optimizer's first
moments after the last step, eager Trainer against accelerated Trainer); in bf16 each gradient also within a
relative error in norm (BF16_GRAD_REL, or eager autocast's times AUTOCAST_FACTOR). The verdict: ``pass``, ``fallback``
(in tolerance, but part of it did not run through graphtrain: the engine's recorded fallbacks, a capture that ran
eagerly, or a fused op's fast path that failed at run time; each reason is kept) or ``fail`` (out of tolerance, or
an exception; in a child process, a signal).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import graphtrain
from graphtrain.bench.families import FAMILIES, build_family
from graphtrain.config.sections import Config, DataConfig, EngineConfig, ModelConfig, OptimConfig, TrainConfig
from graphtrain.kernels._common import runtime_fallbacks
from graphtrain.models import build_model
from graphtrain.models.hf import HFLanguageModel, spec_of
from graphtrain.optim import build_optimizer
from graphtrain.pipeline.state import GLOBAL_STATE
from graphtrain.testing import TOLERANCES, assert_close
from graphtrain.trainer import Trainer

ENTRIES = ("accelerate", "backend", "compile_step", "trainer")
PRECISIONS = ("fp32", "bf16")
PROVIDERS = ("aten", "inductor", "auto")
STEPS = 3
"""Training steps per cell (bench/conformance.py's --steps default)."""
OPTIM = OptimConfig(lr=1e-3, grad_clip=None, schedule="constant", warmup_steps=0)
_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}
# bf16's table (2e-2 absolute) alone would pass most gradients of a tiny model whatever they held, so each bf16
# gradient is also held to 5e-2 relative error in norm against eager fp32's (the bound tests/test_mixed_precision.py
# puts on accelerate's bf16: 8 bits of mantissa), or, where bf16 itself loses more (T5: ReLU and unscaled attention,
# 5-8% in eager autocast's gradients too, measured), to 1.5x eager autocast's error: the mixed-precision parity rule
# (docs: CONVENTIONS, "our error no larger than eager's"), 1.5 for per-parameter noise (ours/autocast measured
# 0.98-1.21 on T5's worst parameters). The norm a relative error divides by is floored at 1e-3 of the whole gradient's:
# a gradient that is zero in exact arithmetic (an attention key's bias: softmax ignores a shift shared by a row)
# holds rounding noise only, and its relative error means nothing.
BF16_GRAD_REL = 5e-2
AUTOCAST_FACTOR = 1.5
REL_FLOOR = 1e-3


# --------------------------------------------------------------------------------------------- rows ----


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    build: Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]
    objective: str | None
    """clm or mlm: a language model the Trainer can train; None: not one (vision, encoder-decoder)."""
    hidden: bool = False
    """A test-only row (never in the default selection): named explicitly with --rows."""


def _hf(family: str, **overrides: Any) -> Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]:
    def build() -> tuple[nn.Module, dict[str, torch.Tensor]]:
        return build_family(family, hidden=64, layers=2, vocab=256, batch=2, seq=32, dropout=False, overrides=overrides)

    return build


def _preset(name: str) -> Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]:
    def build() -> tuple[nn.Module, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = build_model(ModelConfig(name=name, dropout=0.0)).train()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(5, model.spec.vocab_size, (2, 32), generator=g)
        if model.family == "gpt2":
            return model, {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
        labels = torch.where(torch.rand(ids.shape, generator=g) < 0.15, ids, -100)
        labels[:, 0] = ids[:, 0]
        return model, {"input_ids": ids, "labels": labels}

    return build


class _Crash(nn.Module):
    """A test-only row: its forward ends the process with a real signal (SIGABRT, or SIGSEGV reading address 0),
    the way a native kernel's bug does; what --isolate must survive and report."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.lin = how, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import ctypes

        os.abort() if self.how == "abort" else ctypes.string_at(0)
        return self.lin(x).sum()


class _Wrong(nn.Module):
    """A test-only row: compiled, its loss is 1% off eager's (it asks whether it is being compiled), the way a wrong
    rewrite is; the comparison must fail the cell."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.lin(x).square().mean()
        return loss * 1.01 if torch.compiler.is_compiling() else loss


class _Eager(nn.Module):
    """A test-only row: its forward is hidden from Dynamo (``torch.compiler.disable``), so accelerate captures no
    graph and runs it eagerly: a real fallback, which the cell must report with its reason."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).square().mean()


def _crash(how: str) -> Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]:
    return lambda: (_Crash(how), {"x": torch.ones(2, 4)})


# The rows above pick their families' hard cases (grouped-query heads, a sliding window shorter than the sequence);
# every other family of bench/families.py is a row too, built as tests/test_hf_families.py builds it, so that each
# architecture graphtrain takes runs through every entry point, precision and provider, not only accelerate on aten.
_PICKED = set("gpt2 neox llama mistral qwen2 phi gemma bert roberta distilbert vit t5 bart".split())


def _other_families() -> list[Row]:
    return [
        Row(name, f"HF {fam.model}", _hf(name), fam.task if fam.task in ("clm", "mlm") else None)
        for name, fam in FAMILIES.items()
        if name not in _PICKED
    ]


ROWS: dict[str, Row] = {
    r.name: r
    for r in [
        Row("gpt2", "HF GPT2LMHeadModel", _hf("gpt2"), "clm"),
        Row("neox", "HF GPTNeoXForCausalLM", _hf("neox"), "clm"),
        Row("llama-gqa", "HF LlamaForCausalLM, 4 query / 2 key-value heads", _hf("llama"), "clm"),
        Row(
            "mistral-swa", "HF MistralForCausalLM, sliding window 16 < seq 32", _hf("mistral", sliding_window=16), "clm"
        ),
        Row("qwen2", "HF Qwen2ForCausalLM (GQA)", _hf("qwen2"), "clm"),
        Row("phi", "HF PhiForCausalLM", _hf("phi"), "clm"),
        Row("gemma", "HF GemmaForCausalLM (GQA)", _hf("gemma"), "clm"),
        Row("bert", "HF BertForMaskedLM", _hf("bert"), "mlm"),
        Row("roberta", "HF RobertaForMaskedLM", _hf("roberta"), "mlm"),
        Row("distilbert", "HF DistilBertForMaskedLM", _hf("distilbert"), "mlm"),
        Row("vit", "HF ViTForImageClassification (224 px)", _hf("vit"), None),
        Row("t5", "HF T5ForConditionalGeneration", _hf("t5"), None),
        Row("bart", "HF BartForConditionalGeneration", _hf("bart"), None),
        *_other_families(),
        Row("gpt2-tiny", "graphtrain preset", _preset("gpt2-tiny"), "clm"),
        Row("bert-tiny", "graphtrain preset", _preset("bert-tiny"), "mlm"),
        Row("_abort", "test only: forward calls os.abort()", _crash("abort"), None, hidden=True),
        Row("_segv", "test only: forward reads address 0", _crash("segv"), None, hidden=True),
        Row(
            "_eager",
            "test only: forward hidden from Dynamo",
            lambda: (_Eager(), {"x": torch.ones(2, 4)}),
            None,
            hidden=True,
        ),
        Row(
            "_wrong",
            "test only: 1% off eager when compiled",
            lambda: (_Wrong(), {"x": torch.ones(2, 4)}),
            None,
            hidden=True,
        ),
    ]
}


# ------------------------------------------------------------------------------------------ columns ----


@dataclass(frozen=True)
class Column:
    entry: str
    precision: str = "fp32"
    provider: str = "aten"
    recompute: str = "none"
    frozen: bool = False
    one_graph: bool = False

    @property
    def name(self) -> str:
        return "/".join(
            [self.entry, self.precision, self.provider]
            + (["recompute"] * (self.recompute != "none"))
            + (["frozen-emb"] * self.frozen)
            + (["one-graph"] * self.one_graph)
        )

    def engine(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(
            provider=self.provider, precision=self.precision, recompute=self.recompute, fallback="warn"
        )
        if self.recompute != "none":
            kw["memory_budget"] = float(2**20)  # 1 MiB, the least it takes: nothing fits, auto recomputes all it can
        if self.one_graph:
            kw["compile_blocks"] = False
        return kw


def all_columns() -> list[Column]:
    """The matrix's columns: every entry x precision x provider, then recompute, frozen embeddings and one graph per
    entry."""
    cols = [Column(e, p, v) for e in ENTRIES for p in PRECISIONS for v in PROVIDERS]
    cols += [Column(e, recompute="auto") for e in ENTRIES] + [Column(e, frozen=True) for e in ENTRIES]
    cols += [Column(e, one_graph=True) for e in ENTRIES]
    return cols


COLUMNS: dict[str, Column] = {c.name: c for c in all_columns()}


def parse_column(name: str) -> Column:
    """A column by name, also one outside the default list (``trainer/bf16/auto/recompute/frozen-emb``,
    ``compile_step/bf16/auto/one-graph``)."""
    parts = name.split("/")
    flags = set(parts[3:])
    if (
        len(parts) < 3
        or parts[0] not in ENTRIES
        or parts[1] not in PRECISIONS
        or parts[2] not in PROVIDERS
        or not flags <= {"recompute", "frozen-emb", "one-graph"}
    ):
        raise ValueError(
            f"column {name!r} is not ENTRY/PRECISION/PROVIDER[/recompute][/frozen-emb][/one-graph] with ENTRY in "
            f"{'|'.join(ENTRIES)}, PRECISION in {'|'.join(PRECISIONS)}, PROVIDER in {'|'.join(PROVIDERS)}"
        )
    recompute = "auto" if "recompute" in flags else "none"
    return Column(parts[0], parts[1], parts[2], recompute, "frozen-emb" in flags, "one-graph" in flags)


# ---------------------------------------------------------------------------------------------- cell ----


@dataclass
class Result:
    row: str
    column: str
    status: str
    """pass | fallback | fail | n/a"""
    reason: str = ""
    fallbacks: list[str] = field(default_factory=list)
    fused_ops: int | None = None
    """graphtrain ops the passes put into the graphs (net, per graph)."""
    providers: str = ""
    max_loss_diff: float | None = None
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Result:
        return cls(**json.loads(text))


@dataclass
class _Trace:
    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    state: Any = None
    model: nn.Module | None = None


def _loss_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def _freeze_embedding(model: nn.Module) -> None:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError(f"{type(model).__name__} has no input embedding to freeze")
    emb.requires_grad_(False)  # every parameter of it (ViT's patch embedding is a convolution with a bias)


def _loop(
    model: nn.Module,
    call: Callable[..., Any],
    batch: dict[str, torch.Tensor],
    steps: int,
    after_first: Callable[[], Any] | None = None,
    moments: bool = False,
) -> _Trace:
    """`steps` AdamW steps of `call(**batch)`; the first step's gradients of `model`'s trained parameters."""
    opt = build_optimizer(model, OPTIM)
    losses, grads = [], {}
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        loss = _loss_of(call(**batch))
        loss.backward()
        losses.append(loss.detach().float().clone())
        if i == 0:
            grads = {
                n: None if p.grad is None else p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.requires_grad
            }
        opt.step()
        if i == 0 and after_first is not None:
            after_first()
    if moments:  # what the Trainer's cells compare: the first moments after the last step
        grads = {
            n: opt.state[p]["exp_avg"].detach().clone() if p in opt.state else None
            for n, p in model.named_parameters()
            if p.requires_grad
        }
    return _Trace(losses, grads)


def _autocast(model: nn.Module, batch: dict[str, torch.Tensor], col: Column, steps: int) -> _Trace:
    """Eager PyTorch under torch.autocast(bf16): what the Trainer's cells compare after `steps` steps, the first
    step's gradients otherwise."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return (
            _loop(model, model, batch, steps, moments=True) if col.entry == "trainer" else _loop(model, model, batch, 1)
        )


def _eager(model: nn.Module, batch: dict[str, torch.Tensor], col: Column, steps: int) -> _Trace:
    if col.entry == "trainer":
        return _trainer(model, batch, col, steps, accelerate=False)
    return _loop(model, model, batch, steps)


def _graphtrain(model: nn.Module, batch: dict[str, torch.Tensor], col: Column, steps: int) -> _Trace:
    if col.entry == "accelerate":
        graphtrain.accelerate(model, **col.engine())
        wait = (lambda: graphtrain.wait_compiled(model, timeout=600)) if col.provider == "auto" else None
        return dataclasses.replace(_loop(model, model, batch, steps, wait), state=model._graphtrain, model=model)
    if col.entry == "backend":
        compiled = torch.compile(model, backend="graphtrain", options=col.engine())
        return dataclasses.replace(_loop(model, compiled, batch, steps), state=GLOBAL_STATE)
    if col.entry == "compile_step":
        cfg = Config(engine=EngineConfig(**col.engine()), optim=OPTIM)
        step = graphtrain.compile_step(model, cfg)
        losses, grads = [], {}
        for i in range(steps):
            torch.manual_seed(i)
            losses.append(step(**batch)["loss"].detach().float().clone())
            if i == 0:  # m = lerp(0, g, 1 - beta1): the first step's gradient, scaled
                grads = {n: m.detach() / (1 - OPTIM.betas[0]) for n, m in step.state_dict()["exp_avg"].items()}
            if i == 0 and col.provider == "auto":
                graphtrain.wait_compiled(model, timeout=600)
        return _Trace(losses, grads, state=model._graphtrain, model=model)
    return _trainer(model, batch, col, steps, accelerate=True)


class _FixedSource:
    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    def get_batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.batch.items()}


@dataclass
class _FixedData:
    """What the Trainer reads of its data (graphtrain.data.DataBundle): the cell's one batch at every step."""

    train: _FixedSource
    val: _FixedSource
    vocab_size: int
    tokenizer: Any = None


def as_language_model(model: nn.Module, objective: str) -> nn.Module:
    """What the Trainer takes: graphtrain's models as they are, a Hugging Face LM wrapped (models/hf.py)."""
    if hasattr(model, "family") and hasattr(model, "spec"):
        return model
    return HFLanguageModel(model, objective, spec_of(model.config, objective))


def _trainer(model: nn.Module, batch: dict[str, torch.Tensor], col: Column, steps: int, *, accelerate: bool) -> _Trace:
    B, T = batch["input_ids"].shape
    with tempfile.TemporaryDirectory(prefix="graphtrain-conformance-") as out:
        cfg = Config(
            engine=EngineConfig(**col.engine()),
            optim=OPTIM,
            data=DataConfig(seq_len=T),
            train=TrainConfig(
                steps=steps,
                batch_size=B,
                eval_every=10**6,
                eval_batches=1,
                log_every=1,
                ckpt_every=10**6,
                out_dir=out,
                accelerate=accelerate,
                progress=False,
                loggers=["jsonl"],
                seed=0,
            ),
        )
        data = _FixedData(_FixedSource(batch), _FixedSource(batch), vocab_size=model.spec.vocab_size)
        with contextlib.redirect_stdout(io.StringIO()):  # its config and progress lines; the table says the rest
            trainer = Trainer(cfg, model=model, data=data)
            try:
                trainer.fit()
            finally:
                trainer.close()
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    losses = [torch.tensor(r["loss"], dtype=torch.float32) for r in records if r.get("kind") == "train"]
    opt = trainer.optimizer
    moments = {
        n: opt.state[p]["exp_avg"].detach().clone() if p in opt.state else None
        for n, p in trainer.strategy.module.named_parameters()
        if p.requires_grad
    }
    return _Trace(
        losses, moments, state=getattr(trainer.strategy.module, "_graphtrain", None), model=trainer.strategy.module
    )


def _compare(
    ours: _Trace, ref: _Trace, precision: str, autocast: Callable[[], _Trace] | None = None
) -> tuple[str | None, float]:
    """The first difference out of tolerance (one line), or None; and the largest loss difference. `autocast`: eager
    under autocast, run when a low-precision gradient is off eager fp32's by more than BF16_GRAD_REL."""
    rtol, atol = TOLERANCES[_DTYPE[precision]]
    diff = max((abs(float(a) - float(b)) for a, b in zip(ours.losses, ref.losses)), default=0.0)
    if len(ours.losses) != len(ref.losses):
        return f"{len(ours.losses)} losses, eager has {len(ref.losses)}", diff
    if ours.grads.keys() != ref.grads.keys():
        return f"trained parameters differ: {sorted(set(ours.grads) ^ set(ref.grads))[:3]}", diff
    floor = REL_FLOOR * float(
        torch.cat(
            [g.double().flatten() for g in ref.grads.values() if g is not None] or [torch.zeros(1, dtype=torch.float64)]
        ).norm()
    )
    ac: _Trace | None = None

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).norm()) / max(float(b.double().norm()), floor, 1e-30)

    try:
        for i, (a, b) in enumerate(zip(ours.losses, ref.losses)):
            assert_close(a.float(), b.float(), name=f"loss of step {i + 1}", rtol=rtol, atol=atol)
        for n, g in ref.grads.items():
            mine = ours.grads[n]
            if (g is None) != (mine is None):
                return f"gradient of {n}: {'missing' if mine is None else 'unexpected'}", diff
            if g is None:
                continue
            assert_close(mine.float(), g.float(), name=f"gradient of {n}", rtol=rtol, atol=atol)
            if precision == "fp32" or (err := rel(mine, g)) <= BF16_GRAD_REL:
                continue
            if ac is None and autocast is not None:
                ac = autocast()
            theirs = rel(ac.grads[n], g) if ac is not None and ac.grads.get(n) is not None else 0.0
            if err > AUTOCAST_FACTOR * theirs:
                return (
                    f"gradient of {n}: relative error {err:.2e} against eager fp32's, > {BF16_GRAD_REL} and > "
                    f"{AUTOCAST_FACTOR} x eager autocast's ({theirs:.2e})"
                ), diff
    except AssertionError as e:
        return _one_line(str(e)), diff
    return None, diff


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    keep = [ln for ln in lines if "mismatched" in ln.lower() or "greatest" in ln.lower()]
    return " ".join((lines[:1] + keep[:3]) if lines else ["(no message)"])[:300]


def _fallbacks(trace: _Trace, start: dict[str, int]) -> list[str]:
    out = []
    st = trace.state
    if st is not None:
        out += [f"{part}: {_one_line(why)}" for part, why in st.fallbacks[start.get("engine", 0) :]]
        if st.eager_only:
            out.append("capture failed: the module ran eagerly")
    out += [
        f"fused op {f.op} ({f.implementation}) fell back to its reference: {_one_line(f.reason)}"
        for f in runtime_fallbacks()[start.get("kernels", 0) :]
    ]
    return out


def _fused_ops(trace: _Trace, start: dict[str, int]) -> int | None:
    st = trace.state
    if st is None:
        return None
    return sum(
        n for r in st.passes[start.get("passes", 0) :] for op, n in r.op_diff.items() if op.startswith("graphtrain.")
    )


def _providers(trace: _Trace, start: dict[str, int]) -> str:
    st = trace.state
    if st is None:
        return "eager"
    return ",".join(sorted({g.provider.split(" ")[0] for g in st.graphs[start.get("graphs", 0) :]})) or "-"


def run_cell(row: Row, col: Column, steps: int = STEPS) -> Result:
    """Train `row` through `col` and through eager, compare; never raises (an exception is a failed cell)."""
    import time

    import torch._dynamo

    t0 = time.perf_counter()
    if col.entry == "trainer" and row.objective is None:
        why = "the Trainer trains only language models (graphtrain's, Hugging Face causal or masked LMs): not this row"
        return Result(row.name, col.name, "n/a", why)
    torch._dynamo.reset()
    start = {"kernels": len(runtime_fallbacks())}
    if col.entry == "backend":  # the process-wide record: this cell's part is what it adds
        start |= {
            "engine": len(GLOBAL_STATE.fallbacks),
            "passes": len(GLOBAL_STATE.passes),
            "graphs": len(GLOBAL_STATE.graphs),
        }
    try:
        model, batch = row.build()
        if col.entry == "trainer":
            try:
                model = as_language_model(model, row.objective or "clm")
            except ValueError as e:  # a model the Trainer cannot size (no attention heads: Mamba), said as such
                return Result(row.name, col.name, "n/a", str(e))
        if col.frozen:
            _freeze_embedding(model)
        ref_model = copy.deepcopy(model)
        ac_model = copy.deepcopy(model) if col.precision != "fp32" else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallbacks are read from the engine's record instead
            ours = _graphtrain(model, batch, col, steps)
        ref = _eager(ref_model, batch, col, steps)
        bad, diff = _compare(ours, ref, col.precision, lambda: _autocast(ac_model, batch, col, steps))
    except Exception as e:  # noqa: BLE001 - a cell reports, the matrix goes on
        return Result(
            row.name,
            col.name,
            "fail",
            f"{type(e).__name__}: {' '.join(str(e).split())[:300]}",
            seconds=time.perf_counter() - t0,
        )
    fb = _fallbacks(ours, start)
    res = Result(
        row.name,
        col.name,
        "fail" if bad else "fallback" if fb else "pass",
        bad or "",
        fb,
        _fused_ops(ours, start),
        _providers(ours, start),
        diff,
        time.perf_counter() - t0,
    )
    if not bad and fb:
        res.reason = fb[0]
    return res
