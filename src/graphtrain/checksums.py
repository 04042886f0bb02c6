"""SHA-256 checksum files for checkpoints, in `sha256sum` format, so `sha256sum -c FILE` checks them by hand.

    out_dir/ckpt-0000100.pt.sha256     beside a checkpoint file: "<64 hex digits>  ckpt-0000100.pt"
    out_dir/ckpt-0000100/SHA256SUMS    inside a sharded folder: one line per file, paths relative to the folder

A checksum file names the file it describes, and a file is held to the line of its own name
(`verify_file`): a checksum file copied from another checkpoint, which names that one, verifies nothing.

A checksum file is written atomically (temporary file, fsync, rename) before the checkpoint it describes
becomes visible, so a visible checkpoint always has one. While a file is replaced under the same name,
its checksum file lists the old and the new digest; a name may therefore have several lines, and a file
verifies when its digest is any of them.

Standard library only (hashlib): the trainer's single-file checkpoints and the distributed layer's
sharded folders share it, so it lives at the bottom of the layers.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from pathlib import Path

SUMS_NAME = "SHA256SUMS"  # inside a sharded checkpoint folder
SIDECAR_SUFFIX = ".sha256"  # beside a checkpoint file
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")

# Inside `digests_reused()`: (device, inode, size, mtime in ns) -> digest. Off elsewhere: an mtime has the
# resolution of the kernel's clock tick, so a file rewritten in place within a tick could look unchanged.
_digests: dict[tuple[int, int, int, int], str] | None = None


class ChecksumMismatch(ValueError):
    """A file differs from its recorded digest, is missing, or the checksum file itself is malformed."""

    def __init__(self, file: Path, reason: str) -> None:
        super().__init__(reason)
        self.file = file


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes."""
    if _digests is not None:
        st = os.stat(path)
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in _digests:
            _digests[key] = _hash(path)
        return _digests[key]
    return _hash(path)


def _hash(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextlib.contextmanager
def digests_reused():
    """Within this block each file is read and hashed once: resuming verifies the checkpoint it picks, then
    reads its metadata, then loads it (a few seconds, during which nothing else writes the run folder)."""
    global _digests
    outer = _digests
    _digests = {} if outer is None else outer
    try:
        yield
    finally:
        _digests = outer


def sidecar_path(path: str | os.PathLike) -> Path:
    """The checksum file of checkpoint file `path`."""
    path = Path(path)
    return path.with_name(path.name + SIDECAR_SUFFIX)


def write_sums(path: str | os.PathLike, entries: list[tuple[str, str]]) -> Path:
    """Write (name, digest) lines to `path` atomically and durably (mode 0644)."""
    path = Path(path)
    text = "".join(f"{digest}  {name}\n" for name, digest in entries)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_sums(path: str | os.PathLike) -> dict[str, set[str]]:
    """name -> the digests recorded for it. Raises ChecksumMismatch on a malformed line or unsafe name."""
    path = Path(path)
    out: dict[str, set[str]] = {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ChecksumMismatch(path, f"its checksum file {path.name} cannot be read ({type(e).__name__})") from None
    for number, line in enumerate(lines, 1):
        m = _LINE.match(line)
        name = m.group(2) if m else ""
        if not m or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ChecksumMismatch(path, f"its checksum file {path.name} is malformed at line {number}")
        out.setdefault(name, set()).add(m.group(1))
    if not out:
        raise ChecksumMismatch(path, f"its checksum file {path.name} is empty")
    return out


def verify_sums(path: str | os.PathLike, base: str | os.PathLike) -> list[str]:
    """Check every file `path` lists (relative to `base`); returns their names. Raises ChecksumMismatch naming
    the first file that is missing or differs."""
    path, base = Path(path), Path(base)
    sums = read_sums(path)
    for name, digests in sums.items():
        file = base / name
        if not file.is_file():
            raise ChecksumMismatch(file, f"{name} is missing (listed in {path.name})")
        got = sha256_file(file)
        if got not in digests:
            want = " or ".join(d[:16] for d in sorted(digests))
            raise ChecksumMismatch(
                file,
                f"{name} has SHA-256 {got[:16]}..., {path.name} records {want}... "
                f"(the file was truncated or changed after it was written)",
            )
    return list(sums)


def verify_file(sums_path: str | os.PathLike, file: str | os.PathLike) -> None:
    """Check one file against the checksum file beside it (`<file>.sha256`). Only the line(s) naming `file` count: a
    checksum file that names other files only (copied from another checkpoint) is refused, naming what it
    describes. Raises ChecksumMismatch."""
    sums_path, file = Path(sums_path), Path(file)
    sums = read_sums(sums_path)
    digests = {d for name, ds in sums.items() if Path(name) == Path(file.name) for d in ds}
    if not digests:
        named = ", ".join(sorted(sums))
        raise ChecksumMismatch(
            file,
            f"its checksum file {sums_path.name} describes {named}, not {file.name} (copied "
            f"from another checkpoint?), so it proves nothing about this file",
        )
    got = sha256_file(file)
    if got not in digests:
        want = " or ".join(d[:16] for d in sorted(digests))
        raise ChecksumMismatch(
            file,
            f"{file.name} has SHA-256 {got[:16]}..., {sums_path.name} records {want}... "
            f"(the file was truncated or changed after it was written)",
        )


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make renames in `folder` durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
