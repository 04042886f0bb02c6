"""Embedded data: corpus split, tokenizer, cache, deterministic batches, MLM masking, custom folders."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from graphtrain.config.sections import Config, DataConfig
from graphtrain.data import (
    IGNORE_INDEX,
    CodeTokenizer,
    build_data,
    cache_root,
    default_root,
    list_files,
    load_corpus,
    load_or_build,
    split_documents,
)

SMALL = {"max_bytes": 300_000, "vocab_size": 512, "seq_len": 64}


@pytest.fixture(scope="module", autouse=True)
def cache_env(tmp_path_factory: pytest.TempPathFactory):
    """Every build in this file caches under a fresh temporary root."""
    root = tmp_path_factory.mktemp("graphtrain_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRAPHTRAIN_CACHE", str(root))
        yield root


def config(family_seed: int = 1337, **data) -> Config:
    return Config.from_dict({"data": {**SMALL, **data}, "train": {"seed": family_seed}})


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def gpt_data():
    return build_data(config(), "gpt2")


@pytest.fixture(scope="module")
def bert_data():
    return build_data(config(), "bert")


# ------------------------------------------------------------------------------------ corpus --


def test_default_corpus_is_stdlib_python_split_deterministically() -> None:
    cfg = DataConfig(**SMALL)
    root, files = list_files(cfg)
    assert root == default_root() and files
    assert all(f.relpath.endswith(".py") and "site-packages" not in f.relpath for f in files)
    names = {f.relpath for f in files}  # generated codec/data tables are not code worth learning
    assert not any(n.startswith(("encodings/", "pydoc_data/")) for n in names)
    assert not names & {"stringprep.py", "html/entities.py", "re/_casefix.py"}
    assert "_pydecimal.py" in names and "html/parser.py" in names
    assert [f.relpath for f in files] == sorted(f.relpath for f in files)

    a, b = load_corpus(cfg), load_corpus(cfg)
    assert list(a.train) == list(b.train) and list(a.val) == list(b.val)
    assert a.train and a.val and not set(a.train) & set(a.val)
    assert a.n_bytes <= SMALL["max_bytes"]
    read = sorted([*a.train, *a.val])
    assert read == [f.relpath for f in files][: len(read)]  # the first files in path order


def test_split_is_a_stable_hash_of_the_path() -> None:
    # A golden answer: Python's salted hash() would change it from one process to the next.
    names = [f"pkg/mod_{i}.py" for i in range(200)]
    train, val = split_documents({n: "x = 1\n" for n in names}, 0.1)
    assert sorted(int(n[8:-3]) for n in val) == [
        8,
        30,
        31,
        36,
        52,
        56,
        59,
        68,
        79,
        87,
        104,
        116,
        119,
        125,
        134,
        137,
        143,
        158,
        164,
        169,
        174,
        178,
        183,
        190,
        195,
    ]
    assert len(train) == 175


def test_split_guarantees_non_empty_val() -> None:
    train, val = split_documents({"a.py": "a\n" * 50, "b.py": "b\n" * 50}, 0.01)
    assert len(train) == 1 and len(val) == 1
    train, val = split_documents({"only.txt": "line\n" * 100}, 0.1)  # one file: its tail is held out
    assert "".join(train.values()) + "".join(val.values()) == "line\n" * 100 and all(val.values())


# --------------------------------------------------------------------------------- tokenizer --


def test_tokenizer_round_trips_source_text(gpt_data) -> None:
    tok = gpt_data.tokenizer
    assert tok.vocab_size == 512
    assert len({tok.eos_id, tok.pad_id, tok.mask_id, tok.cls_id, tok.sep_id}) == 5
    corpus = load_corpus(DataConfig(**SMALL))
    for text in [
        *list(corpus.val.values())[:1],
        *list(corpus.train.values())[:3],
        "def f(x):\n\treturn x  # héllo → 世界 🙂\r\n",
        "",
    ]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    text = next(iter(corpus.train.values()))
    assert len(tok.encode(text)) < 0.7 * len(text.encode())  # even 512 merges compress source code
    with pytest.raises(TypeError, match="str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_tokenizer_save_load(gpt_data, tmp_path: Path) -> None:
    gpt_data.tokenizer.save(tmp_path / "tok.json")
    loaded = CodeTokenizer.load(tmp_path / "tok.json")
    text = "for i in range(10):\n    print(i)\n"
    assert loaded.encode(text) == gpt_data.tokenizer.encode(text) and loaded.mask_id == gpt_data.tokenizer.mask_id
    with pytest.raises(ValueError, match="does not exist"):
        CodeTokenizer.load(tmp_path / "missing.json")


def test_cache_hit_is_fast_and_identical(cache_env: Path) -> None:
    cfg = DataConfig(**{**SMALL, "vocab_size": 400})  # a key no other test builds first
    first = load_or_build(cfg)
    assert not first.from_cache and first.cache_dir.parent == cache_env / "data" == cache_root(cfg)
    t0 = time.perf_counter()
    second = load_or_build(cfg)
    elapsed = time.perf_counter() - t0
    assert second.from_cache and elapsed < 1.0, f"cache hit took {elapsed:.2f}s"
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    assert first.train.dtype == np.uint16
    assert second.tokenizer.encode("import os\n") == first.tokenizer.encode("import os\n")
    assert not list(first.cache_dir.glob("*.tmp"))  # atomic writes leave no partial files
    # A different vocab size is a different cache entry.
    assert load_or_build(DataConfig(**{**SMALL, "vocab_size": 420})).cache_dir != first.cache_dir


# ----------------------------------------------------------------------------------- batches --


def test_gpt_batches_are_shifted_windows(gpt_data) -> None:
    batch = gpt_data.train.get_batch(0, 4)
    assert set(batch) == {"input_ids", "labels"}
    x, y = batch["input_ids"], batch["labels"]
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    tokens = torch.from_numpy(gpt_data.train.shards[0].astype("int64"))
    for row_x, row_y in zip(x, y):
        window = torch.cat([row_x, row_y[-1:]])
        starts = (tokens[: tokens.numel() - 64] == window[0]).nonzero().flatten()
        assert any(torch.equal(tokens[s : s + 65], window) for s in starts.tolist())


def test_batches_are_deterministic_per_step(gpt_data) -> None:
    a = gpt_data.train.get_batch(5, 4)
    assert torch.equal(a["input_ids"], gpt_data.train.get_batch(5, 4)["input_ids"])
    assert not torch.equal(a["input_ids"], gpt_data.train.get_batch(6, 4)["input_ids"])
    assert not torch.equal(
        gpt_data.val.get_batch(5, 4)["input_ids"][:, :8], gpt_data.val.get_batch(6, 4)["input_ids"][:, :8]
    )
    # A "resumed" process builds its data again and sees the very same batch at the same step.
    resumed = build_data(config(), "gpt2")
    assert torch.equal(a["labels"], resumed.train.get_batch(5, 4)["labels"])
    other_seed = build_data(config(family_seed=7), "gpt2")
    assert not torch.equal(a["input_ids"], other_seed.train.get_batch(5, 4)["input_ids"])


def test_bert_batch_layout(bert_data) -> None:
    tok = bert_data.tokenizer
    b = bert_data.train.get_batch(0, 8)
    assert set(b) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
    assert all(t.shape == (8, 64) and t.dtype == torch.long for t in b.values())
    assert (b["input_ids"][:, 0] == tok.cls_id).all() and (b["input_ids"][:, -1] == tok.sep_id).all()
    assert (b["attention_mask"] == 1).all() and (b["token_type_ids"] == 0).all()
    assert (b["labels"][:, [0, -1]] == IGNORE_INDEX).all()
    assert ((b["labels"] != IGNORE_INDEX).sum(dim=1) >= 1).all()
    # No special token is ever a prediction target.
    assert not torch.isin(b["labels"], torch.tensor(tok.special_ids)).any()


def test_bert_masking_statistics(bert_data) -> None:
    tok = bert_data.tokenizer
    batches = [bert_data.train.get_batch(step, 64) for step in range(3)]  # 3 * 64 * 62 ordinary positions
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    selectable = (ids != tok.cls_id) & (ids != tok.sep_id) & (ids != tok.eos_id)
    selected = labels != IGNORE_INDEX
    n = int(selected.sum())
    assert 0.13 < n / int(selectable.sum()) < 0.17
    masked = (ids[selected] == tok.mask_id).float().mean().item()
    kept = (ids[selected] == labels[selected]).float().mean().item()
    randomized = 1.0 - masked - kept
    assert 0.77 < masked < 0.83 and 0.07 < kept < 0.13 and 0.07 < randomized < 0.13, (masked, kept, randomized)
    assert not (ids[~selected] == tok.mask_id).any()  # [MASK] only where a prediction is asked
    assert torch.equal(bert_data.train.get_batch(1, 64)["input_ids"], batches[1]["input_ids"])


def test_split_too_small_for_seq_len() -> None:
    with pytest.raises(ValueError, match=r"split has only \d+ tokens.*data\.seq_len"):
        build_data(config(seq_len=50_000), "gpt2")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="family"):
        build_data(config(), "t5")
    with pytest.raises(TypeError, match="Config"):
        build_data(DataConfig(), "gpt2")  # type: ignore[arg-type]


def test_get_batch_rejects_bad_step(gpt_data) -> None:
    with pytest.raises(ValueError, match="step"):
        gpt_data.train.get_batch(-1, 2)
    with pytest.raises(ValueError, match="batch_size"):
        gpt_data.train.get_batch(0, 0)


# ------------------------------------------------------------------------------ custom folder --


def write_corpus(folder: Path, n_files: int = 12) -> None:
    for i in range(n_files):
        sub = folder / ("pkg" if i % 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        lines = [f"def function_{i}_{j}(value):\n    return value * {j} + {i}  # note {j}\n" for j in range(60)]
        (sub / f"file_{i:02d}.py").write_text("".join(lines))
    (folder / "notes.md").write_text("# Notes\n\nPlain text works too. Ünïcödé as well.\n" * 20)
    (folder / "image.bin").write_bytes(bytes(range(256)) * 8)  # binary: skipped
    (folder / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))  # not UTF-8: skipped
    (folder / ".git").mkdir()
    (folder / ".git" / "config").write_text("hidden folders are skipped\n")


def test_custom_folder(tmp_path: Path) -> None:
    write_corpus(tmp_path / "corpus")
    cfg = config(path=str(tmp_path / "corpus"), vocab_size=300, seq_len=16)
    corpus = load_corpus(cfg.data)
    names = set(corpus.train) | set(corpus.val)
    assert "notes.md" in names and "pkg/file_01.py" in names and "file_00.py" in names
    assert not names & {"image.bin", "latin1.txt", ".git/config"}
    data = build_data(cfg, "gpt2")
    assert data.vocab_size == 300 and data.info["root"] == str((tmp_path / "corpus").resolve())
    assert data.train.get_batch(0, 2)["input_ids"].shape == (2, 16)
    assert data.val.get_batch(0, 2)["labels"].shape == (2, 16)


def test_single_file_folder(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "input.txt").write_text("".join(f"line {i} of a single text file\n" for i in range(400)))
    data = build_data(config(path=str(tmp_path / "one"), vocab_size=300, seq_len=16), "bert")
    assert data.train.n_tokens > data.val.n_tokens > 16


def test_unusable_folders_raise(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "blob.dat").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "file.xyz").write_text("a file of no known kind\n")
    cases = {
        "missing": "does not exist",
        "empty": "no readable UTF-8 text files",
        "binary": "no readable UTF-8 text files",
        "file.xyz": r"is a \.xyz file: graphtrain reads",
    }
    for name, message in cases.items():
        path = str(tmp_path / name)
        with pytest.raises(ValueError, match=message) as err:
            build_data(config(path=path), "gpt2")
        assert path in str(err.value) and "data.path" in str(err.value)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_batches_feed_the_reference_models(family: str) -> None:
    from graphtrain.config.sections import ModelConfig
    from graphtrain.models import build_model

    data = build_data(config(), family)
    torch.manual_seed(0)
    model = build_model(ModelConfig(name=f"{family}-tiny"), vocab_size=data.vocab_size)
    loss = model(**data.train.get_batch(0, 2))
    assert loss.dim() == 0 and abs(loss.item() - np.log(data.vocab_size)) < 1.0


def test_user_folders_keep_encodings_and_table_modules(tmp_path: Path) -> None:
    for rel in ("encodings/cp1252.py", "pydoc_data/topics.py", "stringprep.py", "main.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\nx = 1\n")
    _, files = list_files(DataConfig(path=str(tmp_path)))
    assert [f.relpath for f in files] == ["encodings/cp1252.py", "main.py", "pydoc_data/topics.py", "stringprep.py"]
