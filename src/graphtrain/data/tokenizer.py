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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from graphtrain.config.sections import DataConfig
from graphtrain.data.corpus import Corpus, SourceFile, list_files, load_corpus

EOS, PAD, MASK, CLS, SEP = "<|endoftext|>", "[PAD]", "[MASK]", "[CLS]", "[SEP]"
SPECIAL_TOKENS = [EOS, PAD, MASK, CLS, SEP]  # trained first, so their ids are 0..4
_CACHE_VERSION = 2  # bump when the cache format or the tokenization recipe changes


class CodeTokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` with ids for the special tokens.

    graphtrain's own tokenizers (trained here) hold all of SPECIAL_TOKENS. A user's tokenizer (`data.tokenizer`,
    `load_user_tokenizer`) passes `specials`, its own names for them; the ones it lacks are None (the batch maker
    says which objective needs which)."""

    def __init__(self, tokenizer: Tokenizer, specials: dict[str, str | None] | None = None) -> None:
        if specials is None:
            missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
            if missing:
                raise ValueError(f"tokenizer lacks the special tokens {missing}: train it with train_tokenizer()")
            specials = {"eos": EOS, "pad": PAD, "mask": MASK, "cls": CLS, "sep": SEP}
        self._tok = tokenizer
        self._digest: str | None = None
        self.specials = dict(specials)

        def tid(name: str) -> int | None:
            token = specials.get(name)
            return None if token is None else tokenizer.token_to_id(token)

        self.eos_id: int | None = tid("eos")
        self.pad_id: int | None = tid("pad")
        self.mask_id: int | None = tid("mask")
        self.cls_id: int | None = tid("cls")
        self.sep_id: int | None = tid("sep")

    def to_str(self) -> str:
        """The tokenizer's JSON (what checkpoints keep and compare on resume)."""
        return self._tok.to_str()

    def digest(self) -> str:
        """sha256 of `to_str()`, computed once (a CodeTokenizer does not change)."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.to_str().encode("utf-8")).hexdigest()
        return self._digest

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def special_ids(self) -> list[int]:
        return [i for i in (self.eos_id, self.pad_id, self.mask_id, self.cls_id, self.sep_id) if i is not None]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as one JSON file (atomically)."""
        _atomic_write(Path(path), lambda f: f.write(self._tok.to_str().encode("utf-8")))

    @classmethod
    def load(cls, path: str | Path, specials: dict[str, str | None] | None = None) -> CodeTokenizer:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file {str(path)!r} does not exist: pass a path written by CodeTokenizer.save")
        return cls(Tokenizer.from_file(str(path)), specials)

    def __repr__(self) -> str:
        return f"CodeTokenizer(vocab_size={self.vocab_size})"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> CodeTokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization, all 256 bytes in the alphabet)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return CodeTokenizer(tok)


# a user tokenizer's own names for the special tokens, when its tokenizer_config.json does not name them
_SPECIAL_CANDIDATES = {
    "eos": ("<|endoftext|>", "</s>", "<|end_of_text|>", "<|im_end|>", "[SEP]"),
    "pad": ("[PAD]", "<pad>", "<|pad|>"),
    "mask": ("[MASK]", "<mask>"),
    "cls": ("[CLS]", "<s>", "<|begin_of_text|>"),
    "sep": ("[SEP]", "</s>"),
}


def user_tokenizer_file(path: str) -> Path:
    """The tokenizer.json of `data.tokenizer` (a file, or a Hugging Face model/tokenizer folder)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
        if not p.is_file():
            raise ValueError(
                f"data.tokenizer {path!r} is a folder without tokenizer.json: point it at a Hugging Face "
                f"fast tokenizer (tokenizer.save_pretrained(folder) writes one) or at the tokenizer.json"
            )
    elif not p.is_file():
        raise ValueError(
            f"data.tokenizer {path!r} does not exist: point it at a tokenizer.json or a folder holding "
            f"one (nothing is downloaded, so hub names are not accepted)"
        )
    return p


def load_user_tokenizer(path: str) -> CodeTokenizer:
    """`data.tokenizer`: a Hugging Face fast tokenizer read from disk, its special tokens named by the
    tokenizer_config.json next to it (eos_token, mask_token, ...) or found under their usual names."""
    file = user_tokenizer_file(path)
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises plain Exception on a malformed file
        raise ValueError(
            f"data.tokenizer {str(file)!r} is not a tokenizers JSON file ({e}): save it with "
            f"tokenizer.save_pretrained(folder) or Tokenizer.save(path)"
        ) from None
    named: dict[str, str] = {}
    config_file = file.parent / "tokenizer_config.json"
    if config_file.is_file():
        try:
            raw = json.loads(config_file.read_text())
        except (ValueError, RecursionError):
            raw = {}
        if not isinstance(raw, dict):  # not a tokenizer config: its special tokens are found by name instead
            raw = {}
        for role in _SPECIAL_CANDIDATES:
            value = raw.get(f"{role}_token")
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str) and tok.token_to_id(value) is not None:
                named[role] = value
    specials: dict[str, str | None] = {}
    for role, candidates in _SPECIAL_CANDIDATES.items():
        specials[role] = named.get(role) or next((c for c in candidates if tok.token_to_id(c) is not None), None)
    return CodeTokenizer(tok, specials)


# ------------------------------------------------------------------------------------- cache --


def cache_root(cfg: DataConfig) -> Path:
    """`data.cache_dir`, else $GRAPHTRAIN_CACHE/data, else ~/.cache/graphtrain/data."""
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir).expanduser()
    root = os.environ.get("GRAPHTRAIN_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "graphtrain"
    return base / "data"


def usable_folder(folder: Path, key: str) -> Path:
    """`folder` created if needed and writable, else a ValueError naming `key` (the setting that chose it) and the
    fix: an unusable cache folder was an OSError, reported as a failed run to --resume."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise ValueError(
            f"{key} {str(folder)!r} cannot be used as a cache folder ({e.strerror or e}): point {key} "
            f"at a folder you can write"
        ) from None
    return folder


def cache_key(cfg: DataConfig, root: Path, files: list[SourceFile]) -> str:
    """Hash of everything the tokenizer and token ids depend on."""
    h = hashlib.sha256()
    h.update(str(root).encode() + b"\0")
    settings = {
        "version": _CACHE_VERSION,
        "vocab_size": cfg.vocab_size,
        "max_bytes": cfg.max_bytes,
        "val_fraction": cfg.val_fraction,
    }
    if cfg.text_field != "text":
        settings["text_field"] = cfg.text_field
    if cfg.tokenizer is not None:  # a user's tokenizer: its contents, not its size setting
        settings["tokenizer"] = hashlib.sha256(user_tokenizer_file(cfg.tokenizer).read_bytes()).hexdigest()
        del settings["vocab_size"]
    h.update(json.dumps(settings, sort_keys=True).encode())
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
    if meta.get("vocab_size") != vocab or (cfg.tokenizer is None and vocab > cfg.vocab_size):
        problems.append(f"its tokenizer has {vocab} tokens, data.vocab_size is {cfg.vocab_size}")
    top = max(int(cached.train.max(initial=0)), int(cached.val.max(initial=0)))
    if top >= vocab:
        problems.append(f"its token ids reach {top}, past its tokenizer's {vocab}")
    if problems:
        raise ValueError(
            f"the data cache {str(cached.cache_dir)!r} was built from another corpus "
            f"({'; '.join(problems)}): delete that folder (graphtrain builds it again) or set "
            f"data.cache_dir to an empty folder"
        )


def load_or_build(cfg: DataConfig) -> TokenizedCorpus:
    """The tokenizer and token ids of both splits, from the cache or built (then cached)."""
    root, files = list_files(cfg)
    key = cache_key(cfg, root, files)
    where = (
        "data.cache_dir"
        if cfg.cache_dir is not None
        else ("$GRAPHTRAIN_CACHE (or data.cache_dir)" if os.environ.get("GRAPHTRAIN_CACHE") else "data.cache_dir")
    )
    folder = usable_folder(cache_root(cfg), where) / key
    meta_path = folder / "meta.json"
    if meta_path.is_file():  # meta.json is written last: its presence means the folder is complete
        try:
            tok = (
                load_user_tokenizer(cfg.tokenizer)
                if cfg.tokenizer is not None
                else CodeTokenizer.load(folder / "tokenizer.json")
            )
            cached = TokenizedCorpus(
                tokenizer=tok,
                train=np.load(folder / "train.npy", mmap_mode="r"),
                val=np.load(folder / "val.npy", mmap_mode="r"),
                cache_dir=folder,
                from_cache=True,
                stats=json.loads(meta_path.read_text()),
            )
        except Exception:  # tokenizers raises plain Exception; any unreadable cache is rebuilt
            cached = None
        if cached is not None:
            _check_cache_is_this_corpus(cached, cfg, root, key)
            return cached

    t0 = time.perf_counter()
    corpus: Corpus = load_corpus(cfg, files=(root, files))
    t1 = time.perf_counter()
    tokenizer = (
        load_user_tokenizer(cfg.tokenizer)
        if cfg.tokenizer is not None
        else train_tokenizer(corpus.train.values(), cfg.vocab_size)
    )
    if tokenizer.eos_id is None:
        raise ValueError(
            f"data.tokenizer {cfg.tokenizer!r} has no end-of-text token (</s>, <|endoftext|>, [SEP], or "
            f"tokenizer_config.json's eos_token) to put between documents: add one to the tokenizer"
        )
    t2 = time.perf_counter()
    train_ids, val_ids = encode_split(tokenizer, corpus.train), encode_split(tokenizer, corpus.val)
    t3 = time.perf_counter()
    stats = {
        "key": key,
        "root": str(root),
        "train_files": len(corpus.train),
        "val_files": len(corpus.val),
        "bytes": corpus.n_bytes,
        "vocab_size": tokenizer.vocab_size,
        "train_tokens": int(train_ids.size),
        "val_tokens": int(val_ids.size),
        "read_s": round(t1 - t0, 3),
        "tokenizer_train_s": round(t2 - t1, 3),
        "encode_s": round(t3 - t2, 3),
    }

    tokenizer.save(folder / "tokenizer.json")
    _atomic_write(folder / "train.npy", lambda f: np.save(f, train_ids))
    _atomic_write(folder / "val.npy", lambda f: np.save(f, val_ids))
    _atomic_write(meta_path, lambda f: f.write(json.dumps(stats, indent=1).encode()))
    # the token ids as a warm start maps them, from the files just written (the arrays above die with this call):
    # pages of the page cache, read as the batches need them, not a copy of every id on the heap for the whole run
    return TokenizedCorpus(
        tokenizer=tokenizer,
        train=np.load(folder / "train.npy", mmap_mode="r"),
        val=np.load(folder / "val.npy", mmap_mode="r"),
        cache_dir=folder,
        from_cache=False,
        stats=stats,
    )
