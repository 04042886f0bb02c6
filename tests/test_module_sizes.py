"""The compile floors stay readable: no module under frontend/, runtime/ or pipeline/ passes 450 lines (issue #53;
split one along a real seam, as provider_auto.py was into measured.py and tiered.py, not into a "part 2")."""
from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "graphtrain"
FLOORS = ("frontend", "runtime", "pipeline")
LIMIT = 450


def test_no_module_of_the_compile_floors_passes_the_limit():
    long = {str(p.relative_to(PACKAGE)): n for floor in FLOORS for p in sorted((PACKAGE / floor).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > LIMIT}
    assert not long, f"modules over {LIMIT} lines (split each along a seam of its own): {long}"
