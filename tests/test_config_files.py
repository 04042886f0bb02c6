"""Job files that compose (`defaults:`) and YAML 1.2 floats (`1e-3`) in files and on the command line."""

from __future__ import annotations

import pytest

from graphtrain.config.sections import Config


def _write(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    return tmp_path / name


def test_defaults_merge_in_order_section_by_section(tmp_path):
    _write(tmp_path, "base.yaml", "optim:\n  lr: 1e-4\n  weight_decay: 0.1\ntrain:\n  steps: 7\n")
    _write(tmp_path, "other.yaml", "train:\n  steps: 8\n  log_every: 3\n")
    (tmp_path / "sub").mkdir()
    _write(tmp_path, "sub/mid.yaml", "defaults: [../base.yaml, ../other.yaml]\ntrain:\n  batch_size: 2\n")
    job = _write(tmp_path, "job.yaml", "defaults: [sub/mid.yaml]\noptim:\n  weight_decay: 0.2\n")
    c = Config.from_yaml(job)
    assert c.optim.lr == 1e-4 and isinstance(c.optim.lr, float)  # from the base, `1e-4` read as a float
    assert c.optim.weight_decay == 0.2  # the file's own key on top
    assert (c.train.steps, c.train.log_every, c.train.batch_size) == (8, 3, 2)  # later bases win; nested bases


def test_defaults_errors_name_the_file(tmp_path):
    _write(tmp_path, "a.yaml", "defaults: [b.yaml]\n")
    _write(tmp_path, "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ValueError, match="cycle"):
        Config.from_yaml(tmp_path / "a.yaml")
    _write(tmp_path, "c.yaml", "defaults: [missing.yaml]\n")
    with pytest.raises(ValueError, match="missing.yaml.*named in the defaults of"):
        Config.from_yaml(tmp_path / "c.yaml")
    _write(tmp_path, "d.yaml", "defaults: {x: 1}\n")
    with pytest.raises(ValueError, match="defaults must be a list"):
        Config.from_yaml(tmp_path / "d.yaml")


def test_exponent_floats_on_the_command_line_and_int_fields_still_strict():
    c = Config().with_overrides(["optim.lr=1e-3", "optim.eps=2E-8", "optim.min_lr_ratio=.5e-1"])
    assert (c.optim.lr, c.optim.eps, c.optim.min_lr_ratio) == (1e-3, 2e-8, 0.05)
    with pytest.raises(TypeError, match="train.steps must be an integer"):
        Config().with_overrides(["train.steps=1e3"])
    assert Config().with_overrides(["data.path=1e3x"]).data.path == "1e3x"  # not a number: stays a string
