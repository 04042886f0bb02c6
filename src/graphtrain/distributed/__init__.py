"""Distributed training on torch.distributed: one entry point for the Trainer.

    env = init_distributed(cfg.parallel)                      # torchrun env -> process group + mesh
    model = build_model(cfg.model, vocab_size)                # same seed on every rank
    par = parallelize(model, lambda m: build_optimizer(m, cfg.optim), cfg.parallel, env)
    for step ...:
        for i, micro in enumerate(micro_batches):             # this dp rank's share of the batch
            loss = par.forward_backward(micro["input_ids"], micro["labels"], micro_step=i, micro_steps=n)
        par.clip_grad_norm_(cfg.optim.grad_clip); par.optimizer.step(); par.optimizer.zero_grad()
    par.save(path, extra) / par.load(path)

Layouts: dp (DDP), dp + zero_stage=1 (ZeroRedundancyOptimizer), tp (Megatron plan, DTensor parameters),
pp (pipelining 1F1B/GPipe), dp x tp and dp x pp (dp through FSDP2 `replicate` over the mesh's dp dim:
DDP takes neither DTensor parameters nor pipelined micro-batches). `par.accelerate(engine)` composes
each with the graph engine, and tp x pp (x dp) on the 3-D mesh. Not supported yet (clear ValueError):
ZeRO-1 with tp, ZeRO-1 with dp x pp.
"""

from __future__ import annotations

from graphtrain.distributed.layout import Parallelized, check_engine_under_ddp, parallelize
from graphtrain.distributed.mesh import DistEnv, check_layout, init_distributed, shutdown
from graphtrain.distributed.zero import optimizer_state_bytes

__all__ = [
    "DistEnv",
    "Parallelized",
    "check_engine_under_ddp",
    "check_layout",
    "init_distributed",
    "parallelize",
    "shutdown",
    "optimizer_state_bytes",
]
