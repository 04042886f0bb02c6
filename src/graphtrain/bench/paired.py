"""Paired timing of bench variants in one process, taking turns: a ratio that the machine's state moves less.

    python -m graphtrain.bench.paired hf-llama-wide --variants compile-bf16 graphtrain-bf16 --rounds 8

Why: on a shared VM the machine's state moves every step time by up to 2x within minutes (docs/design/benchmarks.md,
"Why this machine has slow periods"). `graphtrain bench` runs each variant in processes of its own and interleaves
their repeats, which spreads the state over the variants, but two medians taken minutes apart can still sit in two
states. Here every variant lives in this one process (built, warmed, graphtrain's background compile waited for),
and they take turns: each turn runs `--steps` steps of one variant, and the order reverses every round. Step i of
the first variant's turn is paired with step i of each other variant's turn in the same round, so the two steps of a
pair run seconds apart, and the ratio of each pair (the first variant's time over the other's) is reported: median
and range, beside each variant's median step and the idle-read probe (runner.idle_read_penalty) at start and end.

What the variants share, by construction: one allocator setting (keep, and huge pages as graphtrain chooses them for
the model, as `graphtrain bench` gives every variant), one heap, one set of threads. Eager and torch.compile
variants are built and warmed before any graphtrain variant, so that the process-wide settings graphtrain's first
compile makes (its compile cache folder, no donated buffers: pipeline/cache.py configure_cache) do not reach
torch.compile's graphs. A variant that changes a process-wide math setting (`fp32_matmul_bf16`) would change the
others', so it is refused. Each variant's memory lies idle while the others take their turn, so the first step of a
turn may read colder memory; every variant meets that alike. A check on the bench's ratios, not a replacement for
them: no largest batch, no memory figure, no FLOP count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Imports inside functions: import cost: `--help` stays free of torch.


def find_case(model: str, batch: int | None, seq: int | None) -> Any:
    """The first suite case of `model` (a bench model name, e.g. hf-llama-wide), its batch and length replaced by
    `batch` / `seq` where given; a model no suite has needs both."""
    from graphtrain.bench.suites import SUITES, Case

    for suite in SUITES.values():
        for c in suite.cases:
            if c.model == model and c.attention == "sdpa":
                return Case(model, batch or c.batch, seq or c.seq)
    if batch and seq:
        return Case(model, batch, seq)
    raise ValueError(
        f"no bench suite has the model {model!r}: pass --batch and --seq, or one of `graphtrain bench --list`"
    )


def pair_ratios(times: dict[str, list[float]], base: str) -> dict[str, dict[str, float]]:
    """For each variant other than `base`: the ratio base / variant of the steps at the same position (same round,
    same step of the turn), as median, min, max and count."""
    out = {}
    for name, ts in times.items():
        if name == base:
            continue
        ratios = [a / b for a, b in zip(times[base], ts)]
        out[name] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
            "pairs": len(ratios),
        }
    return out


def build_order(names: list[str]) -> list[str]:
    """The order the variants are built and warmed in: eager and torch.compile ones first, as given, then graphtrain's
    (module docstring: graphtrain's first compile changes process-wide compile settings)."""
    from graphtrain.bench.suites import VARIANTS

    return sorted(names, key=lambda n: VARIANTS[n].mode.startswith("graphtrain"))


def run(case: Any, names: list[str], rounds: int, steps: int, warmup: int, threads: int) -> dict[str, Any]:
    import torch

    import graphtrain
    from graphtrain.bench.case import SEED, build_workload
    from graphtrain.bench.runner import idle_read_penalty
    from graphtrain.bench.suites import VARIANTS
    from graphtrain.kernels import capability
    from graphtrain.runtime.allocator import huge_pages_as_graphtrain, set_cpu_allocator

    torch.set_num_threads(threads)
    set_cpu_allocator("keep", huge_pages=False)
    works = {}
    for name in build_order(names):
        t0 = time.perf_counter()
        work, _ = build_workload(case, VARIANTS[name], "cpu")
        if not works:  # every variant builds the same model
            huge_pages_as_graphtrain(work.model)
        torch.manual_seed(SEED + 2)
        work.step()
        if VARIANTS[name].mode == "graphtrain" and not graphtrain.wait_compiled(work.model, timeout=1800):
            print(f"{name}: its background compile outlived 30 min; it is timed on aten", file=sys.stderr, flush=True)
        for _ in range(warmup):
            work.step()
        works[name] = work
        print(f"{name}: ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    probe_start = idle_read_penalty()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            for _ in range(steps):
                t0 = time.perf_counter()
                works[name].step()
                times[name].append((time.perf_counter() - t0) * 1e3)
        print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
    probe_end = idle_read_penalty()
    return {
        "case": case.name,
        "variants": names,
        "built_in": build_order(names),
        "rounds": rounds,
        "steps_per_turn": steps,
        "threads": threads,
        "machine": capability.machine_key(),
        "torch": torch.__version__,
        "idle_read_start": probe_start,
        "idle_read_end": probe_end,
        "times_ms": times,
        "median_ms": {n: statistics.median(ts) for n, ts in times.items()},
        "ratios": pair_ratios(times, names[0]),
    }


def render(rec: dict[str, Any]) -> str:
    from graphtrain.bench.report import ratio_range

    base = rec["variants"][0]
    lines = [
        f"{rec['case']}, {rec['rounds']} rounds of {rec['steps_per_turn']} steps a turn, one process "
        f"({rec['machine']}); idle-read probe "
        f"{rec['idle_read_start']['ratio']:.2f}x at start, {rec['idle_read_end']['ratio']:.2f}x at end",
    ]
    for name in rec["variants"]:
        ts = rec["times_ms"][name]
        lines.append(f"  {name}: median {rec['median_ms'][name]:.1f} ms a step ({min(ts):.1f}-{max(ts):.1f})")
    for name, r in rec["ratios"].items():
        lines.append(
            f"  {base} / {name}: {r['median']:.2f}x, median of {r['pairs']} paired steps "
            f"(range {ratio_range(r['min'], r['max'])})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a bench model, e.g. hf-llama-wide (`graphtrain bench --list`)")
    p.add_argument("--variants", nargs="+", required=True, metavar="NAME", help="two or more; ratios are to the first")
    p.add_argument("--batch", type=int, help="default: the model's first suite case")
    p.add_argument("--seq", type=int, help="default: the model's first suite case")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="steps a turn")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (after the compile)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="also write the record (every step time) here")
    a = p.parse_args(argv)

    from graphtrain.bench.suites import VARIANTS

    unknown = [n for n in a.variants if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}: choose from {' '.join(VARIANTS)}")
    if len(set(a.variants)) < 2:
        p.error("--variants needs two or more different variants: the ratios compare them")
    shared = [n for n in a.variants if VARIANTS[n].fp32_matmul_bf16]
    if shared:
        p.error(
            f"{shared[0]} sets torch.backends.mkldnn.matmul.fp32_precision for the whole process, which would change "
            "the other variants' math: measure it with `graphtrain bench`, a process of its own"
        )
    if min(a.rounds, a.steps) < 1 or a.warmup < 0:
        p.error("--rounds and --steps must be at least 1, --warmup at least 0")
    try:
        case = find_case(a.model, a.batch, a.seq)
    except ValueError as e:
        p.error(str(e))
    from graphtrain.bench.case import Skip

    try:
        rec = run(case, list(a.variants), a.rounds, a.steps, a.warmup, a.threads)
    except Skip as e:  # a variant that cannot run here (an optional package missing)
        print(f"graphtrain.bench.paired: {e}", file=sys.stderr)
        return 2
    print(render(rec))
    if a.json:
        Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
