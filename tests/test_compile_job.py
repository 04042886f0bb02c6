"""CompileJob (pipeline/job.py): one graph's compile as one value, its provider and precision resolved, its
pass-cache key computed once per job."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx

from graphtrain.config.sections import EngineConfig
from graphtrain.pipeline import cache
from graphtrain.pipeline import job as job_module
from graphtrain.pipeline.job import CompileJob
from graphtrain.pipeline.state import EngineState, GraphRecord


def _job(**config: object) -> CompileJob:
    gm = fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    cfg = EngineConfig(**{"provider": "aten", "precision": "fp32", **config})
    rec = GraphRecord("graph0", "test", 0, [(4, 8)], ["input"])
    return CompileJob(gm, [torch.randn(4, 8)], ["input"], cfg, EngineState(cfg), rec)


@pytest.mark.parametrize("auto", [{"provider": "auto"}, {"precision": "auto"}])
def test_a_job_takes_a_resolved_provider_and_precision(auto):
    with pytest.raises(ValueError, match="must be resolved where the job is made"):
        _job(**auto)


def test_the_pass_cache_key_is_computed_once_per_job_and_per_provider(monkeypatch):
    calls = []
    real = cache.pass_cache_key

    def counted(*args, **kw):
        calls.append(args[3].provider)
        return real(*args, **kw)

    monkeypatch.setattr(job_module, "pass_cache_key", counted)  # where the job looks it up
    job = _job()
    assert job.pass_key == job.pass_key == real(job.gm, job.example_inputs, job.kinds, job.config)
    assert calls == ["aten"]
    inductor = job.for_provider("inductor")
    assert inductor.config.provider == "inductor" and job.config.provider == "aten"
    assert inductor.pass_key != job.pass_key and calls == ["aten", "inductor"]  # its own passes, its own key
    given = dataclasses.replace(job, key="from the training process")
    assert given.pass_key == "from the training process" and len(calls) == 2


def test_a_job_whose_inputs_the_key_cannot_describe_has_no_key(monkeypatch):
    def undescribable(*args, **kw):
        raise TypeError("an input the key cannot describe")

    monkeypatch.setattr(job_module, "pass_cache_key", undescribable)
    assert _job().pass_key is None
