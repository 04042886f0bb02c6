"""`graphtrain train --nproc N ...`: re-run the same command under torchrun (torch.distributed.run).

Single node:   launch(4, ["job.yaml", "parallel.dp=4"])
               ==  torchrun --standalone --nproc-per-node=4 -m graphtrain train job.yaml parallel.dp=4
(`graphtrain train job.yaml parallel.dp=4 --nproc 4` does exactly this: the CLI takes the YAML
positionally, then section.key=value overrides and options, and passes them on minus --nproc.)
Multi-node:    run on every node with the same rendezvous endpoint (see docs/distributed.md):
    launch(16, argv, nnodes=4, rdzv_endpoint="node0:29500", rdzv_id="job42")
"""
from __future__ import annotations

import subprocess
import sys


def torchrun_command(nproc: int, argv: list[str], *, nnodes: int = 1, rdzv_endpoint: str | None = None,
                     rdzv_id: str = "graphtrain", max_restarts: int = 0) -> list[str]:
    """The torchrun command line that runs `graphtrain train <argv>` on `nproc` processes per node."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if "--nproc" in argv or any(a.startswith("--nproc=") for a in argv):
        raise ValueError("remove --nproc from the arguments passed on to the workers (launch adds the torchrun flags)")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")  # local c10d rendezvous on a free port
    else:
        if rdzv_endpoint is None:
            raise ValueError("multi-node launch needs rdzv_endpoint='host:port' of a node every node can reach")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    return cmd + ["-m", "graphtrain", "train", *argv]


def launch(nproc: int, argv: list[str], **kwargs) -> int:
    """Run `graphtrain train <argv>` under torchrun with `nproc` workers; returns torchrun's exit code.

    The workers read RANK/WORLD_SIZE/MASTER_ADDR from torchrun's environment and call
    `graphtrain.distributed.init_distributed(config.parallel)`; parallel.dp*tp*pp must equal
    nproc * nnodes. One intra-op thread per worker unless OMP_NUM_THREADS is set (torchrun's default).
    """
    return subprocess.call(torchrun_command(nproc, argv, **kwargs))
