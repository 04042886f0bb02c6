"""YAML job files: PyYAML's safe loader reading YAML 1.2 floats, and `defaults:` composition (config/sections.py builds
the typed Config from the dict these give)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader reading YAML 1.2 floats: `1e-3` and `2E5` are numbers (YAML 1.1, which PyYAML
    implements, wants a dot, so they came back as strings and a float key rejected them)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


class NestedTooDeep(yaml.YAMLError):
    """YAML nested deeper than the parser's recursion allows (PyYAML composes recursively: a few thousand `[` ended
    in a RecursionError traceback)."""

    def __init__(self) -> None:
        super().__init__(
            "it nests deeper than the YAML reader can follow (thousands of levels), where a job file "
            "or a value needs a few (section, key, value)"
        )
        self.problem, self.problem_mark = str(self), None


def yaml_load(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise NestedTooDeep() from None


def read_yaml_file(path: str | Path, what: str, fix: str) -> Any:
    """A YAML file's data; ValueError naming `what` (e.g. "sweep file") and the file, where the syntax breaks and
    `fix`, for a file that is not valid YAML (or nests too deep) or cannot be read."""
    path = Path(path)
    try:
        return yaml_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ValueError(f"{what} {str(path)!r} is not valid YAML{where}: {problem}; {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {str(path)!r} cannot be read ({getattr(e, 'strerror', None) or e}): {fix}") from None


def load_job_file(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A job file as a dict, its `defaults:` bases merged in first (depth first, in order)."""
    path = Path(path)
    if not path.is_file():
        within = f" (named in the defaults of {str(_seen[-1])!r})" if _seen else ""
        raise ValueError(f"config file {str(path)!r} does not exist{within}: pass the path of a YAML job file")
    if path.resolve() in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path.resolve()))
        raise ValueError(f"config files include each other in a cycle: {chain}; remove one of these defaults")
    d = read_yaml_file(
        path, "config file", f"fix the syntax there (`graphtrain config {path}` checks a file without training)"
    )
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of sections (model:, train:, ...)")
    bases = d.pop("defaults", None) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ValueError(
            f"config file {str(path)!r}: defaults must be a list of YAML file paths (relative to the "
            f"file), e.g. defaults: [base.yaml]"
        )
    merged: dict[str, Any] = {}
    for base in bases:
        merged = _deep_merge(merged, load_job_file(path.parent / base, (*_seen, path.resolve())))
    return _deep_merge(merged, d)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
