"""``provider: auto`` on a cold cache: aten runs a graph from its first call while Inductor compiles in a background
process (``Tiered``; the processes that compile, and their lifetime: runtime/workers.py; runtime/background.py is
the child's side).

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
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphtrain.config.fallback import GraphtrainCaptureError, report_fallback
from graphtrain.pipeline.graph_data import GuardsUnreadable, SizeChecked, rebuild_sizes, size_check
from graphtrain.pipeline.job import CompileJob
from graphtrain.runtime.measured import Candidate, Measured, input_specs
from graphtrain.runtime.providers import UnsuitableProvider
from graphtrain.runtime.workers import prefetch_inductor_setup, worker


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


class Tiered:
    """provider auto on a cold cache: the graph runs on aten (`aten`: its ``Candidate``) from its first call. From
    the module's second call a child process (``graphtrain.runtime.background``) compiles `payload` (the graph as
    data) with Inductor into the caches; the first call after it finished compiles Inductor here from them
    (`compile_inductor()`, returning its ``Candidate``), times both candidates on that call's inputs and keeps the
    faster (``Measured``). An Inductor that failed or refused the graph leaves aten running it: a fallback under
    the module's fallback policy, or a note for a refusal. An empty `payload` means an earlier
    process's background compile already put Inductor in the caches (``inductor_ready``): no child; the switch
    happens at the module's second call."""

    def __init__(
        self,
        aten: Candidate,
        compile_inductor: Callable[[], Candidate],
        payload: bytes,
        rec: Any,
        folder: Any,
        key: str | None,
        state: Any,
        config: Any,
    ) -> None:
        self.aten: Candidate | None = aten
        self.compile_inductor, self.payload = compile_inductor, payload
        self.rec, self.folder, self.key, self.state, self.config = rec, folder, key, state, config
        self.calls = 0
        self.status: tuple[str, str] | None = None  # the child's word on this graph: ("done" | <error type>, text)
        self.chosen: Callable[..., Any] | None = None
        self.loaded: tuple[Candidate, float] | None = None  # Inductor loaded ahead of the switch, and its seconds
        self.cached = not payload  # compiled by an earlier process
        self.first: list[Any] | None = None  # the first call's inputs as InputSpecs: what preload times both on
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
            self._decide(args, ran=self.calls - 1)
            return self.chosen(*args)
        if self.first is None:  # once: not a cost on every call before the switch
            self.first = input_specs(args)
        return self.aten.compiled(*args)

    def preload(self) -> None:
        """Switch now, between steps, once the background compile finished: load Inductor's code from the caches
        and time both providers on inputs like the first call's (measured.InputSpec: its parameters, labels,
        masks), so that the graph's next call runs the winner at full speed. The trainer does this while it waits
        for the compile (workers.preload_background): compile work, kept out of the step times. A graph not called
        yet only loads; it times both at its first call. A failed load is reported as at the switch, aten keeping
        the graph."""
        if self.chosen is not None or self.status is None:
            return
        if self.first is not None:
            with torch.set_grad_enabled(not self.rec.inference):  # as its calls run (an evaluation's: no_grad)
                self._decide(self.first, ran=self.calls)
            self.first = None
            return
        if self.loaded is not None or self.status[0] != "done":
            return
        t0 = time.perf_counter()
        try:
            self.loaded = (self.compile_inductor(), time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - reported at the switch, aten keeps the graph
            self.status = (type(e).__name__, str(e))

    def _decide(self, args: Sequence[Any], ran: int) -> None:
        """Switch: load Inductor (unless preloaded), time both on `args` (a call's inputs, or InputSpecs) and keep
        the faster; `ran`: the calls aten ran before."""
        rec, aten_fn, (kind, text) = self.rec, self.aten.compiled, self.status
        seconds = worker(self.state).seconds
        result: Candidate | None = None
        load = 0.0
        if self.loaded is not None:
            (result, load), self.loaded = self.loaded, None
        elif kind == "done":
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
                report_fallback(
                    f"provider inductor on {rec.name} ({rec.frame})",
                    f"{kind}: {text[:300]}",
                    self.config,
                    what="is not a candidate for provider auto (aten runs it)",
                    sink=self.state.fallbacks,
                )
            return
        fn, note = size_checked(result.compiled, aten_fn)
        result = dataclasses.replace(
            result, compiled=fn, record={**result.record, "notes": [*result.record["notes"], *note]}
        )
        # aten's record as its first calls completed it (its backward was compiled at the first backward)
        aten = dataclasses.replace(self.aten, record=copy.copy(rec.__dict__))
        self.aten = None
        # aten ran this graph's earlier calls: timed without the warm-up call (at the switch, one step's worth less)
        measured = Measured(
            [aten, result], rec, self.folder, self.key, self.state, self.config, warmed=frozenset({"aten"})
        )
        try:
            measured._choose(args)
        except GraphtrainCaptureError:  # engine.fallback=error on a candidate that raised
            raise
        except Exception as e:  # noqa: BLE001 - both raised on these inputs: aten keeps the graph; its call says why
            self.chosen, rec.provider = aten_fn, "aten"
            rec.notes = [*rec.notes, f"provider auto -> aten: both providers raised when timed ({type(e).__name__})"]
            return
        where = (
            "by an earlier process's background compile"
            if self.cached
            else f"in a background process ({seconds:.1f} s for its graphs)"
        )
        rec.notes = [
            *rec.notes,
            f"tiered compile: aten ran the first {ran} call(s); Inductor compiled {where}, loaded here in {load:.2f} s",
        ]
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

    return run, [
        f"Inductor's code assumes {check.guards} (the guards of its compile): calls of other sizes run on aten"
    ]


def compile_inductor_from(
    job: CompileJob, metas: list[tuple[Any, ...]], compile: Callable[[CompileJob], Callable[..., Any]]
) -> Callable[..., Any]:
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
                t = torch.empty_strided([size(d) for d in shape], [size(d) for d in stride], dtype=dtype, device=device)
                inputs.append(t.requires_grad_(True) if requires_grad else t)
            elif m[0] == "symint":
                inputs.append(size(m[1]))
            else:
                inputs.append(m[1])
    # in the grad mode the graph was captured in: an evaluation graph (no_grad) has no backward to compile, and its
    # passes may use forward-only ops (loss_only_lm_head)
    with (
        torch._functorch.config.patch(force_non_lazy_backward_lowering=True),
        torch.set_grad_enabled(not job.rec.inference),
    ):
        fn = compile(dataclasses.replace(job, example_inputs=inputs))
    try:
        check = size_check(env, metas, size)
    except GuardsUnreadable as e:
        raise UnsuitableProvider(str(e)) from None
    return fn if check is None else SizeChecked(fn, check)
