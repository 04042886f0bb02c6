"""``provider: auto``: per graph, the provider that runs this graph's forward and backward fastest, measured.

Which provider wins depends on the graph and the machine, not on a rule we could write down: measured on the
2-core AVX2 EPYC (fp32, fused AdamW, SDPA), Inductor's fused elementwise kernels made a reference BERT 1.37x
faster than eager while a Hugging Face BERT ran at 0.99x and a Llama at 1.00x, where aten's op-by-op execution
of the same optimized graph costs nothing. So each graph is compiled by both candidates and timed on inputs of
its own shapes and the faster one runs the graph (runtime/measured.py: ``Candidate``, ``Measured``); the times go
to the report. The decision is stored next to the pass results (pipeline/cache.py), keyed like them, so a warm
process compiles the winner only. ``choose_provider`` is the whole decision for one graph, from the backend's
``CompileJob`` (runtime/backend.py).

On a cold cache the first step does not wait for Inductor (``engine.compile_in_background``, the default): each
graph runs on aten, compiled in about a second, and Inductor compiles in a background process once the model's
second call begins (the first step runs alone on the cores and its own backward graphs are compiled by then);
the graph's next call after Inductor is ready loads it from the caches, times both as above and keeps the faster
(runtime/tiered.py ``Tiered``). A
process that finds the decision stored compiles the winner only: aten's winners before the first step, and an
Inductor winner from the caches at the module's second call, aten running the first step (``Deferred``: loading
Inductor costs seconds, aten's compile from the pass cache a fraction of one).

Graphs that read DTensors (their collectives would need every rank to time in step) keep Inductor, and so do the
pieces of a graph Dynamo's DDPOptimizer split at DDP's buckets: torch compiles such a piece's backward lazily and
only when its forward went through torch's own AOTAutograd backend wrapper, which the aten provider does not use
(distributed.check_engine_under_ddp). A model compiled block by block under DDP does not go through DDPOptimizer
(frontend/accelerate.py) and is timed as in one process.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from graphtrain.config.fallback import report_fallback
from graphtrain.config.sections import EngineConfig
from graphtrain.pipeline.cache import _encode_graph, cache_root, pass_cache_key
from graphtrain.pipeline.graph_data import input_metas, symbolic_inputs
from graphtrain.pipeline.job import CompileJob
from graphtrain.pipeline.stages import DYNAMO_RESTARTS, compile_with_fallback
from graphtrain.pipeline.trace import dtensor_inputs
from graphtrain.runtime.measured import CANDIDATES, Candidate, Measured, describe, load_decision
from graphtrain.runtime.providers import UnsuitableProvider
from graphtrain.runtime.tiered import (
    Tiered,
    _next_step,
    compile_inductor_from,
    inductor_ready,
    inductor_timed_out,
    size_checked,
)
from graphtrain.runtime.workers import prefetch_inductor_setup, worker

Compile = Callable[[CompileJob], Callable[..., Any]]
"""Stages 1-5 of a job for its provider (runtime/backend.py compile_stages)."""


def measurable(example_inputs: Sequence[Any]) -> bool:
    """Whether provider auto may run this graph on aten and time it against Inductor (else: Inductor alone)."""
    return not (dtensor_inputs(example_inputs) or under_ddp_optimizer())


def under_ddp_optimizer() -> bool:
    """Whether the graph being compiled is a piece of a DDP module's graph split at its buckets (Dynamo's
    DDPOptimizer marks the tracing context while it compiles the pieces)."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    return ctx is not None and getattr(ctx, "ddp_optimizer_ctx", None) is not None


