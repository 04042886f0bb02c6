"""The one setup factory shared by speed and memory runs, and the worker process that runs it.

`build_workload(case, variant)` builds the model from a fixed seed, wraps it the variant's way
(eager, torch.compile, graphtrain.accelerate, ORTModule), makes AdamW and a fixed synthetic batch
(random token ids from a seeded generator; BERT gets MLM labels on 15% of positions). One step is
forward, loss, backward, optimizer step and zero_grad.

Each (case, variant) runs in its own long-lived process (``python -m graphtrain.bench.case``) so
peak memory, compile caches and thread pools never leak between variants. The runner talks to it
in JSON lines: ``setup``, then ``steps N`` as often as it likes (that is how variants interleave),
then ``finish``. Replies go through a private copy of stdout; the real stdout is pointed at stderr
so library prints cannot corrupt the channel.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from graphtrain.bench.suites import VARIANTS, Case, Variant
from graphtrain.config.sections import Config, ModelConfig, OptimConfig
from graphtrain.kernels import flops
from graphtrain.models import build_model as build_reference
from graphtrain.optim import build_optimizer, param_groups

# Imports inside functions: the eager and torch.compile variants never load graphtrain's engine, so their time and
# memory are their own; the suite's parent imports this module for its reply prefix.

SEED = 1337
MLM_PROBABILITY = 0.15
# Hugging Face configs for the `hf-*` cases: the shapes of MEASURED.md's mini and small models.
HF_SIZES = {
    "mini": dict(layers=4, hidden=256, heads=4, vocab=8192),
    "small": dict(layers=6, hidden=512, heads=8, vocab=16384),
    # BERT-Large's and GPT-2 Medium's width in 8 layers: GEMMs wide enough to near a CPU's bf16 peak (suite hf-wide)
    "wide": dict(layers=8, hidden=1024, heads=16, vocab=32768),
    # The published base models (suite gpu, issue #48): GPT-2 124M and BERT-base as released (their vocabularies,
    # 1024 and 512 positions); the Llama at the same width and depth with Llama 2's vocabulary, 4 x width SwiGLU and
    # 6 key/value heads for 12 query heads: 155M parameters
    "base": dict(
        layers=12,
        hidden=768,
        heads=12,
        vocab=dict(gpt2=50257, bert=30522, llama=32000),
        positions=dict(gpt2=1024, bert=512, llama=1024),
        intermediate=3072,
    ),
}
REPLY = "@@bench "


class Skip(Exception):
    """The variant cannot run here (an optional package is missing); reported, not an error."""


@dataclass
class Workload:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: dict[str, torch.Tensor]
    variant: Variant
    device: torch.device
    hf: bool
    opt_seconds: float = 0.0
    """Time spent in optimizer.step + zero_grad so far (CPU: exact; CUDA: launch time only)."""

    step_graph: Any = None
    """graphtrain-step variants: the compiled whole step (it owns the optimizer update)."""

    def step(self) -> torch.Tensor:
        """One training step; returns the (detached) loss."""
        if self.step_graph is not None:
            return self.step_graph(**self.batch)["loss"]
        with self._autocast():
            out = self.model(**self.batch)
            loss = out.loss if self.hf else out
        loss.backward()
        t0 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.opt_seconds += time.perf_counter() - t0
        return loss.detach()

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.variant.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def build_model(case: Case) -> tuple[torch.nn.Module, int, bool]:
    """(model, vocab_size, is_hf), freshly initialized from SEED."""
    torch.manual_seed(SEED)
    if case.model.startswith("hf-"):
        return (*_build_hf(case), True)
    model = build_reference(ModelConfig(name=case.model, attention=case.attention))
    return model, model.spec.vocab_size, False


def _build_hf(case: Case) -> tuple[torch.nn.Module, int]:
    try:
        family, size = case.model.split("-")[1:]
        # per-family entries (the base size's vocabularies and positions) taken for this family
        dims = {k: v[family] if isinstance(v, dict) else v for k, v in HF_SIZES[size].items()}
    except (ValueError, KeyError):
        raise ValueError(f"hf case {case.model!r} must be hf-<gpt2|bert|llama>-<{'|'.join(HF_SIZES)}>") from None
    positions = max(dims.get("positions", 512), case.seq)
    try:
        import transformers
    except ImportError as e:
        raise Skip(f"transformers is not installed ({e}); pip install 'graphtrain[hf]'") from None
    common = dict(attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=dims["vocab"],
            n_positions=positions,
            n_embd=dims["hidden"],
            n_layer=dims["layers"],
            n_head=dims["heads"],
            resid_pdrop=0.1,
            embd_pdrop=0.1,
            attn_pdrop=0.1,
            **common,
        )
        return transformers.GPT2LMHeadModel(cfg), dims["vocab"]
    if family == "bert":
        cfg = transformers.BertConfig(
            vocab_size=dims["vocab"],
            hidden_size=dims["hidden"],
            num_hidden_layers=dims["layers"],
            num_attention_heads=dims["heads"],
            intermediate_size=4 * dims["hidden"],
            max_position_embeddings=positions,
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
            **common,
        )
        return transformers.BertForMaskedLM(cfg), dims["vocab"]
    if family == "llama":  # a Llama-family decoder: RMSNorm, rotary positions, SwiGLU, grouped-query attention
        cfg = transformers.LlamaConfig(
            vocab_size=dims["vocab"],
            hidden_size=dims["hidden"],
            intermediate_size=dims.get("intermediate", int(2.75 * dims["hidden"])),
            num_hidden_layers=dims["layers"],
            num_attention_heads=dims["heads"],
            num_key_value_heads=dims["heads"] // 2,
            max_position_embeddings=positions,
            attention_dropout=0.0,
            use_cache=False,
            **common,
        )
        return transformers.LlamaForCausalLM(cfg), dims["vocab"]
    raise ValueError(f"hf case {case.model!r}: family must be gpt2, bert or llama")


def make_batch(case: Case, vocab_size: int, hf: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """A fixed synthetic batch from a seeded generator (identical for every variant)."""
    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(5, vocab_size, (case.batch, case.seq + 1), generator=g)
    if case.family == "gpt2":
        if hf:  # GPT2LMHeadModel shifts labels itself
            batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1]}
        else:  # graphtrain's GPT2 takes labels already shifted
            batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    else:
        ids = tokens[:, :-1].clone()
        masked = torch.rand(ids.shape, generator=g) < MLM_PROBABILITY
        masked[:, 0] = True  # at least one target per sample
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        ids[masked] = 4  # a fixed [MASK]-like id
        batch = {"input_ids": ids, "labels": labels}
    return {k: v.contiguous().to(device) for k, v in batch.items()}


def labelled_rows(case: Case, batch: dict[str, torch.Tensor], hf: bool) -> int:
    """The rows of the LM head's input that carry a label: what a sparse head computes. Hugging Face's causal LMs
    shift their labels (position i predicts labels[i + 1]), so each sequence's last position has none."""
    labels = batch["labels"]
    if case.family == "gpt2" and hf:
        labels = labels[:, 1:]
    return int(labels.ne(-100).sum())


