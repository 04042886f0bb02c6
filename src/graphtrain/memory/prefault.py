"""Prime a first step: fault in, on the idle core, the memory a module's first training step will ask for.

A large model's first training step is mostly page faults. Its gradients and optimizer state are touched for the
first time (GPT-2 Medium: 1.4 GB of gradients, 2.8 GB of AdamW state), and on a 2-core VM a first touch runs at
about 1 GB/s: measured on a Zen 4 EPYC, GPT-2 Medium b1 s128, the first backward took 3.1 s against 1.1 s later and
the first optimizer step 3.2 s against 0.13 s. Meanwhile a warm start's compile (Dynamo tracing the model, the
backend loading its cached pass results) runs Python on one core for several seconds, and the other core idles.

So the first training call of an accelerated CPU module records, in graphtrain's allocator, the sizes of the
blocks of 2 MiB and more its first step asks for that no block freed before could serve (allocator.record_requests),
until the first optimizer step ends (torch's global optimizer-step hook; or `SETTLE_CALLS` calls of the module
after the first, for loops without a torch optimizer). The list goes to the cache folder, keyed by the model's
parameters (names, shapes, dtypes, which train), the call's input shapes and dtypes, the engine config and the torch
and graphtrain versions. A later process with the same key starts, before Dynamo traces, a C++ thread (no GIL)
that faults in blocks of those sizes in that order (allocator.prime); the step's requests take them, and the thread
skips the requests the step already made. Without a record it primes what is known before the step runs: each
trainable weight's gradient (in no step order, so nothing is skipped). When the first step ends, primed blocks
nobody asked for are given back.

What it does not change: the memory each request gets is the same size (rounded to 4 KiB) and alignment as
graphtrain's allocator gives anyway, and its contents are as undefined as any fresh block's. The first step holds
the primed blocks ahead of their use, at most the first step's own fresh memory (what the recording saw): a step
that repeats the recorded one reaches the same peak. Off with ``engine.cpu_prefault: false``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from graphtrain.memory import allocator

SETTLE_CALLS = 8
"""Settle at the module's 9th call at the latest (gradient accumulation of up to 8 micro-batches still records its
optimizer step)."""

_LOCK = threading.Lock()
_ACTIVE: Session | None = None


class Session:
    """One first step being recorded (and primed, when a record of it exists)."""

    def __init__(self, path: Path, primed_sizes: list[int] | None, primed_from: str, sink: dict[str, Any]) -> None:
        self.path, self.primed_sizes, self.primed_from, self.sink = path, primed_sizes, primed_from, sink
        self.calls = 0
        self.done = False
        self.hook = register_optimizer_step_post_hook(lambda *_: self.settle())

    def on_call(self) -> None:
        self.calls += 1
        if self.calls >= SETTLE_CALLS:
            self.settle()

    def settle(self) -> None:
        global _ACTIVE
        with _LOCK:
            if self.done:
                return
            self.done = True
            _ACTIVE = None
        self.hook.remove()
        sizes = allocator.record_requests(False) or []
        stats = allocator.settle_priming() if self.primed_sizes is not None else None
        self.sink.update(recorded_blocks=len(sizes), recorded_bytes=sum(sizes), path=str(self.path))
        if stats is not None:
            self.sink.update(
                primed_from=self.primed_from,
                primed_blocks=stats["primed"],
                primed_taken=stats["taken"],
                primed_bytes=sum(self.primed_sizes or []),
                returned_bytes=stats["returned_bytes"],
            )
        if sizes and sizes != self.primed_sizes:
            _save(self.path, sizes)


def compiled() -> None:
    """The first graph is compiled and about to run: stop priming. The compile is Python on one core, so the other
    core idles; the step's own work runs OpenMP threads on both, and a priming thread beside them (even under
    SCHED_IDLE: its page faults stall the core in the kernel and the hypervisor) held their barriers up (measured:
    the first forward of GPT-2 Medium took 10 s instead of 5 when priming went on)."""
    if _ACTIVE is not None and _ACTIVE.primed_sizes is not None:
        allocator.stop_priming()


def key(module: torch.nn.Module, args: tuple, kwargs: dict, config: Any) -> str:
    """What a first step's requests depend on: the model's parameters and buffers, the call's tensors, the engine
    config and the versions (a hex digest)."""
    h = hashlib.sha256()
    h.update(
        f"{type(module).__module__}.{type(module).__qualname__}|{torch.__version__}|{_version()}|{config!r}".encode()
    )
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad};".encode())
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        h.update((f"{tuple(leaf.shape)}:{leaf.dtype};" if isinstance(leaf, torch.Tensor) else f"{leaf!r};").encode())
    return h.hexdigest()[:32]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("graphtrain")
    except PackageNotFoundError:  # run from a source tree
        return "source"


def _load(path: Path) -> list[int] | None:
    try:
        sizes = json.loads(path.read_text())["sizes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: this step records a fresh one
    return [int(n) for n in sizes] if isinstance(sizes, list) else None


def _save(path: Path, sizes: list[int]) -> None:
    """Atomically (a reader never sees half a file); a failure to write only costs the next process its priming."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"sizes": sizes, "bytes": sum(sizes)}))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def begin(
    module: torch.nn.Module, args: tuple, kwargs: dict, config: Any, root: Path, sink: dict[str, Any]
) -> Session | None:
    """Start recording this first step (and priming it from an earlier record); None when another module's first
    step is being recorded in this process, or graphtrain's allocator is not installed."""
    global _ACTIVE
    with _LOCK:
        if _ACTIVE is not None:
            return None
        path = root / "first-step" / f"{key(module, args, kwargs, config)}.json"
        if not (allocator.huge_pages_on() or allocator.block_cache_on()) or allocator.record_requests(True) is None:
            return None
        sizes, source = _load(path), "record"
        if not sizes:
            sizes, source = gradient_sizes(module), "gradients"
        if sizes and not allocator.prime(sizes, follow=source == "record"):
            sizes = None
        _ACTIVE = Session(path, sizes or None, source, sink)
        return _ACTIVE


def gradient_sizes(module: torch.nn.Module) -> list[int]:
    """Without a record (a cold start, a new shape): the one part of a first step's fresh memory known before it
    runs, each trainable weight's gradient of 2 MiB and more, last layer first (the order the backward makes
    them). A weight the step leaves without a gradient costs its primed block until the first step ends."""
    sizes = []
    for p in reversed(list(module.parameters())):
        local = getattr(p, "_local_tensor", p)  # a DTensor's shard on this rank
        if p.requires_grad and (n := local.numel() * local.element_size()) >= 2 * 2**20:
            sizes.append(n)
    return sizes
