"""MkDocs hooks: the config and CLI reference pages are generated from the code at build time.

`docs/reference/config.md` and `docs/reference/cli.md` hold a marker each (`<!-- graphtrain:config-reference -->`,
`<!-- graphtrain:cli-reference -->`); `on_page_markdown` replaces it with tables built from the config dataclasses
(their type hints, defaults and the docstring under each field: graphtrain.config.schema.field_docs) and from the
`graphtrain` argparse parser (graphtrain.cli.main.build_parser, walked verb by verb). Nothing generated is committed, so
the pages cannot drift from the code. `missing_descriptions()` lists every key, verb or argument without a
description; tests/test_docs.py requires it to be empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

CONFIG_MARKER = "<!-- graphtrain:config-reference -->"
CLI_MARKER = "<!-- graphtrain:cli-reference -->"


def _cell(text: str) -> str:
    """Text safe inside one Markdown table cell."""
    parts = re.split(r"(`+[^`]*`+)", " ".join(str(text).split()))  # code spans at odd indices
    return "".join(
        p if i % 2 else p.replace("[", "\\[").replace("]", "\\]").replace("<", "&lt;") for i, p in enumerate(parts)
    ).replace("|", "\\|")


def _code(text: str) -> str:
    """Text as one code span inside a table cell (only the pipe needs escaping there)."""
    text = " ".join(str(text).split()).replace("`", "'").replace("|", "\\|")
    return f"`{text}`" if text else ""


# ------------------------------------------------------------------------------------ config ----


def _yaml(value) -> str:
    """A default as a job file writes it (null, true, [0.9, 0.95])."""
    import yaml

    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def config_sections() -> list[tuple[str, type, list[tuple[str, str, str, str]]]]:
    """(section, dataclass, [(key, type, default, description)]) for every section of graphtrain.Config."""
    from graphtrain.config.schema import describe_type, field_docs
    from graphtrain.config.sections import Config

    default = Config()
    out = []
    for sec in dataclasses.fields(Config):
        sub = getattr(default, sec.name)
        cls = type(sub)
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        rows = [
            (f.name, describe_type(hints[f.name]), _yaml(getattr(sub, f.name)), docs.get(f.name, ""))
            for f in dataclasses.fields(sub)
        ]
        out.append((sec.name, cls, rows))
    return out


def config_reference() -> str:
    lines = []
    for name, cls, rows in config_sections():
        lines += [
            f"## `{name}`",
            "",
            _cell(cls.__doc__ or ""),
            "",
            "| key | type | default | description |",
            "|---|---|---|---|",
        ]
        for key, tp, default, doc in rows:
            lines.append(f"| `{name}.{key}` | {_cell(tp)} | {_code(default)} | {_cell(doc)} |")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- cli ----


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _verb_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _arguments(parser: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    """(argument, description, default/choices) for every documented argument of one verb, --help excluded."""
    rows = []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
            continue
        if a.option_strings:
            name = ", ".join(a.option_strings)
            if a.nargs == "?":
                name += f" [{a.metavar or a.dest.upper()}]"
            elif a.nargs != 0:
                name += " " + (a.metavar or a.dest.upper())
        else:
            name = a.metavar if isinstance(a.metavar, str) else a.dest
        extra = []
        if a.choices is not None:
            extra.append("one of " + ", ".join(map(str, a.choices)))
        if a.default not in (None, False, argparse.SUPPRESS) and a.nargs != 0:
            extra.append(f"default {a.default}")
        rows.append((name, a.help or "", "; ".join(extra)))
    return rows


def cli_verbs() -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(verb, help, parser) for every `graphtrain` subcommand, in the parser's order."""
    from graphtrain.cli.main import build_parser

    parser = build_parser()
    helps = _verb_help(parser)
    return [(name, helps.get(name, ""), sub) for name, sub in _subparsers(parser).items()]


def cli_reference() -> str:
    from graphtrain.cli.main import build_parser

    top = build_parser()
    lines = [
        "Global option: `graphtrain --debug COMMAND ...` (or `--debug` after the command) shows full tracebacks "
        "for errors.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    verbs = cli_verbs()
    for name, help_, _ in verbs:
        lines.append(f"| [`{name}`](#graphtrain-{name}) | {_cell(help_)} |")
    lines.append("")
    for name, help_, sub in verbs:
        usage = " ".join(sub.format_usage().replace("usage:", "").split())
        lines += [
            f"## graphtrain {name}",
            "",
            _cell(help_),
            "",
            "```text",
            usage,
            "```",
            "",
            "| argument | description | values |",
            "|---|---|---|",
        ]
        for arg, doc, extra in _arguments(sub):
            lines.append(f"| {_code(arg)} | {_cell(doc)} | {_cell(extra)} |")
        lines.append("")
        if sub.epilog:
            lines += ["```text", sub.epilog.rstrip(), "```", ""]
    del top
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- coverage ----


def missing_descriptions() -> list[str]:
    """Every config key, CLI verb or CLI argument that has no description (the references must cover 100%)."""
    missing = []
    for name, cls, rows in config_sections():
        if not (cls.__doc__ or "").strip():
            missing.append(f"config section {name} (class docstring)")
        missing += [f"config key {name}.{key}" for key, _, _, doc in rows if not doc.strip()]
    for verb, help_, sub in cli_verbs():
        if not help_.strip():
            missing.append(f"CLI verb {verb}")
        missing += [f"CLI argument {verb} {arg}" for arg, doc, _ in _arguments(sub) if not doc.strip()]
    return missing


# ------------------------------------------------------------------------------ mkdocs hooks ----

DESIGN_SECTION = "Design notes"


def _nav_paths(items) -> set[str]:
    out: set[str] = set()
    for item in items or []:
        values = [item] if isinstance(item, str) else list(item.values())
        for v in values:
            out |= _nav_paths(v) if isinstance(v, list) else {v}
    return out


def on_config(config):
    """An engineering record written under docs/design/ (or, by habit, at the top of docs/) joins the design notes'
    nav by itself, titled from its file name, so a new note never fails the strict build for want of a nav entry.
    Guides and references (docs/guides/, docs/reference/) must be listed by hand: one missing from the nav fails."""
    from pathlib import Path

    docs_dir = Path(config["docs_dir"])
    listed = _nav_paths(config["nav"])
    for item in config["nav"] or []:
        if isinstance(item, dict) and isinstance(item.get(DESIGN_SECTION), list):
            section = item[DESIGN_SECTION]
            records = sorted((docs_dir / "design").glob("*.md")) + sorted(docs_dir.glob("*.md"))
            for path in records:
                rel = path.relative_to(docs_dir).as_posix()
                if rel not in listed:
                    section.append({path.stem.replace("-", " ").capitalize(): rel})
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown
