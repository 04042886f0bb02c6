"""`graphtrain train --nproc N ...`: re-run the same command under torchrun's elastic agent.

Single node:   launch(4, ["job.yaml", "parallel.dp=4"])
               ==  torchrun --standalone --nproc-per-node=4 -m graphtrain train job.yaml parallel.dp=4
(`graphtrain train job.yaml parallel.dp=4 --nproc 4` does exactly this: the CLI takes the YAML
positionally, then section.key=value overrides and options, and passes them on minus --nproc.)
Multi-node:    run on every node with the same rendezvous endpoint (see docs/design/distributed.md):
    launch(16, argv, nnodes=4, rdzv_endpoint="node0:29500", rdzv_id="job42")

The agent runs in this process (`torch.distributed.run.run`, what the `torchrun` script calls), so it
is this process that receives a scheduler's SIGTERM or a Ctrl-C: the agent forwards it to every worker
(each finishes its step and saves, graphtrain.trainer.faults) and waits `shutdown_timeout_s` for them
before SIGKILL. With `max_restarts` K > 0 it restarts all workers when one fails, up to K times.

A restart is for a crash (a signal, or exit 1: a runtime failure), never for a refusal (exit 2: the command as
given cannot run), yet torchrun's agent restarts on any failure. In `launch` the agent stops at once when every
failed worker exited 2 (`_no_restart_after_refusal`). Under a torchrun started by hand (or should torch's agent
change) the attempts of one launch share a folder (`launch_state`): a worker that refuses records it there, and
the workers of a restart find the record and exit 2 at once, touching nothing (`refused_earlier`). A restarted worker continues from the latest valid
checkpoint once this launch has written one (`written_since_launch`: compared with the listing of out_dir
taken when the launch began); until then it repeats what the command asked (a fresh start, --resume,
--resume-from CKPT), so a crash before the first save never swaps the checkpoint the user named for another.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from graphtrain.config.torch_compat import torchrun_shutdown_timeout_flag

STATE_ENV = "GRAPHTRAIN_LAUNCH_STATE"  # the folder the attempts of one launch share (set by `launch`)
_TORCHRUN_FIXED_SHUTDOWN_S = 30  # torch 2.11's agent: SIGKILL this long after forwarding a stop signal
_CKPT = re.compile(r"^ckpt-\d{7,}(\.pt)?$")  # trainer/checkpoint.py's names: a file or a sharded folder


def torchrun_command(
    nproc: int,
    argv: list[str],
    *,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "graphtrain",
    max_restarts: int = 0,
    shutdown_timeout_s: int | None = None,
) -> list[str]:
    """The torchrun command line that runs `graphtrain train <argv>` on `nproc` processes per node."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    if "--nproc" in argv or any(a.startswith("--nproc=") for a in argv):
        raise ValueError("remove --nproc from the arguments passed on to the workers (launch adds the torchrun flags)")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    flag = torchrun_shutdown_timeout_flag() if shutdown_timeout_s is not None else None
    if flag is not None:
        cmd.append(f"{flag}={int(shutdown_timeout_s)}")
    elif shutdown_timeout_s is not None and shutdown_timeout_s > _TORCHRUN_FIXED_SHUTDOWN_S:
        print(
            f"graphtrain: this torch's torchrun waits {_TORCHRUN_FIXED_SHUTDOWN_S} s for stopping workers, not "
            f"{int(shutdown_timeout_s)} s (train.preempt_grace_s + 15): a worker still saving then is killed; "
            f"lower train.preempt_grace_s, or use a torch whose torchrun takes --shutdown-timeout (2.13 does)",
            file=sys.stderr,
        )
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")  # local c10d rendezvous on a free port
    else:
        if rdzv_endpoint is None:
            raise ValueError("multi-node launch needs rdzv_endpoint='host:port' of a node every node can reach")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    return cmd + ["-m", "graphtrain", "train", *argv]


def launch(nproc: int, argv: list[str], out_dir: str | os.PathLike | None = None, **kwargs) -> int:
    """Run `graphtrain train <argv>` under torchrun's elastic agent with `nproc` workers (keyword arguments:
    `torchrun_command`'s). Returns 0 when every worker succeeded; the workers' exit status when every
    failed worker exited with the same one (graphtrain's: 1 runtime failure, 2 usage error, 75 preempted);
    128 + the signal number when this process got SIGTERM/SIGINT (forwarded to the workers); else 1.

    The workers read RANK/WORLD_SIZE/MASTER_ADDR from torchrun's environment and call
    `graphtrain.distributed.init_distributed(config.parallel)`; parallel.dp*tp*pp must equal
    nproc * nnodes. One intra-op thread per worker unless OMP_NUM_THREADS is set (torchrun's default).
    `out_dir`: the run folder, listed before the workers start (what a restart must not take for its own).
    """
    cmd = torchrun_command(nproc, argv, **kwargs)
    state = Path(tempfile.mkdtemp(prefix="graphtrain-launch-"))
    previous_state = os.environ.get(STATE_ENV)
    os.environ[STATE_ENV] = str(state)  # torchrun's workers inherit this process's environment
    try:
        if out_dir is not None:
            _write(state / "checkpoints.json", json.dumps(_checkpoints(out_dir)))
        return _run(cmd)
    finally:
        if previous_state is None:
            os.environ.pop(STATE_ENV, None)
        else:
            os.environ[STATE_ENV] = previous_state
        shutil.rmtree(state, ignore_errors=True)


