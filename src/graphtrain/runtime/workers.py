"""The background compile processes of ``provider: auto`` and their lifetime (runtime/tiered.py decides per graph;
runtime/background.py is the child's side): one child at a time per engine state (``_Worker``), in a process group
of its own, stopped or left to finish when the training process exits (``engine.background_at_exit``), and the
once-per-process Inductor setup that overlaps the aten steps before the switch."""

from __future__ import annotations

import json
import os
import signal
import time
import weakref
from typing import Any

from graphtrain.config.torch_compat import inductor_cache_key_functions
from graphtrain.runtime.priority import background_nice, lower_priority

_PREFETCHED = False


def prefetch_inductor_setup() -> None:
    """Start, in a background thread, the once-per-process work of the first Inductor compile or cache load, so that
    it overlaps the steps aten runs before the switch: the hashes of torch's and Triton's sources that key Inductor's
    caches (the key functions torch wraps in ``prefetchable_cache``) and the CPU vector-ISA probe (a compile and a
    child Python that loads it). Measured on the 4-layer HF Llama warm start (2-core AVX2 EPYC), the switching step
    went from 3.1-3.7 s to 2.4-2.6 s; the first step did not change beyond noise. The thread runs at the background
    compile's priority (runtime/background.py, ``GRAPHTRAIN_BACKGROUND_NICE``), and so do the compiler and Python it
    starts (they inherit a thread's nice value on Linux): with the compile alone lowered to +19, these still slowed
    the steps beside them 2-5x on a 2-core AMX Xeon (HF GPT-2 bf16: steps 2 to 13 at 0.6-1.5 s, then 0.17 s).
    Imports happen here, in the calling thread: a thread that imports while the user's program forks (DataLoader
    workers) could leave the child the import lock."""
    global _PREFETCHED
    if _PREFETCHED:
        return
    _PREFETCHED = True
    import threading

    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime import triton_compat  # noqa: F401 - imported here, not in the thread (above)

    # where this torch caches them (torch.utils._functools.prefetchable_cache): in torch's own threads, or in the
    # lowered thread below when the background compile runs lowered (torch's threads run at the steps' priority)
    keys = [key for key in inductor_cache_key_functions() if hasattr(key, "prefetch")]
    if not background_nice():
        for key in keys:
            key.prefetch()  # type: ignore[attr-defined]
        keys = []

    def probe() -> None:
        lower_priority(threading.get_native_id(), os.getpid())
        try:
            for key in keys:
                key()
            cpu_vec_isa.pick_vec_isa()
        except Exception:  # noqa: BLE001 - only a head start: Inductor runs (and reports) the probe itself
            pass

    thread = threading.Thread(target=probe, name="graphtrain-inductor-setup", daemon=True)
    thread.start()
    import atexit

    # the probe runs a compiler and a Python: waited for at exit (a second or two at most), so that no process of
    # graphtrain's outlives the command (measured: a g++ of the probe was still running after a 4-step run returned)
    atexit.register(thread.join, 60.0)


