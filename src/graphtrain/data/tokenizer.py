"""A byte-level BPE tokenizer trained locally on the corpus, and the on-disk cache of token ids.

Nothing is downloaded: the tokenizer is trained with Hugging Face `tokenizers` on the train split.
The tokenizer and both splits' token ids are cached under `data.cache_dir` (default
``$GRAPHTRAIN_CACHE/data`` or ``~/.cache/graphtrain/data``), in a folder named by a hash of
everything they depend on: the file list with sizes and mtimes, vocab_size, max_bytes and
val_fraction. Every file is written atomically (tmp file + os.replace), so concurrent processes
building the same cache never read half a file.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from graphtrain.config import DataConfig
from graphtrain.data.corpus import Corpus, SourceFile, list_files, load_corpus

EOS, PAD, MASK, CLS, SEP = "<|endoftext|>", "[PAD]", "[MASK]", "[CLS]", "[SEP]"
SPECIAL_TOKENS = [EOS, PAD, MASK, CLS, SEP]  # trained first, so their ids are 0..4
_CACHE_VERSION = 2  # bump when the cache format or the tokenization recipe changes


class CodeTokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` with ids for the special tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks the special tokens {missing}: train it with train_tokenizer()")
        self._tok = tokenizer
        self.eos_id: int = tokenizer.token_to_id(EOS)
        self.pad_id: int = tokenizer.token_to_id(PAD)
        self.mask_id: int = tokenizer.token_to_id(MASK)
        self.cls_id: int = tokenizer.token_to_id(CLS)
        self.sep_id: int = tokenizer.token_to_id(SEP)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def special_ids(self) -> list[int]:
        return [self.eos_id, self.pad_id, self.mask_id, self.cls_id, self.sep_id]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as one JSON file (atomically)."""
        _atomic_write(Path(path), lambda f: f.write(self._tok.to_str().encode("utf-8")))

    @classmethod
    def load(cls, path: str | Path) -> "CodeTokenizer":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist: pass a path written by CodeTokenizer.save")
        return cls(Tokenizer.from_file(str(path)))

    def __repr__(self) -> str:
        return f"CodeTokenizer(vocab_size={self.vocab_size})"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> CodeTokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization, all 256 bytes in the alphabet)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return CodeTokenizer(tok)


# ------------------------------------------------------------------------------------- cache --

def cache_root(cfg: DataConfig) -> Path:
    """`data.cache_dir`, else $GRAPHTRAIN_CACHE/data, else ~/.cache/graphtrain/data."""
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir).expanduser()
    root = os.environ.get("GRAPHTRAIN_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "graphtrain"
    return base / "data"


def cache_key(cfg: DataConfig, root: Path, files: list[SourceFile]) -> str:
    """Hash of everything the tokenizer and token ids depend on."""
    h = hashlib.sha256()
    h.update(str(root).encode() + b"\0")
    h.update(json.dumps({"version": _CACHE_VERSION, "vocab_size": cfg.vocab_size, "max_bytes": cfg.max_bytes,
                         "val_fraction": cfg.val_fraction}, sort_keys=True).encode())
    for f in files:
        h.update(f"{f.relpath}\0{f.size}\0{f.mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def _atomic_write(path: Path, write: Callable) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _token_dtype(vocab_size: int) -> type:
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def encode_split(tokenizer: CodeTokenizer, docs: dict[str, str]) -> np.ndarray:
    """All documents' ids, each followed by <|endoftext|>, as one flat array."""
    ids: list[int] = []
    for doc_ids in tokenizer.encode_batch(list(docs.values())):
        ids.extend(doc_ids)
        ids.append(tokenizer.eos_id)
    return np.asarray(ids, dtype=_token_dtype(tokenizer.vocab_size))


@dataclass
class TokenizedCorpus:
    tokenizer: CodeTokenizer
    train: np.ndarray  # flat token ids, uint16 (or int32 for vocabularies over 65536)
    val: np.ndarray
    cache_dir: Path
    from_cache: bool
    stats: dict  # sizes and timings of the build (or of the build that made the cache)


def _check_cache_is_this_corpus(cached: TokenizedCorpus, cfg: DataConfig, root: Path, key: str) -> None:
    """A cache folder is named by the hash of its corpus; refuse one whose contents say otherwise (copied from
    another run or machine, or edited): training on another corpus's token ids would silently mix runs."""
    meta, vocab = cached.stats, cached.tokenizer.vocab_size
    problems = []
    if meta.get("key", key) != key:
        problems.append(f"its key is {meta.get('key')}, this corpus's {key}")
    if meta.get("root") != str(root):
        problems.append(f"built from {meta.get('root')!r}, not {str(root)!r}")
    if meta.get("vocab_size") != vocab or vocab > cfg.vocab_size:
        problems.append(f"its tokenizer has {vocab} tokens, data.vocab_size is {cfg.vocab_size}")
    top = max(int(cached.train.max(initial=0)), int(cached.val.max(initial=0)))
    if top >= vocab:
        problems.append(f"its token ids reach {top}, past its tokenizer's {vocab}")
    if problems:
        raise ValueError(f"the data cache {str(cached.cache_dir)!r} was built from another corpus "
                         f"({'; '.join(problems)}): delete that folder (graphtrain builds it again) or set "
                         f"data.cache_dir to an empty folder")


def load_or_build(cfg: DataConfig) -> TokenizedCorpus:
    """The tokenizer and token ids of both splits, from the cache or built (then cached)."""
    root, files = list_files(cfg)
    key = cache_key(cfg, root, files)
    folder = cache_root(cfg) / key
    meta_path = folder / "meta.json"
    if meta_path.is_file():  # meta.json is written last: its presence means the folder is complete
        try:
            cached = TokenizedCorpus(tokenizer=CodeTokenizer.load(folder / "tokenizer.json"),
                                     train=np.load(folder / "train.npy"), val=np.load(folder / "val.npy"),
                                     cache_dir=folder, from_cache=True, stats=json.loads(meta_path.read_text()))
        except Exception:  # tokenizers raises plain Exception; any unreadable cache is rebuilt
            cached = None
        if cached is not None:
            _check_cache_is_this_corpus(cached, cfg, root, key)
            return cached

    t0 = time.perf_counter()
    corpus: Corpus = load_corpus(cfg, files=(root, files))
    t1 = time.perf_counter()
    tokenizer = train_tokenizer(corpus.train.values(), cfg.vocab_size)
    t2 = time.perf_counter()
    train_ids, val_ids = encode_split(tokenizer, corpus.train), encode_split(tokenizer, corpus.val)
    t3 = time.perf_counter()
    stats = {"key": key, "root": str(root), "train_files": len(corpus.train), "val_files": len(corpus.val),
             "bytes": corpus.n_bytes, "vocab_size": tokenizer.vocab_size, "train_tokens": int(train_ids.size),
             "val_tokens": int(val_ids.size), "read_s": round(t1 - t0, 3), "tokenizer_train_s": round(t2 - t1, 3),
             "encode_s": round(t3 - t2, 3)}

    tokenizer.save(folder / "tokenizer.json")
    _atomic_write(folder / "train.npy", lambda f: np.save(f, train_ids))
    _atomic_write(folder / "val.npy", lambda f: np.save(f, val_ids))
    _atomic_write(meta_path, lambda f: f.write(json.dumps(stats, indent=1).encode()))
    return TokenizedCorpus(tokenizer=tokenizer, train=train_ids, val=val_ids, cache_dir=folder,
                           from_cache=False, stats=stats)
