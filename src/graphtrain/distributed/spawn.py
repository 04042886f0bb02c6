"""Run a function on N local gloo ranks (tests and measurements; production uses torchrun).

`run_ranks(fn, nproc, *args)` spawns N processes with the torchrun environment variables set
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT), one intra-op thread
each, calls `fn(*args)` in each and returns the list of per-rank return values (rank order). A rank's
value travels through a file read with `torch.load(weights_only=True)`: return tensors and plain values
(numbers, strings, lists, tuples, dicts).
A rank that raises fails the whole call with its traceback; a run past `timeout_s` is killed and
raises TimeoutError, so a broken collective can never hang a test suite.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(local_rank: int, fn: Callable, nproc: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(local_rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"rank{local_rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Success: leave without interpreter teardown. About one run in six of the dp=2 -> tp=2 checkpoint test,
    # a rank that had finished aborted at exit ("terminate called without an active exception", SIGABRT:
    # a C++ thread still joinable when static destructors ran), and the others were killed with it. The
    # result is saved and the process group destroyed by now; an exception above still propagates as usual.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Call `fn(*args)` on `nproc` spawned ranks; return their results in rank order."""
    with tempfile.TemporaryDirectory(prefix="graphtrain-ranks-") as out_dir:
        ctx = mp.start_processes(
            _entry, args=(fn, nproc, free_port(), out_dir, args), nprocs=nproc, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{nproc} ranks did not finish within {timeout_s:.0f}s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [_result(out_dir, r) for r in range(nproc)]


def _result(out_dir: str, rank: int) -> Any:
    try:
        return torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=True)
    except pickle.UnpicklingError as e:
        raise TypeError(
            f"run_ranks: rank {rank} returned objects other than tensors and plain values "
            f"({' '.join(str(e).split())[:200]}); return tensors, numbers, strings, lists, tuples and "
            f"dicts"
        ) from None
