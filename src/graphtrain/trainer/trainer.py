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
`engine.memory_budget` (`graphtrain.tools.autobatch.pick_batch_size`; per rank, times parallel.dp);
train.grad_accum is kept, so an optimizer step sees batch_size * grad_accum samples. The chosen
number replaces `auto` in the saved config, so a resumed run draws the same batches.

`train.init_from: PATH` loads only the model weights of a checkpoint (file, sharded folder or run
folder) before training starts at step 0 with a fresh optimizer (BERT phase 2 from phase 1).
"""

from __future__ import annotations

import dataclasses
import errno
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from graphtrain.checksums import digests_reused
from graphtrain.config.sections import Config, expand_path_keys
from graphtrain.early_preempt import before_first_step
from graphtrain.models import build_model, resolve_spec
from graphtrain.trainer import console, runinfo, runtime
from graphtrain.trainer.checkpoint import (
    FORMAT_VERSION,
    check_trusted,
    checkpoint_meta,
    is_sharded,
    latest_checkpoint,
    latest_valid_checkpoint,
    list_checkpoints,
    load_weights,
)
from graphtrain.trainer.compile_wait import compile_wait, prepare_compile_wait
from graphtrain.trainer.faults import (
    NumericsGuard,
    PreemptionGuard,
    TrainingFailed,
    TrainingPreempted,
    is_grace_expired,
)
from graphtrain.trainer.loggers import make_loggers
from graphtrain.trainer.metrics import MetricsLog, Throughput, format_bytes, peak_memory_bytes
from graphtrain.trainer.resume import allowed_keys, check_config_changes, clean_orphans, supersede_later
from graphtrain.trainer.run_outputs import best_checkpoint, update_best, write_hf_folder
from graphtrain.trainer.schedule import lr_at
from graphtrain.trainer.strategies import build_strategy

# Imports inside functions: import cost: an eager run (train.accelerate=false, one process) never loads the
# engine (Dynamo, Inductor), torch.distributed or the tools; each is imported where a run needs it.

_INIT_FROM_AND_RESUME = (
    "train.init_from and --resume cannot be combined: --resume continues a run (weights, "
    "optimizer, step), init_from starts a new one from a checkpoint's weights; to continue a "
    "run started with init_from, add train.init_from=null"
)


def _build_model(cfg: Any, vocab_size: int) -> torch.nn.Module:
    """build_model, with a model too big for memory as one line (the allocator's RuntimeError was a traceback)."""
    try:
        return build_model(cfg, vocab_size=vocab_size)
    except (RuntimeError, MemoryError) as e:
        if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "allocate" not in str(e):
            raise
        with torch.device("meta"):
            n = sum(p.numel() for p in build_model(cfg, vocab_size=vocab_size).parameters())
        raise TrainingFailed(
            f"building model {cfg.label!r} ({n:,} parameters, {n * 4 / 2**30:.1f} GiB of fp32 "
            f"weights) ran out of memory: choose a smaller model (model.name) or lower "
            f"model.vocab_size / model.max_seq_len"
        ) from None


class Trainer:
    """Train `config.model` on `config.data`; `model`/`data` may be passed in instead of built.

    `resume`: False (fresh run; refuses an out_dir that already holds checkpoints), True (continue
    from the latest valid checkpoint in out_dir; an error when there is none), "auto" (the same, or a fresh
    start when out_dir holds no checkpoint: one command starts and continues a run; with train.init_from,
    init_from applies to the fresh start only) or a checkpoint file / run folder to continue from. Corrupt
    checkpoints are skipped, saying so; later checkpoints than the one resumed move aside (trainer/resume.py).

    `allow_config_change`: config keys ("optim.lr,train.batch_size" or a sequence) that may differ from
    the resumed checkpoint's; any other difference, bar the free keys of `resume.is_free`, refuses the resume.
    """

    def __init__(
        self,
        config: Config,
        model: torch.nn.Module | None = None,
        data: Any = None,
        resume: bool | str | Path = False,
        allow_config_change: str | tuple[str, ...] | list[str] = (),
    ) -> None:
        if not isinstance(config, Config):
            raise TypeError(
                f"Trainer expects a graphtrain.Config, got {type(config).__name__}; "
                f"build one with Config() or Config.from_yaml(path)"
            )
        runtime.check_supported(config)
        if config.train.init_from is not None and resume and not _is_auto(resume):
            raise ValueError(_INIT_FROM_AND_RESUME)
        self.allow_config_change = allowed_keys(allow_config_change, config)
        self.config, self.resume = config, resume
        self.env = None
        if config.parallel.world_size > 1:
            from graphtrain.distributed import init_distributed

            self.env = init_distributed(config.parallel)  # clear error when not launched under torchrun
        self.is_main = self.env is None or self.env.is_main
        self.device = self.env.device if self.env is not None else runtime.pick_device()
        with before_first_step():  # SIGTERM while the data and model are prepared: exit 75, saying so
            runtime.setup(config.train)  # threads, deterministic algorithms

            family = model.family if model is not None else resolve_spec(config.model).family
            self.data = data if data is not None else runtime.load_data(config, family, self.env)
            self.data_peak_bytes = runtime.data_preparation_peak(self.device, self.data)
            if config.train.batch_size == "auto":
                config, line = runtime.auto_batch_size(config, model, self.data.vocab_size, self.device)
                self.config = config
                self._log(line)
            runtime.seed_everything(config.train.seed)  # weights depend on the seed only, not on data preparation
            if model is None:
                model = _build_model(config.model, self.data.vocab_size)
            self.family, self.spec = model.family, model.spec
            if config.data.seq_len > self.spec.max_seq_len:
                raise ValueError(
                    f"data.seq_len={config.data.seq_len} is longer than model {config.model.label!r} "
                    f"supports (max_seq_len={self.spec.max_seq_len}): lower data.seq_len, or set "
                    f"model.max_seq_len={config.data.seq_len}"
                )
            self.init_source = None
            # resume "auto" in a run that has checkpoints continues it (fit() picks and verifies the checkpoint, and
            # refuses when none verifies), so init_from applies only to a fresh start; listing is enough here
            if config.train.init_from is not None and not (_is_auto(resume) and list_checkpoints(config.train.out_dir)):
                self.init_source, step = load_weights(
                    model, config.train.init_from, config, self._model_spec(), self._log
                )
                self._log(
                    f"initialised weights from {self.init_source} (step {step} of that run); optimizer and step "
                    f"start fresh"
                )
            self._flops_per_token, self._peak = self._mfu_inputs(model)
            self.strategy = build_strategy(model, config, self.device, self.env, self._log)
            # what trains (accelerated module, DDP wrapper, pipeline stage), its optimizer (WholeStepGraph: the graph)
            self.model, self.optimizer = self.strategy.model, self.strategy.optimizer
            self.out_dir = Path(config.train.out_dir)
            # eval_callbacks: f(step, val_loss) -> a reason to stop training now, or None (graphtrain sweep's pruner)
            self.eval_callbacks: list[Callable[[int, float], str | None]] = []
            self.metrics = MetricsLog(
                self.out_dir / "metrics.jsonl",
                make_loggers(config.train.loggers, self.out_dir, config.to_dict()) if self.is_main else [],
            )
        self.step = 0  # optimizer steps completed

    # ------------------------------------------------------------------------------ training ----
    def fit(self, resume: bool | str | Path | None = None) -> dict[str, Any]:
        """Train to `train.steps`, evaluating and checkpointing on the way; returns a summary.

        Faults (trainer/faults.py): on SIGTERM/SIGINT the step in flight finishes, its checkpoint is written
        and `TrainingPreempted` is raised. A step with a non-finite loss or gradient norm (or a loss spike)
        is skipped, no weight written; `train.max_bad_steps` of them in a row raise `TrainingFailed`, as do
        running out of memory and a failed save (disk full). Checkpoints already written are never touched.
        """
        cfg, tc = self.config, self.config.train
        numerics = NumericsGuard(tc.max_bad_steps, tc.loss_spike_factor)
        bar = None
        with PreemptionGuard(tc.preempt_grace_s, self._log) as preempt:
            try:
                self.step = self._start_run(self.resume if resume is None else resume)
                self._first_step = self.step
                self.compile_wait_s: float | None = None  # train.compile_wait: seconds waited after the first step
                saved_step = self.step if self.step > 0 else None  # the step the latest checkpoint on disk holds
                accum = tc.grad_accum
                tokens_per_step = tc.batch_size * accum * cfg.data.seq_len
                speed = Throughput(tokens_per_step)
                recent: list[float] = []  # train losses of updated steps since the last log line
                skipped = 0  # skipped updates since the last log line
                train_loss = val_loss = math.nan
                val_step = None  # the step val_loss was measured at (train.keep_best compares only those)
                saved: Path | None = None
                self.model.train()
                bar = tqdm(
                    total=tc.steps,
                    initial=self.step,
                    unit="step",
                    disable=not console.show_bar(tc.progress, self.is_main),
                    dynamic_ncols=True,
                    desc=f"train {cfg.model.label}",
                )
                prepare_compile_wait(self.strategy.module, tc, self.step)
                for step in range(self.step, tc.steps):
                    preempt.phase = "step"
                    t0 = time.perf_counter()
                    lr = lr_at(step, cfg.optim, tc.steps)
                    out = self._train_step(step, lr, numerics.max_loss())
                    step_loss = out.loss.item()  # also waits for the device, so the timing is real
                    speed.add(time.perf_counter() - t0)
                    self.step = done = step + 1
                    if done == self._first_step + 1 and done < tc.steps:
                        self.compile_wait_s = compile_wait(
                            self.strategy.module,
                            tc,
                            self.device,
                            preempt,
                            bar,
                            self._log,
                            self.metrics if self.is_main else None,
                            done,
                        )
                    skipped += out.skipped
                    if out.rejected is not None:  # no update was made; stop after max_bad_steps in a row
                        self._log(f"step {done}: update skipped, {out.rejected}")
                        if self.is_main:
                            self.metrics.write(
                                "skip", done, reason=out.rejected, loss=step_loss, grad_norm=out.grad_norm
                            )
                    numerics.record(done, step_loss, out.rejected)
                    if out.rejected is None:
                        recent.append(step_loss)
                    bar.update(1)

                    if self.is_main and (done % tc.log_every == 0 or done == tc.steps):
                        ms, tok_s = speed.window()
                        mem = peak_memory_bytes(self.device)
                        train_loss = sum(recent) / len(recent) if recent else math.nan
                        recent.clear()
                        mfu = self._flops_per_token * tok_s / self._peak if self._peak else None
                        self.metrics.write(
                            "train",
                            done,
                            loss=train_loss,
                            lr=lr,
                            tokens_per_s=tok_s,
                            ms_per_step=ms,
                            peak_mem_bytes=mem,
                            grad_norm=out.grad_norm,
                            skipped=skipped,
                            bad_steps=numerics.total,
                            loss_scale=out.scale,
                            mfu=mfu,
                        )
                        skipped = 0
                        bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=console.human(tok_s), mem=format_bytes(mem))
                        if bar.disable:  # no terminal (a log file): plain lines, no carriage-return redraws
                            print(
                                console.step_line(
                                    done,
                                    tc.steps,
                                    train_loss,
                                    lr,
                                    tok_s,
                                    ms,
                                    mem,
                                    first=done - tc.log_every <= self._first_step,
                                ),
                                flush=True,
                            )
                    stop = None
                    if (tc.eval_every and done % tc.eval_every == 0) or done == tc.steps:
                        val_loss, val_step = self.evaluate(), done
                        if self.is_main:
                            self.metrics.write("eval", done, val_loss=val_loss)
                        self._log(f"step {done}: val loss {val_loss:.4f}")
                        stop = next((r for cb in self.eval_callbacks if (r := cb(done, val_loss))), None)
                    metrics = {"train_loss": train_loss, "val_loss": val_loss, "val_step": val_step}
                    if (tc.ckpt_every and done % tc.ckpt_every == 0) or done == tc.steps:
                        preempt.phase = "save"
                        saved, saved_step = self._save(metrics), done
                    if preempt.agreed(self.env):  # SIGTERM/SIGINT (on any rank): this step is the last
                        if saved_step != done:
                            preempt.phase = "save"
                            saved, saved_step = self._save(metrics), done
                        raise self._preempted(preempt, done, saved)
                    if stop is not None and done < tc.steps:
                        self._log(f"step {done}: stopped early: {stop}")
                        if self.is_main:
                            self.metrics.write("stopped", done, reason=stop)
                        break
            except BaseException as e:
                if is_grace_expired(e):  # the step in flight outlived train.preempt_grace_s
                    raise self._preempted(preempt, None, None) from None
                raise
            finally:
                if bar is not None:
                    bar.close()

        if math.isnan(val_loss):  # resumed a finished run: no step ran
            val_loss = self.evaluate()
        ms, tok_s = speed.overall()
        first_ms = None if speed.first_step_s is None else 1000 * speed.first_step_s
        summary = {
            "steps": self.step,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "tokens_per_s": tok_s,
            "ms_per_step": ms,
            "first_step_ms": first_ms,
            "compile_wait_s": self.compile_wait_s,
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "data_peak_mem_bytes": self.data_peak_bytes,
            "tokens_per_step": tokens_per_step,
            "checkpoint": str(saved or latest_checkpoint(self.out_dir) or ""),
            "out_dir": str(self.out_dir),
        }
        if self.is_main and tc.export_hf:  # after the last save: the folder is the final checkpoint
            hf = write_hf_folder(self.out_dir, cfg, self.data.tokenizer, self.data.vocab_size)
            summary["hf_folder"] = hf["out"]
            self._log(
                f"train.export_hf: wrote {hf['out']} ({hf['class']}, from {Path(hf['checkpoint']).name}; "
                f"reloaded by transformers, max abs logit difference {hf['max_abs_diff']:.2e})"
            )
        if self.is_main:
            self.metrics.write("summary", self.step, **summary)
            runinfo.finish_session(self.out_dir, self.step, self.strategy.module)
            self._log_engine_report()
        return summary

    def _mfu_inputs(self, model: torch.nn.Module) -> tuple[int, float | None]:
        """(model FLOPs per trained token, this machine's matmul peak in FLOP/s or None): MFU is logged
        when the peak was measured on this machine before (`graphtrain train` does it once per machine,
        `graphtrain bench` and `python -m graphtrain.kernels.flops` too; the Trainer itself never spends the
        seconds)."""
        from graphtrain.kernels import capability, flops

        per_token = flops.step_flops(
            flops.matmul_params(model), self.spec.n_layer, self.config.data.seq_len, self.spec.d_model, 1
        )
        peak = capability.peek_probe(f"matmul_peak_{self.device.type}", any_threads=True) or {}
        # the precision the engine runs (auto resolved as the engine resolves it), so bf16 steps meet the bf16 peak
        resolved = capability.resolve_precision(self.config.engine.precision, self.device.type)
        precision = "bf16" if self.config.train.accelerate and resolved in ("bf16", "fp16") else "fp32"
        value = flops.mfu_peak(peak, precision)  # a GPU's datasheet bf16 peak where known, as `graphtrain bench`'s
        if not value:
            self._log(
                f"MFU not logged: this machine's {precision} matmul peak was never measured (python -m "
                f"graphtrain.kernels.flops measures and caches it)"
            )
        return per_token, value if value else None

    def _log_engine_report(self) -> None:
        """The engine's report, as text, to the loggers that take text (TensorBoard's Text tab)."""
        sinks = [s for s in self.metrics.sinks if hasattr(s, "text")]
        if not sinks:
            return
        if not self.config.train.accelerate:
            for sink in sinks:
                sink.close()
            return
        from graphtrain.tools.report import report

        try:
            text = str(report(self.model))
        except Exception as e:  # noqa: BLE001 - a report is a convenience; the run's results are written
            text = f"engine report unavailable: {type(e).__name__}: {e}"
        for sink in sinks:
            sink.text("engine/report", text, self.step)
            sink.close()

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

    def sample(
        self, prompt: str, n_tokens: int, *, temperature: float = 0.8, top_k: int | None = 20, seed: int | None = None
    ) -> str:
        """GPT models: `prompt` followed by `n_tokens` sampled tokens (temperature 0: greedy).

        Sampling draws from its own generator seeded with `seed` (default `train.seed`), so the
        same weights give the same completion and the global RNG is untouched.
        """
        if self.family != "gpt2":
            raise ValueError(
                f"sample() needs a GPT model; {self.config.model.label!r} is a {self.family} (masked LM) model"
            )
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        if self.data.tokenizer is None:
            raise ValueError(
                "sample() needs a tokenizer to encode the prompt and decode tokens; this run trains on "
                "token arrays without one: set data.tokenizer to the tokenizer that made them"
            )
        module = self.strategy.whole_model(self.out_dir, self.data.vocab_size)
        tok = self.data.tokenizer
        ids = list(tok.encode(prompt)) or [tok.eos_id]
        ids = ids[-self.spec.max_seq_len :]
        gen = torch.Generator(device=self.device).manual_seed(self.config.train.seed if seed is None else seed)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        # Eagerly: every generated token is a new sequence length, i.e. a recompile for the engine.
        with torch.compiler.set_stance("force_eager"):
            out = module.generate(x, n_tokens, temperature=temperature, top_k=top_k, generator=gen)
        new = out[0, len(ids) :].tolist()
        eos = getattr(tok, "eos_id", None)
        if eos is not None and eos in new:
            new = new[: new.index(eos)]
        return prompt + tok.decode(new)

    # ---------------------------------------------------------------------------- checkpoints ----
    def save_checkpoint(self, metrics: dict[str, Any] | None = None) -> Path:
        """Save ckpt-{step}.pt atomically (distributed: the sharded folder ckpt-{step}/), keep the train.keep_last
        newest, and with train.keep_best make it ckpt-best when its step was evaluated and beat the best so far."""
        meta = {
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "config": self.config.to_dict(),
            "model_spec": self._model_spec(),
            "metrics": metrics or {},
        }
        tok = getattr(self.data, "tokenizer", None)
        if tok is not None and hasattr(tok, "to_str"):  # the tokenizer travels with the weights; resume checks it
            meta["tokenizer"] = {"sha256": tok.digest(), "json": tok.to_str(), "specials": tok.specials}
        path = self.strategy.save(self.out_dir, meta)
        val = (metrics or {}).get("val_loss")
        if (
            self.config.train.keep_best
            and self.is_main
            and (metrics or {}).get("val_step") == self.step
            and isinstance(val, float)
            and update_best(self.out_dir, path, val)
        ):
            self._log(
                f"step {self.step}: best validation loss so far ({val:.4f}): kept as {best_checkpoint(self.out_dir)}"
            )
        return path

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore weights, optimizer, RNG from `path` (verified, validated against this model); returns its step.
        A sharded folder outside train.out_dir needs train.trust_checkpoint (checkpoint.check_trusted)."""
        check_trusted(path, self.config, "resume")
        self.step = self.strategy.load(Path(path), self._model_spec())
        return self.step

    def _start_run(self, resume: bool | str | Path) -> int:
        """Clean leftovers of killed saves, check out_dir, restore a checkpoint when resuming (moving later ones
        aside), save the config; returns the first step."""
        tc = self.config.train
        if resume and not _is_auto(resume) and tc.init_from is not None:
            raise ValueError(_INIT_FROM_AND_RESUME)
        removed = self._on_main(lambda: clean_orphans(self.out_dir))
        if removed:
            self._log(f"removed what interrupted saves left in {self.out_dir}: {', '.join(removed)}")
        start = 0
        source = self._resume_source(resume) if resume else None
        if source is not None:
            with digests_reused():  # picked, read and loaded: each file is hashed once
                start = self._resume_from(source)
        else:
            existing = list_checkpoints(self.out_dir)
            if existing:
                raise ValueError(
                    f"out_dir {str(self.out_dir)!r} already holds checkpoints (latest "
                    f"{existing[-1][1].name}); continue that run with --resume (resume=True), or "
                    f"choose a new out_dir (--out DIR / train.out_dir=...)"
                )
            if self.is_main:
                self.metrics.reset()
        par, module = self.config.parallel, self.strategy.module
        if self.is_main:  # the full config goes to the run folder; the console gets a few lines (trainer/console.py)
            runtime.write_text_atomic(self.out_dir / "config.yaml", self.config.to_yaml())
            runinfo.start_session(
                self.out_dir,
                self.config,
                self.device,
                par.world_size,
                start,
                tc.batch_size * tc.grad_accum * self.config.data.seq_len,
            )
        n_params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.parameters())
        self._log(
            console.banner(
                self.config,
                n_params,
                par.tp > 1 or par.pp > 1,
                self.data.vocab_size,
                self.device,
                self.env,
                runtime.is_accelerated(module),
                self.out_dir,
            )
        )
        return start

    def _resume_source(self, resume: bool | str | Path) -> Path | None:
        """The checkpoint to continue from: the latest valid one of out_dir (resume True or "auto") or of a given run
        folder, or the given checkpoint. None: "auto" and out_dir holds no checkpoint (a fresh start)."""
        auto = _is_auto(resume)
        where = self.out_dir if resume is True or auto else Path(resume)
        if not (resume is True or auto) and (not where.is_dir() or is_sharded(where)):
            return where  # a checkpoint named by the user: loading it verifies it (a corrupt one is an error)
        found = list_checkpoints(where)
        source = latest_valid_checkpoint(where, self._log)
        if source is not None:
            if auto and self.config.train.init_from is not None:
                self._log("resume auto: train.init_from applies to a fresh start only; continuing the run in out_dir")
            return source
        if not found:
            if auto:
                self._log(f"resume auto: no checkpoint in {self.out_dir}, starting a fresh run")
                return None
            raise ValueError(
                f"resume: no checkpoint (ckpt-*) in {str(where)!r}; train without --resume to start "
                f"fresh (or use --resume auto), or point train.out_dir (--out) at the run to continue"
            )
        raise ValueError(
            f"resume: none of the {len(found)} checkpoints in {str(where)!r} verifies (each is named "
            f"above with the reason): copy intact ones back from a backup, or move the folder away and "
            f"start fresh (a new out_dir, --out DIR)"
        )

    def _resume_from(self, source: Path) -> int:
        """Check `source` fits this run (model, config, steps), then load it and move later checkpoints aside."""
        tc = self.config.train
        check_trusted(source, self.config, "resume")
        meta = checkpoint_meta(source, self.config, self._model_spec())  # verified; the model-defining keys match
        step = int(meta["step"])
        if step > tc.steps:
            raise ValueError(
                f"checkpoint {str(source)!r} is at step {step}, past train.steps={tc.steps}: "
                f"set train.steps above {step} to continue training it"
            )
        check_config_changes(expand_path_keys(meta["config"]), self.config, self.allow_config_change, source, self._log)
        self._check_tokenizer(meta, source)
        start = self.load_checkpoint(source)
        moved = self._on_main(lambda: supersede_later(self.out_dir, start))
        if moved and moved[0] is not None:
            folder, names = moved
            self._log(
                f"resumed from step {start}, so the {len(names)} later checkpoint(s) of {self.out_dir} "
                f"({', '.join(names)}) moved to {folder} (kept, out of --resume's way)"
            )
        if self.is_main:
            self.metrics.truncate_after(start)
        self._log(f"resumed from {source} at step {start}")
        return start

    def _check_tokenizer(self, meta: dict[str, Any], source: Path) -> None:
        """A run continues with the tokenizer it was trained with: the same ids must mean the same text."""
        saved = (meta.get("tokenizer") or {}).get("sha256")
        tok = getattr(self.data, "tokenizer", None)
        current = tok.digest() if tok is not None and hasattr(tok, "digest") else None
        if saved is not None and current is not None and saved != current:
            raise ValueError(
                f"checkpoint {str(source)!r} was trained with another tokenizer than this run builds "
                f"(sha256 {saved[:12]}, now {current[:12]}): use the run's data settings (data.path, "
                f"data.tokenizer, data.vocab_size, data.max_bytes as in its config.yaml), or start a new "
                f"out_dir. The checkpoint holds its tokenizer (graphtrain.trainer.checkpoint.checkpoint_tokenizer)"
            )
        if saved is not None and current is None:
            raise ValueError(
                f"checkpoint {str(source)!r} was trained with a tokenizer, but this run has none (token "
                f"arrays without data.tokenizer): set data.tokenizer to that tokenizer"
            )

    def _on_main(self, fn: Any) -> Any:
        """`fn()` on the main rank (None elsewhere), then a barrier: the others see what it changed on disk."""
        result = fn() if self.is_main else None
        if self.env is not None:
            import torch.distributed as dist

            dist.barrier()
        return result

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

    # ----------------------------------------------------------------------------------- faults ----
    def _train_step(self, step: int, lr: float, max_loss: float) -> Any:
        """One optimizer step; running out of memory becomes a TrainingFailed naming the fixes."""
        try:
            return self.strategy.step(
                self._batches(self.data.train, step * self.config.train.grad_accum, self.config.train.grad_accum),
                lr,
                max_loss,
            )
        except RuntimeError as e:  # torch.OutOfMemoryError (CUDA) is a RuntimeError; the CPU allocator raises one
            if not _is_out_of_memory(e):
                raise
            tc, engine = self.config.train, self.config.engine
            first = "at the first step" if step == self._first_step else f"at step {step + 1}"
            raise TrainingFailed(
                f"out of memory {first} ({_first_line(e)}) with train.batch_size={tc.batch_size}, "
                f"data.seq_len={self.config.data.seq_len}, engine.recompute={engine.recompute}: set "
                f"engine.recompute=auto with engine.memory_budget (e.g. 0.8), or train.batch_size=auto with "
                f"engine.memory_budget, or lower train.batch_size (raise train.grad_accum to keep the samples "
                f"per step)"
            ) from None

    def _save(self, metrics: dict[str, Any]) -> Path:
        """save_checkpoint, a failed write (disk full, I/O error) becoming a TrainingFailed; the checkpoints
        already written are untouched (saves are atomic)."""
        try:
            return self.save_checkpoint(metrics=metrics)
        except OSError as e:
            reason = "the disk is full" if e.errno == errno.ENOSPC else f"{e.strerror or e}"
            where = f" ({e.filename})" if e.filename else ""
            latest = latest_checkpoint(self.out_dir)
            kept = f"the latest complete one, {latest}, is kept" if latest else "no earlier checkpoint exists"
            raise TrainingFailed(
                f"could not write the checkpoint of step {self.step}: {reason}{where}; {kept}. Free "
                f"space in (or point --out / train.out_dir at another disk than) {self.out_dir}, "
                f"then continue with --resume auto"
            ) from None

    def _preempted(self, preempt: PreemptionGuard, step: int | None, saved: Path | None) -> TrainingPreempted:
        """The exception fit() raises on SIGTERM/SIGINT, after the metrics record saying what was saved."""
        name = preempt.signal_name or "signal"
        after = preempt.seconds_since_signal()
        grace = self.config.train.preempt_grace_s
        if step is not None:
            latest = saved or latest_checkpoint(self.out_dir)
            message = (
                f"stopped by {name} at step {step}: checkpoint {latest} holds it, written {after:.1f}s after "
                f"the signal (train.preempt_grace_s={grace:g})"
            )
            saved_after: float | None = after
        else:
            step = self.step
            latest = latest_checkpoint(self.out_dir)
            holds = f"{latest} is the latest checkpoint" if latest else "no checkpoint was written yet"
            message = (
                f"stopped by {name}: step {self.step + 1} did not finish within train.preempt_grace_s="
                f"{grace:g}s and was abandoned; {holds}"
            )
            saved_after = None
        if self.is_main:
            self.metrics.write(
                "preempted",
                step,
                signal=name,
                checkpoint=str(latest) if latest else None,
                seconds_after_signal=saved_after,
            )
        self._log(message)
        return TrainingPreempted(message, signal_name=name, step=step, checkpoint=latest, saved_after_s=saved_after)


def _is_auto(resume: Any) -> bool:
    return isinstance(resume, str) and resume == "auto"


def _is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(e)
    return "out of memory" in text.lower() or "DefaultCPUAllocator: can't allocate memory" in text


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
