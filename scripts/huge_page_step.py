"""A bench case's training step with and without huge pages, one process per setting, the settings alternating: what
`engine.cpu_huge_pages` costs or saves in steady state on this machine (docs/design/memory.md, "huge pages and
power-of-two rows").

    PYTHONPATH=src python scripts/huge_page_step.py hf-gpt2-wide --variant graphtrain-fp32 [--rounds 2]

Each process sets the `keep` allocator without huge pages, builds the case's model and optimizer (the bench's
`build_workload`), then turns huge pages on or leaves them off, as graphtrain decides after the model is built; it
runs one step (timed: the first), waits for graphtrain's background compile, runs 2 warm-up steps and times
`--steps` more. The table gives each round's first step and median step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def child(model: str, variant: str, huge: bool, steps: int) -> dict[str, float]:
    import torch

    import graphtrain
    from graphtrain.bench.case import SEED, build_workload
    from graphtrain.bench.paired import find_case
    from graphtrain.bench.suites import VARIANTS
    from graphtrain.memory import allocator
    from graphtrain.runtime.allocator import set_cpu_allocator

    set_cpu_allocator("keep", huge_pages=False)
    work, _ = build_workload(find_case(model, None, None), VARIANTS[variant], "cpu")
    if huge and not allocator.use_huge_pages(True):
        raise SystemExit("no huge pages here (transparent huge pages off, or no C++ compiler)")
    torch.manual_seed(SEED + 2)
    t0 = time.perf_counter()
    work.step()
    first = time.perf_counter() - t0
    if VARIANTS[variant].mode == "graphtrain":
        graphtrain.wait_compiled(work.model, timeout=1800)
    for _ in range(2):
        work.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        work.step()
        times.append(time.perf_counter() - t0)
    return {"first_s": first, "median_ms": statistics.median(times) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a bench case's model, e.g. hf-gpt2-wide")
    ap.add_argument("--variant", default="graphtrain-fp32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--child", choices=["small", "huge"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.model, a.variant, a.child == "huge", a.steps)))
        return
    print(f"{a.model}, {a.variant}: first step s / median step ms of {a.steps}, per round")
    print("| round | 4 KiB pages | huge pages |")
    print("|---|---|---|")
    for r in range(a.rounds):
        got = {}
        for pages in ("huge", "small") if r % 2 == 0 else ("small", "huge"):
            argv = [sys.executable, __file__, a.model, "--variant", a.variant, "--steps", str(a.steps)]
            argv += ["--child", pages]
            res = subprocess.run(argv, capture_output=True, text=True, check=True)
            got[pages] = json.loads(res.stdout.strip().splitlines()[-1])
        cells = [f"{got[p]['first_s']:.1f} / {got[p]['median_ms']:.0f}" for p in ("small", "huge")]
        print(f"| {r + 1} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
