"""The training text: the Python standard library's own source by default, or a folder of files.

Files are taken in sorted relative-path order and read up to `data.max_bytes`. The train/val
split is by a stable hash (SHA-1) of each file's relative path, so it never changes between
runs or machines, and a file is wholly in one split.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from graphtrain.config import DataConfig

# Folders never worth reading in a user's tree (version control, caches, virtual environments).
_SKIP_DIRS = {".git", ".hg", ".svn", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache",
              ".pytest_cache", ".tox", "site-packages", "dist-packages"}


# Default corpus only: stdlib modules that are generated data tables rather than code. `encodings/`
# alone (cp*.py / mac_*.py codec tables) is ~1.4 MB of the first 8 MB in path order, so a model
# trained on it completes `def ` with table rows. User folders (data.path) are never filtered.
_STDLIB_SKIP_DIRS = {"encodings", "pydoc_data"}  # relative to the stdlib root
_STDLIB_SKIP_FILES = {"stringprep.py", "html/entities.py", "re/_casefix.py"}


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # posix-style, relative to the corpus root
    path: Path
    size: int
    mtime_ns: int


@dataclass
class Corpus:
    """Documents (relative path -> text) of each split; `root` is the folder they came from."""

    root: Path
    train: dict[str, str]
    val: dict[str, str]

    @property
    def n_bytes(self) -> int:
        return sum(len(t.encode()) for t in (*self.train.values(), *self.val.values()))


def default_root() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_root(cfg: DataConfig) -> Path:
    """`data.path` checked to be a folder, or the standard library when it is unset."""
    if cfg.path is None:
        return default_root()
    root = Path(cfg.path).expanduser()
    if not root.exists():
        raise ValueError(f"data.path {cfg.path!r} does not exist: point data.path at a folder of text or code "
                         f"files, or leave it unset to train on the Python standard library")
    if not root.is_dir():
        raise ValueError(f"data.path {cfg.path!r} is a file, not a folder: put the file(s) in a folder and set "
                         f"data.path to that folder")
    return root.resolve()


def list_files(cfg: DataConfig) -> tuple[Path, list[SourceFile]]:
    """Candidate files in sorted relative-path order, with their size and mtime (no reading yet).

    Default corpus: the stdlib's *.py files outside site-packages and the generated table modules
    (`encodings/`, `pydoc_data/`, stringprep, html.entities, re._casefix). Custom folder: every file
    outside hidden and cache folders; binary and non-UTF-8 files are dropped when read.
    """
    root = corpus_root(cfg)
    default = cfg.path is None
    found: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and (default or not d.startswith("."))]
        if default and Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if default and not name.endswith(".py"):
                continue
            if not default and name.startswith("."):
                continue
            path = Path(dirpath) / name
            try:
                st = path.stat()
            except OSError:
                continue
            if not path.is_file():
                continue
            relpath = path.relative_to(root).as_posix()
            if default and relpath in _STDLIB_SKIP_FILES:
                continue
            found.append(SourceFile(relpath, path, st.st_size, st.st_mtime_ns))
    found.sort(key=lambda f: f.relpath)
    return root, found


def _read_text(path: Path, limit: int | None) -> str | None:
    """The file's text (at most `limit` bytes, cut at a character boundary), or None if not UTF-8 text."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if limit is not None and len(raw) > limit:
        text = raw[:limit].decode("utf-8", errors="ignore")
    return text


def read_files(files: list[SourceFile], max_bytes: int | None) -> dict[str, str]:
    """Texts of `files` in order until `max_bytes` bytes are read (the last file may be cut)."""
    docs: dict[str, str] = {}
    remaining = max_bytes
    for f in files:
        if remaining is not None and remaining <= 0:
            break
        text = _read_text(f.path, remaining)
        if not text:
            continue
        docs[f.relpath] = text
        if remaining is not None:
            remaining -= len(text.encode("utf-8"))
    return docs


def split_score(relpath: str) -> float:
    """A number in [0, 1) fixed by the relative path alone (SHA-1, never Python's salted hash())."""
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_documents(docs: dict[str, str], val_fraction: float) -> tuple[dict[str, str], dict[str, str]]:
    """Files with split_score < val_fraction go to val; both splits are guaranteed non-empty.

    With a single document, its last `val_fraction` (cut at a line break) is held out instead.
    """
    if not docs:
        raise ValueError("no documents to split")
    if len(docs) == 1:
        (name, text), = docs.items()
        cut = int(len(text) * (1.0 - val_fraction))
        newline = text.rfind("\n", 0, cut)
        cut = newline + 1 if newline > 0 else cut
        return {name: text[:cut]}, {name + "#val": text[cut:]}
    scores = {name: split_score(name) for name in docs}
    val_names = {n for n, s in scores.items() if s < val_fraction}
    if not val_names:
        # Nothing hashed into val (a small corpus): hold out the lowest-scoring file that is not
        # much bigger than the val share, so val never swallows a large part of a small corpus.
        budget = 2 * val_fraction * sum(len(t) for t in docs.values())
        fits = [n for n in docs if len(docs[n]) <= budget]
        val_names = {min(fits, key=scores.__getitem__) if fits else min(docs, key=lambda n: len(docs[n]))}
    if len(val_names) == len(docs):
        val_names.discard(max(val_names, key=scores.__getitem__))
    train = {n: t for n, t in docs.items() if n not in val_names}
    val = {n: t for n, t in docs.items() if n in val_names}
    return train, val


def load_corpus(cfg: DataConfig, files: tuple[Path, list[SourceFile]] | None = None) -> Corpus:
    """Read and split the corpus described by `cfg` (pass `files` from `list_files` to skip the walk)."""
    root, candidates = files if files is not None else list_files(cfg)
    docs = read_files(candidates, cfg.max_bytes)
    if not docs:
        where = f"data.path {cfg.path!r}" if cfg.path is not None else f"the standard library at {str(root)!r}"
        raise ValueError(f"{where} holds no readable UTF-8 text files: point data.path at a folder of text or "
                         f"code files (binary and non-UTF-8 files are skipped)")
    train, val = split_documents(docs, cfg.val_fraction)
    return Corpus(root=root, train=train, val=val)
