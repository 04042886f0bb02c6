"""What the trainer does after the first step with a cold cache's background Inductor compile (train.compile_wait):
wait for it, give it up, or train beside it.

On a CPU the compile and the training steps share the cores: on the 2-core Zen 5 the default job's steps ran at
0.64-0.77 s beside it against 0.26 s for eager alone, and the compile alone (14-17 s) took less time than they lost
(docs/design/first-step.md, the #54 section). So a CPU run waits for it, or gives it up when too few steps are left
for it to pay; a GPU run trains beside it, its steps leaving the CPU to the compile.

The wait ends with each graph switched: Inductor's code loaded and timed against aten (provider auto's measured
choice), so that the next step runs at full speed. A warm start loads its stored winner at the same point. That
work is the compile's: its seconds go to a ``compile`` record in metrics.jsonl and to the summary's
compile_wait_s, not to a step's time, and they count in the run's wall time like everything else.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from graphtrain.config.sections import TrainConfig
from graphtrain.trainer.faults import PreemptionGuard
from graphtrain.trainer.runtime import is_accelerated

# Imports inside functions: import cost: an eager run never loads the engine (Dynamo, Inductor).

COMPILE_WAIT_MIN_STEPS = 100  # train.compile_wait auto: below this, the compile would not pay for its wait


def compile_wait_action(tc: TrainConfig, device: torch.device, remaining: int) -> str:
    """What the trainer does after the first step with a cold cache's background Inductor compile
    (train.compile_wait): "wait" for it, "skip" it (aten runs the job) or "beside" (train beside it, the graphs
    switching when it is done). `auto`: on a CPU, wait with at least COMPILE_WAIT_MIN_STEPS steps left and skip
    with fewer (the default job's compile took 14 s, the time ~100 of its steps save); elsewhere beside (a GPU's
    steps leave the CPU to the compile)."""
    if tc.compile_wait == "auto":
        if device.type != "cpu":
            return "beside"
        return "wait" if remaining >= COMPILE_WAIT_MIN_STEPS else "skip"
    return "wait" if tc.compile_wait else "beside"


def prepare_compile_wait(module: torch.nn.Module, tc: TrainConfig, step: int) -> None:
    """Before the first step: tell an accelerated `module` that its graphs switch after that step (compile_wait),
    so that a warm start does its loading there rather than inside the first step."""
    if step + 1 < tc.steps and is_accelerated(module):
        from graphtrain.frontend.accelerate import switch_between_steps  # the engine is loaded

        switch_between_steps(module)


def compile_wait(
    module: torch.nn.Module,
    tc: TrainConfig,
    device: torch.device,
    preempt: PreemptionGuard,
    bar: Any,
    log: Any,
    metrics: Any,
    step: int,
) -> float | None:
    """Apply compile_wait_action to `module` after step `step`: wait for the background compile (the graphs then
    switch to the measured winner before the next step), give it up (aten runs the job) or leave it (train beside
    it). A warm start's stored winner is loaded now whatever the action: in-process work that would otherwise
    fall inside the next step. Returns the seconds waited or loaded, None when nothing was. A SIGTERM or Ctrl-C
    ends the wait; the step loop then saves and stops. `metrics`: the run's MetricsLog on the main process (a ``compile`` record), else None."""
    remaining = tc.steps - step
    action = compile_wait_action(tc, device, remaining)
    if not is_accelerated(module):
        return None
    from graphtrain.frontend.accelerate import (  # the engine is loaded
        cancel_compile,
        compile_pending,
        load_pending,
        wait_compiled,
    )

    if not compile_pending(module):
        if not load_pending(module):
            return None
        # A warm start: the stored winner (Inductor) loads from the caches now, not inside the next step
        bar.set_postfix_str("loading")
        t0 = time.perf_counter()
        wait_compiled(module)
        loaded = time.perf_counter() - t0
        log(f"step {step}: loaded the compiled step from the cache in {loaded:.1f} s")
        if metrics is not None:
            metrics.write("compile", step, wait_s=loaded, cached=True)
        return loaded
    if action == "beside":
        return None
    if action == "skip":
        why = (
            f"train.compile_wait: {remaining} steps left, fewer than {COMPILE_WAIT_MIN_STEPS}, too few for a cold "
            f"cache's Inductor compile to pay for itself on a CPU (true: wait for it; false: compile beside the steps)"
        )
        if cancel_compile(module, why):
            log(f"step {step}: aten runs the remaining steps; {why}")
        return None
    log(
        f"step {step}: compiling the step with Inductor (cold compile cache) before the next step: on a CPU the "
        f"compile and the steps would share the cores (train.compile_wait=false trains beside it)"
    )
    bar.set_postfix_str("compiling")
    phase, preempt.phase = preempt.phase, "compile"
    t0 = time.perf_counter()
    try:
        while not preempt.requested and not wait_compiled(module, timeout=0.25):
            pass
    finally:
        preempt.phase = phase
    waited = time.perf_counter() - t0
    if not preempt.requested:
        log(
            f"step {step}: Inductor compiled, loaded and timed against aten in {waited:.1f} s; training goes on at "
            f"full speed"
        )
        if metrics is not None:
            metrics.write("compile", step, wait_s=waited, cached=False)
    return waited