def choose_provider(
    job: CompileJob, compile: Compile, requested: EngineConfig, eager: Callable[..., Any] | None = None
) -> Callable[..., Any]:
    """provider auto for `job`'s graph: compile each candidate now; the first call times them and keeps the faster
    (or an earlier process's decision for this graph is reused and only its winner compiled). A candidate that
    fails to compile is reported and left out. `requested`: the config as the user gave it (provider auto), which
    keys the stored decision. `eager`: what runs the graph when no candidate compiles (reported as a fallback), as
    the named providers fall back; without it that raises."""

    config, state, rec = job.config, job.state, job.rec
    folder = cache_root(config)
    try:
        key = pass_cache_key(job.gm, job.example_inputs, job.kinds, requested, rec.inference)
    except Exception:  # noqa: BLE001 - inputs the key cannot describe: decide anew each process
        key = None
    stored = load_decision(folder, key) if key else None

    def compile_one(p: str) -> Callable[..., Any]:
        return compile(job.for_provider(p))

    if stored is not None and stored["choice"] == "inductor" and config.compile_in_background:
        deferred = _deferred(job, compile, stored)
        if deferred is not None:
            return deferred
    if stored is not None:
        compiled, rec.provider = compile_with_fallback(
            [stored["choice"]] + [p for p in CANDIDATES if p != stored["choice"]],
            compile_one,
            part=f"{rec.name} ({rec.frame})",
            config=config,
            state=state,
            eager=eager,
        )
        rec.provider_times = stored["times"]
        rec.notes.append(describe(stored["times"], rec.provider, cached=True))
        return compiled
    if rec.inference and config.compile_in_background and any(not g.inference for g in state.graphs):
        # An evaluation graph of a module that trains: a background compile of it would share the CPU with the
        # training steps for tens of seconds (the default 400-step job: steps 200-230, right after its first
        # evaluation, at 0.6-1.2 s against 0.35 s, ~17 s lost on the 2-core AVX2 EPYC) to speed up a few forward
        # passes per evaluation. aten runs it; a decision an earlier process stored (above) still applies.
        compiled, rec.provider = compile_with_fallback(
            ["aten", *[p for p in CANDIDATES if p != "aten"]],
            compile_one,
            part=f"{rec.name} ({rec.frame})",
            config=config,
            state=state,
            eager=eager,
        )
        rec.notes.append(
            "provider auto: an evaluation (no_grad) graph of a module that trains runs on aten, "
            "without a background compile"
        )
        return compiled
    if config.compile_in_background and set(CANDIDATES) == {"aten", "inductor"}:
        tiered = _tiered(job, compile, folder, key)
        if tiered is not None:
            return tiered
    candidates: list[Candidate] = []
    for p in CANDIDATES:
        n_passes = len(state.passes)
        try:
            fn = compile_one(p)
        except UnsuitableProvider as e:  # known to run this graph wrongly: not a failure of auto, a rule
            rec.notes.append(f"provider auto: {p} is not a candidate ({e})")
            continue
        except DYNAMO_RESTARTS:
            raise
        except Exception as e:  # noqa: BLE001 - the other candidate still runs the graph
            report_fallback(
                f"provider {p} on {rec.name} ({rec.frame})",
                f"{type(e).__name__}: {str(e)[:300]}",
                config,
                what="is not a candidate for provider auto",
                sink=state.fallbacks,
            )
            continue
        # the record as this candidate left it, and its pass records (the loser's are dropped from the report)
        candidates.append(Candidate(p, fn, copy.copy(rec.__dict__), state.passes[n_passes:]))
    if not candidates:
        if eager is None:
            raise RuntimeError(f"no provider compiled {rec.name}: see the fallbacks")
        # torch.compile(backend="graphtrain") has no call wrapper to run the module eagerly: without this the
        # Dynamo graph raised BackendCompilerFailed where each named provider would have fallen back to it
        report_fallback(
            f"provider auto on {rec.name} ({rec.frame})",
            "no candidate compiled (see the fallbacks before this one)",
            config,
            what="runs eagerly",
            sink=state.fallbacks,
        )
        rec.provider = "eager"
        return eager
    if len(candidates) == 1:
        rec.provider = candidates[0].provider
        return candidates[0].compiled
    rec.provider = "auto (measured at the first call)"
    return Measured(candidates, rec, folder, key, state, config)


