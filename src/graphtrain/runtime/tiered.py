"""``provider: auto`` on a cold cache: aten runs a graph from its first call while Inductor compiles in a background
process (``Tiered``), and the processes that compile (``_Worker``; runtime/background.py is the child's side).

Each graph runs on aten, compiled in about a second, and Inductor compiles in a background process once the model's
second call begins (the first step runs alone on the cores and its own backward graphs are compiled by then); the
graph's next call after Inductor is ready loads it from the caches, times both as runtime/measured.py does and keeps
the faster. Both processes compile the graph from data on fake inputs (``compile_inductor_from``), so that their
cache keys agree.

Why a process and not a thread: FX's tracer (make_fx, used by AOTAutograd and by Inductor's pattern matcher while
it compiles) patches torch.nn.Module.__call__ for the whole process and sets a process-wide "FX is tracing" flag
under which a Dynamo-compiled call raises. Tried first with a thread: the training step's next forward failed
with "Detected that you are using FX to symbolically trace a dynamo-optimized function". A child process shares
nothing but the cache folders: it compiles Inductor from the graph as data, filling graphtrain's pass cache and
Inductor's own caches; the training process then compiles the same graph from those caches in a fraction of a
second.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphtrain.config.fallback import report_fallback
from graphtrain.config.torch_compat import inductor_cache_key_functions
from graphtrain.pipeline.graph_data import GuardsUnreadable, SizeChecked, rebuild_sizes, size_check
from graphtrain.pipeline.job import CompileJob
from graphtrain.runtime.measured import Candidate, Measured
from graphtrain.runtime.providers import UnsuitableProvider


def _ready_path(folder: Any, key: str) -> Any:
    return folder / "providers" / f"{key}.inductor-ready"


def mark_inductor_ready(folder: Any, key: str) -> None:
    """Record that the background compile of the graph with pass-cache key `key` (under Inductor) is in the caches.
    The decision itself needs the training process's timing; a process that ended before it could time both
    leaves this mark, so the next one loads Inductor at its second step instead of compiling it again."""
    try:
        path = _ready_path(folder, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass


def inductor_ready(folder: Any, key: str) -> bool:
    return _ready_path(folder, key).exists()


def _timeout_path(folder: Any, key: str) -> Any:
    return folder / "providers" / f"{key}.inductor-timeout"


def mark_inductor_timeout(folder: Any, key: str, seconds: float) -> None:
    """Record that the background compile of the graph with pass-cache key `key` outlived `seconds`
    (engine.background_timeout; runtime/background.py), so that a later process does not spend them again."""
    try:
        path = _timeout_path(folder, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(f"{seconds!r}\n")
        os.replace(tmp, path)
    except OSError:
        pass


def inductor_timed_out(folder: Any, key: str, seconds: float) -> float | None:
    """The limit an earlier background compile of this graph outlived, if that limit was at least `seconds` (a
    limit of 0 is none: never timed out); None where compiling again may finish in time."""
    try:
        limit = float(_timeout_path(folder, key).read_text())
    except (OSError, ValueError):
        return None
    return limit if seconds > 0 and limit >= seconds else None


def _next_step(state: Any, calls: int, rec: Any) -> bool:
    """Whether the module's first step is over: its call count (frontend/accelerate.py), or, without it
    (``torch.compile(backend="graphtrain")``), more calls of this graph than one step makes."""
    return state.calls >= 1 or calls > max(1, int(getattr(rec, "calls_per_step", 1) or 1))


_PREFETCHED = False


def prefetch_inductor_setup() -> None:
    """Start, in background threads, the once-per-process work of the first Inductor compile or cache load, so that
    it overlaps the steps aten runs before the switch: the hashes of torch's and Triton's sources that key Inductor's
    caches (torch's own ``prefetchable_cache.prefetch``) and the CPU vector-ISA probe (a compile and a child Python
    that loads it). Measured on the 4-layer HF Llama warm start (2-core AVX2 EPYC), the switching step went from
    3.1-3.7 s to 2.4-2.6 s; the first step did not change beyond noise. Imports happen here, in the calling thread:
    a thread that imports while the user's program forks (DataLoader workers) could leave the child the import
    lock."""
    global _PREFETCHED
    if _PREFETCHED:
        return
    _PREFETCHED = True
    import threading

    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime import triton_compat  # noqa: F401 - imported here, not in the thread (above)

    for key in inductor_cache_key_functions():
        prefetch = getattr(key, "prefetch", None)  # torch.utils._functools.prefetchable_cache, where this torch has it
        if prefetch is not None:
            prefetch()

    def probe() -> None:
        try:
            cpu_vec_isa.pick_vec_isa()
        except Exception:  # noqa: BLE001 - only a head start: Inductor runs (and reports) the probe itself
            pass

    thread = threading.Thread(target=probe, name="graphtrain-vec-isa-probe", daemon=True)
    thread.start()
    import atexit
    # the probe runs a compiler and a Python: waited for at exit (a second or two at most), so that no process of
    # graphtrain's outlives the command (measured: a g++ of the probe was still running after a 4-step run returned)
    atexit.register(thread.join, 60.0)


class Tiered:
    """provider auto on a cold cache: the graph runs on aten (`aten`: its ``Candidate``) from its first call. From
    the module's second call a child process (``graphtrain.runtime.background``) compiles `payload` (the graph as
    data) with Inductor into the caches; the first call after it finished compiles Inductor here from them
    (`compile_inductor()`, returning its ``Candidate``), times both candidates on that call's inputs and keeps the
    faster (``Measured``). An Inductor that failed or refused the graph leaves aten running it: a fallback under
    the module's fallback policy, or a note for a refusal. An empty `payload` means an earlier
    process's background compile already put Inductor in the caches (``inductor_ready``): no child; the switch
    happens at the module's second call."""

    def __init__(self, aten: Candidate, compile_inductor: Callable[[], Candidate], payload: bytes, rec: Any,
                 folder: Any, key: str | None, state: Any, config: Any) -> None:
        self.aten: Candidate | None = aten
        self.compile_inductor, self.payload = compile_inductor, payload
        self.rec, self.folder, self.key, self.state, self.config = rec, folder, key, state, config
        self.calls = 0
        self.status: tuple[str, str] | None = None  # the child's word on this graph: ("done" | <error type>, text)
        self.chosen: Callable[..., Any] | None = None
        self.cached = not payload  # compiled by an earlier process
        if self.cached:
            prefetch_inductor_setup()  # the switch comes at the next step; a cold start's when its child has spawned
        else:
            worker(state).add(self)

    def __call__(self, *args: Any) -> Any:
        if self.chosen is not None:
            return self.chosen(*args)
        self.calls += 1
        if not self.cached:
            worker(self.state).poll(self)
        elif _next_step(self.state, self.calls, self.rec):
            self.status = ("done", "")
        if self.status is not None:
            self._decide(args)
            return self.chosen(*args)
        return self.aten.compiled(*args)

    def _decide(self, args: Sequence[Any]) -> None:
        rec, aten_fn, (kind, text) = self.rec, self.aten.compiled, self.status
        seconds = worker(self.state).seconds
        result: Candidate | None = None
        if kind == "done":
            t0 = time.perf_counter()
            try:
                result = self.compile_inductor()
            except Exception as e:  # noqa: BLE001 - reported below, aten keeps the graph
                kind, text = type(e).__name__, str(e)
            load = time.perf_counter() - t0
        if result is None:
            self.chosen, rec.provider, self.aten = aten_fn, "aten", None
            if kind in ("UnsuitableProvider", "stopped", "timeout"):
                rec.notes = [*rec.notes, f"provider auto -> aten: inductor is not a candidate ({text})"]
            else:
                report_fallback(f"provider inductor on {rec.name} ({rec.frame})", f"{kind}: {text[:300]}",
                                self.config, what="is not a candidate for provider auto (aten runs it)",
                                sink=self.state.fallbacks)
            return
        fn, note = size_checked(result.compiled, aten_fn)
        result = dataclasses.replace(result, compiled=fn, record={**result.record,
                                                                  "notes": [*result.record["notes"], *note]})
        # aten's record as its first calls completed it (its backward was compiled at the first backward)
        aten = dataclasses.replace(self.aten, record=copy.copy(rec.__dict__))
        self.aten = None
        # aten ran this graph's earlier calls: timed without the warm-up call (at the switch, one step's worth less)
        measured = Measured([aten, result], rec, self.folder, self.key, self.state, warmed=frozenset({"aten"}))
        measured._choose(args)
        where = ("by an earlier process's background compile" if self.cached else
                 f"in a background process ({seconds:.1f} s for its graphs)")
        rec.notes = [*rec.notes, f"tiered compile: aten ran the first {self.calls - 1} call(s); Inductor compiled "
                                 f"{where}, loaded here in {load:.2f} s"]
        self.chosen = measured.chosen


