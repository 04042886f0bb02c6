"""What `graphtrain bench SUITE` runs: the variants (how a step is executed) and the suites (which
models at which shapes, with how many steps).

A *case* is one (model, batch, seq); a *variant* is one way of running its training step. Every
variant of a case is built by the same setup factory (:mod:`graphtrain.bench.case`) from the same
seed, so the numbers differ only by how the step runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from dataclasses import dataclass
from typing import Literal

Mode = Literal["eager", "compile", "graphtrain", "graphtrain-step", "ortmodule"]


@dataclass(frozen=True)
class Variant:
    name: str
    mode: Mode
    precision: Literal["fp32", "bf16"]
    """bf16: autocast for eager/compile, `accelerate(precision="bf16")` (a graph pass) for graphtrain."""
    doc: str
    recompute: Literal["none", "selective", "full"] = "none"
    """graphtrain only: `accelerate(recompute=...)`, the memory optimizer's activation recompute."""
    compile_mode: str | None = None
    """compile only: torch.compile's `mode` (None: the default mode)."""
    optimizer: Literal["fused", "loop"] = "fused"
    """AdamW's implementation: `fused` is torch.optim.AdamW(fused=True) for eager and torch.compile (the one flag a
    user sets) and graphtrain's FusedAdamW (the same kernel) for graphtrain; `loop` is torch.optim.AdamW's
    default per-parameter loop on CPU (an extra column and an ablation, never a headline)."""
    passes_off: tuple[str, ...] = ()
    """graphtrain only: engine passes switched off (`fuse_*` switches off every fusion): ablations."""
    ablates: str | None = None
    """The lever this ablation variant switches off (the ablation table's row label)."""
    fp32_matmul_bf16: bool = False
    """eager/compile only: fp32 model and no autocast, with ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``
    (stock torch's one flag that runs fp32 matmuls in bf16 on oneDNN, since 2.9): a bf16-class baseline, timed against
    the bf16 peak."""

    @property
    def autocast(self) -> bool:
        """Whether its steps run under torch.autocast(bfloat16): eager and torch.compile in bf16 (graphtrain applies
        bf16 as a graph pass)."""
        return self.precision == "bf16" and self.mode in ("eager", "compile") and not self.fp32_matmul_bf16


_LEVERS = (
    ("graphtrain-fp32-no-fusions", "fusions (every fuse_* pass)", dict(passes_off=("fuse_*",))),
    ("graphtrain-fp32-no-onednn", "oneDNN fp32 GEMMs (lower_gemm_onednn)", dict(passes_off=("lower_gemm_onednn",))),
    ("graphtrain-fp32-no-sparse-head", "sparse masked-LM head (sparse_lm_head)", dict(passes_off=("sparse_lm_head",))),
    ("graphtrain-fp32-loop-adamw", "fused optimizer (AdamW as a per-parameter loop)", dict(optimizer="loop")),
)

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("eager-fp32", "eager", "fp32", "plain PyTorch, torch.optim.AdamW(fused=True)"),
        Variant(
            "eager-fp32-loop-adamw",
            "eager",
            "fp32",
            "plain PyTorch, torch.optim.AdamW's default per-parameter loop",
            optimizer="loop",
        ),
        Variant("eager-bf16", "eager", "bf16", "PyTorch with torch.autocast(bfloat16), AdamW(fused=True)"),
        Variant(
            "eager-fp32-matmul-bf16",
            "eager",
            "bf16",
            "plain PyTorch in fp32 with torch.backends.mkldnn.matmul."
            'fp32_precision = "bf16" (its matmuls in bf16, no autocast), AdamW(fused=True)',
            fp32_matmul_bf16=True,
        ),
        Variant("compile-fp32", "compile", "fp32", "torch.compile(model), default mode (Inductor), AdamW(fused=True)"),
        Variant("compile-bf16", "compile", "bf16", "torch.compile(model) under torch.autocast(bfloat16)"),
        Variant(
            "compile-max-autotune-fp32",
            "compile",
            "fp32",
            'torch.compile(model, mode="max-autotune")',
            compile_mode="max-autotune",
        ),
        Variant(
            "compile-max-autotune-bf16",
            "compile",
            "bf16",
            'torch.compile(model, mode="max-autotune") under torch.autocast(bfloat16)',
            compile_mode="max-autotune",
        ),
        Variant("graphtrain-fp32", "graphtrain", "fp32", "graphtrain.accelerate(model)"),
        Variant("graphtrain-bf16", "graphtrain", "bf16", 'graphtrain.accelerate(model, precision="bf16")'),
        Variant(
            "graphtrain-ckpt-fp32",
            "graphtrain",
            "fp32",
            'graphtrain.accelerate(model, recompute="full"): every layer but the last checkpointed',
            "full",
        ),
        Variant(
            "graphtrain-ckpt-bf16",
            "graphtrain",
            "bf16",
            'graphtrain.accelerate(model, precision="bf16", recompute="full")',
            "full",
        ),
        Variant(
            "graphtrain-selective-fp32",
            "graphtrain",
            "fp32",
            'graphtrain.accelerate(model, recompute="selective"): the attention core recomputed',
            "selective",
            ablates="no recompute (adds selective recompute: the memory lever)",
        ),
        *(
            Variant(name, "graphtrain", "fp32", f"graphtrain.accelerate(model) without {what}", ablates=what, **kw)
            for name, what, kw in _LEVERS
        ),
        Variant(
            "graphtrain-bf16-no-gemm-plans",
            "graphtrain",
            "bf16",
            'graphtrain.accelerate(model, precision="bf16") without the bf16 GEMM plans of its blocks',
            passes_off=("lower_gemm_plans",),
            ablates="bf16 GEMM plans (lower_gemm_plans; the LM head's op keeps its own)",
        ),
        Variant(
            "graphtrain-step-fp32",
            "graphtrain-step",
            "fp32",
            "graphtrain.compile_step(model): forward, backward, "
            "clip and AdamW compiled (blocks once, then one update graph)",
        ),
        Variant("graphtrain-step-bf16", "graphtrain-step", "bf16", 'graphtrain.compile_step(model, precision="bf16")'),
        Variant("ortmodule-fp32", "ortmodule", "fp32", "onnxruntime-training ORTModule (skipped if not installed)"),
    )
}
DEFAULT_VARIANTS = ("eager-fp32", "eager-bf16", "compile-fp32", "compile-bf16", "graphtrain-fp32", "graphtrain-bf16")
BF16_BASELINES = ("eager-bf16", "eager-fp32-matmul-bf16", "compile-bf16", "compile-max-autotune-bf16")
"""Every one-flag bf16 baseline a CPU user has (`graphtrain bench hf --variants ...` with graphtrain-bf16)."""
GPU_VARIANTS = ("eager-bf16", "compile-bf16", "compile-max-autotune-bf16", "graphtrain-bf16")
"""Suite gpu's variants: what a GPU user runs in bf16 with one flag (autocast; torch.compile's two modes)."""
AUTOTUNE_VARIANTS = ("compile-max-autotune-fp32", "compile-max-autotune-bf16")
ABLATION_VARIANTS = (
    "eager-fp32",
    "compile-fp32",
    "graphtrain-fp32",
    *(name for name, _, _ in _LEVERS),
    "graphtrain-selective-fp32",
)
REFERENCE = "eager-fp32"
"""Speed ratios are given against this variant and against torch.compile at the same precision."""


