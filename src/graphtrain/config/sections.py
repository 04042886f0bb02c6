"""One typed, validated configuration for graphtrain: engine, model, data, optimizer, trainer.

Every section is a dataclass; the string under each field is its documentation (the CLI shows
it as help). YAML job files map onto these sections one to one::

    model: {name: gpt2-mini}
    train: {steps: 200, batch_size: 8}
    engine: {provider: auto, precision: bf16}

Values are validated on creation: an unknown key, a wrong type or an out-of-range value raises
``ValueError``/``TypeError`` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from graphtrain.config.jobfile import NestedTooDeep, load_job_file, yaml_load  # noqa: F401 - re-exported (graphtrain.config.sections API)
from graphtrain.config.schema import field_docs, from_dict, suggest, validate


@dataclass
class EngineConfig:
    """How graphtrain captures, optimizes and runs the training graph."""

    provider: Literal["auto", "aten", "inductor"] = "auto"
    """Execution provider: `aten` runs the optimized graph op by op (the reference), `inductor`
    generates code with TorchInductor, `auto` picks the measured-fastest one for the device."""
    fallback: Literal["warn", "error", "silent"] = "warn"
    """When capture or a pass fails: run that part eagerly and warn once, raise, or stay quiet."""
    passes: dict[str, bool] = field(default_factory=dict)
    """Switch passes on or off by name, e.g. {fuse_attention: false}; unnamed ones keep their default."""
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    """Compute precision, applied as a graph pass; parameters stay fp32 (master weights). `auto`: bf16
    where the hardware computes it natively (CUDA with bf16; CPUs with AVX512_BF16, AMX or AVX-NE-CONVERT),
    fp32 elsewhere. bf16 on a CPU without it warns: its matmuls are emulated (~30x slower than fp32 on
    an AVX2 EPYC)."""
    loss_scale_init: float = 65536.0
    """fp16 only: the initial dynamic loss scale."""
    loss_scale_growth: float = 2.0
    """fp16 only: multiply the scale by this after `loss_scale_interval` clean steps."""
    loss_scale_backoff: float = 0.5
    """fp16 only: multiply the scale by this when a step overflows."""
    loss_scale_interval: int = 2000
    """fp16 only: clean steps before the scale grows."""
    loss_scale_hysteresis: int = 2
    """fp16 only: overflowing steps tolerated before the scale backs off."""
    loss_scale_min: float = 1.0
    """fp16 only: the scale never drops below this."""
    recompute: Literal["none", "auto", "selective", "full"] = "none"
    """Activation recompute: none, auto (fit `memory_budget` at least added compute), selective
    (the attention core and cheap elementwise ops), full (checkpoint every layer but the last)."""
    memory_budget: float | None = None
    """Memory budget for `recompute: auto`: bytes (> 1) or a fraction (0-1] of the memory of the device the run uses
    (a GPU's memory, or RAM for a CPU run: graphtrain.memory.budget)."""
    cpu_allocator: Literal["auto", "keep", "release", "default"] = "auto"
    """How glibc's malloc treats freed CPU tensors (set once per process, at the first compile): `keep` serves
    blocks up to 1 GiB from its heap and keeps them for the next step (no page faults on reuse: ~12% of a Hugging
    Face GPT-2 step on a 2-core Xeon), `release` returns blocks over 128 KiB to the OS (the lowest peak, slower),
    `default` leaves glibc alone; `auto`: release under recompute or a memory budget, keep otherwise."""
    cpu_huge_pages: bool | Literal["auto"] = "auto"
    """Put CPU tensors of 2 MiB and more on transparent huge pages (set once per process, at the first compile,
    where the kernel offers them): their first touch faults 2 MiB at a time instead of 4 KiB, which is most of a
    large model's first step (gradients and optimizer state) and, without `keep`, of every step's fresh
    activations (memory/allocator.py). Blocks round up to 2 MiB of resident memory at most. `auto`: on, except
    under cpu_allocator `keep` for a model of less than 256 MiB of parameters, where the steps reuse their blocks
    anyway and the rounding only adds memory (the default job, gpt2-mini: peak 770-776 MB with them, 725-739
    without, same step time, 2-core Zen 5)."""
    cpu_block_cache: bool = True
    """Under `cpu_allocator: release`, keep freed CPU blocks of 128 KiB and more for the next request of their size
    instead of returning them to the OS, bounded so that blocks in use plus kept never pass the most ever in use
    at once: the same peak as returning them, without faulting each step's fresh activations in again
    (memory/allocator.py use_block_cache)."""
    cpu_prefault: bool = True
    """Record the CPU memory a training module's first step asks for (blocks of 2 MiB and more: its gradients and
    optimizer state, first touched then) in the cache folder, and in a later process with the same model, inputs
    and config fault it in on a background thread while Dynamo traces, so the first step finds it ready
    (memory/prefault.py). Needs graphtrain's CPU allocator (cpu_huge_pages or the block cache)."""
    cache_dir: str | None = None
    """Persistent compile cache folder; default ~/.cache/graphtrain/compile."""
    dynamic: bool = False
    """Compile with dynamic shapes instead of recompiling per new input shape."""
    compile_blocks: bool = True
    """Compile each repeated block (a ModuleList of identical layers) once and reuse it for every layer, with the
    code before and after the blocks in graphs of their own; false compiles the model as one graph (and
    train.whole_step's step as one graph, forward to AdamW)."""
    static_masks: bool = True
    """A mask built from shapes alone (Hugging Face's causal mask under a tracer) reaches SDPA as ``is_causal=True``
    or no mask; an HF model's all-ones 2-D ``attention_mask`` is passed as None (passes/static_masks.py)."""
    compile_in_background: bool = True
    """provider auto, cold cache: run each graph on aten (compiled in about a second) from the first step and
    compile Inductor in a background process from the second step on; the graph's next call times both and keeps
    the faster. Warm cache: a graph whose stored winner is Inductor runs its first step on aten and loads Inductor
    from the caches at the second. false compiles (and on a cold cache times) both before the first step (slower to
    start; every step runs on the winner)."""
    background_at_exit: Literal["finish", "stop"] = "stop"
    """A background Inductor compile still running when the training process exits: `stop` (the default) ends it
    with the run, on a normal exit, SIGTERM or Ctrl-C (and, on Linux, when the training process is killed): nothing
    is left running. `finish` lets it complete as a detached process named graphtrain-bg at lower CPU priority
    (nice 10), saying so in one line, so that the next run starts from its results (a run shorter than the compile
    otherwise starts cold every time); `graphtrain cache list` shows it, `graphtrain cache stop` ends it.
    GRAPHTRAIN_BACKGROUND_AT_EXIT overrides this (finish or stop)."""
    background_timeout: float = 600.0
    """provider auto: seconds a background Inductor compile may spend on one graph (0: no limit). A graph that takes
    longer stays on aten, with a note in the report, and the cache remembers it, so later runs do not compile it again
    until the limit is raised. (Swin under ``dynamic=True`` once compiled for more than 15 minutes on one core.)"""
    debug: bool = False
    """Log each pass's time and op-count diff, and lint every graph after every pass."""

    def __post_init__(self) -> None:
        _validate(self)
        if self.memory_budget is not None and not (0 < self.memory_budget <= 1 or self.memory_budget >= 2**20):
            raise ValueError(
                f"engine.memory_budget={self.memory_budget:g} is out of range: give a fraction of device "
                f"memory in (0, 1], e.g. 0.5, or bytes (at least 1 MiB), e.g. 2000000000"
            )
        if self.recompute == "auto" and self.memory_budget is None:  # said now, not as a fallback at the first step
            raise ValueError(
                "engine.recompute=auto fits the step into engine.memory_budget, which is not set: give it "
                "as bytes (e.g. engine.memory_budget=2000000000) or a fraction of device memory (e.g. "
                "0.5), or choose engine.recompute=selective or full"
            )
        if self.background_timeout < 0:
            raise ValueError(
                f"engine.background_timeout must be seconds >= 0 (0: no limit), got {self.background_timeout}"
            )
        if self.loss_scale_backoff <= 0 or self.loss_scale_backoff >= 1:
            raise ValueError("engine.loss_scale_backoff must be in (0, 1), e.g. 0.5")
        if self.loss_scale_growth <= 1:
            raise ValueError("engine.loss_scale_growth must be > 1, e.g. 2.0")
        for k, v in self.passes.items():
            if not isinstance(v, bool):
                raise TypeError(f"engine.passes.{k} must be true or false, got {v!r}")


MAX_VOCAB = 2**24  # ids: a vocabulary past this is a typo (its embedding alone would be gigabytes per layer width)


@dataclass
class ModelConfig:
    """Which reference model to build."""

    name: str = "gpt2-mini"
    """Preset name (see `graphtrain.models.PRESETS`), e.g. gpt2-tiny, gpt2-mini, bert-mini, gpt2-medium; with model.hf
    only a label."""
    hf: str | None = None
    """A Hugging Face model instead of a preset: a local model folder (config.json; its model.safetensors weights
    when present) or a config.json (random init). Built with AutoModelForCausalLM / AutoModelForMaskedLM."""
    objective: Literal["clm", "mlm"] | None = None
    """model.hf: causal (clm) or masked (mlm) language modelling; null infers it from the config."""
    attention: Literal["explicit", "sdpa"] = "explicit"
    """explicit: matmul, scale, mask, softmax, dropout, matmul (as users write it); sdpa: F.scaled_dot_product_attention.
    model.hf: transformers' attn_implementation eager or sdpa."""
    dropout: float | None = None
    """Override the preset's dropout probability."""
    max_seq_len: int | None = None
    """Override the preset's number of learned positions."""
    vocab_size: int | None = None
    """Override the vocabulary size; by default it is the tokenizer's."""

    @property
    def label(self) -> str:
        """How logs name the model: the preset, or hf:<folder> for model.hf."""
        if self.hf is None:
            return self.name
        from pathlib import Path

        p = Path(self.hf)
        return f"hf:{(p.parent if p.suffix == '.json' else p).name or self.hf}"

    def __post_init__(self) -> None:
        _validate(self)
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.hf is not None and (not isinstance(self.hf, str) or not self.hf):
            raise ValueError(f"model.hf must be a path (a model folder or a config.json), got {self.hf!r}")
        if self.vocab_size is not None and not 1 <= self.vocab_size <= MAX_VOCAB:
            raise ValueError(
                f"model.vocab_size={self.vocab_size} is out of range: give 1 to {MAX_VOCAB:,} ids (the "
                f"largest published vocabularies hold about 256,000), or null for the tokenizer's size"
            )
        if self.objective is not None and self.hf is None:
            raise ValueError(
                "model.objective applies to model.hf models only (a preset's objective is its family): "
                "set model.hf, or drop model.objective"
            )


@dataclass
class DataConfig:
    """Where the training text comes from and how it is tokenized."""

    path: str | None = None
    """A folder of text or code files; by default the Python standard library's own source. Also: a .txt, .jsonl, .json
    or .parquet file or a folder of them (read with Hugging Face datasets, data.text_field per row), or pre-tokenized
    .bin (uint16, as nanoGPT writes) / .npy token arrays, memory-mapped (train.* and val.* files, or split by tail)."""
    text_field: str = "text"
    """.jsonl/.json/.parquet data: the field holding each row's text."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer (a tokenizer.json, or a folder with one) instead of training a BPE on the corpus."""
    seq_len: int = 128
    """Tokens per training sample."""
    vocab_size: int = 8192
    """Size of the byte-level BPE vocabulary trained on the corpus (ignored with data.tokenizer); for token arrays
    without data.tokenizer, the vocabulary the ids come from."""
    val_fraction: float = 0.05
    """Fraction of files held out for validation (chosen deterministically by file path)."""
    max_bytes: int | None = 8_000_000
    """Read at most this many bytes of source (null: all); keeps tokenizer training fast."""
    cache_dir: str | None = None
    """Where the tokenizer and token files are cached; default ~/.cache/graphtrain/data."""
    mlm_probability: float = 0.15
    """BERT only: fraction of tokens masked (of which 80% [MASK], 10% random, 10% kept)."""

    def __post_init__(self) -> None:
        _validate(self)
        self.path, self.cache_dir, self.tokenizer = map(_expand_user, (self.path, self.cache_dir, self.tokenizer))
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be at least 2, got {self.seq_len}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.vocab_size < 260:
            raise ValueError(f"data.vocab_size must be at least 260 (256 bytes + specials), got {self.vocab_size}")
        if self.vocab_size > MAX_VOCAB:
            raise ValueError(
                f"data.vocab_size={self.vocab_size} is out of range: give at most {MAX_VOCAB:,} (the "
                f"largest published vocabularies hold about 256,000)"
            )
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"data.mlm_probability must be in (0, 1), got {self.mlm_probability}")


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule."""

    name: Literal["adamw", "lamb"] = "adamw"
    """adamw or lamb (the BERT-Large recipe's optimizer)."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled weight decay; never applied to biases, norms and embeddings' positions."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam moment coefficients."""
    eps: float = 1e-8
    """Adam epsilon."""
    schedule: Literal["cosine", "linear", "poly", "constant"] = "cosine"
    """Decay after warmup: cosine, linear, poly (power `poly_power`) or constant."""
    poly_power: float = 1.0
    """Exponent of the `poly` schedule."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1
    """The schedule decays to lr * min_lr_ratio."""
    grad_clip: float | None = 1.0
    """Clip gradients to this global norm (null: no clipping)."""
    fused: bool = True
    """Use graphtrain's fused multi-tensor optimizer implementation."""

    def __post_init__(self) -> None:
        _validate(self)
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be positive, got {self.lr}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            raise ValueError("optim.warmup_steps must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(
                f"optim.min_lr_ratio must be in [0, 1] (the schedule ends at lr * min_lr_ratio), "
                f"got {self.min_lr_ratio}"
            )
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(
                f"optim.grad_clip must be positive (a global gradient norm), or null for no clipping; "
                f"got {self.grad_clip}"
            )
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if self.eps <= 0:
            raise ValueError(f"optim.eps must be positive, e.g. 1e-8, got {self.eps}")
        if self.poly_power <= 0:
            raise ValueError(f"optim.poly_power must be positive, got {self.poly_power}")


LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclass
class TrainConfig:
    """The training loop."""

    steps: int = 400
    """Optimizer steps to run in total."""
    batch_size: int | Literal["auto"] = 8
    """Samples per micro-batch, summed over data-parallel ranks (an optimizer step sees batch_size *
    grad_accum samples). `auto`: the largest micro-batch whose predicted step peak fits
    `engine.memory_budget` (per rank, times parallel.dp); grad_accum stays as set."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    eval_every: int = 200
    """Evaluate on the validation split every N steps (and at the end)."""
    eval_batches: int = 8
    """Validation batches per evaluation."""
    log_every: int = 10
    """Record metrics every N steps."""
    ckpt_every: int = 200
    """Save a checkpoint every N steps (and at the end); 0 saves only at the end."""
    keep_last: int = 3
    """Keep the N newest checkpoints (ckpt-NNNNNNN.pt), deleting older ones after each successful save; 0 keeps
    every checkpoint."""
    keep_best: bool = False
    """Also keep the checkpoint with the lowest validation loss as ckpt-best.pt (a sharded run: ckpt-best/), never
    pruned: updated at each save whose step was evaluated (train.eval_every, and the last step) and improved on it.
    `graphtrain export RUN --checkpoint best` exports it."""
    export_hf: bool = False
    """At the end of the run, write the final checkpoint as a Hugging Face folder in <out_dir>/hf (config.json,
    generation_config.json, model.safetensors and the run's tokenizer; what `graphtrain export RUN --format hf`
    writes), replacing the one an earlier run of the folder wrote."""
    out_dir: str = "runs/default"
    """Checkpoints, metrics.jsonl and the saved config go here."""
    seed: int = 1337
    """Seed for weights, data order and dropout."""
    deterministic: bool = False
    """Use deterministic algorithms, so a resumed run matches an uninterrupted one bitwise."""
    accelerate: bool = True
    """Run the training step through the graphtrain engine (false: plain eager PyTorch)."""
    whole_step: bool = False
    """Compile the whole step, forward, loss, backward, clipping, AdamW and fp16 loss scaling (graphtrain.compile_step):
    a model with repeated blocks through its graphs compiled block by block, then one update graph; one graph of the
    whole step otherwise (or with engine.compile_blocks false). Needs optim.name adamw, grad_accum 1, one process,
    accelerate true."""
    threads: int | None = None
    """torch intra-op threads (default: all cores)."""
    progress: bool = True
    """Show a live progress bar."""
    compile_wait: bool | Literal["auto"] = "auto"
    """engine.provider auto on a cold compile cache: after the first step (run on aten), wait for the background
    Inductor compile instead of training beside it. On a CPU the compile and the steps share the cores: on the
    2-core Zen 5, the default job's steps ran at 0.64-0.77 s beside it against 0.26 s for eager alone, and the
    compile alone took less time than they lost. `auto`: on a CPU, wait when at least 100 steps remain and
    otherwise give the compile up (aten runs the job: the compile would not pay for itself); on a GPU, train
    beside it (the steps leave the CPU to the compile). true: always wait; false: train beside it. The wait ends
    with each graph switched (Inductor's code loaded and timed against aten); a warm cache's stored winner is
    loaded at the same point whatever this says. Both are printed and kept out of the step times; the run's wall
    time includes them."""
    sample_prompt: str = "def "
    """GPT models: prompt completed at the end of training."""
    sample_tokens: int = 48
    """GPT models: tokens sampled for the final completion (0: none)."""
    init_from: str | None = None
    """Start from the model weights of this checkpoint (a ckpt-*.pt file, a sharded ckpt-* folder, or a
    run folder: its latest checkpoint), at step 0 with a fresh optimizer and this config's schedule.
    The model must have the same shapes (model.name, max_seq_len, vocab); data.seq_len may differ.
    Not together with --resume (which continues a run: weights, optimizer, step and RNG)."""
    preempt_grace_s: float = 30.0
    """On SIGTERM or SIGINT: seconds to finish the current step and write its checkpoint before exiting
    with status 75 (re-run with --resume auto to continue). A step still running then is abandoned:
    the run exits from the last checkpoint, saying so. A second SIGINT stops at once (status 130)."""
    max_bad_steps: int = 5
    """A step whose loss or gradient norm is not finite (or a loss spike) is skipped: no weight is
    updated. After this many such steps in a row the run stops with an error naming the step."""
    loss_spike_factor: float | None = None
    """Also skip a step whose loss exceeds this times the median of the last 50 updated steps' losses
    (from the 10th on), e.g. 3.0; null: off."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where metrics go: jsonl (metrics.jsonl, always written), tensorboard (event files in
    <out_dir>/tensorboard, with the engine's report as text), wandb (offline unless WANDB_MODE says otherwise)
    and mlflow (<out_dir>/mlflow.db unless MLFLOW_TRACKING_URI is set), the last two when installed."""
    trust_checkpoint: bool = False
    """Allow --resume-from and train.init_from to load a sharded checkpoint folder from outside
    train.out_dir. Its DCP .metadata is a Python pickle: graphtrain reads it with an allow-list of
    DCP's own classes, but refuses foreign folders unless you set this (only for folders you trust)."""

    def __post_init__(self) -> None:
        _validate(self)
        # `~` expanded here, once, so that every reader of out_dir (the run's writes, the lock, the checks) means the
        # same folder: a run once landed in ./~/... while the out_dir check created an empty folder under $HOME
        self.out_dir = _expand_user(self.out_dir)
        self.init_from = _expand_user(self.init_from)
        if self.preempt_grace_s <= 0:
            raise ValueError(f"train.preempt_grace_s must be positive (seconds), got {self.preempt_grace_s}")
        unknown = [n for n in self.loggers if n not in LOGGERS]
        if unknown:
            raise ValueError(f"train.loggers: unknown logger(s) {unknown}; choose from {list(LOGGERS)}")
        if self.loss_spike_factor is not None and self.loss_spike_factor <= 1:
            raise ValueError(
                f"train.loss_spike_factor must be > 1 (a multiple of the median loss), e.g. 3.0, or "
                f"null (off); got {self.loss_spike_factor}"
            )
        if self.keep_last < 0:
            raise ValueError(f"train.keep_last must be >= 0 (0 keeps every checkpoint), got {self.keep_last}")
        for name in ("steps", "grad_accum", "eval_batches", "log_every", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size != "auto" and self.batch_size < 1:
            raise ValueError(f"train.batch_size must be >= 1 or 'auto', got {self.batch_size}")
        for name in ("eval_every", "ckpt_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0 (0: only at the end), got {getattr(self, name)}")
        if self.init_from is not None and not self.init_from.strip():
            raise ValueError("train.init_from must be a checkpoint file or run folder, or null (random init)")


@dataclass
class ParallelConfig:
    """Distributed layout: dp * tp * pp must equal the world size."""

    dp: int = 1
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel (Megatron) degree."""
    pp: int = 1
    """Pipeline-parallel stages."""
    zero_stage: Literal[0, 1] = 0
    """1 shards optimizer state across data-parallel ranks (ZeRO stage 1)."""
    microbatches: int = 1
    """Pipeline micro-batches per step."""
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule."""
    timeout_s: int = 300
    """Collective timeout: a dead rank gives an error after this, never a hang."""

    def __post_init__(self) -> None:
        _validate(self)
        for name in ("dp", "tp", "pp", "microbatches", "timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass
class Config:
    """A whole graphtrain job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        _validate(self)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Config:
        return from_dict(cls, d or {}, prefix="")

    @classmethod
    def from_yaml(cls, path: str | Path) -> Config:
        """A YAML job file; `defaults: [base.yaml, ...]` in it names base files (relative to it) merged first, in
        order, section by section, with the file's own keys on top."""
        return cls.from_dict(load_job_file(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        d = self.to_dict()
        d["optim"]["betas"] = list(d["optim"]["betas"])
        return yaml.safe_dump(d, sort_keys=False)

    def with_overrides(self, overrides: list[str] | dict[str, Any]) -> Config:
        """Apply `section.key=value` overrides (values parsed as YAML) and re-validate."""
        d = self.to_dict()
        items = overrides.items() if isinstance(overrides, dict) else [_split_override(o) for o in overrides]
        for key, value in items:
            parts = key.split(".")
            node = d
            for i, p in enumerate(parts[:-1]):
                if not isinstance(node.get(p), dict):
                    raise ValueError(
                        f"unknown config key {key!r}: {'.'.join(parts[: i + 1])!r} is not a section"
                        f"{suggest(p, [k for k, v in node.items() if isinstance(v, dict)])}"
                    )
                node = node[p]
            node[parts[-1]] = value
        return Config.from_dict(d)


def _split_override(o: str) -> tuple[str, Any]:
    if "=" not in o:
        raise ValueError(f"override {o!r} must look like section.key=value, e.g. train.steps=50")
    key, raw = o.split("=", 1)
    try:
        value = yaml_load(raw) if raw != "" else None
    except NestedTooDeep as e:
        raise ValueError(f"override {key.strip()}: {e}") from None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


# ----------------------------------------------------------------------------- validation ----


def _section_name(cls: type) -> str:
    for f in dataclasses.fields(Config):
        if f.default_factory is cls:  # type: ignore[comparison-overlap]
            return f.name + "."
    return ""


def _validate(obj: Any) -> None:
    validate(obj, _section_name(type(obj)))


def _expand_user(path: str | None) -> str | None:
    """A path key with a leading `~` or `~user` expanded (os.path.expanduser); other paths as given."""
    return os.path.expanduser(path) if isinstance(path, str) and path.startswith("~") else path


PATH_KEYS = (
    ("train", "out_dir"),
    ("train", "init_from"),
    ("data", "path"),
    ("data", "cache_dir"),
    ("data", "tokenizer"),
)  # expanded when a Config is made


def expand_path_keys(d: dict[str, Any]) -> dict[str, Any]:
    """A config dict (a checkpoint's, saved before `~` was expanded at creation) with PATH_KEYS expanded as a new
    Config's are, so that comparing it with one does not see `~/x` and `/home/me/x` as a change."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for section, key in PATH_KEYS:
        if isinstance(out.get(section), dict) and key in out[section]:
            out[section][key] = _expand_user(out[section][key])
    return out


def describe_all() -> str:
    """Every config key with its default and documentation, for `graphtrain config` (no arguments)."""
    lines = []
    default = Config()
    for sec in dataclasses.fields(Config):
        sub = getattr(default, sec.name)
        lines.append(f"{sec.name}:  {type(sub).__doc__}")
        docs = field_docs(type(sub))
        for f in dataclasses.fields(sub):
            lines.append(f"  {sec.name}.{f.name} = {getattr(sub, f.name)!r}\n      {docs.get(f.name, '')}")
    return "\n".join(lines)


def resolve_engine_config(config: Config | EngineConfig | dict | None, overrides: dict[str, Any]) -> EngineConfig:
    """Accept a Config, an EngineConfig, a dict of engine keys or None, plus keyword overrides."""
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, Config):
        base = dataclasses.asdict(config.engine)
    elif isinstance(config, EngineConfig):
        base = dataclasses.asdict(config)
    elif isinstance(config, dict):
        base = dict(config)
    else:
        raise TypeError(f"config must be a graphtrain.Config, EngineConfig, dict or None, got {type(config).__name__}")
    base.update(overrides)
    return from_dict(EngineConfig, base, prefix="engine.")
