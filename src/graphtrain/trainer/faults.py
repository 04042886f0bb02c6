"""What `Trainer.fit` does when a run meets a fault: a preemption signal, or a bad step.

Preemption (`PreemptionGuard`): SIGTERM (what spot machines, Slurm and Kubernetes send before they
kill) and SIGINT (Ctrl-C) do not stop the process where it stands. The handler only records the
signal; the step in flight finishes, its checkpoint is written, and `fit` raises `TrainingPreempted`,
which `graphtrain train` turns into exit status 75 (re-run with ``--resume auto`` to continue). Under
torchrun every rank learns of the signal through one all-reduce of a stop flag per step, so all ranks
save the same step; the all-reduce is started after step N and waited for after step N+1, so it runs
while a step computes (a signal then stops the run one step later). If the step in flight has not
finished `train.preempt_grace_s` after the signal, the run is stopped without it (the checkpoints
already written are complete: saves are atomic) and says so; a checkpoint being written is left to
finish. A second SIGINT stops at once (KeyboardInterrupt); a
second SIGTERM changes nothing (torchrun forwards the one the scheduler sent to every worker).

Numerics (`NumericsGuard`): a step whose loss or global gradient norm is not finite, or (with
`train.loss_spike_factor`) whose loss exceeds k x the median loss of the last 50 updated steps, is
skipped by the step strategy before any weight is written. The guard supplies that loss limit,
counts bad steps and stops the run with `TrainingFailed` after `train.max_bad_steps` in a row.
fp16 overflows with a finite loss are the loss scaler's business, not bad steps.
"""

from __future__ import annotations

import math
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

SPIKE_WINDOW = 50  # losses of updated steps the spike guard takes the median of
SPIKE_WARMUP = 10  # the guard is off until this many are seen (again after a resume)


class TrainingFailed(RuntimeError):
    """The run started and then failed (divergence, out of memory, a failed save): a runtime failure,
    not a usage error. Checkpoints written before are kept."""


class TrainingPreempted(Exception):
    """fit() stopped on SIGTERM/SIGINT. `step`: optimizer steps completed and saved in `checkpoint`
    (the latest checkpoint; None when the run has none); `saved_after_s`: seconds from the signal to
    that checkpoint being written (None when no checkpoint was written on the signal)."""

    def __init__(
        self, message: str, *, signal_name: str, step: int, checkpoint: Any, saved_after_s: float | None
    ) -> None:
        super().__init__(message)
        self.signal_name, self.step, self.checkpoint, self.saved_after_s = signal_name, step, checkpoint, saved_after_s


class _GraceExpired(BaseException):
    """Raised in the main thread when the step in flight outlives train.preempt_grace_s."""