def _inductor_loader(job: CompileJob, compile: Compile) -> tuple[bytes, Callable[[], Candidate], str]:
    """(the graph as a background job, a function that compiles it under Inductor in this process, the job's pass-cache
    key) for provider auto's tiered and deferred paths: both compile from the graph as data on fake inputs
    (tiered.compile_inductor_from), so the background process that fills the caches and this process that loads from
    them agree on every cache key. The loader returns Inductor's ``Candidate``. Raises when the graph is not plain
    data."""
    inductor = job.for_provider("inductor")
    metas = input_metas(symbolic_inputs(job.gm, job.example_inputs))
    inductor_key = inductor.pass_key
    if inductor_key is None:
        raise ValueError(f"{job.rec.name}: its inputs have no pass-cache key")
    inductor = dataclasses.replace(inductor, key=inductor_key)
    payload = pickle.dumps(
        {
            "graph": _encode_graph(job.gm),
            "inputs": metas,
            "kinds": job.kinds,
            "config": inductor.config,
            "key": inductor_key,
            "name": job.rec.name,
            "inference": job.rec.inference,
        }
    )
    rec, state = job.rec, job.state

    def compile_inductor() -> Candidate:
        r = copy.copy(rec)
        r.notes = list(rec.notes)
        n = len(state.passes)
        f = compile_inductor_from(dataclasses.replace(inductor, rec=r), metas, compile)
        return Candidate("inductor", f, copy.copy(r.__dict__), [x for x in state.passes[n:] if x.graph == rec.name])

    return payload, compile_inductor, inductor_key


def _aten_candidate(job: CompileJob, compile: Compile) -> Candidate | None:
    """aten's ``Candidate`` (compiled now), or None when aten does not compile the graph (its pass records are
    dropped: the synchronous path then tries, and reports, every provider)."""
    state = job.state
    n_passes = len(state.passes)
    try:
        fn = compile(job.for_provider("aten"))
    except DYNAMO_RESTARTS:
        raise
    except Exception:  # noqa: BLE001 - reported by the synchronous path
        del state.passes[n_passes:]
        return None
    return Candidate("aten", fn, copy.copy(job.rec.__dict__), state.passes[n_passes:])


def _tiered(job: CompileJob, compile: Compile, folder: Any, key: str | None) -> Callable[..., Any] | None:
    """provider auto without a stored decision: aten now, Inductor compiled by a background process and loaded
    from the caches when it is done (``Tiered``); None when the graph cannot be sent (not plain data, or no
    pass-cache key) or aten does not compile it: then both are compiled now."""
    if key is None:
        return None
    try:
        payload, compile_inductor, inductor_key = _inductor_loader(job, compile)
    except Exception:  # noqa: BLE001 - a graph that is not plain data: compiled here and now
        return None
    aten = _aten_candidate(job, compile)
    if aten is None:
        return None
    rec, config = job.rec, job.config
    if inductor_ready(folder, inductor_key):  # an earlier process's background compile finished it
        rec.provider = "aten (provider auto: Inductor is in the caches, loaded and measured at the next step)"
        payload = b""
    elif (timed_out := inductor_timed_out(folder, inductor_key, config.background_timeout)) is not None:
        # an earlier process's background compile of it outlived the limit: not again
        rec.provider = "aten"
        rec.notes.append(
            f"provider auto -> aten: inductor is not a candidate (an earlier background compile of this "
            f"graph took more than {timed_out:g} s, engine.background_timeout, and was stopped; raise the "
            f"limit (0: none) to compile it again)"
        )
        return aten.compiled
    else:
        rec.provider = "aten (provider auto: Inductor compiles in a background process, measured when ready)"
    return Tiered(aten, compile_inductor, payload, rec, folder, key, job.state, config)


