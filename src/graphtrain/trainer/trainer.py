"""The Trainer behind `graphtrain train`: one straight-line loop you can read top to bottom.

    trainer = Trainer(Config())          # builds data, model (vocab from the tokenizer), optimizer
    summary = trainer.fit()              # train, evaluate, checkpoint; returns losses and speed
    print(trainer.sample("def ", 48))    # GPT models: complete a prompt

Everything a step depends on is a function of (config, step): batches come from
``get_batch(step * grad_accum + micro)`` and the learning rate from `lr_at(step)`, so a checkpoint
(weights, optimizer, step, RNG) is all a resumed run needs. With ``train.deterministic`` a run
stopped at step k and resumed matches an uninterrupted one bitwise.

Distributed (parallel.dp*tp*pp > 1, under torchrun: `graphtrain train --nproc N parallel.dp=N`): the
Trainer calls `init_distributed` + `parallelize` and trains through the `Parallelized` model. Every
rank draws the same full batch from `get_batch` and keeps its data-parallel rank's rows; the logged
loss is averaged over dp ranks. Only rank 0 logs, prints, shows the progress bar and samples;
checkpoints are sharded folders (`ckpt-NNNNNNN/`, written atomically by `Parallelized.save`) and
evaluation averages each rank's share of the validation batches across dp ranks. With train.accelerate
each rank's part of the model runs through the graph engine, per layout (`Parallelized.accelerate`; after
the first step rank 0 logs how many graphs each rank captured). With pp > 1 training and
evaluation run the pipeline schedule over parallel.microbatches, and `sample()` reads the whole model
from the latest checkpoint on rank 0.

`train.batch_size: auto` picks the largest micro-batch whose predicted step peak fits
`engine.memory_budget` (`graphtrain.memory.autobatch.pick_batch_size`; per rank, times parallel.dp);
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
from typing import Any

import torch
from tqdm.auto import tqdm

from graphtrain.config import Config
from graphtrain.data import build_data
from graphtrain.models import build_model, get_spec
from graphtrain.optim import build_optimizer, make_loss_scaler, optimizer_step
from graphtrain.trainer import runtime
from graphtrain.trainer.checkpoint import (FORMAT_VERSION, KEEP_LAST, check_compatible, checkpoint_path,
                                           is_sharded, latest_checkpoint, list_checkpoints, load_checkpoint,
                                           load_sharded_meta, prune_checkpoints, rng_state, save_checkpoint,
                                           set_rng_state)
from graphtrain.trainer.metrics import MetricsLog, Throughput, format_bytes, peak_memory_bytes
from graphtrain.trainer.schedule import lr_at, set_lr


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
        self.config, self.resume = config, resume
        tc = config.train
        if tc.init_from is not None and resume:
            raise ValueError("train.init_from and --resume cannot be combined: --resume continues a run (weights, "
                             "optimizer, step), init_from starts a new one from a checkpoint's weights; to continue a run started with init_from, "
                             "add train.init_from=null")
        self.env = self.par = None
        if config.parallel.world_size > 1:
            from graphtrain.distributed import init_distributed
            self.env = init_distributed(config.parallel)  # clear error when not launched under torchrun
        self.is_main = self.env is None or self.env.is_main
        self.device = self.env.device if self.env is not None else runtime.pick_device()
        runtime.setup(tc)  # threads, deterministic algorithms

        family = model.family if model is not None else get_spec(config.model.name).family
        self.data = data if data is not None else self._build_data(config, family)
        if tc.batch_size == "auto":
            config = self.config = self._auto_batch_size(config, model)
            tc = config.train
        runtime.seed_everything(tc.seed)  # weights depend on the seed only, not on data preparation
        if model is None:
            model = build_model(config.model, vocab_size=self.data.vocab_size)
        self.family, self.spec = model.family, model.spec
        if config.data.seq_len > self.spec.max_seq_len:
            raise ValueError(f"data.seq_len={config.data.seq_len} is longer than model {config.model.name!r} supports "
                             f"(max_seq_len={self.spec.max_seq_len}): lower data.seq_len, or set "
                             f"model.max_seq_len={config.data.seq_len}")
        self.init_source = self._init_weights(model, tc.init_from) if tc.init_from is not None else None
        self.whole_step = None
        if self.env is None and tc.whole_step:
            model.to(self.device)
            self.model = self._module = model  # trained by the step graph; evaluated eagerly
            self.whole_step = runtime.build_whole_step(model, config)
            self.optimizer = runtime.StepGraphOptimizer(self.whole_step)
        elif self.env is None:
            model.to(self.device)
            self.model = runtime.maybe_accelerate(model, config)
            self.optimizer = build_optimizer(self.model, config.optim)
            self._module = self.model
        else:
            from graphtrain.distributed import parallelize
            self.par = parallelize(model, lambda m: build_optimizer(m, config.optim), config.parallel, self.env)
            self.model, self.optimizer, self._module = self.par.model, self.par.optimizer, self.par.module
            if tc.accelerate:  # per layout (Parallelized.accelerate says how)
                runtime.accelerate_distributed(self.par, config)
            # Each data-parallel replica and each pipeline stage draws its own dropout (runtime.rank_seed); the
            # first stage of replica 0 keeps a single process's stream. Tensor-parallel ranks of one stage share
            # theirs: dropout on replicated activations (after a row-parallel all-reduce) must drop the same
            # elements on every tp rank. Attention dropout, on each rank's own heads, salts that shared stream with
            # the tp rank (docs/distributed.md, "Dropout under tensor parallelism").
            if self.env.dp_rank or self.env.pp_rank:
                runtime.seed_everything(runtime.rank_seed(tc.seed, self.env.dp_rank, self.env.pp_rank))
        # fp16 only: dynamic loss scaling (inside the step graph with train.whole_step)
        self.scaler = make_loss_scaler(config.engine) if self.whole_step is None else None
        self.out_dir = Path(tc.out_dir)
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl")
        self.step = 0  # optimizer steps completed
        self._engine_checked = False

    def _log(self, text: str) -> None:
        if self.is_main:
            tqdm.write(text)

    def _build_data(self, config: Config, family: str) -> Any:
        """Rank 0 builds (or reads) the cached tokenizer and tokens first; the others then read its cache."""
        if self.env is None:
            return build_data(config, family)
        import torch.distributed as dist
        data = build_data(config, family) if self.is_main else None
        dist.barrier()
        return data if data is not None else build_data(config, family)

    def _auto_batch_size(self, config: Config, model: torch.nn.Module | None) -> Config:
        """train.batch_size=auto -> the largest micro-batch fitting engine.memory_budget (grad_accum kept)."""
        from graphtrain.memory.autobatch import pick_batch_size
        budget = runtime.memory_budget_bytes(config, self.device)
        if model is not None:
            factory = (lambda: model)
        else:
            def factory() -> torch.nn.Module:
                return build_model(config.model, vocab_size=self.data.vocab_size)
        with torch.random.fork_rng(devices=[]):  # building probe models must not move the weights' seed
            plan = pick_batch_size(factory, config.data.seq_len, budget, engine_cfg=config.engine)
        dp = config.parallel.dp
        chosen = plan.micro_batch * dp
        self._log(f"train.batch_size=auto: micro-batch {plan.micro_batch}"
                  f"{f' per rank x {dp} dp ranks = {chosen}' if dp > 1 else ''} (predicted step peak "
                  f"{format_bytes(plan.predicted_peak)} of the {format_bytes(int(budget))} engine.memory_budget), "
                  f"grad_accum {config.train.grad_accum}: {chosen * config.train.grad_accum} samples per step")
        return config.with_overrides({"train.batch_size": chosen})

    def _init_weights(self, model: torch.nn.Module, init_from: str) -> Path:
        """train.init_from: load a checkpoint's model weights only (shapes must match; seq_len may differ)."""
        source = Path(init_from).expanduser()
        if source.is_dir() and not is_sharded(source):
            found = latest_checkpoint(source)
            if found is None:
                raise ValueError(f"train.init_from={init_from!r}: no checkpoint (ckpt-*) in that folder; point it "
                                 f"at a finished run's out_dir or a checkpoint file")
            source = found
        elif not source.exists():
            raise ValueError(f"train.init_from={init_from!r} does not exist: point it at a checkpoint file or a "
                             f"finished run's out_dir (e.g. the previous phase's train.out_dir)")
        spec = dataclasses.asdict(self.spec)
        try:
            if is_sharded(source):
                from graphtrain.distributed.checkpoint import load_checkpoint as load_sharded
                step = load_sharded_meta(source, self.config, spec)["step"]
                load_sharded(source, model, None)
            else:
                state = load_checkpoint(source, self.config, spec)
                step = state["step"]
                model.load_state_dict(state["model"])
        except RuntimeError as e:
            raise ValueError(f"train.init_from={init_from!r}: the checkpoint's weights do not fit this model "
                             f"({str(e).splitlines()[0]})") from None
        self._log(f"initialised weights from {source} (step {step} of that run); optimizer and step start fresh")
        return source

    # ------------------------------------------------------------------------------ training ----
    def fit(self, resume: bool | str | Path | None = None) -> dict[str, Any]:
        """Train to `train.steps`, evaluating and checkpointing on the way; returns a summary."""
        cfg, tc = self.config, self.config.train
        self.step = self._start_run(self.resume if resume is None else resume)
        accum, batch_size = tc.grad_accum, tc.batch_size
        tokens_per_step = batch_size * accum * cfg.data.seq_len
        speed = Throughput(tokens_per_step)
        recent: list[float] = []  # train losses since the last log line
        train_loss = val_loss = math.nan
        saved: Path | None = None
        self.model.train()
        bar = tqdm(total=tc.steps, initial=self.step, disable=not (tc.progress and self.is_main), unit="step",
                   dynamic_ncols=True,
                   desc=f"train {cfg.model.name}")
        try:
            for step in range(self.step, tc.steps):
                t0 = time.perf_counter()
                lr = lr_at(step, cfg.optim, tc.steps)
                set_lr(self.optimizer, lr)
                if self.whole_step is not None:
                    out = self.whole_step(lr=lr, **self._to_device(self.data.train.get_batch(step, batch_size)))
                    loss_sum = out["loss"]
                    info = {"grad_norm": float(out["grad_norm"]), "skipped": out["skipped"], "scale": out["scale"]}
                elif self.par is None:
                    loss_sum = torch.zeros((), device=self.device)
                    for micro in range(accum):
                        batch = self._to_device(self.data.train.get_batch(step * accum + micro, batch_size))
                        loss = self.model(**batch) / accum
                        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
                        loss_sum += loss.detach()
                    # unscale and skip on overflow (fp16), clip to optim.grad_clip, optimizer.step()
                    info = optimizer_step(self.optimizer, self.model.parameters(), self.scaler, cfg.optim.grad_clip)
                else:
                    loss_sum, info = self._distributed_step(step, accum, batch_size)
                self.optimizer.zero_grad(set_to_none=True)
                step_loss = loss_sum.item()  # also waits for the device, so the timing is real
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
                                       peak_mem_bytes=mem, grad_norm=info["grad_norm"], skipped=info["skipped"],
                                       loss_scale=info["scale"])
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
        summary = {"steps": self.step, "train_loss": train_loss, "val_loss": val_loss, "tokens_per_s": tok_s,
                   "ms_per_step": ms, "first_step_ms": None if speed.first_step_s is None else 1000 * speed.first_step_s,
                   "peak_mem_bytes": peak_memory_bytes(self.device), "tokens_per_step": tokens_per_step,
                   "checkpoint": str(saved or latest_checkpoint(self.out_dir) or ""), "out_dir": str(self.out_dir)}
        if self.is_main:
            self.metrics.write("summary", self.step, **summary)
        return summary

    def _shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This data-parallel rank's rows of a full batch (every rank drew the same one)."""
        dp = self.config.parallel.dp
        if self.env is None or dp == 1:
            return batch
        n = next(iter(batch.values())).size(0) // dp
        r = self.env.dp_rank
        return {k: v[r * n:(r + 1) * n] for k, v in batch.items()}

    def _distributed_step(self, step: int, accum: int, batch_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """Forward/backward every micro-batch through `self.par` (gradients all-reduced on the last), clip
        by the global norm, step; returns the loss averaged over dp ranks and the step info."""
        import torch.distributed as dist
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(accum):
            batch = self._shard(self._to_device(self.data.train.get_batch(step * accum + micro, batch_size)))
            ids, labels = batch.pop("input_ids"), batch.pop("labels")
            loss = self.par.forward_backward(ids, labels, micro_step=micro, micro_steps=accum, **batch)
            loss_sum += loss.float() / accum
        norm = self.par.clip_grad_norm_(self.config.optim.grad_clip)
        self.optimizer.step()
        if self.config.parallel.dp > 1:
            dist.all_reduce(loss_sum, group=self.env.group("dp"))
            loss_sum /= self.config.parallel.dp
        if not self._engine_checked:
            self._engine_checked = True
            if runtime.is_accelerated(self._module):
                self._log(runtime.check_distributed_capture(self._module, self.model, self.config))
        return loss_sum, {"grad_norm": float(norm), "skipped": False, "scale": None}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over `train.eval_batches` fixed batches (eval mode, no grad, RNG untouched)."""
        tc = self.config.train
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                losses = [self._eval_loss(self._to_device(self.data.val.get_batch(i, tc.batch_size)))
                          for i in range(tc.eval_batches)]
        finally:
            self.model.train(was_training)
        mean = torch.stack(losses).double().mean()
        if self.env is not None and self.config.parallel.dp > 1:  # each dp rank evaluated its share
            import torch.distributed as dist
            dist.all_reduce(mean, group=self.env.group("dp"))
            mean /= self.config.parallel.dp
        return mean.item()

    def _eval_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.par is None:
            return self.model(**batch).detach().float()
        batch = self._shard(batch)
        return self.par.eval_loss(batch.pop("input_ids"), batch.pop("labels"), **batch).float()

    def sample(self, prompt: str, n_tokens: int, *, temperature: float = 0.8, top_k: int | None = 20,
               seed: int | None = None) -> str:
        """GPT models: `prompt` followed by `n_tokens` sampled tokens (temperature 0: greedy).

        Sampling draws from its own generator seeded with `seed` (default `train.seed`), so the
        same weights give the same completion and the global RNG is untouched.
        """
        if self.par is not None and self.config.parallel.tp > 1:
            raise ValueError("sample() needs the whole model on one rank: not with parallel.tp>1")
        if self.family != "gpt2":
            raise ValueError(f"sample() needs a GPT model; {self.config.model.name!r} is a {self.family} "
                             f"(masked LM) model")
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        tok = self.data.tokenizer
        ids = list(tok.encode(prompt)) or [tok.eos_id]
        ids = ids[-self.spec.max_seq_len:]
        gen = torch.Generator(device=self.device).manual_seed(self.config.train.seed if seed is None else seed)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        # Eagerly: every generated token is a new sequence length, i.e. a recompile for the engine.
        module = self._module if self.par is None or self.config.parallel.pp == 1 else self._whole_model()
        with torch.compiler.set_stance("force_eager"):
            out = module.generate(x, n_tokens, temperature=temperature, top_k=top_k, generator=gen)
        new = out[0, len(ids):].tolist()
        eos = getattr(tok, "eos_id", None)
        if eos is not None and eos in new:
            new = new[:new.index(eos)]
        return prompt + tok.decode(new)

    def _whole_model(self) -> torch.nn.Module:
        """parallel.pp>1: every rank holds one stage, so sample() reads the whole model from the latest sharded
        checkpoint, on this rank alone (no collective: rank 0 samples while the others have finished)."""
        from graphtrain.distributed.checkpoint import load_model_weights_local
        path = latest_checkpoint(self.out_dir)
        if path is None:
            raise ValueError("sample() with parallel.pp>1 reads the whole model from the run's latest checkpoint, and "
                             f"{str(self.out_dir)!r} has none yet: call it after fit() (which saves at the end)")
        with torch.random.fork_rng(devices=[]):
            model = build_model(self.config.model, vocab_size=self.data.vocab_size)
        load_model_weights_local(path, model)
        return model.to(self.device).eval()

    # ---------------------------------------------------------------------------- checkpoints ----
    def save_checkpoint(self, metrics: dict[str, Any] | None = None) -> Path:
        """Save ckpt-{step}.pt atomically (distributed: the sharded folder ckpt-{step}/), keep the last few."""
        if self.par is not None:
            return self._save_sharded(metrics)
        state = {"format_version": FORMAT_VERSION, "step": self.step, "model": self.model.state_dict(),
                 "optimizer": self.optimizer.state_dict(), "rng": rng_state(), "config": self.config.to_dict(),
                 "model_spec": dataclasses.asdict(self.spec), "metrics": metrics or {},
                 "loss_scaler": None if self.scaler is None else self.scaler.state_dict()}
        path = save_checkpoint(checkpoint_path(self.out_dir, self.step), state)
        prune_checkpoints(self.out_dir, keep=KEEP_LAST, protect=path)
        return path

    def _save_sharded(self, metrics: dict[str, Any] | None) -> Path:
        """Collective: every rank writes its shards; rank 0 writes the metadata (with every rank's RNG)."""
        import torch.distributed as dist
        rngs: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(rngs, rng_state())
        extra = {"format_version": FORMAT_VERSION, "step": self.step, "rng": rngs, "config": self.config.to_dict(),
                 "model_spec": dataclasses.asdict(self.spec), "metrics": metrics or {},
                 "parallel": dataclasses.asdict(self.config.parallel)}
        path = self.par.save(checkpoint_path(self.out_dir, self.step, sharded=True), extra=extra)
        if self.is_main:
            prune_checkpoints(self.out_dir, keep=KEEP_LAST, protect=path)
        dist.barrier()
        return path

    def _load_sharded(self, path: Path) -> int:
        if not is_sharded(path):
            raise ValueError(f"checkpoint {str(path)!r} is a single-process checkpoint: a distributed run resumes "
                             f"only sharded checkpoint folders (ckpt-NNNNNNN/); to start from its weights, set "
                             f"train.init_from={path} with a new out_dir")
        extra = load_sharded_meta(path, self.config, dataclasses.asdict(self.spec))
        try:
            self.par.load(path)
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"checkpoint {str(path)!r} does not fit this model/optimizer "
                             f"({str(e).splitlines()[0]}); use the config it was trained with, or a new out_dir") from None
        rngs = extra.get("rng") or []
        saved_layout = {k: (extra.get("config") or {}).get("parallel", {}).get(k) for k in ("dp", "tp", "pp")}
        layout = {k: getattr(self.config.parallel, k) for k in ("dp", "tp", "pp")}
        if len(rngs) == self.env.world_size and saved_layout == layout:
            set_rng_state(rngs[self.env.rank])
        else:  # another layout: every rank reseeds from (seed, step, its replica and stage), tp ranks alike
            step = int(extra["step"])
            runtime.seed_everything(runtime.rank_seed(self.config.train.seed, self.env.dp_rank, self.env.pp_rank)
                                    + (1 << 31) * step)
        self.step = int(extra["step"])
        return self.step

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore weights, optimizer, RNG from `path` (validated against this model); returns its step."""
        if self.par is not None:
            return self._load_sharded(Path(path))
        state = load_checkpoint(path, self.config, dataclasses.asdict(self.spec))
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"checkpoint {str(path)!r} does not fit this model/optimizer ({str(e).splitlines()[0]}); "
                             f"use the config it was trained with (saved in it and in out_dir/config.yaml), "
                             f"or start fresh with a new out_dir") from None
        if self.scaler is not None and state.get("loss_scaler") is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        return self.step

    def _start_run(self, resume: bool | str | Path) -> int:
        """Check out_dir, restore a checkpoint when resuming, save the config; returns the first step."""
        tc = self.config.train
        if resume and tc.init_from is not None:
            raise ValueError("train.init_from and --resume cannot be combined: --resume continues a run (weights, "
                             "optimizer, step), init_from starts a new one from a checkpoint's weights; to continue a run started with init_from, "
                             "add train.init_from=null")
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
        if self.env is not None:
            par = self.config.parallel
            where += (f" per rank, {self.env.world_size} ranks (pp {par.pp} x dp {par.dp} x tp {par.tp}"
                      f"{', ZeRO-1' if par.zero_stage else ''})")
        local = self.config.parallel.tp > 1 or self.config.parallel.pp > 1
        n_params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in self._module.parameters())
        self._log(f"model {self.config.model.name}: {n_params:,} params{' (this rank)' if local else ''}, {where}, "
                  f"{'graphtrain engine' if runtime.is_accelerated(self._module) else 'eager PyTorch'}")
        return start

    def close(self) -> None:
        """Distributed runs: destroy the process group (call once training and sampling are done)."""
        if self.env is not None:
            from graphtrain.distributed import shutdown
            shutdown()

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.device.type == "cpu":
            return batch
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