def sparse_head_ran(work: Workload) -> bool:
    """Whether the variant's graphs run the sparse LM head (graphtrain's `sparse_lm_head` pass rewrote a head):
    read from the engine's pass records after the first step. Unknown (no record) counts as sparse, so that MFU is
    never counted on FLOPs that may not run."""
    from graphtrain.tools.report import report

    if work.variant.mode not in ("graphtrain", "graphtrain-step") or "sparse_lm_head" in work.variant.passes_off:
        return False
    try:
        passes = report(work.model).passes
    except Exception:  # noqa: BLE001 - no engine state to read: assume the shortcut ran
        return True
    return any(p["name"] == "sparse_lm_head" and p["rewrites"] for p in passes) or not passes


def head_returns_logits(work: Workload) -> bool:
    """Whether the variant's fused LM head also returns the logits (the `*_logits` ops, which the engine puts in
    where the model returns them, as Hugging Face's do): such a head computes every row's logits in its forward,
    and a sparse head skips only the unlabelled rows' gradients."""
    from graphtrain.tools.report import report

    try:
        ops = report(work.model).fused_ops or []
    except Exception:  # noqa: BLE001 - no engine state to read: count the larger skip, as sparse_head_ran does
        return False
    return any(op["name"].endswith("cross_entropy_logits") for op in ops)