class _Worker:
    """The background compiles of one engine state: one child process at a time compiles the jobs queued when it
    started (graphs met later go to the next one). Jobs are weak references: a module that was dropped is not
    compiled for. A child still running when the training process exits finishes or is stopped, as
    ``engine.background_at_exit`` says (``_at_exit``)."""

    def __init__(self, state: Any) -> None:
        self.state_ref = weakref.ref(state)
        self.queued: list[weakref.ref[Any]] = []
        self.running: list[weakref.ref[Any]] = []
        self.collected: list[weakref.ref[Any]] = []  # jobs whose child finished, until they load (preload_background)
        self.started = False
        self.proc: Any = None
        self.folder: Any = None
        self.t0 = 0.0
        self.seconds = 0.0

    def add(self, job: Any) -> None:
        self.queued.append(weakref.ref(job))

    def poll(self, job: Any) -> None:
        """Start at the module's second call (frontend/accelerate.py counts finished calls), or, without that count
        (``torch.compile(backend="graphtrain")``), at the first graph's second call; collect what a finished
        child said."""
        if not self.started:
            state = self.state_ref()
            first = self.queued[0]() if self.queued else None
            if not ((state is not None and state.calls >= 1) or (first is job and job.calls >= 2)):
                return
            self.started = True
        if self.proc is not None and self.proc.poll() is not None:
            self._collect()
        if self.proc is None and self.queued:
            self._spawn()

    def _spawn(self) -> None:
        import atexit
        import subprocess
        import sys
        import tempfile
        from pathlib import Path

        jobs = [r for r in self.queued if r() is not None]
        self.queued = []
        if not jobs:
            return
        self.folder = Path(tempfile.mkdtemp(prefix="graphtrain-precompile-"))
        for i, ref in enumerate(jobs):
            job = ref()
            (self.folder / f"{i}.job").write_bytes(job.payload)
            job.payload = b""  # the child has it now
        del job
        self.running = jobs
        self.t0 = time.perf_counter()
        state = self.state_ref()
        finish = state is not None and finish_at_exit(state.config)
        (self.folder / "owner.json").write_text(
            json.dumps(
                {
                    "parent_pid": os.getpid(),
                    "command": " ".join(sys.argv)[:300],
                    "started": time.time(),
                    "detached": finish,
                }
            )
        )
        # Its own process group (it and its Inductor compile workers are stopped together, background.kill_tree);
        # `finish`: its own session too, so that it outlives this process and its terminal (runtime/background.py)
        with open(self.folder / "stderr.txt", "wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "graphtrain.runtime.background",
                    str(self.folder),
                    str(os.getpid()),
                    *(["--detach"] if finish else []),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                start_new_session=finish,
                **_own_group(finish),
            )
        # At once, before its interpreter imports torch (seconds of CPU), if GRAPHTRAIN_BACKGROUND_NICE asks for a lower
        # priority (runtime/background.py)
        lower_priority(self.proc.pid, os.getpid())
        self.proc.graphtrain_folder = self.folder
        self.proc.graphtrain_finish = finish
        _CHILDREN.append(self.proc)
        if not _AT_EXIT:
            _AT_EXIT.append(atexit.register(_at_exit))
        prefetch_inductor_setup()  # this process loads what the child compiles

    def _collect(self) -> None:
        import shutil

        self.seconds = time.perf_counter() - self.t0
        if self.proc in _CHILDREN:
            _CHILDREN.remove(self.proc)
        code = self.proc.returncode
        for i, ref in enumerate(self.running):
            job = ref()
            if job is None:
                continue
            status = self.folder / f"{i}.status"
            try:
                kind, _, text = status.read_text().partition("\n")
            except OSError:
                if getattr(self.proc, "graphtrain_stopped", False):
                    job.status = ("stopped", "its background compile process was stopped")
                    continue
                err = (self.folder / "stderr.txt").read_text(errors="replace")[-600:].strip()
                kind, text = "ChildProcessError", f"the compile process exited with code {code}: {err}"
            job.status = (kind, text)
        shutil.rmtree(self.folder, ignore_errors=True)
        self.collected += self.running
        self.proc, self.running = None, []


def _own_group(detached: bool) -> dict[str, Any]:
    """Popen's argument for a process group of the child's own (Python 3.11+; on 3.10 the child stays in ours and
    is stopped alone, its Inductor workers following when they see it gone). A detached child has its session."""
    import sys

    return {"process_group": 0} if not detached and sys.version_info >= (3, 11) else {}


_CHILDREN: list[Any] = []
_AT_EXIT: list[Any] = []


AT_EXIT_ENV = "GRAPHTRAIN_BACKGROUND_AT_EXIT"
FINISH_NICE = 10


def finish_at_exit(config: Any) -> bool:
    """Whether a background compile of an engine with `config` goes on after the training process exits
    (``engine.background_at_exit``, overridden by $GRAPHTRAIN_BACKGROUND_AT_EXIT when that is finish or stop)."""
    env = os.environ.get(AT_EXIT_ENV, "").strip().lower()
    if env in ("finish", "stop"):
        return env == "finish"
    if env:
        import warnings

        warnings.warn(
            f"{AT_EXIT_ENV}={env!r} is ignored: set it to finish or stop (engine.background_at_exit="
            f"{config.background_at_exit} applies)",
            stacklevel=2,
        )
    return config.background_at_exit == "finish"


