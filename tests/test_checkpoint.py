"""Checkpoints: atomic saves survive a crash mid-write; corrupt and mismatched files give clear errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from graphtrain.config.sections import Config
from graphtrain.trainer import checkpoint as ck


def make_state(step: int, config: Config | None = None, **extra) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {
        "format_version": ck.FORMAT_VERSION,
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": ck.rng_state(),
        "config": (config or Config()).to_dict(),
        "model_spec": None,
    }
    state.update(extra)
    return state


def test_save_load_roundtrip(tmp_path):
    state = make_state(3)
    path = ck.save_checkpoint(ck.checkpoint_path(tmp_path, 3), state)
    assert path.name == "ckpt-0000003.pt"
    loaded = ck.load_checkpoint(path, Config())
    assert loaded["step"] == 3
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v)
    assert loaded["config"] == Config().to_dict()
    assert (path.stat().st_mode & 0o777) == 0o644


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = ck.checkpoint_path(tmp_path, 5)
    good = make_state(5)
    ck.save_checkpoint(path, good)
    before = path.read_bytes()

    def crashing_save(obj, f, *a, **kw):
        f.write(b"PK\x03\x04 half a checkpoint")  # a partial write, then the process "dies"
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", crashing_save)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(path, make_state(5))  # overwrite the same step
    with pytest.raises(OSError):
        ck.save_checkpoint(ck.checkpoint_path(tmp_path, 6), make_state(6))  # a new step
    monkeypatch.undo()

    assert path.read_bytes() == before
    # no temp file, no ckpt-6 (nor its checksum file); ckpt-5 still verifies
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000005.pt", "ckpt-0000005.pt.sha256"]
    assert ck.verify_checkpoint(path) is True
    assert ck.latest_checkpoint(tmp_path) == path
    assert ck.load_checkpoint(path)["step"] == 5


def test_truncated_checkpoint_names_file_and_earlier_one(tmp_path):
    ck.save_checkpoint(ck.checkpoint_path(tmp_path, 1), make_state(1))
    bad = ck.save_checkpoint(ck.checkpoint_path(tmp_path, 2), make_state(2))
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    with pytest.raises(ValueError) as e:
        ck.load_checkpoint(bad)
    msg = str(e.value)
    assert "ckpt-0000002.pt" in msg and "corrupt" in msg
    assert "ckpt-0000001.pt" in msg and "start fresh" in msg


@pytest.mark.parametrize("content", [b"", b"\x00garbage" * 100, b"not a zip file at all"])
def test_garbage_checkpoint(tmp_path, content):
    bad = tmp_path / "ckpt-0000007.pt"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=r"ckpt-0000007\.pt.*(corrupt|unreadable)"):
        ck.load_checkpoint(bad)


def test_not_a_graphtrain_checkpoint(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="not a graphtrain checkpoint"), pytest.warns(UserWarning, match="unverified"):
        ck.load_checkpoint(path)  # no checksum file beside it: warned once
    torch.save({**make_state(1), "format_version": 99}, path)
    with pytest.raises(ValueError, match="format version 99"):
        ck.load_checkpoint(path)
    with pytest.raises(ValueError, match="does not exist"):
        ck.load_checkpoint(tmp_path / "missing.pt")


def test_mismatched_model_config_lists_keys_and_fix(tmp_path):
    saved = Config().with_overrides(["model.name=gpt2-tiny", "data.vocab_size=512"])
    path = ck.save_checkpoint(ck.checkpoint_path(tmp_path, 1), make_state(1, saved))
    with pytest.raises(ValueError) as e:
        ck.load_checkpoint(path, Config())
    msg = str(e.value)
    assert "model.name: checkpoint 'gpt2-tiny', current 'gpt2-mini'" in msg
    assert "data.vocab_size" in msg and "model.max_seq_len" not in msg
    assert "model.name=gpt2-tiny data.vocab_size=512" in msg and "new out_dir" in msg
    # training settings may change on resume
    ck.load_checkpoint(path, saved.with_overrides(["train.steps=999", "optim.lr=0.1"]))


def test_mismatched_model_spec(tmp_path):
    spec = {"family": "gpt2", "n_layer": 2, "d_model": 64, "vocab_size": 512, "dropout": 0.1}
    path = ck.save_checkpoint(tmp_path / "ckpt-0000001.pt", make_state(1, model_spec=spec))
    ck.load_checkpoint(path, model_spec={**spec, "dropout": 0.0})  # dropout changes no shapes
    with pytest.raises(ValueError, match="model vocab_size: checkpoint 512, current 500"):
        ck.load_checkpoint(path, model_spec={**spec, "vocab_size": 500})


def test_latest_and_prune(tmp_path):
    for step in (1, 2, 10, 3, 4):
        ck.save_checkpoint(ck.checkpoint_path(tmp_path, step), {"step": step})
    (tmp_path / ".ckpt-0000099.pt.abc.tmp").write_bytes(b"leftover")  # ignored: not a checkpoint name
    (tmp_path / "ckpt-notes.txt").write_text("mine")
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [1, 2, 3, 4, 10]
    assert ck.latest_checkpoint(tmp_path).name == "ckpt-0000010.pt"
    deleted = ck.prune_checkpoints(tmp_path, keep=3)
    assert sorted(p.name for p in deleted) == ["ckpt-0000001.pt", "ckpt-0000002.pt"]
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3, 4, 10]
    assert (tmp_path / "ckpt-notes.txt").read_text() == "mine"
    assert ck.latest_checkpoint(tmp_path / "nowhere") is None


def test_rng_state_roundtrip_through_file(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = ck.save_checkpoint(tmp_path / "ckpt-0000001.pt", make_state(1))  # make_state reseeds torch
    state = ck.load_checkpoint(path)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    ck.set_rng_state(state["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