def executed_flops(case: Case, work: Workload, info: dict[str, Any]) -> dict[str, Any]:
    """The FLOPs each step runs (`executed_flops_per_step`), from the dense formula less what a sparse head skips
    for each unlabelled row where it skips them (`skips_rows`: not a causal LM's one position a sequence): 6 FLOPs
    per weight (forward, and backward for the input and the weight), or 4 where the head returns every row's
    logits (`head_returns_logits`: the forward runs dense). What it skips is named in `flops_shortcut`, which the
    report prints beside the variant's MFU."""
    from graphtrain.kernels.linear_cross_entropy import skips_rows

    dense = info["flops_per_step"]
    rows = case.batch * case.seq
    run = labelled_rows(case, work.batch, work.hf)
    if not sparse_head_ran(work) or not skips_rows(run, rows):  # a batch with few ignored rows runs dense
        return {"executed_flops_per_step": dense, "flops_shortcut": None}
    head = info["vocab"] * info["d_model"]
    logits = head_returns_logits(work)
    per_row = 4 if logits else 6
    return {
        "executed_flops_per_step": dense - per_row * head * (rows - run),
        "flops_shortcut": f"sparse LM head: {run} of {rows} rows"
        + (" in the backward (the logits of every row are returned)" if logits else ""),
    }


def wrap_model(model: torch.nn.Module, variant: Variant) -> torch.nn.Module:
    from graphtrain.frontend.accelerate import accelerate

    if variant.mode == "eager":
        return model
    if variant.mode == "compile":
        return torch.compile(model, mode=variant.compile_mode)
    if variant.mode == "graphtrain-step":  # the step graph is built in build_workload
        return model
    if variant.mode == "graphtrain":
        return accelerate(model, precision=variant.precision, recompute=variant.recompute, passes=passes_off(variant))
    if variant.mode == "ortmodule":
        try:
            from onnxruntime.training.ortmodule import ORTModule
        except Exception as e:  # noqa: BLE001 - any failure to import means "not available here"
            raise Skip(f"ORTModule is not available ({type(e).__name__}: {e})") from None
        return ORTModule(model)
    raise ValueError(f"unknown variant mode {variant.mode!r}")


def passes_off(variant: Variant) -> dict[str, bool]:
    """The engine.passes switches of an ablation variant (`fuse_*` names every fusion pass)."""
    from graphtrain.passes.manager import registered_passes

    if not variant.passes_off:
        return {}
    names = registered_passes()
    off: dict[str, bool] = {}
    for pat in variant.passes_off:
        hits = [n for n in names if n.startswith(pat[:-1])] if pat.endswith("*") else [pat]
        unknown = [n for n in hits if n not in names]
        if unknown or not hits:
            raise ValueError(f"variant {variant.name}: no engine pass matches {pat!r}")
        off.update({n: False for n in hits})
    return off


def make_optimizer(model: torch.nn.Module, variant: Variant | None = None) -> torch.optim.Optimizer:
    """AdamW with the same hyperparameters for every variant (lr 1e-3, betas (0.9, 0.95), decay 0.01 on
    matrices only), each at the strongest setting its user gets with one flag: eager and torch.compile
    variants use `torch.optim.AdamW(fused=True)` (one vectorized pass over p, g, m, v per tensor);
    graphtrain variants use `graphtrain.optim.build_optimizer`, i.e. what `graphtrain train` runs
    (FusedAdamW: the same kernel). `variant.optimizer == "loop"` gives torch.optim.AdamW's default
    per-parameter loop instead (on CPU ~5x slower for gpt2-small: an extra column and an ablation). The
    optimizer's share of the step is reported separately (`opt_ms`)."""
    cfg = OptimConfig()
    loop = variant is not None and variant.optimizer == "loop"
    if variant is not None and variant.mode in ("graphtrain", "graphtrain-step") and not loop:
        return build_optimizer(model, cfg)
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        foreach=False if loop else None,
        fused=None if loop else True,
    )


