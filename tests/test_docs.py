"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`, its generated references
describe every config key and CLI verb, and every code block of its pages runs.

Code blocks: each page's ```python blocks and its ```bash blocks (every one starts with `graphtrain`; commands
that are shown but not run are ```console) run in order, in one temporary folder per page that holds a link to
the repository's configs/, with this environment's `graphtrain` first on PATH. A block preceded by
`<!-- docs-test: slow -->` trains or compiles: it runs only in the slow suite, which runs every block of the
page. The design notes (docs/design/) are engineering records, not guides: their blocks are not run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from graphtrain.config.sections import Config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(
    r"^(?:<!-- docs-test: (?P<mark>\w+) -->\n)?```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^```[ \t]*$", re.M | re.S
)
RUN_LANGS = ("python", "bash")


def _hooks():
    spec = importlib.util.spec_from_file_location("graphtrain_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Loader(yaml.SafeLoader):
    """mkdocs.yml with its !!python/name tags read as None (only the nav is wanted here)."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def _nav_pages(nav) -> list[tuple[str, str]]:
    """(section, page) for every page of the nav, in order."""
    out = []

    def walk(items, section):
        for item in items:
            if isinstance(item, str):
                out.append((section, item))
                continue
            for title, value in item.items():
                if isinstance(value, list):
                    walk(value, title)
                else:
                    out.append((section or title, value))

    walk(nav, "")
    return out


def guide_pages() -> list[str]:
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)["nav"]
    return [page for section, page in _nav_pages(nav) if section != "Design notes"]


def blocks(page: str) -> list[tuple[str, str, str | None]]:
    """(language, code, mark) of every fenced block of a page."""
    text = (DOCS / page).read_text()
    return [(m["lang"], m["body"], m["mark"]) for m in FENCE.finditer(text)]


def _run_page(page: str, tmp_path: Path, include_slow: bool) -> int:
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    env = dict(
        os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONUNBUFFERED="1"
    )
    ran = 0
    for i, (lang, code, mark) in enumerate(blocks(page)):
        if lang not in RUN_LANGS or (mark == "slow" and not include_slow):
            continue
        if lang == "python":
            script = tmp_path / f"_block_{i}.py"
            script.write_text(code)
            cmd = [sys.executable, str(script)]
        else:
            cmd = ["bash", "-euo", "pipefail", "-c", code]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (
            f"{page}, block {i} ({lang}) exited {r.returncode}:\n{code}\n--- stdout ---\n"
            f"{r.stdout[-4000:]}\n--- stderr ---\n{r.stderr[-4000:]}"
        )
        ran += 1
    return ran


def _pages_with(fast: bool) -> list[str]:
    return [
        p
        for p in guide_pages()
        if any(lang in RUN_LANGS and (mark != "slow" or not fast) for lang, _, mark in blocks(p))
    ]


# ------------------------------------------------------------------------------- the pages ----


def test_nav_lists_every_page_and_guides_exist():
    pages = guide_pages()
    for page in pages:
        assert (DOCS / page).is_file(), f"mkdocs.yml names {page}, which is not in docs/"
    for needed in (
        "quickstart.md",
        "concepts.md",
        "reference/config.md",
        "reference/cli.md",
        "reference/python-api.md",
        "reference/run-folder.md",
    ):
        assert needed in pages


def test_bash_blocks_are_commands_that_run():
    """A ```bash block is run; a command shown but not run is ```console (so none is skipped silently)."""
    for page in guide_pages():
        for lang, code, mark in blocks(page):
            if lang == "bash":
                first = next(line for line in code.splitlines() if line.strip() and not line.startswith("#"))
                assert first.startswith("graphtrain"), (
                    f"{page}: a bash block that is not a graphtrain command "
                    f"(use ```console for commands the tests do not run): {first}"
                )
            assert mark in (None, "slow"), f"{page}: unknown docs-test mark {mark!r} (slow is the one there is)"


@pytest.mark.parametrize("page", _pages_with(fast=True))
def test_page_code_blocks_run(page, tmp_path):
    assert _run_page(page, tmp_path, include_slow=False) > 0


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with(fast=False))
def test_page_code_blocks_run_all(page, tmp_path):
    assert _run_page(page, tmp_path, include_slow=True) > 0


# -------------------------------------------------------------------------- the references ----


def test_references_describe_every_config_key_and_cli_verb():
    missing = _hooks().missing_descriptions()
    assert not missing, (
        "these have no description for the generated references (a docstring under the config "
        f"field, help= on the verb or argument): {missing}"
    )


@dataclasses.dataclass
class _Extra:
    """A section whose key has no docstring (the coverage check must name it)."""

    knob: int = 1


@dataclasses.dataclass
class _WithExtra(Config):
    extra: _Extra = dataclasses.field(default_factory=_Extra)


def test_coverage_check_finds_an_undocumented_verb_and_key(monkeypatch):
    """The check above can fail: a verb and an argument without help, a config key without a docstring."""
    from graphtrain.cli import main as cli
    from graphtrain.config import sections as config

    monkeypatch.setitem(
        cli.SUBCOMMANDS, "undocumented", cli.Subcommand("", lambda p: p.add_argument("--knob"), lambda args: 0)
    )
    monkeypatch.setattr(config, "Config", _WithExtra)
    missing = _hooks().missing_descriptions()
    assert {"CLI verb undocumented", "CLI argument undocumented --knob KNOB", "config key extra.knob"} <= set(missing)


def test_mkdocs_build_strict(tmp_path):
    """`make docs`: warnings are errors (a broken link, a page missing from the nav, a docstring mkdocstrings cannot
    render); the generated references are in the built site."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -r requirements-docs.txt)")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -r requirements-docs.txt)")
    pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings-python is not installed")
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    hooks = _hooks()
    config_page = (site / "reference" / "config" / "index.html").read_text()
    for section, _, rows in hooks.config_sections():
        for key, *_ in rows:
            assert f"{section}.{key}" in config_page, f"{section}.{key} is missing from the built config reference"
    cli_page = (site / "reference" / "cli" / "index.html").read_text()
    for verb, _, _ in hooks.cli_verbs():
        assert f'id="graphtrain-{verb}"' in cli_page, f"graphtrain {verb} is missing from the built CLI reference"
    api_page = (site / "reference" / "python-api" / "index.html").read_text()
    for name in ("accelerate", "report", "bisect", "compile_step", "wait_compiled", "Trainer"):
        assert 'id="graphtrain.' in api_page and name in api_page


def test_run_folder_page_names_every_checkpoint_key_and_record_kind():
    """The run-folder reference against the code that writes the folder: every key a checkpoint must hold, and
    every kind of metrics.jsonl record the trainer writes."""
    from graphtrain.trainer.checkpoint import FORMAT_VERSION, REQUIRED_KEYS

    page = (DOCS / "reference" / "run-folder.md").read_text()
    for key in REQUIRED_KEYS:
        assert f"| `{key}` |" in page, f"checkpoint key {key} is not described"
    assert f"`{FORMAT_VERSION}`" in page
    trainer_src = "".join(p.read_text() for p in (ROOT / "src" / "graphtrain" / "trainer").glob("*.py"))
    kinds = set(re.findall(r'metrics\.write\("(\w+)"', trainer_src))
    assert kinds, "no metrics.write(...) calls found: the record kinds moved; update this test"
    for kind in kinds:
        assert f"| `{kind}` |" in page, f"metrics.jsonl record kind {kind!r} is not described"
