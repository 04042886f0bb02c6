"""#16: data.path as .jsonl/.parquet/.txt files (Hugging Face datasets), as memory-mapped .bin/.npy token arrays,
and data.tokenizer (a local Hugging Face tokenizer), with the tokenizer kept in every checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from graphtrain.config.sections import Config
from graphtrain.data import build_data

pytestmark = pytest.mark.usefixtures("tiny_env")
TEXTS = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 20 for i in range(60)]


def _config(**data) -> Config:
    return Config().with_overrides(
        {"data.vocab_size": 300, "data.seq_len": 16, **{f"data.{k}": v for k, v in data.items()}}
    )


def test_jsonl_and_parquet_rows_are_documents(tmp_path):
    datasets = pytest.importorskip("datasets")
    (tmp_path / "j").mkdir()
    with open(tmp_path / "j" / "a.jsonl", "w") as f:
        for t in TEXTS:
            f.write(json.dumps({"body": t, "n": 1}) + "\n")
    datasets.Dataset.from_dict({"body": TEXTS}).to_parquet(str(tmp_path / "rows.parquet"))
    a = build_data(_config(path=str(tmp_path / "j"), text_field="body"), "gpt2")
    b = build_data(_config(path=str(tmp_path / "rows.parquet"), text_field="body"), "gpt2")
    assert a.info["train_files"] + a.info["val_files"] == 60 and a.info["val_files"] >= 1
    # the same rows give the same corpus, whichever file format holds them
    assert a.info["bytes"] == b.info["bytes"] == sum(len(t) for t in TEXTS), (a.info, b.info)
    assert b.info["train_files"] + b.info["val_files"] == 60  # (which rows are held out hashes file#row)
    text = a.tokenizer.decode(a.train.get_batch(0, 1)["input_ids"][0].tolist())
    assert "return x *" in text


def test_a_single_txt_file_is_one_document(tmp_path):
    (tmp_path / "book.txt").write_text("".join(TEXTS))
    data = build_data(_config(path=str(tmp_path / "book.txt")), "gpt2")
    assert data.info["train_files"] == data.info["val_files"] == 1
    assert data.train.n_tokens > 10 * data.val.n_tokens > 0


def test_text_field_errors_name_the_fields(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "a.jsonl").write_text(json.dumps({"content": "x = 1\n" * 50}) + "\n")
    with pytest.raises(ValueError, match=r"no field 'text' \(its rows have 'content'\): set data.text_field"):
        build_data(_config(path=str(tmp_path / "a.jsonl")), "gpt2")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(ValueError, match="holds int, not text"):
        build_data(_config(path=str(tmp_path / "b.jsonl")), "gpt2")


def test_nanogpt_token_files_are_memory_mapped(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 300, 5000).astype(np.uint16), rng.integers(0, 300, 600).astype(np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    data = build_data(_config(path=str(tmp_path)), "gpt2")
    assert data.tokenizer is None and data.vocab_size == 300
    assert isinstance(data.train.shards[0], np.memmap) and data.train.n_tokens == 5000 and data.val.n_tokens == 600
    batch = data.train.get_batch(3, 4)
    for x, y in zip(batch["input_ids"], batch["labels"]):  # every window is a slice of train.bin
        window = torch.cat([x, y[-1:]]).numpy()
        hits = [s for s in np.flatnonzero(train == window[0]) if np.array_equal(train[s : s + 17], window)]
        assert hits
    assert torch.equal(batch["input_ids"], data.train.get_batch(3, 4)["input_ids"])


def test_several_shards_and_a_single_npy(tmp_path):
    (tmp_path / "s").mkdir()
    for i in range(3):
        np.save(tmp_path / "s" / f"shard_{i}.npy", np.full(400, i, dtype=np.int32))
    np.save(tmp_path / "s" / "shard_val.npy", np.full(100, 7, dtype=np.int32))
    data = build_data(_config(path=str(tmp_path / "s")), "gpt2")
    assert data.val.n_tokens == 100 and data.train.n_tokens == 1200
    firsts = {int(data.train.get_batch(step, 8)["input_ids"][r, 0]) for step in range(6) for r in range(8)}
    assert firsts == {0, 1, 2}  # windows come from every shard, never across one's end (rows are constant)
    rows = data.train.get_batch(0, 8)["input_ids"]
    assert all(len(set(r.tolist())) == 1 for r in rows)
    np.save(tmp_path / "one.npy", np.arange(1000, dtype=np.int64) % 300)
    one = build_data(_config(path=str(tmp_path / "one.npy")), "gpt2")
    assert one.train.n_tokens == 950 and one.val.n_tokens == 50  # the tail is validation


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    np.array([1, 2, 999] * 100, dtype=np.uint16).tofile(tmp_path / "tokens.bin")
    with pytest.raises(ValueError, match=r"holds token id 999, outside data.vocab_size=300: set data.vocab_size above"):
        build_data(_config(path=str(tmp_path / "tokens.bin")), "gpt2")
    with pytest.raises(ValueError, match="masked-LM batches need"):
        build_data(_config(path=str(tmp_path / "tokens.bin"), vocab_size=1000), "bert")


def test_users_tokenizer_and_its_errors(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        TEXTS,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "docs").mkdir()
    for i, t in enumerate(TEXTS):
        (tmp_path / "docs" / f"{i}.py").write_text(t)
    data = build_data(_config(path=str(tmp_path / "docs"), tokenizer=str(tmp_path)), "gpt2")
    assert data.tokenizer.eos_id == tok.token_to_id("</s>") and data.vocab_size == tok.get_vocab_size()
    assert data.train.get_batch(0, 2)["input_ids"].max() < tok.get_vocab_size()
    with pytest.raises(ValueError, match="masked-LM batches need .* has no mask, cls"):
        build_data(_config(path=str(tmp_path / "docs"), tokenizer=str(tmp_path)), "bert")
    with pytest.raises(ValueError, match="folder without tokenizer.json"):
        build_data(_config(path=str(tmp_path / "docs"), tokenizer=str(tmp_path / "docs")), "gpt2")
    with pytest.raises(ValueError, match="does not exist"):
        build_data(_config(tokenizer=str(tmp_path / "nope.json")), "gpt2")


def test_resume_refuses_another_tokenizer(tmp_path):
    """The checkpoint keeps the tokenizer; a resume that would tokenize differently (here: the corpus file changed,
    so the BPE trained on it changed) is refused with the fix, and the same data resumes."""
    from graphtrain import Trainer
    from graphtrain.trainer.checkpoint import checkpoint_tokenizer, latest_checkpoint

    (tmp_path / "docs").mkdir()
    for i, t in enumerate(TEXTS[:30]):
        (tmp_path / "docs" / f"{i}.py").write_text(t)
    items = [
        f"data.path={tmp_path / 'docs'}",
        "data.vocab_size=300",
        "data.seq_len=16",
        "model.name=gpt2-tiny",
        "train.batch_size=2",
        "train.steps=2",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.progress=false",
        "train.threads=1",
        "train.accelerate=false",
        "train.sample_tokens=0",
        "train.loggers=[jsonl]",
        f"train.out_dir={tmp_path / 'run'}",
    ]
    t = Trainer(Config().with_overrides(items))
    t.fit()
    assert checkpoint_tokenizer(latest_checkpoint(tmp_path / "run")).digest() == t.data.tokenizer.digest()
    more = Config().with_overrides([*items, "train.steps=3"])
    Trainer(more, resume=True, allow_config_change="train.steps").fit()  # same data: resumes
    (tmp_path / "docs" / "0.py").write_text("class Changed:\n    pass\n" * 40)
    with pytest.raises(ValueError, match="trained with another tokenizer"):
        Trainer(
            Config().with_overrides([*items, "train.steps=4"]), resume=True, allow_config_change="train.steps"
        ).fit()