def build_workload(case: Case, variant: Variant, device: str = "cpu") -> tuple[Workload, dict[str, Any]]:
    """Build everything for one (case, variant); returns the workload and facts about it."""
    from graphtrain.frontend.compile_step import compile_step

    dev = torch.device(device)
    t0 = time.perf_counter()
    if variant.fp32_matmul_bf16:
        if not hasattr(torch.backends.mkldnn, "matmul"):
            raise Skip(f"torch {torch.__version__} has no torch.backends.mkldnn.matmul.fp32_precision (2.9 and later)")
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    model, vocab, hf = build_model(case)
    model.to(dev).train()
    n_layer, d_model = flops.model_dims(model)
    info = {
        "params": sum(p.numel() for p in model.parameters()),
        "matmul_params": flops.matmul_params(model),
        "n_layer": n_layer,
        "d_model": d_model,
        "hf": hf,
        "vocab": vocab,
    }
    batch = make_batch(case, vocab, hf, dev)
    wrapped = wrap_model(model, variant)
    optimizer = make_optimizer(model, variant)
    info["build_s"] = time.perf_counter() - t0
    info["flops_per_step"] = flops.step_flops(info["matmul_params"], n_layer, case.seq, d_model, case.batch * case.seq)
    work = Workload(wrapped, optimizer, batch, variant, dev, hf)
    if variant.mode == "graphtrain-step":
        work.step_graph = compile_step(model, Config(), precision=variant.precision)  # same AdamW settings
    return work, info


# ------------------------------------------------------------------------------- memory ----


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory so far: CUDA max allocated, else this process's peak RSS (VmHWM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    kib = _proc_status_kib("VmHWM")
    if kib is None:  # not Linux: ru_maxrss is KiB on Linux, bytes on macOS
        import resource

        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kib = r // 1024 if sys.platform == "darwin" else r
    return kib / 1024


