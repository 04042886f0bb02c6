"""Process group and device mesh: the first thing every distributed run does.

`init_distributed(parallel)` reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), picks the backend (NCCL on CUDA, gloo on CPU), sets the collective
timeout from `parallel.timeout_s` (so a dead or stuck rank raises instead of hanging), and builds a
`torch.distributed.device_mesh.DeviceMesh` with dims ("pp", "dp", "tp"). tp is the innermost dim,
so tensor-parallel peers are neighbouring ranks (same node, fastest link), and pp the outermost.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from graphtrain.config.sections import ParallelConfig

MESH_DIMS = ("pp", "dp", "tp")


@dataclass
class DistEnv:
    """Where this process sits: global rank/world, and its coordinates in the (pp, dp, tp) mesh."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None
    parallel: ParallelConfig

    def _coord(self, dim: str) -> int:
        return 0 if self.mesh is None else self.mesh.get_local_rank(dim)

    @property
    def pp_rank(self) -> int:
        return self._coord("pp")

    @property
    def dp_rank(self) -> int:
        return self._coord("dp")

    @property
    def tp_rank(self) -> int:
        return self._coord("tp")

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The process group along one mesh dim (None when not distributed)."""
        return None if self.mesh is None else self.mesh.get_group(dim)

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes metrics and samples."""
        return self.rank == 0


def check_layout(parallel: ParallelConfig, world_size: int) -> None:
    """Raise ValueError unless pp * dp * tp == world size, naming the sizes and the fix."""
    if parallel.world_size != world_size:
        hint = (
            f"set parallel.dp={world_size // (parallel.tp * parallel.pp)}"
            if world_size % (parallel.tp * parallel.pp) == 0
            else f"choose dp, tp, pp whose product is {world_size}"
        )
        raise ValueError(
            f"parallel layout pp={parallel.pp} x dp={parallel.dp} x tp={parallel.tp} = {parallel.world_size} ranks, "
            f"but the job has world size {world_size}: {hint}, or launch with --nproc {parallel.world_size}"
        )


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(parallel: ParallelConfig, backend: str | None = None) -> DistEnv:
    """Initialise torch.distributed from the torchrun environment and build the (pp, dp, tp) mesh.

    Without a torchrun environment (no WORLD_SIZE) and a 1-rank layout this returns a
    single-process DistEnv with no process group, so the same Trainer code runs both ways.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    check_layout(parallel, world_size)
    backend = backend or default_backend()
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
        # Without async error handling a dead NCCL peer hangs the others forever.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return DistEnv(0, 1, 0, device, None, parallel)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise ValueError(
                "WORLD_SIZE is set but MASTER_ADDR/MASTER_PORT are not: launch with torchrun "
                "(`graphtrain train --nproc N` or `torchrun --nproc-per-node N -m graphtrain train`)"
            )
        dist.init_process_group(
            backend=backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=parallel.timeout_s)
        )
    mesh = init_device_mesh(device.type, (parallel.pp, parallel.dp, parallel.tp), mesh_dim_names=MESH_DIMS)
    return DistEnv(rank, world_size, local_rank, device, mesh, parallel)


def shutdown() -> None:
    """Destroy the process group (call at the end of a run so NCCL/gloo exit cleanly)."""
    if dist.is_initialized():
        dist.destroy_process_group()
