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
    """Tiered.preload times both providers between steps on the first call's InputSpecs: tensors of the call's
    shapes, strides, dtypes and requires_grad, with new memory; other arguments as they were."""
    from graphtrain.runtime.measured import InputSpec, input_specs, time_step

    mask = torch.randn(1, 1, 4, 4).expand(3, 1, 4, 4)
    weight = torch.randn(4, 3).t().requires_grad_()
    ids = torch.tensor([[5, 7]])
    specs = input_specs([mask, weight, ids, 3])
    assert [type(x) for x in specs] == [InputSpec, InputSpec, InputSpec, int] and specs[3] == 3
    assert all(x.meta.is_meta for x in specs[:3])
    seen = []

    def fn(m, w, ids, n):
        seen.append((m.stride(), w.stride(), w.requires_grad, ids.dtype, n))
        assert m.data_ptr() != mask.data_ptr() and w.data_ptr() != weight.data_ptr()
        return (m.sum() + (w * 2).sum()) * n

    rng = torch.random.get_rng_state()
    time_step(fn, specs, repeats=1, budget_s=float("inf"))
    assert set(seen) == {(mask.stride(), weight.stride(), True, torch.int64, 3)}
    assert torch.equal(rng, torch.random.get_rng_state()), "the random inputs drew from the training run's stream"


def test_input_specs_time_on_values_like_the_calls_and_hold_no_activation():
    """Regression (HF BERT small, bf16, 2-core AMX Xeon): the timing between steps ran on standard-normal weights
    and zero labels. The sparse LM head then ran every row (2x its real cost) and the encoder block's Inductor code
    took 40.5 ms against 28.5 ms on the real inputs, so provider auto kept aten for the blocks: the step 266 ms
    instead of 240. A spec now gives a parameter's own values, a small undifferentiated input's values (labels with
    their -100s, a mask's -inf) and random values of an activation's mean and spread; it holds no activation."""
    import gc
    import weakref

    from graphtrain.runtime.measured import VALUES_MAX_BYTES, InputSpec, input_specs, real_input

    weight = (torch.randn(64, 32) * 0.02).requires_grad_()  # a leaf the graph differentiates: a parameter
    hidden = (torch.randn(8, 32) * 3.0 + 1.5).requires_grad_() * 1.0  # an activation: not a leaf
    labels = torch.full((8,), -100)
    labels[2] = 7
    mask = torch.zeros(1, 1, 8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    big_ids = torch.zeros(VALUES_MAX_BYTES // 8 + 1, dtype=torch.int64)  # over the size kept by value
    # an expanded mask: logically over that size, 64 KiB in memory; kept in its own layout
    wide = torch.zeros(8, 1, 64, 64).masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), float("-inf"))
    wide = wide.expand(8, 512, 64, 64)
    specs = input_specs([weight, hidden, labels, mask, big_ids, wide])
    assert all(isinstance(s, InputSpec) for s in specs)
    assert specs[1].values is None and specs[1].param is None and specs[4].values is None
    assert specs[5].values is not None and specs[5].values.stride() == wide.stride()
    assert specs[5].values.untyped_storage().nbytes() < 2 * 8 * 64 * 64 * 4  # not materialised

    w, h, y, m, b, e = (real_input(s) for s in specs)
    assert torch.equal(e, wide) and e.stride() == wide.stride()
    assert torch.equal(w, weight) and w.data_ptr() != weight.data_ptr() and w.requires_grad
    assert torch.equal(y, labels) and torch.equal(m, mask) and y.data_ptr() != labels.data_ptr()
    assert h.requires_grad and abs(h.mean().item() - 1.5) < 0.6 and 2.0 < h.std().item() < 4.0
    assert not torch.equal(h, hidden)
    assert b.shape == big_ids.shape and not b.any()

    hidden_ref = weakref.ref(hidden)
    del hidden, w, h, e
    gc.collect()
    assert hidden_ref() is None, "a spec kept the call's activation alive"
    del weight
    gc.collect()
    w2 = real_input(specs[0])  # the parameter is gone: random values of its shape
    assert w2.shape == (64, 32) and w2.requires_grad


def _measured(candidates, policy):
    from graphtrain.config.sections import EngineConfig
    from graphtrain.pipeline.stages import new_record
    from graphtrain.pipeline.state import EngineState
    from graphtrain.runtime.measured import Candidate, Measured

    config = EngineConfig(fallback=policy)
    state = EngineState(config)
    x = torch.randn(4, requires_grad=True)
    rec = new_record("graph0", "forward", [x], ["input"], state, frame_compile=0)
    cands = [Candidate(p, fn, dict(rec.__dict__), []) for p, fn in candidates]
    return Measured(cands, rec, None, None, state, config), rec, state, x


def test_a_candidate_that_raises_when_timed_is_not_chosen_and_is_reported():
    """Regression (HF DeBERTa-v2 in bf16 under provider auto): the timing at the switch ran a candidate that raised
    and the error reached the user from graphtrain.wait_compiled. A candidate that raises is now left out, said as
    a fallback, and the other runs the graph; under engine.fallback=error that is the error."""
    import pytest

    from graphtrain.config.fallback import GraphtrainCaptureError

    def runs(x):
        return x * 2

    def raises(x):
        raise RuntimeError("value cannot be converted to type c10::BFloat16 without overflow")

    m, rec, state, x = _measured([("inductor", raises), ("aten", runs)], "warn")
    with pytest.warns(UserWarning, match="raised when timed"):
        out = m(x)
    assert torch.equal(out, x * 2) and rec.provider == "aten" and list(rec.provider_times) == ["aten"]
    assert state.fallbacks and "without overflow" in state.fallbacks[0][1]
    m, *_ = _measured([("inductor", raises), ("aten", runs)], "error")
    with pytest.raises(GraphtrainCaptureError, match="raised when timed"):
        m(x)
    m, *_ = _measured([("inductor", raises), ("aten", raises)], "warn")
    with pytest.raises(RuntimeError, match="without overflow"):  # the graph's own error: accelerate falls back on it
        m(x)
