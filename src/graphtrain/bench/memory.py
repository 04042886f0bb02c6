"""Peak memory and throughput: eager vs torch.compile vs graphtrain's recompute modes.

    python -m graphtrain.bench.memory --model gpt2-small --seq 256 --batch 4 --cap-gib 4

Each variant runs in its own fresh subprocess (graphtrain.memory.measure): warm-up steps, then
the resident high-water mark over the timed steps (CPU) -- absolute ``peak_rss`` and the step's
tensor part ``peak_tensor``. The largest batch under ``--cap-gib`` (absolute resident memory) is
found per variant from a second measurement at half the batch: peak is affine in the batch, so
the two points give the line, and ``--confirm`` measures the extrapolated batch to check it.
Timings on a shared 2-core machine vary by up to 35%: read step-time ratios with that in mind.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from graphtrain.memory.measure import measure

GiB = 2**30
MiB = 2**20
VARIANTS = [("eager", "eager", "none", False), ("compile", "compile", "none", False),
            ("graphtrain", "graphtrain", "none", False), ("graphtrain+inplace", "graphtrain", "none", True),
            ("selective", "graphtrain", "selective", True), ("full", "graphtrain", "full", True)]


def run(a: argparse.Namespace) -> list[dict]:
    rows = []
    chosen = [v for v in VARIANTS if not a.only or v[0] in a.only.split(",")]
    for name, mode, rc, inplace in chosen:
        t0 = time.time()
        r = measure(model=a.model, seq=a.seq, batch=a.batch, mode=mode, recompute=rc, inplace=inplace,
                    steps=a.steps, warmup=a.warmup, dropout=a.dropout)
        if "error" in r:
            print(f"{name}: FAILED {r['error'][-400:]}", file=sys.stderr)
            continue
        r["variant"] = name
        if a.cap_gib:
            half = measure(model=a.model, seq=a.seq, batch=max(1, a.batch // 2), mode=mode, recompute=rc,
                           inplace=inplace, steps=1, warmup=a.warmup, dropout=a.dropout)
            if "error" not in half and half["batch"] != r["batch"]:
                k = (r["peak_rss"] - half["peak_rss"]) / (r["batch"] - half["batch"])
                r["per_sample_bytes"] = k
                r["max_batch_under_cap"] = int((a.cap_gib * GiB - (r["peak_rss"] - k * r["batch"])) // k) if k > 0 else None
                if a.confirm and r["max_batch_under_cap"]:
                    c = measure(model=a.model, seq=a.seq, batch=r["max_batch_under_cap"], mode=mode, recompute=rc,
                                inplace=inplace, steps=1, warmup=1, dropout=a.dropout)
                    r["confirm_peak_rss"] = c.get("peak_rss")
        r["wall_s"] = time.time() - t0
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    eager = next((r for r in rows if r["variant"] == "eager"), None)
    out = ["| variant | peak RSS MiB | step tensors MiB | vs eager | step s | vs eager | max batch under cap |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = f"{r['peak_tensor_bytes'] / eager['peak_tensor_bytes']:.2f}x" if eager else "-"
        tp = f"{eager['step_s'] / r['step_s']:.2f}x" if eager else "-"
        out.append(f"| {r['variant']} | {r['peak_rss'] / MiB:,.0f} | {r['peak_tensor_bytes'] / MiB:,.0f} | {rel} | "
                   f"{r['step_s']:.2f} | {tp} | {r.get('max_batch_under_cap', '-')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--cap-gib", type=float, default=None, help="find the largest batch under this resident cap")
    p.add_argument("--confirm", action="store_true", help="measure the extrapolated largest batch")
    p.add_argument("--only", default=None, help="comma-separated variants: " + ",".join(v[0] for v in VARIANTS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument("--out", default=None, help="append the JSON rows to this file")
    a = p.parse_args(argv)
    rows = run(a)
    print(f"\n{a.model} seq {a.seq} batch {a.batch} (CPU peak resident memory; step tensors = peak minus "
          f"the non-tensor resident baseline)\n" + table(rows))
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
