"""Peak memory and throughput: eager vs torch.compile vs graphtrain's recompute modes.

    python -m graphtrain.bench.memory --model gpt2-small --seq 1024 --batch 2 --cap-gib 4 --rounds 2

Each variant runs in its own fresh subprocess (graphtrain.tools.measure): warm-up steps, then
the resident high-water mark over the timed steps (CPU) -- absolute ``peak_rss`` (VmHWM, the figure the
docs quote) and the step's tensor part ``peak_tensor``. For the graphtrain variants the engine's step
prediction becomes a predicted process peak (the resident set measured before the timed steps, less the
parameters, optimizer state and batch in it, plus the predicted step peak: memory/process.py), recorded
with its error against ``peak_rss`` in every JSON row (``predicted_process_peak``, ``process_peak_error``)
and the table. Variants ``none``/``selective``/``full`` are
``graphtrain.accelerate(model, provider="aten", recompute=...)`` with the default passes (what users
run); ``graphtrain-*`` variants are the memory optimizer alone (``engine.capture.compile_train_step``, no
fusion). ``--rounds N`` interleaves the variants N times (eager, compile, none, ..., eager, ...) and
reports the median step time over rounds: on a shared machine load drifts over minutes, so
interleaving keeps the ratios fair. The largest batch under ``--cap-gib`` (absolute resident memory)
is found per variant from a second measurement at half the batch: peak is affine in the batch, so
the two points give the line, and ``--confirm`` measures the extrapolated batch to check it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from graphtrain.tools.measure import measure

# Imports inside functions: import cost: the comparison's parent process only starts measuring subprocesses
# (tools/measure.py); its in-process step timing loads the engine when it runs.

GiB = 2**30
MiB = 2**20
# name -> measure() keywords
VARIANTS: dict[str, dict] = {
    "eager": dict(mode="eager"),
    "compile": dict(mode="compile"),
    "none": dict(mode="accelerate", recompute="none"),
    "selective": dict(mode="accelerate", recompute="selective"),
    "full": dict(mode="accelerate", recompute="full"),
    "graphtrain-none": dict(mode="graphtrain", recompute="none"),
    "graphtrain-selective": dict(mode="graphtrain", recompute="selective"),
    "graphtrain-full": dict(mode="graphtrain", recompute="full"),
}
DEFAULT = "eager,compile,none,selective,full"
RECOMPUTING = ("selective", "full", "graphtrain-selective", "graphtrain-full")


def malloc_pinned(names: list[str], malloc: str) -> bool:
    """One allocator setting for every variant of a table (issue: the same process environment for every
    variant). `auto`: glibc's mmap threshold pinned in every process when a recompute variant is in the table
    (graphtrain's engine pins it for recompute, runtime/backend.py), glibc's default in every process otherwise."""
    if malloc == "auto":
        return any(n in RECOMPUTING for n in names)
    return malloc == "pinned"


def run(a: argparse.Namespace) -> list[dict]:
    names = (a.only or DEFAULT).split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    pinned = malloc_pinned(names, a.malloc)
    print(f"glibc mmap threshold: {'pinned' if pinned else 'default'} in every variant's process", file=sys.stderr)
    common = dict(
        model=a.model,
        seq=a.seq,
        warmup=a.warmup,
        dropout=a.dropout,
        attention=a.attention,
        pin_malloc=pinned,
        no_pin_malloc=not pinned,
    )
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rnd in range(a.rounds):
        for name in names:
            r = measure(batch=a.batch, steps=a.steps, **common, **VARIANTS[name])
            if "error" in r:
                print(f"{name}: FAILED {r['error'][-400:]}", file=sys.stderr)
                continue
            r["variant"], r["round"] = name, rnd
            runs[name].append(r)
            print(json.dumps(r), flush=True)
    rows = []
    for name in names:
        if not runs[name]:
            continue
        r = dict(runs[name][-1])
        r["step_s"] = statistics.median(x["step_s"] for x in runs[name])
        r["step_s_rounds"] = [x["step_s"] for x in runs[name]]
        r["peak_rss"] = max(x["peak_rss"] for x in runs[name])
        r["peak_tensor_bytes"] = max(x["peak_tensor_bytes"] for x in runs[name])
        errs = [x["process_peak_error"] for x in runs[name] if x.get("process_peak_error") is not None]
        if errs:  # each round's prediction against that round's own peak; the worst one is the row's
            r["process_peak_error_rounds"] = errs
            worst = max(runs[name], key=lambda x: abs(x.get("process_peak_error") or 0))
            for k in ("predicted_process_peak", "process_peak_error"):
                r[k] = worst[k]
            r["process_peak_error_measured"] = worst["peak_rss"]
        if a.cap_gib:
            half = measure(batch=max(1, a.batch // 2), steps=1, **common, **VARIANTS[name])
            if "error" not in half and half["batch"] != r["batch"]:
                r["max_batch_under_cap"], r["cap_method"] = _max_batch(r, half, a.cap_gib * GiB)
                if a.confirm and r["max_batch_under_cap"]:
                    c = measure(batch=r["max_batch_under_cap"], steps=1, **{**common, "warmup": 1}, **VARIANTS[name])
                    r["confirm_peak_rss"] = c.get("peak_rss")
                    b_c = r["max_batch_under_cap"]
                    if c.get("peak_rss") and b_c != r["batch"]:  # refit the line through the far point
                        k = (c["peak_rss"] - r["peak_rss"]) / (b_c - r["batch"])
                        if k > 0:
                            r["max_batch_refit"] = int(b_c + (a.cap_gib * GiB - c["peak_rss"]) // k)
        rows.append(r)
    return rows


def _max_batch(r: dict, half: dict, cap: float) -> tuple[int | None, str]:
    """Largest batch whose resident peak stays under `cap`, from measurements at two batches.

    Peak is affine in the batch while activations set it: the two measured points give the line. With
    little activation memory the peak is the optimizer update (parameters + gradients + moments), the
    same at both batches, and the measured line is flat: then the engine's own prediction (forward and
    backward phases, which grow with the batch; within a few % of measured, tests/test_memory_predict.py)
    gives the slope, and the measured optimizer-phase peak must fit too."""
    db = r["batch"] - half["batch"]
    k = (r["peak_rss"] - half["peak_rss"]) / db
    ph, hph = r.get("predicted_phases"), half.get("predicted_phases")
    if ph and hph:
        act = lambda p: max(p["forward"], p["backward"])  # noqa: E731
        kp = (act(ph) - act(hph)) / db
        if kp > 0 and (k <= 0 or k < 0.5 * kp):  # measured line flat: the optimizer phase sets both peaks
            baseline = r["peak_rss"] - r["peak_tensor_bytes"]  # interpreter, libraries, caches
            if r["peak_rss"] > cap:
                return 0, "predicted"
            return int((cap - baseline - (act(ph) - kp * r["batch"])) // kp), "predicted slope"
    if k <= 0:
        return None, "flat"
    return int((cap - (r["peak_rss"] - k * r["batch"])) // k), "measured line"


def interleaved_step_times(
    model: str,
    seq: int,
    batch: int,
    variants: list[str],
    steps: int = 5,
    warmup: int = 2,
    threads: int = 2,
    dropout: float | None = None,
    attention: str = "sdpa",
) -> dict[str, list[float]]:
    """Step times of several variants in one process, alternating one step of each: load on a shared machine
    drifts over minutes, so back-to-back steps compare under the same load. Memory is not measured here
    (one process holds every model); use run() for that. Variants: eager, compile, or a recompute mode
    (none/selective/full) of graphtrain.accelerate(provider="aten")."""
    import copy

    import torch

    from graphtrain.runtime.allocator import huge_pages_as_graphtrain, set_cpu_allocator
    from graphtrain.tools.measure import build

    torch.set_num_threads(threads)
    # what accelerate does for these modes (runtime/allocator.py allocator_mode, and huge pages as it chooses them
    # for this model); applies to every variant here
    set_cpu_allocator(
        "release" if any(v in ("selective", "full", "auto") for v in variants) else "keep", huge_pages=False
    )
    torch.manual_seed(0)
    base, data = build(model, seq, batch, dropout, attention)
    huge_pages_as_graphtrain(base)
    steps_fn = {}
    for v in variants:
        m = copy.deepcopy(base)
        if v == "compile":
            fn = torch.compile(m)
        elif v == "eager":
            fn = m
        else:
            import graphtrain

            fn = graphtrain.accelerate(m, provider="aten", recompute=v)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

        def step(fn=fn, opt=opt) -> None:
            fn(*data).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps_fn[v] = step
    times: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(warmup + steps):
        for v in variants:
            t0 = time.perf_counter()
            steps_fn[v]()
            if i >= warmup:
                times[v].append(time.perf_counter() - t0)
    return times


def table(rows: list[dict], cap_gib: float | None = None) -> str:
    eager = next((r for r in rows if r["variant"] == "eager"), None)
    out = [
        "| variant | peak RSS MiB | vs eager | step tensors MiB | vs eager | saved for backward MiB | "
        "predicted step MiB | predicted process MiB | error vs peak RSS | step s (median) | eager/this | "
        "max batch under cap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = f"{r['peak_rss'] / eager['peak_rss']:.2f}x" if eager else "-"
        relt = f"{r['peak_tensor_bytes'] / eager['peak_tensor_bytes']:.2f}x" if eager else "-"
        tp = f"{eager['step_s'] / r['step_s']:.2f}x" if eager else "-"
        saved = f"{r['saved_bytes'] / MiB:,.0f}" if r.get("saved_bytes") is not None else "-"
        pred = f"{r['predicted_peak'] / MiB:,.0f}" if r.get("predicted_peak") else "-"
        proc, err = "-", "-"
        if r.get("predicted_process_peak"):
            proc, err = f"{r['predicted_process_peak'] / MiB:,.0f}", f"{100 * r['process_peak_error']:+.2f}%"
        mb = r.get("max_batch_under_cap", "-")
        if r.get("cap_method") == "predicted slope":
            mb = f"{mb} (predicted slope)"
        if r.get("confirm_peak_rss"):
            mb = f"{mb} (measured {r['confirm_peak_rss'] / MiB:,.0f} MiB)"
            if "max_batch_refit" in r:
                mb += f" -> {r['max_batch_refit']} refit"
        out.append(
            f"| {r['variant']} | {r['peak_rss'] / MiB:,.0f} | {rel} | {r['peak_tensor_bytes'] / MiB:,.0f} | {relt} | "
            f"{saved} | {pred} | {proc} | {err} | {r['step_s']:.2f} | {tp} | {mb} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--cap-gib", type=float, default=None, help="find the largest batch under this resident cap")
    p.add_argument("--confirm", action="store_true", help="measure the extrapolated largest batch")
    p.add_argument("--only", default=None, help=f"comma-separated variants (default {DEFAULT}): " + ",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=1, help="interleave the variants this many times (median step time)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument(
        "--attention",
        choices=("sdpa", "explicit"),
        default="sdpa",
        help="reference models' attention: SDPA (the headline baseline) or hand-written (second rows)",
    )
    p.add_argument(
        "--malloc",
        choices=("auto", "pinned", "default"),
        default="auto",
        help="glibc's mmap threshold in every variant's process: auto pins it when a recompute variant "
        "runs (as graphtrain does for recompute), else glibc's default; never per variant",
    )
    p.add_argument("--out", default=None, help="append the JSON rows to this file")
    p.add_argument(
        "--timing", action="store_true", help="only step times, all variants in one process, interleaved step by step"
    )
    a = p.parse_args(argv)
    if a.timing:
        names = (a.only or DEFAULT).split(",")
        names = [n for n in names if n in ("eager", "compile", "none", "selective", "full")]
        times = interleaved_step_times(
            a.model, a.seq, a.batch, names, steps=a.steps, warmup=a.warmup, dropout=a.dropout, attention=a.attention
        )
        ref = statistics.median(times[names[0]])
        print(f"{a.model} seq {a.seq} batch {a.batch}: step time, variants interleaved step by step in one process")
        print("| variant | median step s | vs " + names[0] + " | all |\n|---|---|---|---|")
        for n in names:
            med = statistics.median(times[n])
            print(f"| {n} | {med:.2f} | {med / ref:.2f}x | {', '.join(f'{t:.2f}' for t in times[n])} |")
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps({"timing": times, "model": a.model, "seq": a.seq, "batch": a.batch}) + "\n")
        return
    rows = run(a)
    print(
        f"\n{a.model} seq {a.seq} batch {a.batch} on {rows[0]['machine'] if rows else '?'} (CPU peak resident "
        f"memory, VmHWM; step tensors = peak minus the non-tensor resident baseline; predicted process = the "
        f"resident set before the step, less its parameters, optimizer state and batch, plus the predicted step "
        f"peak; error = (predicted process - peak RSS) / peak RSS; cap {a.cap_gib} GiB)\n" + table(rows, a.cap_gib)
    )
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
