"""The background compile process of ``provider: auto`` (runtime/tiered.py, ``Tiered``).

``python -m graphtrain.runtime.background FOLDER [PARENT_PID]``: for each ``<i>.job`` in FOLDER (a graph as data, its inputs'
shapes, its input kinds, the engine config and the pass-cache key the training process computed), compile the
graph with Inductor into graphtrain's pass cache and Inductor's own caches, then write ``<i>.status``: ``done``,
or the error's type name and message on two lines. The training process keeps training on aten meanwhile and
loads the result from the caches when this process exited. It runs at the training process's CPU priority unless
``GRAPHTRAIN_BACKGROUND_NICE`` gives a nice increment; the training process then lowers it from the child's start
(before its interpreter imports torch) and lowers its own Inductor setup thread the same (workers.py,
``prefetch_inductor_setup``). Measured on a 2-core AMX Xeon (HF GPT-2, BERT and Llama mini, bf16, a plain
``accelerate`` loop, cold cache, 2026-11-30):
- at the steps' priority (the default), GPT-2's steps beside the compile took 0.36-3.05 s against eager +
  autocast's 0.25-0.29 s, for the 30 s the compile took, then ran at Inductor's speed (0.14 s);
- at +19, steps 2 to 60 took 0.14-0.47 s (medians 0.15-0.17 s; eager + autocast's 0.21-0.26 s). But a loop that
  keeps both cores busy leaves the compile almost no CPU: after 300 steps (55 s) GPT-2 still ran on aten
  (0.17 s a step against Inductor's 0.14 s).
So +19 suits short runs and runs that must never step slower than eager; the default suits long runs, whose total
time the early switch shortens. The trainer waits for the compile after its first step (``train.compile_wait``),
where the priority does not matter. At +10 on the 2-core Zen 5, a 400-step job that trained beside the compile ended
before its first graph switched.

Each graph's compile has a time limit (``engine.background_timeout``): one that outlives it gets the status
``timeout``, its graph stays on aten in the training process, and a mark in the cache (``providers/<key>.
inductor-timeout``) keeps later runs from compiling it again under the same or a lower limit.

The child ends with the training process (``engine.background_at_exit: stop``, the default): the training process
kills it and its compile workers (one process group) at exit, on a normal return and after SIGTERM or Ctrl-C alike,
and on Linux the kernel kills it when the training process dies without running its exit handlers (SIGKILL, an
out-of-memory kill): the child asks for that itself with ``prctl(PR_SET_PDEATHSIG)`` as it starts. Nothing of
graphtrain's is left running after ``graphtrain train`` returns.

``engine.background_at_exit: finish`` opts in to finishing in the background instead: the child starts detached (a
session of its own, ``--detach``), named ``graphtrain-bg``, is reniced to 10 when the training process exits, removes
its folder when done, and its results land in the caches for the next run (a run shorter than the compile otherwise
starts cold every time; measured on the 2-core AVX2 EPYC, HF Llama 4 layers width 256 b16 s128: ~35 s of compile).
``graphtrain cache list`` shows such processes (``running()``), ``graphtrain cache stop`` ends them (``stop()``).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path

from graphtrain.runtime.priority import lower_priority

# Imports inside functions: order: the child process renices itself and arms its parent-death signal before torch and
# the engine load, and `graphtrain cache list/stop` read its folders without loading them.

MODULE = "graphtrain.runtime.background"
NAME = b"graphtrain-bg"  # the process name (/proc/PID/comm, what `top` and `ps -o comm` show)
OWNER = "owner.json"  # in the job folder: who started the child, when, and whether it was detached


def compile_job(data: dict) -> None:
    from graphtrain.pipeline.cache import _decode_graph, cache_root
    from graphtrain.pipeline.job import CompileJob
    from graphtrain.pipeline.state import EngineState, GraphRecord
    from graphtrain.runtime.backend import compile_stages
    from graphtrain.runtime.tiered import compile_inductor_from, mark_inductor_ready

    config = data["config"]
    state = EngineState(config)
    rec = GraphRecord(data["name"], "background compile", 0, [m[1] for m in data["inputs"]], data["kinds"])
    rec.inference = bool(data.get("inference", False))  # its passes as the training process's (loss_only_lm_head)
    job = CompileJob(_decode_graph(data["graph"]), (), data["kinds"], config, state, rec, key=data["key"])
    compile_inductor_from(job, data["inputs"], compile_stages)  # its example inputs: fake ones, from the shapes
    mark_inductor_ready(cache_root(config), data["key"])  # for a later process, if this one's parent is gone


class CompileTimeout(BaseException):
    """Raised in this process's main thread when one graph's compile outlives ``engine.background_timeout``. A
    BaseException, so that Inductor's own ``except Exception`` handlers (its fallbacks) do not take it for a failure
    of one kernel and carry on."""


def _limit(seconds: float) -> None:
    """Interrupt the compile after `seconds` (0: never). SIGALRM's timer: POSIX only; elsewhere there is no limit."""
    import signal

    if not hasattr(signal, "setitimer"):
        return

    def expired(signum: int, frame: object) -> None:
        raise CompileTimeout

    signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(0.0, seconds))