def size_checked(fn: Callable[..., Any], aten_fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[str]]:
    """(`fn` (Inductor's code loaded from data) for the calls whose sizes its compile assumed and `aten_fn` for the
    others, the note that says so) for a symbolic graph compiled in a ShapeEnv of its own (graph_data.SizeChecked);
    (`fn`, []) for any other."""
    if not isinstance(fn, SizeChecked):
        return fn, []
    inductor, check = fn.fn, fn.check

    def run(*args: Any) -> Any:
        return inductor(*args) if check(args) else aten_fn(*args)
    return run, [f"Inductor's code assumes {check.guards} (the guards of its compile): calls of other sizes run on "
                 f"aten"]


def compile_inductor_from(job: CompileJob, metas: list[tuple[Any, ...]],
                          compile: Callable[[CompileJob], Callable[..., Any]]) -> Callable[..., Any]:
    """Stages 1-5 under Inductor (`compile`: runtime/backend.py compile_stages; `job`'s provider is inductor) for a
    graph given as data, on fake inputs made from `metas` (the same in the background process that compiles it
    first and in the training process that loads it from the caches: their cache keys agree); the pass result is
    stored under `job.key`, the key the training process computed. The backward is compiled now, not at its first
    call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    env, size = rebuild_sizes(metas)  # static shapes too: Inductor's caches want a shape env to key on
    mode = FakeTensorMode(shape_env=env)
    inputs: list[Any] = []
    with mode:
        for m in metas:
            if m[0] == "tensor":
                _, shape, stride, dtype, device, requires_grad, _ = m
                t = torch.empty_strided([size(d) for d in shape], [size(d) for d in stride], dtype=dtype,
                                        device=device)
                inputs.append(t.requires_grad_(True) if requires_grad else t)
            elif m[0] == "symint":
                inputs.append(size(m[1]))
            else:
                inputs.append(m[1])
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        fn = compile(dataclasses.replace(job, example_inputs=inputs))
    try:
        check = size_check(env, metas, size)
    except GuardsUnreadable as e:
        raise UnsuitableProvider(str(e)) from None
    return fn if check is None else SizeChecked(fn, check)


class _Worker:
    """The background compiles of one engine state: one child process at a time compiles the jobs queued when it
    started (graphs met later go to the next one). Jobs are weak references: a module that was dropped is not
    compiled for. A child still running when the training process exits finishes or is stopped, as
    ``engine.background_at_exit`` says (``_at_exit``)."""

    def __init__(self, state: Any) -> None:
        self.state_ref = weakref.ref(state)
        self.queued: list[weakref.ref[Tiered]] = []
        self.running: list[weakref.ref[Tiered]] = []
        self.started = False
        self.proc: Any = None
        self.folder: Any = None
        self.t0 = 0.0
        self.seconds = 0.0

    def add(self, job: Tiered) -> None:
        self.queued.append(weakref.ref(job))

    def poll(self, job: Tiered) -> None:
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
        (self.folder / "owner.json").write_text(json.dumps({
            "parent_pid": os.getpid(), "command": " ".join(sys.argv)[:300], "started": time.time(),
            "detached": finish}))
        # Its own process group (it and its Inductor compile workers are stopped together, background.kill_tree);
        # `finish`: its own session too, so that it outlives this process and its terminal (runtime/background.py)
        with open(self.folder / "stderr.txt", "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "graphtrain.runtime.background", str(self.folder),
                                          str(os.getpid()), *(["--detach"] if finish else [])],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=finish, **_own_group(finish))
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
        warnings.warn(f"{AT_EXIT_ENV}={env!r} is ignored: set it to finish or stop (engine.background_at_exit="
                      f"{config.background_at_exit} applies)", stacklevel=2)
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
        print(f"graphtrain: the background Inductor compile (pid {pids}) finishes after this process, at low "
              f"priority, as engine.background_at_exit=finish asks, so that the next run starts from its results; "
              f"`graphtrain cache list` shows it, `graphtrain cache stop` ends it (engine.background_at_exit=stop, "
              f"the default, ends it with the run)", file=sys.stderr)
    stop_background()


def stop_background() -> None:
    """Stop every background compile process of this process (at exit; tests call it between tests). A graph
    whose child was stopped keeps running on aten."""
    import shutil
    import signal
    while _CHILDREN:
        proc = _CHILDREN.pop()
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