class PreemptionGuard:
    """Context manager around the training loop: SIGTERM/SIGINT set a stop request (see the module doc).

    `phase` is "step" while a step (or evaluation) runs and "save" while a checkpoint is written; only a
    step is abandoned when the grace period ends. Handlers are installed only in the main thread (Python
    delivers signals there) and the previous ones are restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float, log: Callable[[str], None]) -> None:
        self.grace_s, self.log = grace_s, log
        self.signal_name: str | None = None
        self.t_signal: float | None = None
        self.phase = "step"
        self.expired = False
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}
        self._flag: torch.Tensor | None = None  # distributed: the stop flag being all-reduced, and its work
        self._work: Any = None

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.phase = "done"
        if self._work is not None and exc[0] is None:  # every rank issued it: complete it before teardown
            self._work.wait()
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def request(self, signal_name: str) -> None:
        """Ask for a graceful stop (what the signal handler does); starts the grace timer."""
        if self.requested:
            return
        self.signal_name, self.t_signal = signal_name, time.monotonic()
        again = "; Ctrl-C again stops at once" if signal_name == "SIGINT" else ""
        self.log(
            f"{signal_name}: finishing the current step and saving a checkpoint (within "
            f"train.preempt_grace_s={self.grace_s:g}s){again}"
        )
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.expired and signum == signal.SIGINT and self.phase == "step":  # sent by _expire
            raise _GraceExpired()
        if self.requested:
            if signum == signal.SIGINT and not self.expired:
                raise KeyboardInterrupt  # the second Ctrl-C
            return
        self.request(signal.Signals(signum).name)

    def _expire(self) -> None:
        """Timer thread, grace period over: abandon the step in flight (not a save: let it complete)."""
        if self.phase == "done":
            return
        if self.phase == "save":
            self.log(
                f"{self.signal_name}: train.preempt_grace_s={self.grace_s:g}s is over and the checkpoint is still "
                f"being written; letting it finish"
            )
            return
        self.expired = True
        # A real SIGINT to the main thread: it also interrupts a blocking call there (a sleep, a socket wait);
        # _handle then raises _GraceExpired. A long C++ kernel finishes first.
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def seconds_since_signal(self) -> float:
        return 0.0 if self.t_signal is None else time.monotonic() - self.t_signal

    def agreed(self, env: Any) -> bool:
        """Stop after this step? Distributed: every rank gives the same answer. Each call waits for the stop
        flags all-reduced (MAX over all ranks) since the previous call and starts the next all-reduce, which
        runs while the next step computes: a signal seen by any rank during step N stops every rank after
        step N+1, at the cost of one asynchronous all-reduce of one int per step."""
        if env is None:
            return self.requested
        import torch.distributed as dist

        stop = False
        if self._work is not None:
            self._work.wait()
            self._work, stop = None, bool(self._flag.item())
        if stop:  # every rank stops here: no further all-reduce
            if not self.requested:
                self.request("SIGTERM (on another rank)")
            return True
        self._flag = torch.tensor([int(self.requested)], dtype=torch.int32, device=env.device)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        return False


def is_grace_expired(e: BaseException) -> bool:
    return isinstance(e, _GraceExpired)


class NumericsGuard:
    """Counts bad steps (skipped updates: non-finite loss or gradient norm, loss spikes) and gives the
    spike limit for the next step."""

    def __init__(self, max_bad_steps: int, spike_factor: float | None) -> None:
        self.max_bad_steps, self.spike_factor = max_bad_steps, spike_factor
        self.losses: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.in_a_row = 0
        self.total = 0
        self.first_bad_step: int | None = None

    def max_loss(self) -> float:
        """The loss above which the next step is skipped (+inf: no limit)."""
        if self.spike_factor is None or len(self.losses) < SPIKE_WARMUP:
            return math.inf
        return self.spike_factor * statistics.median(self.losses)

    def record(self, step: int, loss: float, rejected: str | None) -> None:
        """After step `step` (1-based): a good step resets the count; the max_bad_steps-th bad one in a
        row raises TrainingFailed naming the steps."""
        if rejected is None:
            self.in_a_row, self.first_bad_step = 0, None
            if math.isfinite(loss):
                self.losses.append(loss)
            return
        self.total += 1
        self.in_a_row += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
        if self.in_a_row >= self.max_bad_steps:
            steps = f"step {step}" if self.in_a_row == 1 else f"steps {self.first_bad_step}-{step}"
            raise TrainingFailed(
                f"training diverged at step {step}: {self.in_a_row} bad steps in a row ({steps}; last: {rejected}); "
                f"their updates were skipped, so the weights hold no NaN. Lower optim.lr, set optim.grad_clip "
                f"(e.g. 1.0) or train.loss_spike_factor, then resume from the last checkpoint (--resume auto), "
                f"or allow more with train.max_bad_steps (now {self.max_bad_steps})"
            )


def rejection(loss: float, grad_norm: float, max_loss: float, overflow_is_scalers: bool) -> str | None:
    """Why a step's update must be skipped, or None. `overflow_is_scalers` (fp16 loss scaling): a
    non-finite gradient norm with a finite loss is an overflow the scaler handles, not a bad step."""
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    if not math.isfinite(grad_norm) and not overflow_is_scalers:
        return f"the gradient norm is {grad_norm}"
    if loss > max_loss:
        return f"loss spike: {loss:.4g} > {max_loss:.4g} (train.loss_spike_factor x the median recent loss)"
    return None