def _prctl(option: int, value: int | bytes) -> None:
    """prctl(2) through libc (Linux only; elsewhere nothing). No library wraps it for Python's standard library."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent `parent` dies (PR_SET_PDEATHSIG, Linux), and send
    it now if that parent is already gone (it died before the prctl took effect)."""
    _prctl(1, int(sig))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def main(argv: list[str]) -> int:
    detach = "--detach" in argv
    argv = [a for a in argv if a != "--detach"]
    folder = Path(argv[0])
    # the training process's pid, from it: read here, getppid() may already name init (the package import that
    # precedes main() takes seconds, and a short run can exit meanwhile)
    parent = int(argv[1]) if len(argv) > 1 else os.getppid()
    _prctl(15, NAME)  # PR_SET_NAME
    if not detach:
        die_with_parent(parent)
    lower_priority(os.getpid(), parent)  # (the parent did it already as it started this process, unless it raced)
    import graphtrain.kernels  # noqa: F401 - graphtrain's custom ops, which the graphs call
    from graphtrain.pipeline.cache import cache_root, configure_cache
    from graphtrain.runtime.tiered import mark_inductor_timeout

    jobs = sorted(folder.glob("*.job"), key=lambda p: int(p.stem))
    for path in jobs:
        status = path.with_suffix(".status")
        if status.exists():  # done before this process restarted itself (below)
            continue
        timed_out = False
        try:
            # Our own file, written a moment ago by the training process that started us (runtime/tiered.py).
            data = pickle.loads(path.read_bytes())  # noqa: S301
            configure_cache(data["config"])
            limit = float(data["config"].background_timeout)
            try:
                _limit(limit)
                compile_job(data)
            finally:
                _limit(0.0)
            text = "done\n"
        except CompileTimeout:
            timed_out = True
            mark_inductor_timeout(cache_root(data["config"]), data["key"], limit)
            text = (
                f"timeout\nits background compile took more than {limit:g} s (engine.background_timeout) and was "
                f"stopped; raise the limit (0: none) to compile it"
            )
        except Exception as e:  # noqa: BLE001 - the training process reports it under its fallback policy
            text = f"{type(e).__name__}\n{' '.join(str(e).split())[:2000]}"
        tmp = status.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, status)
        if timed_out and path != jobs[-1]:
            # The interrupted compile may have left Inductor's process-wide state half-built: the other graphs are
            # compiled by a fresh image of this process (same pid, so the training process still waits on it),
            # which skips the graphs that have a status.
            sys.stdout.flush()
            sys.stderr.flush()
            os.execv(
                sys.executable,
                [sys.executable, "-m", MODULE, str(folder), str(parent), *(["--detach"] if detach else [])],
            )
    if os.getppid() != parent:  # the training process exited and left us to finish (engine.background_at_exit):
        import shutil  # nobody else will collect the folder

        shutil.rmtree(folder, ignore_errors=True)
    return 0


# ------------------------------------------------------------------- `graphtrain cache list / stop` --


def running() -> list[dict]:
    """This user's background compile processes (Linux: read from /proc): pid, folder, the pid and command of the
    training process that started it, whether that one still runs, detached or not, seconds running, graphs done
    out of queued."""
    if not Path("/proc/self").exists():
        raise OSError("graphtrain cache list reads /proc, which this system does not have (Linux only); use ps")
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if MODULE not in args or args.index(MODULE) + 1 >= len(args):
            continue
        folder = Path(args[args.index(MODULE) + 1])
        try:
            owner = json.loads((folder / OWNER).read_text())
        except (OSError, ValueError):
            owner = {}
        parent = owner.get("parent_pid")
        out.append(
            {
                "pid": int(entry.name),
                "folder": str(folder),
                "detached": "--detach" in args,
                "parent_pid": parent,
                "parent_alive": parent is not None and Path(f"/proc/{parent}").exists(),
                "command": owner.get("command", ""),
                "seconds": time.time() - owner.get("started", time.time()),
                "done": len(list(folder.glob("*.status"))),
                "jobs": len(list(folder.glob("*.job"))),
            }
        )
    return sorted(out, key=lambda r: r["pid"])


def stop(pids: list[int] | None = None, grace_s: float = 5.0) -> list[int]:
    """Stop this user's background compiles (all, or those in `pids`): SIGTERM to each one's process group (its
    Inductor compile workers with it), SIGKILL after `grace_s`; their folders are removed. Returns the pids
    stopped. A pid that is not one of them is a ValueError (nothing else is ever signalled)."""
    import shutil

    from graphtrain.runtime.workers import kill_tree

    procs = {r["pid"]: r for r in running()}
    if pids:
        unknown = [p for p in pids if p not in procs]
        if unknown:
            raise ValueError(
                f"no background compile of yours has pid {', '.join(map(str, unknown))}: "
                f"`graphtrain cache list` shows the ones running"
            )
        procs = {p: procs[p] for p in pids}
    for pid in procs:
        kill_tree(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and not _zombie(p) for p in procs):
        time.sleep(0.05)
    for pid, r in procs.items():
        if Path(f"/proc/{pid}").exists() and not _zombie(pid):
            kill_tree(pid, signal.SIGKILL)
        if _is_job_folder(Path(r["folder"])):  # named by the process's command line: removed only if it is one
            shutil.rmtree(r["folder"], ignore_errors=True)
    return sorted(procs)


def _is_job_folder(folder: Path) -> bool:
    """A folder runtime/tiered.py made for a child: tempfile's, named graphtrain-precompile-*, with owner.json."""
    import tempfile

    return (
        folder.name.startswith("graphtrain-precompile-")
        and (folder / OWNER).is_file()
        and folder.resolve().parent == Path(tempfile.gettempdir()).resolve()
    )


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
