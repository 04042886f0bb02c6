"""Per-rank optimizer memory, gradient all-reduce volume and step time for dp=1, dp=2, dp=2+ZeRO-1.

    OMP_NUM_THREADS=1 python -m graphtrain.bench.distributed [--model gpt2-tiny] [--steps 20]

Ranks are gloo processes on this machine (graphtrain.distributed.spawn.run_ranks).
"""
from __future__ import annotations

import argparse
import time

import torch

from graphtrain.config import ModelConfig, OptimConfig, ParallelConfig


def _work(dp: int, zero: int, model_name: str, steps: int) -> tuple[float, int, int]:
    from graphtrain.distributed import parallelize
    from graphtrain.distributed.data_parallel import gradient_bytes
    from graphtrain.models import build_model
    from graphtrain.optim import build_optimizer

    torch.manual_seed(0)
    model = build_model(ModelConfig(name=model_name, dropout=0.0))
    par = parallelize(model, lambda m: build_optimizer(m, OptimConfig()), ParallelConfig(dp=dp, zero_stage=zero, timeout_s=60))
    g = torch.Generator().manual_seed(1)
    vocab = model.spec.vocab_size
    ids, labels = (torch.randint(0, vocab, (8 // dp, 64), generator=g) for _ in range(2))
    t0 = time.perf_counter()
    for i in range(steps + 3):
        if i == 3:
            t0 = time.perf_counter()
        par.forward_backward(ids, labels)
        par.optimizer.step()
        par.optimizer.zero_grad()
    return (time.perf_counter() - t0) / steps, par.optimizer_state_bytes(), gradient_bytes(par.module)


def main(argv: list[str] | None = None) -> int:
    from graphtrain.distributed.spawn import run_ranks

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    for label, world, zero in (("dp=1", 1, 0), ("dp=2", 2, 0), ("dp=2 zero1", 2, 1)):
        per_rank = run_ranks(_work, world, world, zero, a.model, a.steps)
        print(label, [f"{s * 1e3:.1f} ms/step, optim state {o:,} B, grads {gb:,} B" for s, o, gb in per_rank])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
