"""provider auto's measurement (runtime/measured.py time_step): how a compiled candidate is timed, on a call's own
inputs or on the shapes a call left (InputSpec), without touching the training run's random stream."""

from __future__ import annotations

import torch


def test_time_step_warms_up_only_a_candidate_that_has_not_run():
    from graphtrain.runtime.measured import time_step

    calls = []
    x = torch.randn(4, requires_grad=True)

    def fn(x):
        calls.append(1)
        return x * 2

    for warmed, n in ((False, 3), (True, 2)):
        calls.clear()
        assert time_step(fn, [x], repeats=2, budget_s=float("inf"), warmed=warmed) < float("inf")
        assert len(calls) == n


def test_time_step_calls_a_candidate_with_its_inputs_own_layout():
    # A compiled graph asserts its inputs' strides: timing it on a contiguous copy of an expanded mask (stride 0,
    # ModernBERT's) raised and the module fell back to eager.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphtrain.runtime.measured import time_step

    mask = torch.randn(1, 1, 4, 4).expand(3, 1, 4, 4)
    w = torch.randn(4, 3).t()
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(mask)
    seen = []

    def fn(m, f, w):
        seen.append((m.stride(), f.stride(), w.stride()))
        return m + f

    time_step(fn, [mask, fake, w], repeats=1, budget_s=float("inf"))
    assert set(seen) == {(mask.stride(), mask.stride(), w.stride())}


def test_time_step_on_a_calls_input_specs_makes_new_tensors_of_its_layout_and_kind():
    """Tiered.preload times both providers between steps on the last call's InputSpecs: tensors of the call's
    shapes, strides, dtypes and requires_grad, with new memory (random floats, zero indices); other arguments as
    they were."""
    from graphtrain.runtime.measured import InputSpec, input_specs, time_step

    mask = torch.randn(1, 1, 4, 4).expand(3, 1, 4, 4)
    weight = torch.randn(4, 3).t().requires_grad_()
    ids = torch.tensor([[5, 7]])
    specs = input_specs([mask, weight, ids, 3])
    assert [type(x) for x in specs] == [InputSpec, InputSpec, InputSpec, int] and specs[3] == 3
    assert all(x.meta.is_meta for x in specs[:3])  # no memory of the call's is held
    seen = []

    def fn(m, w, ids, n):
        seen.append((m.stride(), w.stride(), w.requires_grad, ids.dtype, ids.sum().item(), n))
        assert m.data_ptr() != mask.data_ptr() and w.data_ptr() != weight.data_ptr()
        return (m.sum() + (w * 2).sum()) * n

    rng = torch.random.get_rng_state()
    time_step(fn, specs, repeats=1, budget_s=float("inf"))
    assert set(seen) == {(mask.stride(), weight.stride(), True, torch.int64, 0, 3)}
    assert torch.equal(rng, torch.random.get_rng_state()), "the random inputs drew from the training run's stream"