def _deferred(job: CompileJob, compile: Compile, stored: dict[str, Any]) -> Callable[..., Any] | None:
    """provider auto with a stored decision for Inductor (a warm start): aten runs the first step, Inductor is
    loaded from the caches at the module's next call (``Deferred``). None where the graph is not plain data or
    aten does not compile it: then the winner is compiled now."""
    try:
        _, load, _ = _inductor_loader(job, compile)
    except Exception:  # noqa: BLE001 - compiled here and now
        return None
    aten = _aten_candidate(job, compile)
    if aten is None:
        return None
    job.rec.provider = "aten (provider auto: the stored winner, Inductor, loads from the caches at the next call)"
    return Deferred(aten, load, stored, job.rec, job.state, job.config)


class Deferred:
    """provider auto on a warm start whose stored decision is Inductor: the graph runs on aten (`aten`: its
    ``Candidate``, compiled before the first step in a fraction of a second from the pass cache) for the first
    step, and from the module's second call (or, without the module's count, the graph's first call after a
    step's worth of calls) on the stored winner, loaded from the caches by `load()`. Loading Inductor is most of
    a warm start: importing its compiler, the compiled modules and AOTAutograd's cache keys took 3.6 s of a
    12.8 s warm first step on GPT-2 Medium (2-core Zen 4). Nothing is timed again: the stored decision stands. A
    winner that fails to load leaves aten running the graph, reported under the module's fallback policy."""

    def __init__(
        self, aten: Candidate, load: Callable[[], Candidate], stored: dict[str, Any], rec: Any, state: Any, config: Any
    ) -> None:
        self.aten: Candidate | None = aten
        self.load, self.stored = load, stored
        self.rec, self.state, self.config = rec, state, config
        self.calls = 0
        self.chosen: Callable[..., Any] | None = None
        if not state.switch_between_steps:
            # a head start for the load at the second call. Not when the caller loads between the steps (the
            # trainer): the setup's three compiler probes (Python children) would slow the first step from
            # 0.93 s to 1.5-1.9 s (gpt2-mini warm, 2-core Zen 5) to save 1.1 s of a load outside any step
            prefetch_inductor_setup()
        worker(state).collected.append(weakref.ref(self))  # ready to load between steps (preload)

    def __call__(self, *args: Any) -> Any:
        if self.chosen is not None:
            return self.chosen(*args)
        self.calls += 1
        if _next_step(self.state, self.calls, self.rec):
            self._switch(ran=self.calls - 1)
            return self.chosen(*args)
        return self.aten.compiled(*args)

    def preload(self) -> None:
        """Load the stored winner now, between steps (workers.preload_background; the trainer does it after the
        first step), so that the graph's next call runs it: loading is compile work, kept out of the step times."""
        if self.chosen is None:
            prefetch_inductor_setup()  # the compiler probes run beside the load (once per process)
            self._switch(ran=self.calls)

    def _switch(self, ran: int) -> None:
        rec, aten_fn, aten_passes = self.rec, self.aten.compiled, self.aten.passes
        self.aten = None
        t0 = time.perf_counter()
        try:
            inductor = self.load()
        except Exception as e:  # noqa: BLE001 - aten keeps the graph
            self.chosen, rec.provider = aten_fn, "aten"
            report_fallback(
                f"provider inductor on {rec.name} ({rec.frame})",
                f"{type(e).__name__}: {str(e)[:300]}",
                self.config,
                what="runs on aten (the stored winner did not load)",
                sink=self.state.fallbacks,
            )
            return
        load = time.perf_counter() - t0
        compile_seconds = rec.compile_seconds
        rec.__dict__.update(inductor.record)
        fn, note = size_checked(inductor.compiled, aten_fn)
        rec.compile_seconds = compile_seconds
        rec.provider, rec.provider_times = "inductor", self.stored["times"]
        rec.notes = [
            *rec.notes,
            *note,
            describe(self.stored["times"], "inductor", cached=True),
            f"warm start: aten ran the first {ran} call(s); Inductor loaded from the caches in {load:.2f} s",
        ]
        dropped = {id(r) for r in aten_passes}
        self.state.passes[:] = [r for r in self.state.passes if id(r) not in dropped]
        self.chosen = fn
