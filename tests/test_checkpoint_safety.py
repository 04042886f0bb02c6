"""Checkpoint safety (issue #18): SHA-256 checksums verified on load, resume auto over corrupt checkpoints,
no code run from any file graphtrain loads, leftovers of killed saves cleaned, resumes that never mix runs.

Every malicious-file test first shows the crafted file *does* run its payload under an unguarded loader
(pickle.load, torch.load(weights_only=False), DCP's own reader), so the test could fail, then that
graphtrain's loader refuses it with a clear error and the payload never ran.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from graphtrain.checksums import SUMS_NAME, read_sums, sidecar_path, write_sums
from graphtrain.config.sections import Config
from graphtrain.distributed import checkpoint as dck
from graphtrain.models import build_model
from graphtrain.trainer import Trainer, list_checkpoints
from graphtrain.trainer import checkpoint as ck
from graphtrain.trainer.resume import clean_orphans, config_changes, is_free, supersede_later
from test_checkpoint import make_state

TINY = [
    "model.name=gpt2-tiny",
    "data.seq_len=32",
    "data.vocab_size=512",
    "data.max_bytes=300000",
    "train.batch_size=2",
    "train.steps=4",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.log_every=2",
    "train.ckpt_every=1",
    "train.accelerate=false",
    "train.progress=false",
    "train.threads=1",
    "train.sample_tokens=0",
    "optim.warmup_steps=1",
]


pytestmark = pytest.mark.usefixtures("tiny_env")  # conftest.py: shared data cache, settings restored


def tiny(out_dir: Path, *overrides: str) -> Config:
    return Config().with_overrides([*TINY, f"train.out_dir={out_dir}", *overrides])


class Payload:
    """Unpickling this creates `marker`: what a crafted file would do (here, harmlessly)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def _sharded(folder: Path, config: Config, step: int = 1) -> tuple[Path, torch.nn.Module]:
    """A trainer-style sharded checkpoint folder of gpt2-tiny, written in this process (no process group)."""
    model = build_model(config.model, vocab_size=512)
    extra = {
        "format_version": ck.FORMAT_VERSION,
        "step": step,
        "config": config.to_dict(),
        "model_spec": dataclasses.asdict(model.spec),
        "rng": [],
        "metrics": {},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is disabled ... assuming a single process"
        path = dck.save_checkpoint(ck.checkpoint_path(folder, step, sharded=True), model, None, extra)
    return path, model


def _resum(folder: Path) -> None:
    """What an attacker who edits a file can also do: rewrite SHA256SUMS to match."""
    write_sums(
        folder / SUMS_NAME,
        [(f.name, hashlib.sha256(f.read_bytes()).hexdigest()) for f in sorted(folder.iterdir()) if f.name != SUMS_NAME],
    )


# ------------------------------------------------------------------------------- integrity ----


def test_checkpoint_file_records_its_sha256_and_a_changed_byte_is_named(tmp_path):
    path = ck.save_checkpoint(ck.checkpoint_path(tmp_path, 1), make_state(1))
    ck.save_checkpoint(ck.checkpoint_path(tmp_path, 2), make_state(2))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sidecar_path(path).read_text() == f"{digest}  ckpt-0000001.pt\n"  # `sha256sum -c` reads it
    assert ck.verify_checkpoint(path) is True

    latest = ck.checkpoint_path(tmp_path, 2)
    _flip_byte(latest)  # same size, one byte: torch.load itself would not notice (it checks no CRC)
    with pytest.raises(ValueError) as e:
        ck.load_checkpoint(latest)
    msg = str(e.value)
    assert "ckpt-0000002.pt' is corrupt: ckpt-0000002.pt has SHA-256" in msg and "truncated or changed" in msg
    assert "--resume-from" in msg and "ckpt-0000001.pt" in msg and "start fresh" in msg
    latest.write_bytes(latest.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match=r"ckpt-0000002\.pt' is corrupt"):
        ck.load_checkpoint(latest)


def test_checksum_file_is_in_place_before_the_checkpoint_appears(tmp_path, monkeypatch):
    """At the moment of the rename that makes ckpt-N.pt visible, its checksum file already holds the new digest;
    replacing a checkpoint of the same step, both the old and the new file verify throughout."""
    path = ck.checkpoint_path(tmp_path, 3)
    seen = []
    replace = os.replace

    def watching_replace(src, dst):
        if Path(dst) == path:
            sums = read_sums(sidecar_path(path))["ckpt-0000003.pt"]
            seen.append(
                (
                    hashlib.sha256(Path(src).read_bytes()).hexdigest() in sums,
                    not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() in sums,
                )
            )
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", watching_replace)
    ck.save_checkpoint(path, make_state(3))
    ck.save_checkpoint(path, make_state(30))  # the same step again
    monkeypatch.undo()
    assert seen == [(True, True), (True, True)]
    assert len(sidecar_path(path).read_text().splitlines()) == 1 and ck.verify_checkpoint(path)
    assert ck.load_checkpoint(path)["step"] == 30


def test_checkpoint_without_checksum_loads_with_one_warning_and_zip_crcs_checked(tmp_path):
    path = ck.save_checkpoint(ck.checkpoint_path(tmp_path, 1), make_state(1))
    sidecar_path(path).unlink()  # as written by graphtrain before checksums
    with pytest.warns(UserWarning, match=r"no checksum file \(ckpt-0000001\.pt\.sha256\).*loads unverified"):
        assert ck.load_checkpoint(path)["step"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.load_checkpoint(path)  # once per file
    assert ck.verify_checkpoint(path) is False
    _flip_byte(path, 0.7)  # inside a tensor's bytes: torch.load would return wrong weights silently
    with pytest.raises(ValueError, match=r"ckpt-0000001\.pt' is unreadable or corrupt: .*fails its CRC-32"):
        ck.load_checkpoint(path)


def test_latest_valid_checkpoint_skips_corrupt_ones_saying_why(tmp_path):
    for step in (1, 2, 3):
        ck.save_checkpoint(ck.checkpoint_path(tmp_path, step), make_state(step))
    _flip_byte(ck.checkpoint_path(tmp_path, 3))
    ck.checkpoint_path(tmp_path, 2).write_bytes(b"")
    lines: list[str] = []
    assert ck.latest_valid_checkpoint(tmp_path, lines.append) == ck.checkpoint_path(tmp_path, 1)
    assert len(lines) == 2
    assert re.search(r"skipping checkpoint .*ckpt-0000003\.pt: it is corrupt \(ckpt-0000003\.pt has SHA-256", lines[0])
    assert "ckpt-0000002.pt" in lines[1]
    assert ck.latest_valid_checkpoint(tmp_path / "nowhere") is None


def test_sharded_folder_lists_every_file_and_any_change_is_named(tmp_path):
    config = tiny(tmp_path)
    path, model = _sharded(tmp_path, config)
    assert set(read_sums(path / SUMS_NAME)) == {".metadata", "__0_0.distcp", "extra.pt"}
    assert ck.verify_checkpoint(path) is True and ck.load_sharded_meta(path, config)["step"] == 1
    assert ck.latest_valid_checkpoint(tmp_path) == path
    _flip_byte(path / "__0_0.distcp")
    with pytest.raises(ValueError, match=r"ckpt-0000001' is corrupt: __0_0\.distcp has SHA-256"):
        ck.load_sharded_meta(path, config)
    with pytest.raises(ValueError, match=r"is corrupt: __0_0\.distcp has SHA-256"):
        dck.load_checkpoint(path, model)
    assert ck.latest_valid_checkpoint(tmp_path) is None
    (path / SUMS_NAME).unlink()  # a folder written before checksums: loads, warned once
    with pytest.warns(UserWarning, match=r"ckpt-0000001/SHA256SUMS"):
        ck.load_sharded_meta(path, config)


@pytest.mark.slow  # 16 s of spawning; tests/test_distributed_ckpt.py loads (so verifies) 2-rank folders by default
@pytest.mark.dist
def test_two_rank_sharded_save_checksums_both_ranks_files(tmp_path):
    from graphtrain.distributed.spawn import run_ranks

    run_ranks(_save_two_ranks, 2, str(tmp_path / "ckpt-0000001"))
    sums = read_sums(tmp_path / "ckpt-0000001" / SUMS_NAME)
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "extra.pt"} <= set(sums)
    assert ck.verify_checkpoint(tmp_path / "ckpt-0000001") is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000001"]  # no .tmp/.old left


def _save_two_ranks(path: str) -> None:
    from graphtrain.config.sections import ParallelConfig
    from graphtrain.distributed import parallelize

    model = build_model(Config().with_overrides(["model.name=gpt2-tiny"]).model, vocab_size=512)
    par = parallelize(model, lambda m: torch.optim.AdamW(m.parameters()), ParallelConfig(dp=2, timeout_s=60))
    par.save(path, extra={"step": 1})


# ------------------------------------------------------------------ no code run from files ----


def test_crafted_pt_checkpoint_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "ckpt-0000001.pt"
    torch.save({**make_state(1), "model": Payload(marker)}, path)
    torch.load(path, weights_only=False)  # control: an unguarded load runs it
    assert marker.exists()
    marker.unlink()
    write_sums(sidecar_path(path), [(path.name, hashlib.sha256(path.read_bytes()).hexdigest())])  # checksum ok
    with pytest.raises(
        ValueError,
        match=r"holds Python objects other than tensors and plain values.*never "
        r"unpickles.*not written by graphtrain",
    ):
        ck.load_checkpoint(path)
    model = build_model(tiny(tmp_path).model, vocab_size=512)
    with pytest.raises(ValueError, match="holds Python objects other than tensors"):  # train.init_from, a file
        ck.load_weights(model, str(path), tiny(tmp_path / "run"), {})
    assert not marker.exists()


def test_crafted_sharded_extra_and_dcp_metadata_are_refused_without_running_them(tmp_path):
    marker = tmp_path / "ran"
    config = tiny(tmp_path / "run")
    path, model = _sharded(tmp_path / "run", config)

    torch.save({"format_version": 1, "step": Payload(marker)}, path / "extra.pt")
    _resum(path)
    with pytest.raises(ValueError, match=r"extra\.pt holds Python objects other than tensors.*does not unpickle"):
        ck.load_sharded_meta(path, config)
    torch.load(path / "extra.pt", weights_only=False)  # control
    assert marker.exists()
    marker.unlink()

    good = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _resum(path)
    for load in (lambda: dck.load_checkpoint(path, model), lambda: dck.load_model_weights_local(path, model)):
        with pytest.raises(
            ValueError,
            match=r"DCP \.metadata names (io|builtins)\.open, which is not part of DCP's "
            r"checkpoint metadata; graphtrain refuses to unpickle it",
        ):
            load()
    assert not marker.exists()
    dcp.FileSystemReader(str(path)).read_metadata()  # control: DCP's own reader runs it
    assert marker.exists()
    marker.unlink()

    # genuine metadata that declares a weight as a pickled "bytes" entry: DCP would torch.load it with
    # weights_only=False; graphtrain reads only tensor entries
    meta = pickle.loads(good)
    meta.state_dict_metadata["model.wte.weight"] = dcp.metadata.BytesStorageMetadata()
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    _resum(path)
    with pytest.raises(
        ValueError,
        match=r"entry 'model\.wte\.weight' is stored as BytesStorageMetadata, not a "
        r"tensor",
    ):
        dck.load_checkpoint(path, model)


def test_sharded_folder_outside_the_run_needs_trust(tmp_path):
    marker = tmp_path / "ran"
    config = tiny(tmp_path / "run")
    elsewhere, _ = _sharded(tmp_path / "elsewhere", config, step=2)
    model = build_model(config.model, vocab_size=512)
    spec = dataclasses.asdict(model.spec)
    with pytest.raises(
        ValueError,
        match=r"train\.init_from: .*ckpt-0000002' is a sharded checkpoint folder outside "
        r"this run's train\.out_dir.*set train\.trust_checkpoint=true",
    ):
        ck.load_weights(model, str(elsewhere), config, spec)
    trusted = config.with_overrides(["train.trust_checkpoint=true"])
    assert ck.load_weights(model, str(tmp_path / "elsewhere"), trusted, spec) == (elsewhere, 2)
    with pytest.raises(ValueError, match=r"resume: .*ckpt-0000002' is a sharded checkpoint folder outside"):
        Trainer(config, resume=elsewhere).fit()  # --resume-from
    inside, _ = _sharded(tmp_path / "run" / "phase1", config, step=3)  # under out_dir: no trust needed
    assert ck.load_weights(model, str(inside), config, spec)[1] == 3
    # trusted, and crafted all the same: the allow-list still refuses it
    (elsewhere / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _resum(elsewhere)
    with pytest.raises(ValueError, match="refuses to unpickle"):
        ck.load_weights(model, str(elsewhere), trusted, spec)
    assert not marker.exists()


def test_config_and_data_caches_run_no_code(tmp_path):
    marker = tmp_path / "ran"
    job = tmp_path / "job.yaml"
    job.write_text(f"train: !!python/object/apply:builtins.open ['{marker}', 'w']\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        Config.from_yaml(job)
    assert not marker.exists()

    # tokenizer cache: token ids are .npy files read with numpy's allow_pickle=False (the default); an object
    # array is refused and the cache rebuilt
    from graphtrain.data.tokenizer import load_or_build

    cfg = (
        Config()
        .with_overrides(["data.vocab_size=512", "data.max_bytes=300000", f"data.cache_dir={tmp_path / 'cache'}"])
        .data
    )
    first = load_or_build(cfg)
    # the ids are mapped from the file, and np.save below rewrites it in place (graphtrain's own writes replace the
    # file, which leaves a mapping valid): keep a copy to compare with
    want = np.array(first.train)
    np.save(first.cache_dir / "train.npy", np.array([Payload(marker)], dtype=object), allow_pickle=True)
    np.load(first.cache_dir / "train.npy", allow_pickle=True)  # control
    assert marker.exists()
    marker.unlink()
    again = load_or_build(cfg)
    assert not again.from_cache and np.array_equal(again.train, want) and not marker.exists()


# ------------------------------------------------------------------------------- orphans ----


def test_clean_orphans_removes_only_graphtrains_leftovers(tmp_path):
    keep = ck.save_checkpoint(ck.checkpoint_path(tmp_path, 1), make_state(1))
    leftovers = {
        ".ckpt-0000002.pt.k3j4.tmp": b"half",
        ".ckpt-0000002.pt.sha256.x1.tmp": b"",
        "ckpt-0000003.pt.sha256": b"0" * 64 + b"  ckpt-0000003.pt\n",
        ".config.yaml.tmp": b"",
        "metrics.jsonl.tmp": b"",
    }
    mine = {
        "notes.tmp": b"mine",
        "ckpt-notes.txt": b"mine",
        "x.ckpt-0000002.pt.tmp": b"mine",
        "ckpt-0000009.pt.sha256.bak": b"mine",
    }
    for name, data in {**leftovers, **mine}.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "ckpt-0000004.tmp").mkdir()  # a sharded save in progress when killed
    (tmp_path / "ckpt-0000004.tmp" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "ckpt-0000005.old").mkdir()  # killed between moving ckpt-5 aside and the new one into place
    (tmp_path / "ckpt-0000005.old" / ".metadata").write_bytes(b"m")
    done = clean_orphans(tmp_path)
    assert sorted(done) == sorted([*leftovers, "ckpt-0000004.tmp/", "ckpt-0000005.old/ (restored as ckpt-0000005/)"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [keep.name, sidecar_path(keep).name, "ckpt-0000005", *mine]
    )
    assert clean_orphans(tmp_path) == []


# ----------------------------------------------------------------------- resume, by Trainer ----


def test_resume_auto_starts_fresh_then_continues_from_the_latest_valid_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert Trainer(tiny(out, "train.steps=3"), resume="auto").fit()["steps"] == 3  # nothing there: fresh
    assert "no checkpoint in" in capsys.readouterr().out
    _flip_byte(ck.checkpoint_path(out, 3))
    (out / ".ckpt-0000004.pt.abc123.tmp").write_bytes(b"killed mid-save")
    trainer = Trainer(tiny(out, "train.steps=5"), resume="auto")
    assert trainer.fit()["steps"] == 5
    log = capsys.readouterr().out
    assert "removed what interrupted saves left in" in log and ".ckpt-0000004.pt.abc123.tmp" in log
    assert re.search(r"skipping checkpoint .*ckpt-0000003\.pt: it is corrupt", log)
    assert re.search(r"later checkpoint\(s\) of .* \(ckpt-0000003\.pt\) moved to .*superseded-2-", log)
    assert "resumed from" in log and "ckpt-0000002.pt at step 2" in log
    assert [s for s, _ in list_checkpoints(out)] == [3, 4, 5]
    (aside,) = out.glob("superseded-2-*")
    assert sorted(p.name for p in aside.iterdir()) == ["ckpt-0000003.pt", "ckpt-0000003.pt.sha256"]  # kept
    assert not list(out.glob(".*.tmp"))


def test_resume_true_skips_corrupt_and_refuses_when_none_verifies(tmp_path, capsys):
    out = tmp_path / "run"
    Trainer(tiny(out, "train.steps=2")).fit()
    _flip_byte(ck.checkpoint_path(out, 2))
    assert Trainer(tiny(out, "train.steps=2"), resume=True).fit()["steps"] == 2
    assert re.search(r"skipping checkpoint .*ckpt-0000002\.pt: it is corrupt", capsys.readouterr().out)
    for _, p in list_checkpoints(out):
        _flip_byte(p)
    for resume in (True, "auto"):
        with pytest.raises(ValueError, match=r"none of the 2 checkpoints in .* verifies"):
            Trainer(tiny(out, "train.steps=2"), resume=resume).fit()


def test_resume_with_a_changed_config_shows_the_difference_and_needs_it_named(tmp_path, capsys):
    out = tmp_path / "run"
    Trainer(tiny(out, "train.steps=2")).fit()
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    changed = tiny(out, "train.steps=3", "optim.lr=0.0005", "train.batch_size=4", "engine.recompute=full")
    with pytest.raises(ValueError) as e:
        Trainer(changed, resume=True).fit()
    msg = str(e.value)
    assert "optim.lr: 0.001 -> 0.0005; train.batch_size: 2 -> 4)" in msg and "mix two runs" in msg
    assert "--allow-config-change optim.lr,train.batch_size" in msg and "set optim.lr=0.001 train.batch_size=2" in msg
    assert "train.steps" not in msg and "engine.recompute" not in msg  # free to change
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before  # nothing on disk changed
    with pytest.raises(ValueError, match="allow_config_change: unknown config key 'optim.lrr'"):
        Trainer(changed, resume=True, allow_config_change="optim.lrr")
    capsys.readouterr()
    trainer = Trainer(changed, resume=True, allow_config_change="optim.lr,train.batch_size")
    assert trainer.fit()["steps"] == 3
    assert "optim.lr: 0.001 -> 0.0005 (allowed)" in capsys.readouterr().out


def test_config_change_rules():
    saved = Config().to_dict()
    now = (
        Config()
        .with_overrides(
            [
                "train.steps=99",
                "model.name=gpt2-tiny",
                "parallel.dp=2",
                "optim.betas=[0.8,0.9]",
                "engine.precision=bf16",
                "engine.provider=aten",
            ]
        )
        .to_dict()
    )
    del saved["train"]["max_bad_steps"]  # a checkpoint from before that key existed
    now["train"]["max_bad_steps"] = 9
    keys = [k for k, _, _ in config_changes(saved, now)]
    assert keys == ["optim.betas", "train.steps", "engine.provider", "engine.precision", "parallel.dp"]  # no model.name
    assert [k for k in keys if not is_free(k)] == ["optim.betas", "engine.precision"]


def test_resume_from_an_earlier_checkpoint_moves_the_later_ones_aside(tmp_path, capsys):
    out = tmp_path / "run"
    Trainer(tiny(out)).fit()
    assert [s for s, _ in list_checkpoints(out)] == [2, 3, 4]
    later = {n: (out / n).read_bytes() for n in ("ckpt-0000003.pt", "ckpt-0000004.pt")}
    trainer = Trainer(tiny(out, "train.steps=2"), resume=ck.checkpoint_path(out, 2))
    assert trainer.fit()["steps"] == 2
    (aside,) = out.glob("superseded-2-*")
    assert re.search(r"2 later checkpoint\(s\) .*moved to .*superseded-2-", capsys.readouterr().out)
    for name, data in later.items():
        assert (aside / name).read_bytes() == data and ck.verify_checkpoint(aside / name)  # intact, verifiable
    assert [s for s, _ in list_checkpoints(out)] == [2]
    assert ck.latest_valid_checkpoint(out) == ck.checkpoint_path(out, 2)  # the next --resume continues step 2
    assert supersede_later(out, 2) == (None, [])
