"""The training text: the Python standard library's own source by default, or a folder of files.

Files are taken in sorted relative-path order and read up to `data.max_bytes`. The train/val
split is by a stable hash (SHA-1) of each file's relative path, so it never changes between
runs or machines, and a file is wholly in one split.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from graphtrain.config.sections import DataConfig

# Folders never worth reading in a user's tree (version control, caches, virtual environments).
_SKIP_DIRS = {
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    ".venv",
    "venv",
    "node_modules",
    ".mypy_cache",
    ".pytest_cache",
    ".tox",
    "site-packages",
    "dist-packages",
}


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


# data.path kinds: a folder of text files (or one text file) is read as documents; .jsonl/.json/.parquet files
# (one, or a folder of them) are read with Hugging Face `datasets`, one document per row's data.text_field; .bin/.npy
# token arrays (data/shards.py) are memory-mapped, not tokenized.
DATASET_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
TOKEN_SUFFIXES = (".bin", ".npy")


def source_kind(cfg: DataConfig, paths: list[Path] | None = None) -> str:
    """What data.path holds: "files" (text files; the default corpus), "dataset" (rows of .jsonl/.json/.parquet
    files, or one .txt file) or "tokens" (pre-tokenized .bin/.npy arrays). `paths`: the folder's files when the
    caller has listed them already (else it is walked)."""
    if cfg.path is None:
        return "files"
    p = Path(cfg.path).expanduser()
    if p.is_file():
        if p.suffix in TOKEN_SUFFIXES:
            return "tokens"
        if p.suffix in DATASET_BUILDERS:
            return "dataset"
        raise ValueError(
            f"data.path {cfg.path!r} is a {p.suffix or 'suffix-less'} file: graphtrain reads a folder of "
            f"text files, a .txt, .jsonl, .json or .parquet file (or a folder of them), or .bin/.npy token "
            f"arrays; rename the file or put it in a folder"
        )
    suffixes = {f.suffix for f in (paths if paths is not None else walk_files(corpus_root(cfg), default=False))}
    if suffixes and suffixes <= set(TOKEN_SUFFIXES):
        return "tokens"
    if suffixes and suffixes <= {".jsonl", ".json", ".parquet"}:
        return "dataset"
    return "files"


def is_run_folder(folder: Path) -> bool:
    """Whether `folder` is a graphtrain run folder (a train.out_dir): it holds the run's config.yaml and
    metrics.jsonl, or its lock. Never read as data: a run folder inside data.path fed the run's own checkpoints and
    metrics into its corpus, which then changed with every save, and each `--resume auto` was refused as "another
    tokenizer"."""
    return (folder / ".graphtrain.lock").is_file() or (
        (folder / "metrics.jsonl").is_file() and (folder / "config.yaml").is_file()
    )


