"""The torch versions graphtrain supports, checked without importing torch: `import graphtrain` reads the installed
torch's version from its distribution metadata here (importing torch costs seconds that `graphtrain --help` and
`graphtrain config` do not need), and config/torch_compat.py checks `torch.__version__` again when the engine imports it (a torch
on PYTHONPATH has no metadata). The shims for the differences inside the range live in config/torch_compat.py."""

from __future__ import annotations

import re
import warnings

MIN_TORCH = (2, 11)
NEWEST_TESTED = (2, 14)
SUPPORTED = f"torch {MIN_TORCH[0]}.{MIN_TORCH[1]} to {NEWEST_TESTED[0]}.{NEWEST_TESTED[1]}"


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.11.0+cu130' -> (2, 11)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ImportError(f"graphtrain: cannot read the torch version {version!r}; graphtrain supports {SUPPORTED}")
    return int(m.group(1)), int(m.group(2))


_checked: set[str] = set()  # versions already checked in this process: a newer torch is warned about once


def check_torch_version(version: str) -> None:
    """Raise ImportError for a torch older than MIN_TORCH; warn for one newer than NEWEST_TESTED."""
    if version in _checked:
        return
    found = parse_version(version)
    if found < MIN_TORCH:
        raise ImportError(
            f"graphtrain supports {SUPPORTED}, found torch {version}: "
            f"install a supported one (pip install 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}')"
        )
    if found > NEWEST_TESTED:
        warnings.warn(
            f"graphtrain is tested with {SUPPORTED}; torch {version} is newer: it should work, and a "
            f"failure naming a torch private API belongs in graphtrain/config/torch_compat.py",
            stacklevel=3,
        )
    _checked.add(version)


def check_installed_torch() -> None:
    """check_torch_version on the torch this process has imported already, else on the installed distribution's
    metadata (ImportError: no torch at all)."""
    import sys

    imported = sys.modules.get("torch")
    if imported is not None and hasattr(imported, "__version__"):
        check_torch_version(imported.__version__)
        return
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        try:
            import importlib.util

            if importlib.util.find_spec("torch") is not None:
                return  # a torch without metadata (built in place, on PYTHONPATH): config/torch_compat.py checks it on import
        except (ImportError, ValueError):
            pass
        raise ImportError(f"graphtrain needs torch ({SUPPORTED}): pip install torch") from None
    check_torch_version(version)