def children_peak_mib() -> float:
    """The largest peak RSS of this process's finished children (the background compile, Inductor's compile
    workers): what a whole-process peak adds to the worker's own. Linux reports KiB."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def current_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return (_proc_status_kib("VmRSS") or 0) / 1024


def reset_peak_memory(device: torch.device) -> bool:
    """Restart the peak at the current usage (Linux: write 5 to /proc/self/clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------- worker ----


class Worker:
    """Serves the runner's commands for one (case, variant) inside this process."""

    def __init__(self, case: Case, variant: Variant, device: str, pin_mmap: bool = False) -> None:
        self.case, self.variant, self.device = case, variant, torch.device(device)
        self.pin_mmap = pin_mmap
        self.work: Workload | None = None
        self.steps_done = 0
        self.loss: float | None = None
        self.peak_before_reset = 0.0  # the whole-process peak, kept across resets
        self.was_reset = False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def setup(self) -> dict[str, Any]:
        from graphtrain.frontend.accelerate import wait_compiled

        torch.set_num_threads(os.cpu_count() or 1)
        # the same process environment for every variant of a run (runner decides): what graphtrain sets itself
        # (runtime/allocator.py allocator_mode), release under its recompute variants, keep otherwise
        from graphtrain.runtime.allocator import huge_pages_as_graphtrain, set_cpu_allocator

        # huge pages too, as graphtrain decides them for this model, once it is built (huge_pages_as_graphtrain)
        set_cpu_allocator("release" if self.pin_mmap else "keep", huge_pages=False)
        if self.device.type == "cuda":
            # TF32 allowed for every variant, the one line torch.compile itself suggests on these GPUs (issue #48's
            # baselines): fp32 matmuls outside autocast run on tensor cores
            torch.set_float32_matmul_precision("high")
        t0 = time.perf_counter()
        self.work, info = build_workload(self.case, self.variant, str(self.device))
        if self.device.type == "cpu":
            info["huge_pages"] = huge_pages_as_graphtrain(self.work.model)
        info["setup_mem_mib"] = current_memory_mib(self.device)
        torch.manual_seed(SEED + 2)  # same dropout stream start for every variant
        t1 = time.perf_counter()
        self._run(1)
        info["first_step_s"] = time.perf_counter() - t1
        info["time_to_first_step_s"] = time.perf_counter() - t0
        if self.variant.mode == "graphtrain":  # provider auto: time what training settles on (Inductor or aten)
            t2 = time.perf_counter()
            wait_compiled(self.work.model)
            self._run(1)  # each graph measures its candidates and switches
            info["background_compile_s"] = time.perf_counter() - t2
        # from the start of setup to the first step at the speed the variant keeps: the same as the first step for
        # every variant but graphtrain's, whose first steps run on aten while Inductor compiles in the background
        info["time_to_full_speed_s"] = time.perf_counter() - t0
        info.update(executed_flops(self.case, self.work, info))
        info["threads"] = torch.get_num_threads()
        info["fp32_matmul_precision"] = torch.get_float32_matmul_precision()
        info["optimizer"] = (
            "AdamW in the step graph" if self.work.step_graph is not None else type(self.work.optimizer).__name__
        )
        return info

    def _run(self, n: int) -> float:
        assert self.work is not None, "setup must come first"
        self._sync()
        t0 = time.perf_counter()
        loss = None
        for _ in range(n):
            loss = self.work.step()
        self._sync()
        dt = time.perf_counter() - t0
        self.steps_done += n
        self.loss = float(loss) if loss is not None else self.loss
        return dt

    def steps(self, n: int, reset_peak: bool = False) -> dict[str, Any]:
        if reset_peak:  # the steady-state peak then excludes setup and compile-time transients
            self.peak_before_reset = max(self.peak_before_reset, peak_memory_mib(self.device))
            self.was_reset = reset_peak_memory(self.device)
        assert self.work is not None, "setup must come first"
        opt0 = self.work.opt_seconds
        seconds = self._run(n)
        opt = None if self.work.step_graph is not None else self.work.opt_seconds - opt0  # inside the graph
        return {"seconds": seconds, "steps": n, "loss": self.loss, "opt_seconds": opt}

    def finish(self, gemm_floor: bool = False, peak_flops: float | None = None) -> dict[str, Any]:
        """The memory figures; then, with `gemm_floor`, one more step with its matmuls recorded and each timed alone
        (bench/gemm_floor.py), after the memory was read and the timed rounds ran, so it costs neither anything."""
        now = peak_memory_mib(self.device)
        out: dict[str, Any] = {
            "peak_mem_mib": max(now, self.peak_before_reset),
            "step_peak_mem_mib": now if self.was_reset else None,
            "children_peak_mem_mib": children_peak_mib(),
            "steps_done": self.steps_done,
            "final_loss": self.loss,
        }
        if gemm_floor:
            from graphtrain.bench import gemm_floor as floor

            assert self.work is not None, "setup must come first"
            try:
                out["gemm_floor"] = floor.measure(floor.record(self.work.step), peak_flops, str(self.device))
            except Exception as e:  # noqa: BLE001 - an extra figure: its failure is reported, the timed ones kept
                import traceback

                traceback.print_exc()
                out["gemm_floor"] = {"error": f"{type(e).__name__}: {e}"}
        return out


def serve(case: Case, variant: Variant, device: str, stdin: Any, channel: Any, pin_mmap: bool = False) -> None:
    worker = Worker(case, variant, device, pin_mmap)
    for line in stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "setup":
                reply = {"ok": True, **worker.setup()}
            elif op == "steps":
                reply = {"ok": True, **worker.steps(int(cmd["n"]), bool(cmd.get("reset_peak")))}
            elif op == "peak":
                reply = {"ok": True, "peak_mem_mib": peak_memory_mib(worker.device)}
            elif op == "finish":
                reply = {"ok": True, **worker.finish(bool(cmd.get("gemm_floor")), cmd.get("peak_flops"))}
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Skip as e:
            reply = {"ok": False, "skipped": str(e)}
        except Exception as e:  # noqa: BLE001 - reported to the runner, which records it per variant
            import traceback

            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        channel.write(REPLY + json.dumps(reply) + "\n")
        channel.flush()
        if op == "finish" or not reply["ok"]:
            return


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    case = Case(**spec["case"])
    channel = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints from libraries go to the worker's log, not the reply channel
    serve(case, VARIANTS[spec["variant"]], spec.get("device", "cpu"), sys.stdin, channel, bool(spec.get("pin_mmap")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
