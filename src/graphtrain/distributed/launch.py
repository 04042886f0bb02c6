"""`graphtrain train --nproc N ...`: re-run the same command under torchrun's elastic agent.

Single node:   launch(4, ["job.yaml", "parallel.dp=4"])
               ==  torchrun --standalone --nproc-per-node=4 -m graphtrain train job.yaml parallel.dp=4
(`graphtrain train job.yaml parallel.dp=4 --nproc 4` does exactly this: the CLI takes the YAML
positionally, then section.key=value overrides and options, and passes them on minus --nproc.)
Multi-node:    run on every node with the same rendezvous endpoint (see docs/distributed.md):
    launch(16, argv, nnodes=4, rdzv_endpoint="node0:29500", rdzv_id="job42")

The agent runs in this process (`torch.distributed.run.run`, what the `torchrun` script calls), so it
is this process that receives a scheduler's SIGTERM or a Ctrl-C: the agent forwards it to every worker
(each finishes its step and saves, graphtrain.trainer.faults) and waits `shutdown_timeout_s` for them
before SIGKILL. With `max_restarts` K > 0 it restarts all workers when one fails, up to K times; the
restarted workers see TORCHELASTIC_RESTART_COUNT > 0 and continue from the latest valid checkpoint.
"""
from __future__ import annotations

import signal
import sys
import threading


def torchrun_command(nproc: int, argv: list[str], *, nnodes: int = 1, rdzv_endpoint: str | None = None,
                     rdzv_id: str = "graphtrain", max_restarts: int = 0,
                     shutdown_timeout_s: int | None = None) -> list[str]:
    """The torchrun command line that runs `graphtrain train <argv>` on `nproc` processes per node."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    if "--nproc" in argv or any(a.startswith("--nproc=") for a in argv):
        raise ValueError("remove --nproc from the arguments passed on to the workers (launch adds the torchrun flags)")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}"]
    if shutdown_timeout_s is not None:
        cmd.append(f"--shutdown-timeout={int(shutdown_timeout_s)}")
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")  # local c10d rendezvous on a free port
    else:
        if rdzv_endpoint is None:
            raise ValueError("multi-node launch needs rdzv_endpoint='host:port' of a node every node can reach")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    return cmd + ["-m", "graphtrain", "train", *argv]


def launch(nproc: int, argv: list[str], **kwargs) -> int:
    """Run `graphtrain train <argv>` under torchrun's elastic agent with `nproc` workers (keyword arguments:
    `torchrun_command`'s). Returns 0 when every worker succeeded; the workers' exit status when every
    failed worker exited with the same one (graphtrain's: 1 runtime failure, 2 usage error, 75 preempted);
    128 + the signal number when this process got SIGTERM/SIGINT (forwarded to the workers); else 1.

    The workers read RANK/WORLD_SIZE/MASTER_ADDR from torchrun's environment and call
    `graphtrain.distributed.init_distributed(config.parallel)`; parallel.dp*tp*pp must equal
    nproc * nnodes. One intra-op thread per worker unless OMP_NUM_THREADS is set (torchrun's default).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    cmd = torchrun_command(nproc, argv, **kwargs)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    try:
        run(parse_args(cmd[3:]))  # cmd[:3] is `python -m torch.distributed.run`
    except ChildFailedError as e:  # restarts exhausted: the last attempt's failures, per global rank
        codes = {f.exitcode for f in e.failures.values()}
        return codes.pop() if len(codes) == 1 and min(codes) > 0 else 1
    except SignalException as e:  # the agent forwarded the signal and waited for the workers
        return 128 + int(e.sigval)
    finally:  # the agent installed handlers that raise SignalException: put the previous ones back
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
