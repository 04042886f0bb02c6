"""The README's measured figures trace back to the benchmark and memory pages (issue #52): every ratio and percentage
in its Measured section appears in a docs page that records the command, commit and machine behind it, and no ratio
range it quotes straddles 1.00x (such a range is not a gain)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("docs/design/benchmarks.md", "docs/design/memory.md", "docs/design/measured.md")


def _measured() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Measured")
    return text[start : text.index("\n## ", start + 1)]


def test_every_readme_figure_appears_in_the_docs_tables():
    docs = "".join((ROOT / p).read_text() for p in SOURCES if (ROOT / p).exists())
    figures = set(re.findall(r"\b\d+\.\d+x|\b\d+(?:\.\d+)?%", _measured()))
    assert figures, "the README's Measured section quotes no figure"
    missing = sorted(f for f in figures if f not in docs)
    assert not missing, f"README figures found in none of {SOURCES}: {missing}"


def test_no_readme_ratio_range_straddles_one():
    for lo, hi in re.findall(r"\((\d+\.\d+)-(\d+\.\d+)\)", _measured()):
        assert not float(lo) < 1.0 < float(hi), f"the README quotes a range that straddles 1.00x: {lo}-{hi}"
