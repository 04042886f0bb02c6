"""The Trainer behind `graphtrain train`: one straight-line loop you can read top to bottom.

    trainer = Trainer(Config())          # builds data, model (vocab from the tokenizer), optimizer
    summary = trainer.fit()              # train, evaluate, checkpoint; returns losses and speed
    print(trainer.sample("def ", 48))    # GPT models: complete a prompt

`fit()` is the same loop in every mode: resume, then per step the learning rate, one optimizer step,
logging, evaluation and checkpoints. How the step runs is a step strategy (trainer/strategies.py):
`SingleProcessStep` (eager, or through the graph engine with train.accelerate), `WholeStepGraph`
(train.whole_step: the whole step as one graph) or `DistributedStep` (parallel.dp*tp*pp > 1). The
strategy builds the model and optimizer, steps, evaluates and saves and loads checkpoints.

Everything a step depends on is a function of (config, step): batches come from
``get_batch(step * grad_accum + micro)`` and the learning rate from `lr_at(step)`, so a checkpoint
(weights, optimizer, step, RNG) is all a resumed run needs. With ``train.deterministic`` a run
stopped at step k and resumed matches an uninterrupted one bitwise.

Distributed (under torchrun: `graphtrain train --nproc N parallel.dp=N`): every rank draws the same
full batch and keeps its data-parallel rank's rows; the logged loss and the validation loss are
averaged over dp ranks. Only rank 0 logs, prints, shows the progress bar and samples; checkpoints are
sharded folders (`ckpt-NNNNNNN/`). With train.accelerate each rank's part of the model runs through
the graph engine, per layout (after the first step rank 0 logs how many graphs each rank captured).
With pp > 1 training and evaluation run the pipeline schedule over parallel.microbatches, and
`sample()` reads the whole model from the latest checkpoint on rank 0.

`train.batch_size: auto` picks the largest micro-batch whose predicted step peak fits
`engine.memory_budget` (`graphtrain.engine.autobatch.pick_batch_size`; per rank, times parallel.dp);
train.grad_accum is kept, so an optimizer step sees batch_size * grad_accum samples. The chosen
number replaces `auto` in the saved config, so a resumed run draws the same batches.

`train.init_from: PATH` loads only the model weights of a checkpoint (file, sharded folder or run
folder) before training starts at step 0 with a fresh optimizer (BERT phase 2 from phase 1).
"""
from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm.auto import tqdm

from graphtrain.config import Config
from graphtrain.models import build_model, get_spec
from graphtrain.trainer import runtime
from graphtrain.trainer.checkpoint import (FORMAT_VERSION, is_sharded, latest_checkpoint, list_checkpoints,
                                           load_weights)
from graphtrain.trainer.metrics import MetricsLog, Throughput, format_bytes, peak_memory_bytes
from graphtrain.trainer.schedule import lr_at
from graphtrain.trainer.strategies import build_strategy

_INIT_FROM_AND_RESUME = ("train.init_from and --resume cannot be combined: --resume continues a run (weights, "
                         "optimizer, step), init_from starts a new one from a checkpoint's weights; to continue a "
                         "run started with init_from, add train.init_from=null")