def _at_exit() -> None:
    """At the training process's exit: each background compile still running whose engine says ``finish`` (it was
    started detached) goes on, reniced to FINISH_NICE, and removes its own folder when done (runtime/background.py);
    its results land in the caches for the next run. Every other one is stopped with its compile workers (the
    default, ``stop``): nothing of graphtrain's outlives the command. Written by hand: a child that outlives its
    parent is plain POSIX (no library involved)."""
    import sys

    finishing = [p for p in _CHILDREN if p.poll() is None and getattr(p, "graphtrain_finish", False)]
    for proc in finishing:
        _CHILDREN.remove(proc)
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, max(FINISH_NICE, os.getpriority(os.PRIO_PROCESS, proc.pid)))
        except (OSError, AttributeError):  # not POSIX, or the child just ended: nothing to lower
            pass
    if finishing:
        pids = ", ".join(str(p.pid) for p in finishing)
        print(
            f"graphtrain: the background Inductor compile (pid {pids}) finishes after this process, at low "
            f"priority, as engine.background_at_exit=finish asks, so that the next run starts from its results; "
            f"`graphtrain cache list` shows it, `graphtrain cache stop` ends it (engine.background_at_exit=stop, "
            f"the default, ends it with the run)",
            file=sys.stderr,
        )
    stop_background()


def stop_background() -> None:
    """Stop every background compile process of this process (at exit; tests call it between tests). A graph
    whose child was stopped keeps running on aten."""
    while _CHILDREN:
        _stop_child(_CHILDREN.pop())


def _stop_child(proc: Any) -> None:
    import shutil

    if proc.poll() is None:
        proc.graphtrain_stopped = True
        kill_tree(proc.pid, signal.SIGKILL)  # its group: the child and the Inductor workers it started
        proc.wait()
    shutil.rmtree(proc.graphtrain_folder, ignore_errors=True)  # also a finished child's that was not collected


def kill_tree(pid: int, sig: int) -> None:
    """Send `sig` to `pid`'s process group when `pid` leads one (a child started with its own group: its Inductor
    compile workers are in it), else to `pid` alone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def worker(state: Any) -> _Worker:
    w = getattr(state, "background", None)
    if w is None:
        w = state.background = _Worker(state)
    return w


def background_pending(state: Any) -> bool:
    """Whether an engine state has background compiles queued or running (a cold cache's Inductor compile)."""
    w = getattr(state, "background", None)
    return w is not None and (w.proc is not None or any(r() is not None for r in w.queued))


def cancel_background(state: Any, why: str) -> int:
    """Give up an engine state's background compiles, queued or running: each of their graphs keeps aten, with
    `why` in its note (the status ``stopped``). Returns how many graphs were waiting for one."""
    w = getattr(state, "background", None)
    if w is None:
        return 0
    jobs = [j for r in [*w.queued, *w.running] if (j := r()) is not None]
    if w.proc is not None:
        if w.proc in _CHILDREN:
            _CHILDREN.remove(w.proc)
        _stop_child(w.proc)
        w.proc = None
    w.queued, w.running, w.started = [], [], True
    for job in jobs:
        job.status = ("stopped", why)
    return len(jobs)


def preload_background(state: Any) -> None:
    """Switch now, between steps, each graph whose Inductor code is ready to load: a background compile finished
    (``Tiered.preload``: loaded and timed against aten) or a warm start's stored winner (``Deferred.preload``:
    loaded), so that the graph's next call runs at full speed. Part of waiting for the compile."""
    w = getattr(state, "background", None)
    if w is None:
        return
    jobs, w.collected = w.collected, []
    for ref in jobs:
        if (job := ref()) is not None:
            job.preload()


def load_pending(state: Any) -> bool:
    """Whether an engine state has graphs whose Inductor code is ready to load (preload_background would switch
    them): a finished background compile's, or a warm start's stored winner."""
    w = getattr(state, "background", None)
    return w is not None and any((j := r()) is not None and j.chosen is None for r in w.collected)


def wait_background(state: Any, timeout: float | None = None) -> bool:
    """Start the background compiles of an engine state now if they have not started, and wait until the child
    finished (True) or `timeout` seconds passed (False). The graphs switch to the winner at their next call."""
    import subprocess

    w = worker(state)
    w.started = True
    deadline = None if timeout is None else time.perf_counter() + timeout
    while True:
        if w.proc is None and w.queued:
            w._spawn()
        if w.proc is None:
            return True
        try:
            w.proc.wait(None if deadline is None else max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            return False
        w._collect()
