"""The process's peak resident memory over a training step: a measured baseline plus the predicted step.

``predict_peak`` predicts the step's *tensors* at their peak (trained parameters, gradients, optimizer
state, batch, activations, temporaries). What a user sees, and what the README and ``docs/design/memory.md``
quote, is the whole process's peak resident set (Linux ``VmHWM``): the step's tensors on top of the
interpreter, torch and its libraries (365 MiB resident once torch and graphtrain are imported, on the
2-core AVX2 EPYC of docs/design/memory.md), the compiled graphs and Dynamo's caches, frozen parameters, buffers
and the allocator's overhead. None of that is predicted, so it is measured, once, right before the
step::

    process peak = (VmRSS before the step - resident state) + predicted step peak

where *resident state* is the bytes of the tensors the step prediction counts that are already
allocated at that moment -- trained parameters, their gradients, the optimizer's state, the batch --
measured from the objects themselves (never taken from the prediction, so a prediction that forgot the
optimizer state or the parameters is that much short). ``VmRSS - resident state`` is everything else
resident; the prediction adds the whole step on top. Before the first ``optimizer.step()`` there is no
optimizer state yet, and the prediction adds it as new. The step is assumed to end with
``zero_grad(set_to_none=True)`` (what ``predict_peak`` models).

``predict_process_peak`` is the helper; ``graphtrain.report(model, optimizer=opt)`` shows its result
next to the step peak, and ``python -m graphtrain.bench.memory`` compares it with the measured VmHWM.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from graphtrain.memory.allocator import trim
from graphtrain.memory.predict import MemoryEstimate, param_bytes, storage_bytes, storage_key


def rss_bytes(field: str = "VmRSS") -> int | None:
    """This process's resident set (``VmRSS``) or its high-water mark (``VmHWM``) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Restart ``VmHWM`` at the current resident set (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _unique_bytes(tensors: Iterable[Any]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            t = t.to_local() if hasattr(t, "to_local") else t
            seen[storage_key(t)] = storage_bytes(t)
    return sum(seen.values())


def resident_state(
    model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, batch: Iterable[Any] = ()
) -> dict[str, int]:
    """Bytes now allocated of each persistent part of the step that ``predict_peak`` counts (one storage once)."""
    params = [p for p in model.parameters() if p.requires_grad] if model is not None else []
    state = [] if optimizer is None else [t for s in optimizer.state.values() for t in s.values()]
    return {
        "params": param_bytes(params),
        "grads": _unique_bytes(p.grad for p in params),
        "optimizer_state": _unique_bytes(state),
        "batch_inputs": _unique_bytes(batch),
    }


@dataclass(frozen=True)
class ProcessPeak:
    """Predicted peak resident memory of this process over one training step (bytes).

    process_peak = baseline_rss - resident_state + step_peak: the measured resident set before the step,
    less the step's own tensors already in it (counted by the prediction), plus the predicted step peak."""

    step_peak: int  # predict_peak: params + grads + optimizer state + batch + activations at the step's peak
    baseline_rss: int  # VmRSS measured before the step
    resident_state: int  # of the step's persistent tensors, the bytes allocated at the baseline (measured)
    resident_parts: dict[str, int]
    optimizer_measured: bool  # False: no optimizer given, its state counted as not yet allocated (an upper bound)

    @property
    def other_resident(self) -> int:
        """Resident at the baseline and not predicted: interpreter, libraries, compiled graphs and caches,
        frozen parameters, buffers, allocator overhead."""
        return self.baseline_rss - self.resident_state

    @property
    def increment(self) -> int:
        """What the step adds to the resident set at its peak (predicted)."""
        return self.step_peak - self.resident_state

    @property
    def process_peak(self) -> int:
        return self.other_resident + self.step_peak

    def relative_error(self, measured_peak_rss: float) -> float:
        """(predicted - measured) / measured, against the measured VmHWM over the step."""
        return (self.process_peak - measured_peak_rss) / measured_peak_rss

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "other_resident": self.other_resident,
            "increment": self.increment,
            "process_peak": self.process_peak,
        }


def _step_peak(estimate: MemoryEstimate | Mapping[str, Any] | int) -> int:
    if isinstance(estimate, MemoryEstimate):
        return estimate.peak
    if isinstance(estimate, Mapping):  # a report's graphs[i]["predicted_memory"]
        return int(estimate["peak"])
    return int(estimate)


def predict_process_peak(
    estimate: MemoryEstimate | Mapping[str, Any] | int,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    batch: Iterable[Any] = (),
    baseline_rss: int | None = None,
) -> ProcessPeak | None:
    """Predict this process's peak resident memory (VmHWM) over the next training step.

    estimate: the step prediction (``predict_peak``'s MemoryEstimate, a report's ``predicted_memory`` dict,
    or its peak in bytes). model, optimizer, batch: the objects whose tensors the step prediction counts;
    what of them is allocated now is measured and taken out of the baseline (the prediction adds it back).
    baseline_rss: the resident set before the step; None measures it now, after ``gc.collect()`` and glibc's
    ``malloc_trim`` (freed heap pages would otherwise count as resident), so call it between steps.
    Returns None where the resident set cannot be read (not Linux)."""
    if baseline_rss is None:
        gc.collect()
        trim()
        baseline_rss = rss_bytes()
        if baseline_rss is None:
            return None
    parts = resident_state(model, optimizer, batch)
    return ProcessPeak(_step_peak(estimate), int(baseline_rss), sum(parts.values()), parts, optimizer is not None)
