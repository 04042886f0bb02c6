"""GPU smoke check (issue #48): Hugging Face models built from config train through graphtrain on CUDA like eager.

Run from a source checkout on a GPU machine (scripts/gpu-check.sh runs it): PYTHONPATH=src python scripts/gpu_smoke.py

Each case trains a small model (dropout off) for a few AdamW steps twice, once eagerly and once through one of
graphtrain's entry points, from the same weights and batches, and compares the per-step losses under graphtrain's
tolerance table (graphtrain.testing.TOLERANCES): fp32 with TF32 off against eager fp32, bf16 against eager under
bf16 autocast. Entry points: graphtrain.accelerate, torch.compile(backend="graphtrain"), graphtrain.compile_step.
Each case runs in its own process (a crash or a hang stays in its row); one that raises, misses the tolerance or
runs past --case-timeout is a failure, and the table says which and why. Exit status: 0 when every case passed.

Timings in the table are wall-clock seconds of this run (first step: compile included; step: the median of the
steps after it); they come from tiny models and say nothing about throughput.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

DEVICE = "cuda"  # --device cpu checks this script itself on a machine without a GPU


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _models(names: list[str]) -> dict[str, Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor]]]]:
    import transformers as tf

    def text_batch(vocab: int, b: int = 4, s: int = 128) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (b, s), device=DEVICE)
        return {"input_ids": ids, "labels": ids.clone()}

    def gpt2():
        cfg = tf.GPT2Config(
            n_layer=2,
            n_embd=128,
            n_head=4,
            vocab_size=1000,
            n_positions=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
        )
        return tf.GPT2LMHeadModel(cfg), text_batch(1000)

    def llama():  # grouped-query attention: 4 query heads share 2 key/value heads
        cfg = tf.LlamaConfig(
            vocab_size=1000,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            use_cache=False,
        )
        return tf.LlamaForCausalLM(cfg), text_batch(1000)

    def bert():
        cfg = tf.BertConfig(
            vocab_size=1000,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        batch = text_batch(1000)
        masked = torch.rand(batch["labels"].shape, device=DEVICE) < 0.15
        batch["labels"] = torch.where(masked, batch["labels"], torch.full_like(batch["labels"], -100))
        return tf.BertForMaskedLM(cfg), batch

    def vit():
        cfg = tf.ViTConfig(
            image_size=64,
            patch_size=8,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_labels=10,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        return tf.ViTForImageClassification(cfg), {
            "pixel_values": torch.randn(4, 3, 64, 64, device=DEVICE),
            "labels": torch.randint(0, 10, (4,), device=DEVICE),
        }

    table = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit}
    return {n: table[n] for n in names}


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The update every case uses: compile_step's AdamW with weight decay and clipping off (OptimConfig's betas)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True)


def _eager(model: torch.nn.Module, batch: dict, steps: int, precision: str) -> tuple[list[float], list[float]]:
    return _loop(model, model, batch, steps, autocast=precision == "bf16")


def _loop(
    call: Any, model: torch.nn.Module, batch: dict, steps: int, autocast: bool
) -> tuple[list[float], list[float]]:
    """`steps` training steps of `call` (the model, or its compiled form) with AdamW on `model`'s parameters:
    the losses and the step times."""
    opt = _adamw(model)
    losses, times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss = call(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def _graphtrain(
    entry: str, model: torch.nn.Module, batch: dict, steps: int, precision: str
) -> tuple[list[float], list[float]]:
    import graphtrain
    from graphtrain.config.sections import Config

    if entry == "compile_step":
        cfg = Config().with_overrides(
            [f"engine.precision={precision}", "optim.lr=1e-3", "optim.weight_decay=0.0", "optim.grad_clip=null"]
        )
        step = graphtrain.compile_step(model, cfg)
        losses, times = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = step(lr=1e-3, **batch)
            _sync()
            times.append(time.perf_counter() - t0)
            losses.append(float(out["loss"]))
        return losses, times
    if entry == "accelerate":
        compiled = graphtrain.accelerate(model, precision=precision)
    else:  # the torch.compile backend: precision as autocast, as a user of torch.compile writes it
        compiled = torch.compile(model, backend="graphtrain")
    return _loop(compiled, model, batch, steps, autocast=precision == "bf16" and entry == "torch.compile")


def _fallbacks(entry: str, model: torch.nn.Module) -> list[str]:
    """What ran other than compiled: the engine's fallbacks (a graph, or the whole capture, run eagerly) and the fused
    ops whose fast path failed at run time. A case whose losses match eager because it quietly ran eagerly is not a
    pass."""
    from graphtrain.kernels import runtime_fallbacks
    from graphtrain.pipeline.state import GLOBAL_STATE

    state = GLOBAL_STATE if entry == "torch.compile" else getattr(model, "_graphtrain", None)
    if state is None:
        return [f"{entry} left no engine state on the model: nothing was compiled"]
    out = [f"{part}: {' '.join(str(why).split())[:200]}" for part, why in state.fallbacks]
    out += ["capture failed: the model ran eagerly"] if state.eager_only else []
    out += [f"fused op {f.op} ({f.implementation}) fell back: {f.reason[:200]}" for f in runtime_fallbacks()]
    return out


def run_case(
    make: Callable[[], tuple[torch.nn.Module, dict]], entry: str, precision: str, steps: int
) -> dict[str, Any]:
    from graphtrain.testing import TOLERANCES

    torch.manual_seed(0)
    model, batch = make()
    model = model.to(DEVICE).train()
    ref = copy.deepcopy(model)
    want, eager_t = _eager(ref, batch, steps, precision)
    got, gt_t = _graphtrain(entry, model, batch, steps, precision)
    fell_back = _fallbacks(entry, model)
    rtol, atol = TOLERANCES[torch.bfloat16 if precision == "bf16" else torch.float32]
    worst = max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want))
    ok = all(abs(g - w) <= atol + rtol * abs(w) for g, w in zip(got, want))
    return {
        "ok": ok,
        "worst_rel": worst,
        "first_s": gt_t[0],
        "step_ms": 1e3 * statistics.median(gt_t[1:]),
        "eager_ms": 1e3 * statistics.median(eager_t[1:]),
        "losses": (got, want),
        "fallbacks": fell_back,
    }


# (model, entry, precision), each case a process start and a compile. First a round that covers every model, entry
# and precision once, so a --budget cut still leaves each of them checked; then every model through accelerate in
# the other precision and the remaining spread.
CASES = [
    ("gpt2", "accelerate", "fp32"),
    ("llama", "accelerate", "bf16"),
    ("bert", "accelerate", "bf16"),
    ("vit", "accelerate", "fp32"),
    ("gpt2", "torch.compile", "bf16"),
    ("llama", "compile_step", "fp32"),
    ("gpt2", "accelerate", "bf16"),
    ("llama", "accelerate", "fp32"),
    ("bert", "accelerate", "fp32"),
    ("vit", "accelerate", "bf16"),
    ("llama", "torch.compile", "fp32"),
    ("bert", "torch.compile", "bf16"),
    ("vit", "torch.compile", "fp32"),
    ("gpt2", "compile_step", "bf16"),
]


def _one(case: str, steps: int) -> int:
    """Run one case in this process; print its result as the last line (JSON)."""
    name, entry, precision = case.split(":")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 cases are TF32-off parity; bf16 cases are bf16 anyway
    torch.backends.cudnn.allow_tf32 = False
    try:
        r = run_case(_models([name])[name], entry, precision, steps)
        out = {
            "status": "MISMATCH" if not r["ok"] else "FALLBACK" if r["fallbacks"] else "ok",
            "detail": f"{r['worst_rel']:.1e} | {r['first_s']:.1f} | {r['step_ms']:.1f} | {r['eager_ms']:.1f}",
        }
        if r["fallbacks"]:
            out["detail"] += " | " + "; ".join(r["fallbacks"])
        if not r["ok"]:
            out["detail"] += (
                f" | losses {[f'{x:.5f}' for x in r['losses'][0]]} vs eager {[f'{x:.5f}' for x in r['losses'][1]]}"
            )
    except Exception as e:  # noqa: BLE001 - a crash is this case's result
        traceback.print_exc()
        out = {"status": "CRASH", "detail": " ".join(f"{type(e).__name__}: {e}".split())[:300]}
    print(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases",
        default=",".join(":".join(c) for c in CASES),
        help="model:entry:precision,... (models gpt2 llama bert vit; entries accelerate torch.compile "
        "compile_step; precisions fp32 bf16)",
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=1, help="cases run at once, each in its own process")
    ap.add_argument("--case-timeout", type=float, default=120.0, help="seconds one case may take")
    ap.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="seconds for all cases (0: no limit); a case that cannot start in time is NOT RUN",
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check the script without a GPU")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: run this case
    a = ap.parse_args(argv)
    global DEVICE
    DEVICE = a.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(
            "error: no CUDA device: this smoke check needs an NVIDIA GPU (use --device cpu to check the script)",
            file=sys.stderr,
        )
        return 2
    if a.one:
        return _one(a.one, a.steps)
    import transformers
    import triton

    import graphtrain

    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, transformers "
        f"{transformers.__version__}, graphtrain {graphtrain.__version__}, "
        f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU'}; each case in its own process"
    )
    start = time.perf_counter()

    def run_one(case: str) -> tuple[str, bool]:
        """One case in its own process: its table row, and whether it passed."""
        t0 = time.perf_counter()
        left = a.budget - (t0 - start) if a.budget else a.case_timeout
        if left < 20:  # not enough for a process start and a compile
            row = f"| {' | '.join(case.split(':'))} | NOT RUN | the --budget of {a.budget:.0f} s was spent |"
            print(row, flush=True)
            return row, False
        cmd = [sys.executable, __file__, "--one", case, "--steps", str(a.steps), "--device", DEVICE]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=min(a.case_timeout, left))
            last = (r.stdout.strip().splitlines() or ["{}"])[-1]
            out = (
                json.loads(last)
                if last.startswith("{")
                else {"status": "CRASH", "detail": f"exit {r.returncode}: {' '.join(r.stderr.split()[-40:])[:300]}"}
            )
            if out["status"] != "ok":
                sys.stderr.write(f"--- {case}\n{r.stdout[-3000:]}{r.stderr[-3000:]}\n")
        except subprocess.TimeoutExpired:
            out = {"status": "TIMEOUT", "detail": f"over {min(a.case_timeout, left):.0f} s"}
        row = f"| {' | '.join(case.split(':'))} | {out['status']} | {out['detail']} |"
        print(row + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        return row, out["status"] == "ok"

    # --jobs cases at once: each is a process with its own compile on the CPU cores and small models on the GPU, so
    # several share one GPU (their step times then say less; the table is about correctness)
    with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
        results = list(pool.map(run_one, a.cases.split(",")))
    rows = [row for row, _ in results]
    failed = sum(not ok for _, ok in results)
    print("\n| model | entry | precision | status | worst rel loss diff | first step s | step ms | eager step ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
