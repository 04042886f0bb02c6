"""A weight gradient's GEMM (d Y^T @ X, d Y read transposed) on 4 KiB pages and on huge pages, its rows unpadded and
padded by one cache line (kernels/linear_cross_entropy.py logits_row_stride): the measurement behind that padding
and behind the benchmarks' huge-page setting (memory/allocator.py).

    PYTHONPATH=src python scripts/huge_page_gemm.py [--rows 512] [--k 512] [--widths 1408 4096 16000 16384 32768]

Each page setting runs in a process of its own (graphtrain's allocator, as `use_huge_pages` installs it, is per
process), the settings alternate over `--rounds`; per width and layout the best of `--calls` calls of each round is
kept, and the table gives the median over rounds and the range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def child(huge: bool, rows: int, k: int, widths: list[int], calls: int) -> dict[str, float]:
    import torch

    from graphtrain.memory import allocator

    if huge and not allocator.use_huge_pages(True):
        raise SystemExit("no huge pages here (transparent huge pages off, or no C++ compiler)")
    x = torch.randn(rows, k)
    out: dict[str, float] = {}
    for v in widths:
        for pad in (0, 16):
            dy = torch.randn(rows, v + pad)[:, :v]
            torch.mm(dy.t(), x)  # warm-up
            best = float("inf")
            for _ in range(calls):
                t0 = time.perf_counter()
                torch.mm(dy.t(), x)
                best = min(best, time.perf_counter() - t0)
            out[f"{v}/{pad}"] = best * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--widths", type=int, nargs="+", default=[1408, 4096, 16000, 16384, 32768])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--child", choices=["small", "huge"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child == "huge", a.rows, a.k, a.widths, a.calls)))
        return
    runs: dict[str, list[dict[str, float]]] = {"small": [], "huge": []}
    for r in range(a.rounds):
        for pages in ("small", "huge") if r % 2 == 0 else ("huge", "small"):
            argv = [sys.executable, __file__, "--child", pages, "--rows", str(a.rows), "--k", str(a.k)]
            argv += ["--calls", str(a.calls), "--widths", *map(str, a.widths)]
            res = subprocess.run(argv, capture_output=True, text=True, check=True)
            runs[pages].append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"d Y^T @ X, d Y [{a.rows}, width] fp32 read transposed, X [{a.rows}, {a.k}]: ms a GEMM, median (range)")
    print("| width | 4 KiB pages | 4 KiB pages, padded | huge pages | huge pages, padded |")
    print("|---|---|---|---|---|")
    for v in a.widths:
        cells = []
        for pages in ("small", "huge"):
            for pad in (0, 16):
                ts = [r[f"{v}/{pad}"] for r in runs[pages]]
                cells.append(f"{statistics.median(ts):.1f} ({min(ts):.1f}-{max(ts):.1f})")
        print(f"| {v} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
