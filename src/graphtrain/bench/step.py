"""Training-step benchmark: eager vs torch.compile vs graphtrain, interleaved, one process per variant.

    python -m graphtrain.bench.step --model gpt2-small --batch 8 --seq 128 \\
        --variants eager,compile,graphtrain --steps 10 --repeats 3

Each variant lives in its own worker process (so its peak RSS is its own: weights, grads, AdamW state,
activations, compiled code) built from the same seed. The parent drives them in turns, A B C A B C, so
that machine-load drift (up to 35% here, MEASURED.md) hits every variant alike; only one worker runs at a
time. A step is forward + loss + backward + AdamW step + zero_grad. Reported: median step time over the
repeats (each repeat = mean over --steps) with min-max spread, ratios to eager and torch.compile, peak
RSS, and time to first step (includes compile; set GRAPHTRAIN_CACHE/TORCHINDUCTOR_CACHE_DIR for warm).

Variants: eager | compile (torch.compile, inductor) | graphtrain (accelerate, provider auto) |
graphtrain-aten | graphtrain-inductor; fused AdamW in every one. Models: graphtrain presets (gpt2-small,
bert-mini, ...), hf-gpt2 / hf-bert (transformers, built from config at the "small" size, SDPA attention), or
hf:<family> (any family of graphtrain.bench.families, e.g. hf:deberta2, hf:swin, at --dims).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import time
from typing import Any

import torch

# Imports inside functions: order: each worker process sets its environment (threads, allocator, caches) before
# graphtrain loads in it.


def build(
    model: str, batch: int, seq: int, seed: int = 0, dims: tuple[int, int, int] = (256, 4, 8192)
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model (dropout on, train mode) and one fixed batch. ``hf:<family>`` builds a Hugging Face family of
    graphtrain.bench.families at `dims` (hidden, layers, vocabulary)."""
    if model.startswith("hf:"):
        from graphtrain.bench.families import build_family

        hidden, layers, vocab = dims
        return build_family(model[3:], hidden=hidden, layers=layers, vocab=vocab, batch=batch, seq=seq, seed=seed)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if model.startswith("hf-"):
        import transformers as tf

        kw = dict(vocab_size=16384, attn_implementation="sdpa")
        if model == "hf-gpt2":
            m: torch.nn.Module = tf.GPT2LMHeadModel(
                tf.GPT2Config(n_layer=6, n_embd=512, n_head=8, n_positions=512, **kw)
            )
        elif model == "hf-bert":
            m = tf.BertForMaskedLM(
                tf.BertConfig(num_hidden_layers=6, hidden_size=512, num_attention_heads=8, intermediate_size=2048, **kw)
            )
        else:
            raise ValueError(f"unknown model {model!r}: use hf-gpt2, hf-bert or a graphtrain preset")
        vocab, family = 16384, "gpt2" if model == "hf-gpt2" else "bert"
    else:
        from graphtrain.config.sections import ModelConfig
        from graphtrain.models import build_model, resolve_spec

        cfg = ModelConfig(name=model)
        spec = resolve_spec(cfg)
        m, vocab, family = build_model(cfg), spec.vocab_size, spec.family
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    if family == "gpt2":
        inputs = {"input_ids": ids, "labels": ids}
    else:
        labels = torch.where(torch.rand(batch, seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        inputs = {"input_ids": ids, "labels": labels}
    return m.train(), inputs


def _loss(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def _worker(
    conn: Any, variant: str, model: str, batch: int, seq: int, threads: int, dims: tuple[int, int, int]
) -> None:
    torch.set_num_threads(threads)
    # the same process environment for every variant: the CPU allocator graphtrain sets for itself without
    # recompute (freed blocks kept; huge pages as it chooses them for this model), as the `graphtrain bench` suites do
    from graphtrain.runtime.allocator import huge_pages_as_graphtrain, set_cpu_allocator

    set_cpu_allocator("keep", huge_pages=False)
    m, inputs = build(model, batch, seq, dims=dims)
    huge_pages_as_graphtrain(m)
    if variant == "compile":
        m.compile()
    elif variant.startswith("graphtrain"):
        import graphtrain

        provider = variant.split("-", 1)[1] if "-" in variant else "auto"
        graphtrain.accelerate(m, provider=provider)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)  # the strongest one-flag AdamW, every variant

    def step() -> None:
        _loss(m(**inputs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    if variant.startswith("graphtrain"):  # provider auto: time the compiled graphs, not the background compile
        import graphtrain

        graphtrain.wait_compiled(m, timeout=1800)
        step()  # the switching step
    conn.send(("first", first))
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        step()  # one untimed warm-up step per turn (caches, allocator)
        t0 = time.perf_counter()
        for _ in range(cmd):
            step()
        conn.send(("time", (time.perf_counter() - t0) / cmd))
    conn.send(("rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    if variant.startswith("graphtrain"):
        import graphtrain

        conn.send(("report", str(graphtrain.report(m))))
    else:
        conn.send(("report", ""))


def run(
    model: str,
    batch: int,
    seq: int,
    variants: list[str],
    steps: int,
    repeats: int,
    threads: int,
    show_report: bool = False,
    dims: tuple[int, int, int] = (256, 4, 8192),
) -> dict[str, dict[str, Any]]:
    ctx = mp.get_context("spawn")
    # the spawned workers inherit this environment: torch.compile's own Inductor cache kept apart per simulated
    # ISA, as for `graphtrain bench`'s workers (worker.worker_env says why)
    from graphtrain.bench.worker import worker_env

    if "TORCHINDUCTOR_CACHE_DIR" in (env := worker_env()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = env["TORCHINDUCTOR_CACHE_DIR"]
    workers = {}
    res: dict[str, dict[str, Any]] = {v: {"times": []} for v in variants}
    for v in variants:  # start (and compile) one at a time: two cores, no overlap
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(child, v, model, batch, seq, threads, dims))
        p.start()
        res[v]["first"] = parent.recv()[1]
        workers[v] = (p, parent)
    for _ in range(repeats):
        for v in variants:
            workers[v][1].send(steps)
            res[v]["times"].append(workers[v][1].recv()[1])
    for v in variants:
        p, conn = workers[v]
        conn.send(None)
        res[v]["rss"] = conn.recv()[1]
        res[v]["report"] = conn.recv()[1]
        p.join()
    for r in res.values():
        r["median"] = statistics.median(r["times"])
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--variants", default="eager,compile,graphtrain")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per turn")
    ap.add_argument("--repeats", type=int, default=3, help="turns per variant (interleaved)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--dims",
        default="256,4,8192",
        metavar="HIDDEN,LAYERS,VOCAB",
        help="size of an hf:<family> model (graphtrain.bench.families)",
    )
    ap.add_argument("--report", action="store_true", help="print graphtrain's engine report per variant")
    a = ap.parse_args(argv)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    known = {"eager", "compile", "graphtrain", "graphtrain-aten", "graphtrain-inductor"}
    if set(variants) - known:
        raise SystemExit(f"unknown variants {sorted(set(variants) - known)}; choose from {sorted(known)}")
    parts = a.dims.split(",")
    if len(parts) != 3 or not all(x.strip().isdigit() for x in parts):
        raise SystemExit(f"--dims {a.dims!r}: give three integers, hidden,layers,vocab (e.g. 256,4,8192)")
    dims = tuple(int(x) for x in parts)
    res = run(a.model, a.batch, a.seq, variants, a.steps, a.repeats, a.threads, a.report, dims)
    print(
        f"{a.model} batch {a.batch} seq {a.seq}, {a.threads} threads, {a.repeats} interleaved turns x "
        f"{a.steps} steps, torch {torch.__version__}"
    )
    print(
        f"{'variant':<20} {'median s/step':>13} {'spread':>15} {'vs eager':>9} {'vs compile':>10} "
        f"{'peak RSS':>10} {'first step':>10}"
    )
    base = res.get("eager", {}).get("median")
    comp = res.get("compile", {}).get("median")
    for v, r in res.items():
        speed_e = f"{base / r['median']:.2f}x" if base else "-"
        speed_c = f"{comp / r['median']:.2f}x" if comp else "-"
        print(
            f"{v:<20} {r['median']:>13.3f} {min(r['times']):>7.3f}-{max(r['times']):<7.3f} {speed_e:>9} "
            f"{speed_c:>10} {r['rss'] / 2**20:>7.0f} MiB {r['first']:>9.1f}s"
        )
    if a.report:
        for v, r in res.items():
            if r["report"]:
                print(f"\n--- {v} ---\n{r['report']}")


if __name__ == "__main__":
    main()
