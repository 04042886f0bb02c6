"""Pre-tokenized data: `.bin` / `.npy` token arrays, memory-mapped (the corpus never loads into RAM).

    data.path: data/openwebtext          # a folder with train.bin and val.bin (nanoGPT's prepare.py writes them)
    data.path: shards/                   # several shards: names holding "val" are validation, the rest train
    data.path: tokens.npy                # one array: its last data.val_fraction is validation

`.bin` files are raw uint16 token ids (nanoGPT's format); `.npy` files carry their own dtype (any integer type).
The vocabulary is `data.tokenizer`'s when given (the tokenizer also decodes samples and supplies masked-LM
specials), else `data.vocab_size`; every id is checked to be below it, streaming over each array once per
version of the file (its largest id is remembered in the data cache, keyed by path, size and modification time).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphtrain.config.sections import DataConfig
from graphtrain.data.corpus import TOKEN_SUFFIXES, corpus_root, split_score, walk_files
from graphtrain.data.tokenizer import CodeTokenizer, _atomic_write, cache_root

_CHUNK = 1 << 24  # ids scanned at a time for the vocabulary check


@dataclass
class TokenShards:
    train: list[np.ndarray]
    val: list[np.ndarray]
    tokenizer: CodeTokenizer | None
    vocab_size: int
    info: dict


def open_array(path: Path) -> np.ndarray:
    """A read-only memory map of one token file."""
    try:
        arr = np.load(path, mmap_mode="r") if path.suffix == ".npy" else np.memmap(path, dtype=np.uint16, mode="r")
    except (OSError, ValueError) as e:
        raise ValueError(
            f"data.path: {str(path)!r} is not a token array ({e}): .bin files hold raw uint16 ids, "
            f".npy files are written by numpy.save"
        ) from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"data.path: {str(path)!r} holds a {arr.dtype} array of shape {arr.shape}: token files must "
            f"be flat arrays of integer ids"
        )
    return arr


def _id_range(cfg: DataConfig, path: Path, arr: np.ndarray) -> tuple[int, int]:
    """The smallest and largest id in `arr`: scanned in chunks the first time, then read from the data cache while
    the file's size and modification time stay the same (a corpus of many GB is not re-read at every start)."""
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:20]
    memo = cache_root(cfg) / "token-max" / f"{key}.json"
    try:
        d = json.loads(memo.read_text())
        return int(d["min_id"]), int(d["max_id"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # absent or not ours: scanned again
        pass
    chunks = [arr[i : i + _CHUNK] for i in range(0, arr.shape[0], _CHUNK)]
    low = min((int(c.min()) for c in chunks), default=0)
    top = max((int(c.max()) for c in chunks), default=-1)
    _atomic_write(memo, lambda f: f.write(json.dumps({"path": str(path), "min_id": low, "max_id": top}).encode()))
    return low, top


def load_token_shards(cfg: DataConfig, tokenizer: CodeTokenizer | None) -> TokenShards:
    root = corpus_root(cfg)
    given = Path(cfg.path).expanduser()
    files = (
        [given.resolve()]
        if given.is_file()
        else sorted(p for p in walk_files(root, default=False) if p.suffix in TOKEN_SUFFIXES)
    )
    arrays = {f: open_array(f) for f in files}
    vocab = tokenizer.vocab_size if tokenizer is not None else cfg.vocab_size
    for f, arr in arrays.items():
        low, top = _id_range(cfg, f, arr)
        if low < 0:  # a negative id indexes the embedding from its end, or fails the step with a traceback
            raise ValueError(
                f"data.path: {str(f)!r} holds token id {low}: token ids are 0 or more; rewrite the file "
                f"with the tokenizer's ids (a signed dtype that wrapped around is a common cause)"
            )
        if top >= vocab:
            where = f"data.tokenizer's vocabulary ({vocab})" if tokenizer is not None else f"data.vocab_size={vocab}"
            raise ValueError(
                f"data.path: {str(f)!r} holds token id {top}, outside {where}: set data.vocab_size above "
                f"{top} (or data.tokenizer to the tokenizer that made the ids)"
            )
    if len(files) == 1:  # one array: its tail is validation
        arr = arrays[files[0]]
        cut = int(arr.shape[0] * (1.0 - cfg.val_fraction))
        train, val = [arr[:cut]], [arr[cut:]]
    else:
        val_files = [f for f in files if "val" in f.stem.lower()]
        if not val_files:  # no names say: hold out shards by their path's hash, as documents are
            rel = {f: f.relative_to(root).as_posix() for f in files}
            val_files = [min(files, key=lambda f: split_score(rel[f]))]
        train = [arrays[f] for f in files if f not in val_files]
        val = [arrays[f] for f in val_files]
        if not train:
            raise ValueError(
                f"data.path {cfg.path!r}: every token file's name says val; name the training ones "
                f"train.bin / train.npy"
            )
    info = {
        "root": str(root),
        "token_files": [str(f) for f in files],
        "train_tokens": int(sum(a.shape[0] for a in train)),
        "val_tokens": int(sum(a.shape[0] for a in val)),
        "vocab_size": vocab,
        "memory_mapped": True,
    }
    return TokenShards(train=train, val=val, tokenizer=tokenizer, vocab_size=vocab, info=info)
