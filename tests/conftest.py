"""Shared test hygiene."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    """Hermetic caches: unless the caller chose a folder, the session's compile cache (graphtrain's pass results,
    Inductor's, the provider decisions) starts empty in a temporary folder, so no test passes or fails because of
    what an earlier run left in ~/.cache (a CI failure once hid a pass's fallback warning behind a cache hit)."""
    import os
    import tempfile

    # pytest-xdist (`make test` runs two workers): a worker inherits the controller's environment, so the folder the
    # controller made would be shared by every worker; each worker takes its own, as one serial session has one
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if "GRAPHTRAIN_CACHE" not in os.environ or (worker and os.environ.get("_GRAPHTRAIN_TEST_CACHE_MADE")):
        os.environ["GRAPHTRAIN_CACHE"] = config._graphtrain_cache = tempfile.mkdtemp(
            prefix=f"graphtrain-test-cache-{worker or 'main'}-"
        )
        os.environ["_GRAPHTRAIN_TEST_CACHE_MADE"] = "1"
    # a CLI run in a subprocess that ends before its background compile must not leave it running beside the
    # next tests (engine.background_at_exit); tests of that behaviour set it in their own subprocess's environment
    os.environ.setdefault("GRAPHTRAIN_BACKGROUND_AT_EXIT", "stop")


def _register_fuzz_profiles() -> None:
    """The layout fuzzing's Hypothesis budgets (tests/fuzz_layouts.py): a fixed, derandomized one for the default
    suite and a larger one for ``-m slow``; no example database (the runs are reproducible as they are)."""
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # the fuzz modules skip themselves
        return
    quiet = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile(
        "graphtrain-fuzz", max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=quiet
    )
    settings.register_profile("graphtrain-fuzz-slow", settings.get_profile("graphtrain-fuzz"), max_examples=400)


_register_fuzz_profiles()


def pytest_unconfigure(config):
    import shutil

    if getattr(config, "_graphtrain_cache", None):
        shutil.rmtree(config._graphtrain_cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Reset Dynamo's caches after each test that used it.

    Every `graphtrain.accelerate` compiles `nn.Module._call_impl` with its own backend, and Dynamo
    allows a code object `torch._dynamo.config.recompile_limit` (8) cache entries per process; a
    long test session would otherwise hit that limit depending on test order."""
    yield
    import sys

    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    if "graphtrain.runtime.workers" in sys.modules:  # provider auto's background compiles end with their test
        sys.modules["graphtrain.runtime.workers"].stop_background()
    if "graphtrain.config.fallback" in sys.modules:  # the once-per-process fallback warnings: once per test instead
        sys.modules["graphtrain.config.fallback"]._WARNED.clear()


@pytest.fixture
def one_thread():
    """One intra-op thread for tiny models: they gain nothing from threads and, on a busy shared
    2-core machine, lose a lot to oversubscription (measured up to 60x on gpt2-tiny steps)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_env(tmp_path_factory, monkeypatch):
    """Trainer tests: a data cache shared by the whole session (the tokenizer trains once); the
    process settings a Trainer changes (threads, deterministic algorithms) restored after."""
    import torch

    cache = tmp_path_factory.getbasetemp() / "graphtrain-cache"
    cache.mkdir(exist_ok=True)
    monkeypatch.setenv("GRAPHTRAIN_CACHE", str(cache))
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
