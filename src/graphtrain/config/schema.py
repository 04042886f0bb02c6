"""Checking config values against the config dataclasses' type hints, and reading their field docs.

graphtrain.config.sections declares the sections (dataclasses whose fields carry a type hint and a docstring); this module
turns a parsed YAML mapping into them and checks each value: an unknown key names the closest known one, a wrong
type or value says what the key takes. Written by hand rather than with a schema library (pydantic, attrs'
validators) because the messages are part of the product: each names the full `section.key` and the fix, and YAML
1.1's quirks (1e-3 read as a string) are forgiven where the user meant a number.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
from typing import Any, Literal, Union


def suggest(name: str, options: list[str], prefix: str = "") -> str:
    """A hint naming the closest key in full (`prefix` is its section, e.g. "optim.")."""
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {prefix + close[0]!r}?)" if close else f" (known: {', '.join(sorted(options))})"


def from_dict(cls: type, d: Any, prefix: str) -> Any:
    """An instance of config dataclass `cls` from a mapping; nested sections recurse, `prefix` names them."""
    if not isinstance(d, dict):
        section = prefix.rstrip(".") or "root"
        raise TypeError(
            f"config section {section!r} must be a mapping of keys, got {type(d).__name__} {_shown(d)}; e.g. "
            f"{section if section != 'root' else 'train'}: {{steps: 50}}"
        )
    names = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in d.items():
        if key not in names:
            raise ValueError(f"unknown config key {prefix + str(key)!r}{suggest(str(key), list(names), prefix)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value if value is not None else {}, prefix + key + ".")
        else:
            kwargs[key] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e)) from None


def check(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently coerce: int->float, list->tuple) one value against a type hint."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        errors = []
        for arm in typing.get_args(tp):
            try:
                return check(value, arm, key)
            except (TypeError, ValueError) as e:
                errors.append(e)
        right_type = [e for e in errors if isinstance(e, ValueError) and "finite" in str(e)]
        if right_type:  # a number, but nan or inf
            raise right_type[0]
        raise TypeError(f"{key} must be {describe_type(tp)}, got {_shown(value)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or type(value) is bool and not any(a is value for a in allowed):
            raise ValueError(f"{key} must be one of {', '.join(repr(a) for a in allowed)}; got {_shown(value)}")
        return value
    if tp is type(None):
        if value is not None:
            raise TypeError(f"{key} must be null")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{key} must be true or false, got {_shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{key} must be an integer, got {_shown(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string; the user meant a number
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{key} must be a number, got {_shown(value)}")
        if not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {_shown(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise TypeError(f"{key} must be a string, got {_shown(value)}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise TypeError(f"{key} must be a list of {len(args)} values, got {_shown(value)}")
        return tuple(check(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{key} must be a mapping, got {_shown(value)}")
        return dict(value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{key} must be a list, e.g. [a, b], got {_shown(value)}")
        (arg,) = typing.get_args(tp)
        return [check(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, tp):
            raise TypeError(f"{key} must be a {tp.__name__}, got {type(value).__name__}")
        return value
    raise AssertionError(f"config type {tp} of {key} is not handled")


def describe_type(tp: Any) -> str:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return {type(None): "null", int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _shown(value: Any, limit: int = 120) -> str:
    """`value`'s repr for an error line, cut to `limit` characters (a pasted blob stays one readable line)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def validate(obj: Any, prefix: str) -> None:
    """Check (and coerce) every field of a config dataclass in place; `prefix` is its section, e.g. "optim."."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        setattr(obj, f.name, check(getattr(obj, f.name), hints[f.name], prefix + f.name))


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (shown as CLI help)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
