"""Per-rank memory, communication volume and step time for each parallel layout, against one process.

    OMP_NUM_THREADS=1 python -m graphtrain.bench.distributed [--model gpt2-tiny] [--steps 20]

Layouts: dp=1, dp=2, dp=2 + ZeRO-1, tp=2, pp=2 (1F1B, 2 micro-batches), each on gloo processes on this
machine (graphtrain.distributed.spawn.run_ranks), 8 sequences of 64 tokens per step in total. Per rank:
parameter bytes held (local shards), optimizer state bytes, and bytes sent per step: the data-parallel
gradient all-reduce (each rank's gradient bytes), the tensor-parallel collectives (counted as they run,
`tensor_parallel.COMM_BYTES`), the pipeline's activations and their gradients between stages (from the
boundary tensor's shape: micro-batches x 2 directions).
"""

from __future__ import annotations

import argparse
import time

import torch

from graphtrain.config.sections import ModelConfig, OptimConfig, ParallelConfig
from graphtrain.distributed import parallelize
from graphtrain.distributed import tensor_parallel as tp
from graphtrain.distributed.data_parallel import gradient_bytes
from graphtrain.distributed.spawn import run_ranks
from graphtrain.models import build_model
from graphtrain.optim import build_optimizer

LAYOUTS = {
    "dp=1": dict(),
    "dp=2": dict(dp=2),
    "dp=2 zero1": dict(dp=2, zero_stage=1),
    "tp=2": dict(tp=2),
    "pp=2": dict(pp=2, microbatches=2),
}
BATCH, SEQ = 8, 64


def _work(layout: dict, model_name: str, steps: int) -> dict:

    torch.manual_seed(0)
    model = build_model(ModelConfig(name=model_name, dropout=0.0))
    par = parallelize(model, lambda m: build_optimizer(m, OptimConfig()), ParallelConfig(timeout_s=60, **layout))
    dp = par.env.parallel.dp
    g = torch.Generator().manual_seed(1)
    vocab = model.spec.vocab_size
    ids, labels = (torch.randint(0, vocab, (BATCH // dp, SEQ), generator=g) for _ in range(2))
    t0 = time.perf_counter()
    for i in range(steps + 3):
        if i == 3:
            t0 = time.perf_counter()
            tp.COMM_BYTES.clear()
        par.forward_backward(ids, labels)
        par.optimizer.step()
        par.optimizer.zero_grad()
    seconds = (time.perf_counter() - t0) / steps
    local = [p.to_local() if hasattr(p, "to_local") else p for p in par.module.parameters()]
    pp_bytes = 0
    if par.env.parallel.pp > 1:  # each stage boundary: [B/dp, T, d] activations forward, their gradient back
        pp_bytes = 2 * (BATCH // dp) * SEQ * model.spec.d_model * 4
    return {
        "ms": seconds * 1e3,
        "param_bytes": sum(t.numel() * t.element_size() for t in local),
        "optim_bytes": par.optimizer_state_bytes(),
        "dp_bytes": gradient_bytes(par.module) if dp > 1 else 0,
        "tp_bytes": sum(tp.COMM_BYTES.values()) // steps,
        "pp_bytes": pp_bytes,
    }


def main(argv: list[str] | None = None) -> int:

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    a = p.parse_args(argv)
    print(
        "| layout | rank | ms/step | parameter bytes | optimizer state bytes | dp all-reduce bytes/step "
        "| tp collective bytes/step | pp boundary bytes/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label in a.layouts.split(","):
        layout = LAYOUTS[label]
        world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
        for r, m in enumerate(run_ranks(_work, world, layout, a.model, a.steps)):
            print(
                f"| {label} | {r} | {m['ms']:.1f} | {m['param_bytes']:,} | {m['optim_bytes']:,} | {m['dp_bytes']:,} "
                f"| {m['tp_bytes']:,} | {m['pp_bytes']:,} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