def walk_files(root: Path, default: bool) -> list[Path]:
    """Files under `root` outside version-control, cache, run (is_run_folder) and (but for the default corpus)
    hidden folders."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if is_run_folder(Path(dirpath)):
            dirnames[:] = []
            continue
        dirnames[:] = [
            d
            for d in dirnames
            if d not in _SKIP_DIRS and (default or not d.startswith(".")) and not is_run_folder(Path(dirpath) / d)
        ]
        if default and Path(dirpath) == root:
            dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for name in filenames:
            if (default and not name.endswith(".py")) or (not default and name.startswith(".")):
                continue
            found.append(Path(dirpath) / name)
    return found


def default_root() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_root(cfg: DataConfig) -> Path:
    """`data.path` checked to be a folder, or the standard library when it is unset."""
    if cfg.path is None:
        return default_root()
    root = Path(cfg.path).expanduser()
    if not root.exists():
        raise ValueError(
            f"data.path {cfg.path!r} does not exist: point data.path at a folder of text or code "
            f"files, or leave it unset to train on the Python standard library"
        )
    if root.is_file():
        return root.parent.resolve()
    return root.resolve()


def list_files(cfg: DataConfig) -> tuple[Path, list[SourceFile]]:
    """Candidate files in sorted relative-path order, with their size and mtime (no reading yet).

    Default corpus: the stdlib's *.py files outside site-packages and the generated table modules
    (`encodings/`, `pydoc_data/`, stringprep, html.entities, re._casefix). Custom folder: every file
    outside hidden and cache folders; binary and non-UTF-8 files are dropped when read.
    """
    root = corpus_root(cfg)
    default = cfg.path is None
    single = cfg.path is not None and Path(cfg.path).expanduser().is_file()
    paths = [Path(cfg.path).expanduser().resolve()] if single else walk_files(root, default)
    found: list[SourceFile] = []
    for path in paths:
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
    """The file's text (at most `limit` bytes, cut at a character boundary), or None if not UTF-8 text. Only what
    is kept is read: the file was once read whole before the cut (a 2 GB file under data.max_bytes=20000 took the
    peak from 0.5 GB to 2.4 GB); a file is judged text by that part."""
    try:
        with open(path, "rb") as f:
            raw = f.read() if limit is None else f.read(limit)
            cut = limit is not None and len(raw) == limit and f.read(1) != b""
    except OSError:
        return None
    if b"\x00" in raw:
        return None
    try:  # a character the cut splits is dropped, an invalid byte before it refuses the file
        return codecs.getincrementaldecoder("utf-8")().decode(raw, final=not cut)
    except UnicodeDecodeError:
        return None


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
        ((name, text),) = docs.items()
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


def read_rows(files: list[SourceFile], text_field: str, max_bytes: int | None) -> dict[str, str]:
    """Documents from .jsonl/.json/.parquet rows (their `text_field`) or whole .txt files, read with Hugging Face
    `datasets` (streamed: nothing beyond `max_bytes` is read, no Arrow cache is written), keyed file#row."""
    try:
        import datasets
    except ImportError:
        raise ValueError(
            "data.path names .jsonl/.json/.parquet/.txt files, which graphtrain reads with Hugging Face "
            "datasets: pip install 'graphtrain[data]'"
        ) from None
    datasets.disable_progress_bars()
    docs: dict[str, str] = {}
    remaining = max_bytes
    for f in files:
        builder = DATASET_BUILDERS[f.path.suffix]
        extra = {"sample_by": "document"} if builder == "text" else {}
        try:
            rows = datasets.load_dataset(builder, data_files=str(f.path), split="train", streaming=True, **extra)
            field = "text" if builder == "text" else text_field
            for i, row in enumerate(rows):
                if field not in row:
                    raise ValueError(
                        f"{str(f.path)!r} has no field {field!r} (its rows have "
                        f"{', '.join(map(repr, row)) or 'no fields'}): set data.text_field to the field "
                        f"holding the text"
                    )
                text = row[field]
                if not isinstance(text, str):
                    raise ValueError(
                        f"{str(f.path)!r} row {i}: field {field!r} holds {type(text).__name__}, not text: "
                        f"set data.text_field to a field of strings"
                    )
                if not text:
                    continue
                if remaining is not None:
                    raw = text.encode("utf-8")[:remaining]
                    text = raw.decode("utf-8", errors="ignore")  # cut at a character boundary
                    remaining -= len(raw)
                docs[f"{f.relpath}#{i}"] = text
                if remaining is not None and remaining <= 0:
                    return docs
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - pyarrow/json errors: name the file and the reader
            raise ValueError(
                f"data.path: {str(f.path)!r} could not be read as {builder} "
                f"({type(e).__name__}: {str(e).splitlines()[0][:300]}): fix the file or remove it"
            ) from None
    return docs


def load_corpus(cfg: DataConfig, files: tuple[Path, list[SourceFile]] | None = None) -> Corpus:
    """Read and split the corpus described by `cfg` (pass `files` from `list_files` to skip the walk)."""
    root, candidates = files if files is not None else list_files(cfg)
    if source_kind(cfg, [f.path for f in candidates]) == "dataset":
        docs = read_rows(candidates, cfg.text_field, cfg.max_bytes)
        if not docs:
            raise ValueError(
                f"data.path {cfg.path!r} holds no non-empty {cfg.text_field!r} text: point it at files "
                f"with text rows, or set data.text_field"
            )
        train, val = split_documents(docs, cfg.val_fraction)
        return Corpus(root=root, train=train, val=val)
    docs = read_files(candidates, cfg.max_bytes)
    if not docs:
        where = f"data.path {cfg.path!r}" if cfg.path is not None else f"the standard library at {str(root)!r}"
        raise ValueError(
            f"{where} holds no readable UTF-8 text files: point data.path at a folder of text or "
            f"code files (binary and non-UTF-8 files are skipped)"
        )
    train, val = split_documents(docs, cfg.val_fraction)
    return Corpus(root=root, train=train, val=val)