class Trainer:
    """Train `config.model` on `config.data`; `model`/`data` may be passed in instead of built.

    `resume`: False (fresh run; refuses an out_dir that already holds checkpoints), True (continue
    from the latest checkpoint in out_dir) or a checkpoint file / run folder to continue from.
    """

    def __init__(self, config: Config, model: torch.nn.Module | None = None, data: Any = None,
                 resume: bool | str | Path = False) -> None:
        if not isinstance(config, Config):
            raise TypeError(f"Trainer expects a graphtrain.Config, got {type(config).__name__}; "
                            f"build one with Config() or Config.from_yaml(path)")
        runtime.check_supported(config)
        if config.train.init_from is not None and resume:
            raise ValueError(_INIT_FROM_AND_RESUME)
        self.config, self.resume = config, resume
        self.env = None
        if config.parallel.world_size > 1:
            from graphtrain.distributed import init_distributed
            self.env = init_distributed(config.parallel)  # clear error when not launched under torchrun
        self.is_main = self.env is None or self.env.is_main
        self.device = self.env.device if self.env is not None else runtime.pick_device()
        runtime.setup(config.train)  # threads, deterministic algorithms

        family = model.family if model is not None else get_spec(config.model.name).family
        self.data = data if data is not None else runtime.load_data(config, family, self.env)
        if config.train.batch_size == "auto":
            config, line = runtime.auto_batch_size(config, model, self.data.vocab_size, self.device)
            self.config = config
            self._log(line)
        runtime.seed_everything(config.train.seed)  # weights depend on the seed only, not on data preparation
        if model is None:
            model = build_model(config.model, vocab_size=self.data.vocab_size)
        self.family, self.spec = model.family, model.spec
        if config.data.seq_len > self.spec.max_seq_len:
            raise ValueError(f"data.seq_len={config.data.seq_len} is longer than model {config.model.name!r} supports "
                             f"(max_seq_len={self.spec.max_seq_len}): lower data.seq_len, or set "
                             f"model.max_seq_len={config.data.seq_len}")
        self.init_source = None
        if config.train.init_from is not None:
            self.init_source, step = load_weights(model, config.train.init_from, config, self._model_spec())
            self._log(f"initialised weights from {self.init_source} (step {step} of that run); optimizer and step "
                      f"start fresh")
        self.strategy = build_strategy(model, config, self.device, self.env, self._log)
        # what trains (accelerated module, DDP wrapper, pipeline stage) and its optimizer (WholeStepGraph: the graph)
        self.model, self.optimizer = self.strategy.model, self.strategy.optimizer
        self.out_dir = Path(config.train.out_dir)
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl")
        self.step = 0  # optimizer steps completed

    # ------------------------------------------------------------------------------ training ----
    def fit(self, resume: bool | str | Path | None = None) -> dict[str, Any]:
        """Train to `train.steps`, evaluating and checkpointing on the way; returns a summary."""
        cfg, tc = self.config, self.config.train
        self.step = self._start_run(self.resume if resume is None else resume)
        accum = tc.grad_accum
        tokens_per_step = tc.batch_size * accum * cfg.data.seq_len
        speed = Throughput(tokens_per_step)
        recent: list[float] = []  # train losses since the last log line
        train_loss = val_loss = math.nan
        saved: Path | None = None
        self.model.train()
        bar = tqdm(total=tc.steps, initial=self.step, disable=not (tc.progress and self.is_main), unit="step",
                   dynamic_ncols=True, desc=f"train {cfg.model.name}")
        try:
            for step in range(self.step, tc.steps):
                t0 = time.perf_counter()
                lr = lr_at(step, cfg.optim, tc.steps)
                out = self.strategy.step(self._batches(self.data.train, step * accum, accum), lr)
                step_loss = out.loss.item()  # also waits for the device, so the timing is real
                speed.add(time.perf_counter() - t0)
                self.step = done = step + 1
                if not math.isfinite(step_loss):
                    clip = " and set optim.grad_clip=1.0" if cfg.optim.grad_clip is None else ""
                    raise ValueError(f"training diverged: the loss is {step_loss} at step {done} (nothing saved for "
                                     f"this step); lower optim.lr (now {cfg.optim.lr}){clip}, then resume from the "
                                     f"last checkpoint (--resume-from) or start fresh")
                recent.append(step_loss)
                bar.update(1)

                if self.is_main and (done % tc.log_every == 0 or done == tc.steps):
                    ms, tok_s = speed.window()
                    mem = peak_memory_bytes(self.device)
                    train_loss = sum(recent) / len(recent)
                    recent.clear()
                    self.metrics.write("train", done, loss=train_loss, lr=lr, tokens_per_s=tok_s, ms_per_step=ms,
                                       peak_mem_bytes=mem, grad_norm=out.grad_norm, skipped=out.skipped,
                                       loss_scale=out.scale)
                    bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tok_s:,.0f}", mem=format_bytes(mem))
                    if not tc.progress:
                        print(f"step {done:>6}/{tc.steps}  loss {train_loss:.4f}  lr {lr:.2e}  {tok_s:,.0f} tok/s  "
                              f"{ms:.0f} ms/step  peak mem {format_bytes(mem)}", flush=True)
                if (tc.eval_every and done % tc.eval_every == 0) or done == tc.steps:
                    val_loss = self.evaluate()
                    if self.is_main:
                        self.metrics.write("eval", done, val_loss=val_loss)
                    self._log(f"step {done}: val loss {val_loss:.4f}")
                if (tc.ckpt_every and done % tc.ckpt_every == 0) or done == tc.steps:
                    saved = self.save_checkpoint(metrics={"train_loss": train_loss, "val_loss": val_loss})
        finally:
            bar.close()

        if math.isnan(val_loss):  # resumed a finished run: no step ran
            val_loss = self.evaluate()
        ms, tok_s = speed.overall()
        first_ms = None if speed.first_step_s is None else 1000 * speed.first_step_s
        summary = {"steps": self.step, "train_loss": train_loss, "val_loss": val_loss, "tokens_per_s": tok_s,
                   "ms_per_step": ms, "first_step_ms": first_ms,
                   "peak_mem_bytes": peak_memory_bytes(self.device), "tokens_per_step": tokens_per_step,
                   "checkpoint": str(saved or latest_checkpoint(self.out_dir) or ""), "out_dir": str(self.out_dir)}
        if self.is_main:
            self.metrics.write("summary", self.step, **summary)
        return summary

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over `train.eval_batches` fixed batches (eval mode, no grad, RNG untouched)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                return self.strategy.eval_loss(self._batches(self.data.val, 0, self.config.train.eval_batches))
        finally:
            self.model.train(was_training)

    def sample(self, prompt: str, n_tokens: int, *, temperature: float = 0.8, top_k: int | None = 20,
               seed: int | None = None) -> str:
        """GPT models: `prompt` followed by `n_tokens` sampled tokens (temperature 0: greedy).

        Sampling draws from its own generator seeded with `seed` (default `train.seed`), so the
        same weights give the same completion and the global RNG is untouched.
        """
        if self.family != "gpt2":
            raise ValueError(f"sample() needs a GPT model; {self.config.model.name!r} is a {self.family} "
                             f"(masked LM) model")
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        module = self.strategy.whole_model(self.out_dir, self.data.vocab_size)
        tok = self.data.tokenizer
        ids = list(tok.encode(prompt)) or [tok.eos_id]
        ids = ids[-self.spec.max_seq_len:]
        gen = torch.Generator(device=self.device).manual_seed(self.config.train.seed if seed is None else seed)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        # Eagerly: every generated token is a new sequence length, i.e. a recompile for the engine.
        with torch.compiler.set_stance("force_eager"):
            out = module.generate(x, n_tokens, temperature=temperature, top_k=top_k, generator=gen)
        new = out[0, len(ids):].tolist()
        eos = getattr(tok, "eos_id", None)
        if eos is not None and eos in new:
            new = new[:new.index(eos)]
        return prompt + tok.decode(new)

    # ---------------------------------------------------------------------------- checkpoints ----
    def save_checkpoint(self, metrics: dict[str, Any] | None = None) -> Path:
        """Save ckpt-{step}.pt atomically (distributed: the sharded folder ckpt-{step}/), keep the last few."""
        meta = {"format_version": FORMAT_VERSION, "step": self.step, "config": self.config.to_dict(),
                "model_spec": self._model_spec(), "metrics": metrics or {}}
        return self.strategy.save(self.out_dir, meta)

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore weights, optimizer, RNG from `path` (validated against this model); returns its step."""
        self.step = self.strategy.load(Path(path), self._model_spec())
        return self.step

    def _start_run(self, resume: bool | str | Path) -> int:
        """Check out_dir, restore a checkpoint when resuming, save the config; returns the first step."""
        tc = self.config.train
        if resume and tc.init_from is not None:
            raise ValueError(_INIT_FROM_AND_RESUME)
        start = 0
        if resume:
            source = latest_checkpoint(self.out_dir) if resume is True else Path(resume)
            if source is not None and source.is_dir() and not is_sharded(source):
                source = latest_checkpoint(source)
            if source is None:
                where = self.out_dir if resume is True else Path(resume)
                raise ValueError(f"resume: no checkpoint (ckpt-*.pt) in {str(where)!r}; train without --resume to "
                                 f"start fresh, or point train.out_dir (--out) at the run to continue")
            start = self.load_checkpoint(source)
            if start > tc.steps:
                raise ValueError(f"checkpoint {str(source)!r} is at step {start}, past train.steps={tc.steps}: "
                                 f"set train.steps above {start} to continue training it")
            if self.is_main:
                self.metrics.truncate_after(start)
            self._log(f"resumed from {source} at step {start}")
        else:
            existing = list_checkpoints(self.out_dir)
            if existing:
                raise ValueError(f"out_dir {str(self.out_dir)!r} already holds checkpoints (latest "
                                 f"{existing[-1][1].name}); continue that run with --resume (resume=True), or "
                                 f"choose a new out_dir (--out DIR / train.out_dir=...)")
            if self.is_main:
                self.metrics.reset()
        if self.is_main:
            runtime.write_text_atomic(self.out_dir / "config.yaml", self.config.to_yaml())
        self._log(f"# graphtrain config (saved to {self.out_dir / 'config.yaml'})\n{self.config.to_yaml()}")
        where = f"device {self.device}, {torch.get_num_threads()} threads"
        par = self.config.parallel
        if self.env is not None:
            where += (f" per rank, {self.env.world_size} ranks (pp {par.pp} x dp {par.dp} x tp {par.tp}"
                      f"{', ZeRO-1' if par.zero_stage else ''})")
        module = self.strategy.module
        n_params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.parameters())
        local = " (this rank)" if par.tp > 1 or par.pp > 1 else ""
        self._log(f"model {self.config.model.name}: {n_params:,} params{local}, {where}, "
                  f"{'graphtrain engine' if runtime.is_accelerated(module) else 'eager PyTorch'}")
        return start

    def close(self) -> None:
        """Distributed runs: destroy the process group (call once training and sampling are done)."""
        if self.env is not None:
            from graphtrain.distributed import shutdown
            shutdown()

    # -------------------------------------------------------------------------------- helpers ----
    def _batches(self, split: Any, first: int, n: int) -> Iterator[dict[str, torch.Tensor]]:
        """Batches first .. first+n-1 of a data split on the device, each drawn when the step takes it."""
        for index in range(first, first + n):
            batch = split.get_batch(index, self.config.train.batch_size)
            if self.device.type != "cpu":
                batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            yield batch

    def _model_spec(self) -> dict[str, Any]:
        return dataclasses.asdict(self.spec)

    def _log(self, text: str) -> None:
        if self.is_main:
            tqdm.write(text)