def _run(cmd: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    try:
        with _no_restart_after_refusal():
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


# ------------------------------------------------------------------------------ restarts ----

EXIT_USAGE = 2  # cli/main.py's: the command as given cannot run


@contextlib.contextmanager
def _no_restart_after_refusal():
    """While the agent runs in this process: when every failed worker exited 2 (refused the command), the agent
    stops instead of restarting them (it sets its restarts left to 0; torch 2.13's LocalElasticAgent). Where
    torch's agent has changed, the workers' own record does it (`refused_earlier`), one quick attempt per restart."""
    try:
        from torch.distributed.elastic.agent.server.api import WorkerState
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        original = LocalElasticAgent._monitor_workers
    except (ImportError, AttributeError):
        yield
        return

    def monitor(self, worker_group):
        result = original(self, worker_group)
        failures = getattr(result, "failures", None) or {}
        if (
            result.state == WorkerState.FAILED
            and failures
            and hasattr(self, "_remaining_restarts")
            and all(f.exitcode == EXIT_USAGE for f in failures.values())
        ):
            self._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitor
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original


def restart_count() -> int:
    """How often torchrun's agent has restarted this worker (0: the first attempt, or not under torchrun)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def launch_state() -> Path | None:
    """The folder the attempts of this launch share: `launch`'s (GRAPHTRAIN_LAUNCH_STATE), or under a torchrun
    started by hand one per agent (its run id and PID: the parent of every attempt's workers) in the temporary
    folder. None outside torchrun, and under a torchrun that restarts nothing (TORCHELASTIC_MAX_RESTARTS 0)."""
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV])
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    try:
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    except ValueError:
        restarts = 0
    if run_id is None or restarts == 0:
        return None
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:64]
    return Path(tempfile.gettempdir()) / f"graphtrain-launch-{os.getuid()}-{safe}-{os.getppid()}"


def record_refusal(message: str) -> None:
    """A worker refused the command (exit 2): the restarts of this launch must refuse too, without running."""
    state = launch_state()
    if state is None:
        return
    try:
        state.mkdir(parents=True, exist_ok=True)
        _write(state / f"refused-{os.environ.get('RANK', '0')}", message)
    except OSError:
        pass


def refused_earlier() -> str | None:
    """The message of an earlier attempt's refusal in this launch, if a worker of one refused."""
    state = launch_state()
    if state is None or restart_count() == 0 or not state.is_dir():
        return None
    for p in sorted(state.glob("refused-*")):
        try:
            return p.read_text()
        except OSError:
            continue
    return None


def record_checkpoints(out_dir: str | os.PathLike) -> None:
    """On the first attempt: the checkpoints out_dir holds when the launch begins (once per launch)."""
    state = launch_state()
    if state is None or restart_count() > 0 or (state / "checkpoints.json").exists():
        return
    try:
        state.mkdir(parents=True, exist_ok=True)
        _write(state / "checkpoints.json", json.dumps(_checkpoints(out_dir)))
    except OSError:
        pass


def written_since_launch(out_dir: str | os.PathLike) -> bool:
    """Has this launch written a checkpoint into out_dir (one that was not there, as it was, when it began)?
    Without the launch's listing: True (the agent's own rule, continue from the latest checkpoint)."""
    state = launch_state()
    try:
        before = json.loads((state / "checkpoints.json").read_text()) if state is not None else None
    except (OSError, ValueError):
        before = None
    if before is None:
        return True
    return any(item not in before for item in _checkpoints(out_dir))


def _checkpoints(out_dir: str | os.PathLike) -> list[list]:
    """[name, inode, mtime in ns] of every checkpoint (file or folder) in out_dir: a replaced one differs."""
    folder = Path(out_dir).expanduser()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    out = []
    for entry in entries:
        if _CKPT.match(entry.name):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            out.append([entry.name, st.st_ino, st.st_mtime_ns])
    return sorted(out)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
