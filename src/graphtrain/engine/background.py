"""The background compile process of ``provider: auto`` (engine/choose.py, ``Tiered``).

``python -m graphtrain.engine.background FOLDER [PARENT_PID]``: for each ``<i>.job`` in FOLDER (a graph as data, its inputs'
shapes, its input kinds, the engine config and the pass-cache key the training process computed), compile the
graph with Inductor into graphtrain's pass cache and Inductor's own caches, then write ``<i>.status``: ``done``,
or the error's type name and message on two lines. The training process keeps training on aten meanwhile and
loads the result from the caches when this process exited. It runs at the training's own CPU priority unless
GRAPHTRAIN_BACKGROUND_NICE says otherwise: at nice 10 on the 2-core Zen 5, a training step that kept both cores
busy starved it, and the default 400-step job (2 min 20 s) ended before its first graph switched; at nice 0 the
same job switched to Inductor (its last 100 steps at 250-313 ms against 306-343 ms on aten) and took 2 min 30 s:
at 400 small steps the compile about pays for itself; longer jobs gain.

Each graph's compile has a time limit (``engine.background_timeout``): one that outlives it gets the status
``timeout``, its graph stays on aten in the training process, and a mark in the cache (``providers/<key>.
inductor-timeout``) keeps later runs from compiling it again under the same or a lower limit.

A training process that exits before this one is done leaves it running (``engine.background_at_exit: finish``,
reniced to 10), so that its results reach the caches; it then removes its folder itself. Measured on the 2-core
AVX2 EPYC (HF Llama, 4 layers, width 256, b16 s128): the background compile takes ~35 s, so a run of a few steps
used to kill it every time and the next run started as cold as the first.
"""
from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path


def compile_job(data: dict) -> None:
    from graphtrain.engine.backend import compile_inductor_from
    from graphtrain.engine.cache import _decode_graph, cache_root
    from graphtrain.engine.choose import mark_inductor_ready
    from graphtrain.engine.state import EngineState, GraphRecord
    config = data["config"]
    state = EngineState(config)
    rec = GraphRecord(data["name"], "background compile", 0, [m[1] for m in data["inputs"]], data["kinds"])
    compile_inductor_from(_decode_graph(data["graph"]), data["inputs"], data["kinds"], config, state, rec,
                          data["key"])
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


def main(argv: list[str]) -> int:
    folder = Path(argv[0])
    # the training process's pid, from it: read here, getppid() may already name init (the package import that
    # precedes main() takes seconds, and a short run can exit meanwhile)
    parent = int(argv[1]) if len(argv) > 1 else os.getppid()
    try:
        os.nice(int(os.environ.get("GRAPHTRAIN_BACKGROUND_NICE", "0")))
    except OSError:
        pass
    import graphtrain.kernels  # noqa: F401 - graphtrain's custom ops, which the graphs call
    from graphtrain.engine.cache import cache_root, configure_cache
    from graphtrain.engine.choose import mark_inductor_timeout
    jobs = sorted(folder.glob("*.job"), key=lambda p: int(p.stem))
    for path in jobs:
        status = path.with_suffix(".status")
        if status.exists():  # done before this process restarted itself (below)
            continue
        timed_out = False
        try:
            # Our own file, written a moment ago by the training process that started us (engine/choose.py).
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
            text = (f"timeout\nits background compile took more than {limit:g} s (engine.background_timeout) and was "
                    f"stopped; raise the limit (0: none) to compile it")
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
            os.execv(sys.executable, [sys.executable, "-m", "graphtrain.engine.background", str(folder), str(parent)])
    if os.getppid() != parent:  # the training process exited and left us to finish (engine.background_at_exit):
        import shutil           # nobody else will collect the folder
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