@dataclass(frozen=True)
class Case:
    model: str
    """A graphtrain preset (gpt2-mini, bert-large, ...) or `hf-<family>-<size>` (see case.HF_SIZES)."""
    batch: int
    seq: int
    maxbatch: bool = False
    """Also search the largest batch whose peak memory stays under the cap."""
    attention: Literal["sdpa", "explicit"] = "sdpa"
    """graphtrain presets: F.scaled_dot_product_attention (what users write today; the headline rows) or the
    hand-written matmul-softmax-dropout-matmul (second rows). Hugging Face cases always use SDPA."""

    @property
    def name(self) -> str:
        return f"{self.model}{'' if self.attention == 'sdpa' else '-explicit'} b{self.batch} s{self.seq}"

    @property
    def family(self) -> str:
        return "bert" if "bert" in self.model else "gpt2"


@dataclass(frozen=True)
class Suite:
    name: str
    doc: str
    cases: tuple[Case, ...]
    steps: int = 5
    """Steps per timed block; one block per variant per repeat."""
    repeats: int = 5
    """Interleaved rounds: every round times one block of every variant (A B C, then B C A, ...)."""
    warmup: int = 2
    """Untimed steps after the first (compiling) step."""
    cap_gib: float = 8.0
    """Memory cap for the largest-batch search."""
    max_workers: int = 8
    """Variants of one case alive (and interleaved) at once; lower it for models whose copies do not fit."""
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    """What runs when `--variants` is not given."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where it runs when `--device` is not given."""


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            "tiny",
            "seconds-long smoke run used by the tests",
            (Case("gpt2-tiny", 2, 32), Case("bert-tiny", 2, 32)),
            steps=2,
            repeats=2,
            warmup=1,
            cap_gib=2.0,
        ),
        Suite(
            "small",
            "gpt2/bert mini and small presets at seq 128 with SDPA attention (small also with hand-written "
            "attention): stable numbers from a 2-core CPU in minutes",
            (
                Case("gpt2-mini", 16, 128),
                Case("bert-mini", 16, 128),
                Case("gpt2-small", 8, 128),
                Case("bert-small", 8, 128),
                Case("gpt2-small", 8, 128, attention="explicit"),
                Case("bert-small", 8, 128, attention="explicit"),
            ),
            steps=4,
            repeats=5,
            warmup=2,
            cap_gib=8.0,
            variants=DEFAULT_VARIANTS + AUTOTUNE_VARIANTS,
        ),
        Suite(
            "hf",
            "Hugging Face GPT2LMHeadModel / BertForMaskedLM (dropout 0.1) / LlamaForCausalLM (GQA, no dropout) "
            "from config (random init, SDPA)",
            (
                Case("hf-gpt2-mini", 16, 128),
                Case("hf-bert-mini", 16, 128),
                Case("hf-gpt2-small", 8, 128),
                Case("hf-bert-small", 8, 128),
                Case("hf-llama-mini", 16, 128),
                Case("hf-llama-small", 8, 128),
            ),
            steps=4,
            repeats=5,
            warmup=2,
            cap_gib=8.0,
            variants=DEFAULT_VARIANTS + AUTOTUNE_VARIANTS,
        ),
        Suite(
            "hf-wide",
            "the Hugging Face models at width 1024 (BERT-Large's, GPT-2 Medium's) in 8 layers, in bf16: GEMMs wide "
            "enough to near the machine's bf16 peak, for the MFU that the mini and small sizes cannot show",
            (
                Case("hf-gpt2-wide", 8, 128),
                Case("hf-bert-wide", 8, 128),
                Case("hf-llama-wide", 8, 128),
            ),
            steps=3,
            repeats=3,
            warmup=2,
            cap_gib=12.0,
            max_workers=3,
            variants=("eager-bf16", "compile-bf16", "graphtrain-bf16"),
        ),
        Suite(
            "gpu",
            "one CUDA GPU, bf16 (issue #48): Hugging Face GPT-2 124M, a 155M Llama with grouped-query attention "
            "and BERT-base MLM, from config, against eager and torch.compile (default and max-autotune) under "
            "autocast, each with fused AdamW and TF32 allowed",
            (
                Case("hf-gpt2-base", 16, 512),
                Case("hf-llama-base", 8, 1024),
                Case("hf-bert-base", 32, 512),
            ),
            steps=10,
            repeats=5,
            warmup=3,
            cap_gib=40.0,
            max_workers=4,
            variants=GPU_VARIANTS,
            device="cuda",
        ),
        Suite(
            "ablation",
            "what each of graphtrain's levers is worth: graphtrain fp32 with one lever switched off at a "
            "time, beside eager and torch.compile, on the headline small and Hugging Face cases",
            (
                Case("gpt2-small", 8, 128),
                Case("bert-small", 8, 128),
                Case("hf-gpt2-small", 8, 128),
                Case("hf-bert-small", 8, 128),
            ),
            steps=4,
            repeats=4,
            warmup=2,
            cap_gib=8.0,
            variants=ABLATION_VARIANTS,
        ),
        Suite(
            "seed",
            "the ORT Training blog's models: BERT-Large phase 1 (seq 128) and 2 (seq 512), GPT-2 Medium "
            "(seq 1024), at CPU-sized batches, plus the largest batch under the memory cap",
            (
                Case("bert-large", 4, 128, maxbatch=True),
                Case("bert-large", 1, 512, maxbatch=True),
                Case("gpt2-medium", 1, 1024, maxbatch=True),
            ),
            steps=2,
            repeats=3,
            warmup=1,
            cap_gib=12.0,
            max_workers=1,
            variants=DEFAULT_VARIANTS + ("graphtrain-ckpt-fp32", "graphtrain-ckpt-bf16"),
        ),
        Suite(
            "seed-ablation",
            "the seed models with one graphtrain lever switched off at a time (fp32)",
            (Case("bert-large", 4, 128), Case("bert-large", 1, 512), Case("gpt2-medium", 1, 1024)),
            steps=1,
            repeats=2,
            warmup=1,
            cap_gib=12.0,
            max_workers=1,
            variants=ABLATION_VARIANTS,
        ),
        # max_workers=1: one gpt2-medium worker at seq 1024 peaks at 12.6 GB (eager fp32, batch 1), so two side
        # by side can exhaust a 24 GiB machine; variants run one after another on an otherwise idle machine.
    )
}


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        close = difflib.get_close_matches(name, list(SUITES), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown benchmark suite {name!r}: {hint}choose one of {', '.join(SUITES)}")
    return SUITES[name]


def resolve_variants(names: list[str] | None, suite: Suite | None = None) -> list[Variant]:
    """The requested variants (default: the suite's) in the canonical order (the reference first when present)."""
    names = list(names or (suite.variants if suite is not None else DEFAULT_VARIANTS))
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}: choose from {', '.join(VARIANTS)}")
    order = list(VARIANTS)
    return [VARIANTS[n] for n in sorted(dict.fromkeys(names), key=order.index)]


def select_cases(suite: Suite, patterns: list[str] | None) -> tuple[Case, ...]:
    """Cases whose name contains any of `patterns` or matches it as a shell-style glob (``hf-llama-*``); all cases
    when none are given."""
    if not patterns:
        return suite.cases
    chosen = tuple(c for c in suite.cases if any(p in c.name or fnmatch.fnmatchcase(c.name, p) for p in patterns))
    if not chosen:
        raise ValueError(
            f"no case of suite {suite.name!r} matches {patterns}: cases are {', '.join(c.name for c in suite.cases)}"
        )
    return chosen


def with_overrides(suite: Suite, **changes: object) -> Suite:
    """The suite with non-None fields replaced (CLI flags such as --steps, --repeats, --cap-gib)."""
    return dataclasses.replace(suite, **{k: v for k, v in changes.items() if v is not None})
