"""Imports point one way, down the layers, with no cycle (docs/design/architecture.md, "Layers").

Every `import` in every module of the package counts, at module level and inside functions alike: a lazy
import that dodges a cycle is the cycle all the same. The files are read with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "graphtrain"

# Top to bottom. A module may import its own layer and the layers below it.
LAYERS: list[tuple[str, ...]] = [
    ("cli", "__main__"),
    ("bench",),
    ("runs",),
    ("trainer", "integrations"),
    ("distributed",),
    ("tools",),
    ("frontend",),
    ("runtime",),
    ("pipeline",),
    ("memory",),
    ("optim", "passes", "models", "data"),
    ("kernels",),
    ("testing",),
    ("checksums", "early_preempt"),
    ("config",),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}

# `graphtrain/__init__.py` is the public facade (graphtrain.accelerate, .report, .Trainer, ...): it may point at
# any layer (lazily, so `import graphtrain` stays light) and is exempt. Importing *it* counts as importing what
# it exposes: `from graphtrain import NAME` is an edge to NAME's module, a bare `import graphtrain` an edge to
# the highest layer the facade reaches.
FACADE = "graphtrain"

# (importer, imported) edges allowed against the layering, each with the reason it cannot go. Keep it empty.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The module `name` refers to: itself, or the nearest enclosing module (an attribute of a module)."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _facade_names() -> tuple[dict[str, str], int]:
    """The facade's names -> the modules they come from, and the highest layer (lowest rank) it reaches."""
    tree = ast.parse(MODULES[FACADE].read_text())
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("graphtrain."):
            names.update({a.asname or a.name: node.module for a in node.names})
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            lazy = ast.literal_eval(node.value)
            names.update(lazy)
    top = min(RANK[_layer(_resolve(m))] for m in names.values())
    return names, top


def _layer(module: str) -> str:
    return module.split(".")[1]


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every graphtrain import in `module`, wherever it stands."""
    out = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "graphtrain"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                base = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if source.split(".")[0] != "graphtrain":
                continue
            for a in node.names:  # `from pkg import submodule` imports the submodule; the facade's names resolve later
                full = f"{source}.{a.name}"
                out.append((node.lineno, full if full in MODULES or source == FACADE else source))
    return out


def _edges() -> list[tuple[str, int, str]]:
    """(importer, line, imported module) over the whole package; imports of the facade resolved through it."""
    facade_names, _ = _facade_names()
    edges = []
    for module, path in MODULES.items():
        if module == FACADE:
            continue
        for line, target in _imports(module, path):
            if _resolve(target) == FACADE:  # `import graphtrain` or `from graphtrain import NAME`
                target = facade_names.get(target[len(FACADE) + 1 :], FACADE)
            edges.append((module, line, _resolve(target)))
    return edges


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if m != FACADE and _layer(m) not in RANK)
    assert not unplaced, f"place these in LAYERS (and docs/design/architecture.md): {unplaced}"


def test_imports_point_down():
    _, facade_rank = _facade_names()
    upward = []
    for module, line, target in _edges():
        rank = facade_rank if target == FACADE else RANK[_layer(target)]
        if rank < RANK[_layer(module)] and (module, target) not in ALLOWED_UPWARD:
            upward.append(
                f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} ({_layer(module)}) imports "
                f"{target} ({'the facade' if target == FACADE else _layer(target)})"
            )
    assert not upward, "imports above their own layer (move the shared piece down instead):\n" + "\n".join(upward)


def test_allow_list_is_current():
    edges = {(m, t) for m, _, t in _edges()}
    stale = [e for e in ALLOWED_UPWARD if e not in edges]
    assert not stale, f"ALLOWED_UPWARD names edges that no longer exist: {stale}"


def test_no_import_cycles():
    """No module reaches itself through imports (lazy ones included); a package's modules never import the
    package itself (its __init__ imports them)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, _, target in _edges():
        if target != module:
            graph[module].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles (move the shared piece into a module both can import): {cycles}"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The walk finds imports inside functions and resolves relative ones (what the rules above rely on)."""
    src = tmp_path / "m.py"
    src.write_text(
        "import torch\n\ndef f():\n    from graphtrain.frontend.accelerate import accelerate\n"
        "    from . import predict\n    from .. import checksums\n    import graphtrain\n"
    )
    found = sorted(t for _, t in _imports("graphtrain.memory.m", src))
    assert found == [
        "graphtrain",
        "graphtrain.checksums",
        "graphtrain.frontend.accelerate",
        "graphtrain.memory.predict",
    ], found
    names, top = _facade_names()
    assert names["accelerate"] == "graphtrain.frontend.accelerate" and "trainer" in LAYERS[top]  # graphtrain.Trainer


# ------------------------------------------------------------------ sizes and hidden wiring ----

SIZE_LIMITED = ("frontend", "runtime", "pipeline", "tools")
MAX_LINES = 450
MAX_PACKAGE_SHARE = 0.15


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_file_of_the_engine_floors_is_over_450_lines():
    """frontend/, runtime/, pipeline/ and tools/ keep files a reader can hold (the architecture issue's bound)."""
    long = [
        f"{p.relative_to(PACKAGE.parent)}: {_lines(p)}"
        for m, p in MODULES.items()
        if m != FACADE and _layer(m) in SIZE_LIMITED and _lines(p) > MAX_LINES
    ]
    assert not long, f"over {MAX_LINES} lines (split along a seam of the code, not by count): {long}"


def test_no_package_holds_more_than_15_percent_of_the_source():
    """Python source lines per top-level package (the C++ under kernels/csrc/ is not counted here)."""
    per: dict[str, int] = {}
    for m, p in MODULES.items():
        per[_layer(m) if m != FACADE else FACADE] = per.get(_layer(m) if m != FACADE else FACADE, 0) + _lines(p)
    total = sum(per.values())
    big = {k: f"{v / total:.1%}" for k, v in per.items() if v > MAX_PACKAGE_SHARE * total}
    assert not big, f"packages over {MAX_PACKAGE_SHARE:.0%} of the source: {big}"


def _says_why(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's own lines or on the line just above it."""
    own = "".join(lines[node.lineno - 1 : node.end_lineno])
    above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
    return "#" in own or above.startswith("#")


MODULE_REASON = "# Imports inside functions:"


def test_function_local_imports_say_why():
    """A graphtrain import inside a function hides a dependency from the reader; it stays only where a comment
    says why (import cost, an optional dependency, environment set before torch loads): on its line, the line
    above, or once per module in a comment starting with MODULE_REASON when one reason covers them all."""
    silent = []
    for path in MODULES.values():
        text = path.read_text()
        if MODULE_REASON in text:
            continue
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.ImportFrom)
                    and not node.level
                    and (node.module or "").split(".")[0] == "graphtrain"
                    or isinstance(node, ast.Import)
                    and any(a.name.split(".")[0] == "graphtrain" for a in node.names)
                ):
                    if not _says_why(lines, node):
                        silent.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not silent, (
        "imports inside functions without a reason (move them to the top of the module, or say why "
        f"in a comment): {silent}"
    )


# Only these modules build graphs with torch's tracers and compilers; everything else goes through their functions
# (pipeline/trace.py's trace_step, pipeline/stages.py's autodiff, runtime/providers.py's providers), so every compile
# gets the pipeline's records and the provider's checks.
COMPILER_ENTRY_POINTS = ("aot_function", "aot_module_simplified", "compile_fx", "make_fx")
COMPILER_MODULES = ("graphtrain.pipeline.trace", "graphtrain.pipeline.stages", "graphtrain.runtime.providers")


def _compiler_uses(path: Path) -> list[tuple[int, str]]:
    """(line, name) for every call or import of a COMPILER_ENTRY_POINTS name in `path` (mentions in text do not
    count: docstrings and comments are not calls)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in COMPILER_ENTRY_POINTS:
                out.append((node.lineno, f"calls {name}"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.name.rpartition(".")[2] in COMPILER_ENTRY_POINTS:
                    out.append((node.lineno, f"imports {a.name}"))
    return out


def test_only_the_pipeline_and_the_providers_call_the_compilers():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line} {what}"
        for module, path in MODULES.items()
        if module not in COMPILER_MODULES
        for line, what in _compiler_uses(path)
    ]
    assert not found, (
        "torch's tracers and compilers called outside pipeline/trace.py, pipeline/stages.py and "
        "runtime/providers.py (call a function of theirs instead, so the compile gets the provider's "
        "checks):\n" + "\n".join(found)
    )


def test_the_compiler_scan_sees_calls_and_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        '"""make_fx in a docstring"""\nimport torch._inductor.compile_fx\n\ndef f(g, a):\n'
        "    from torch.fx.experimental.proxy_tensor import make_fx as trace\n"
        "    return torch._inductor.compile_fx.compile_fx(g, a), trace(g)(*a)  # aot_function\n"
    )
    assert _compiler_uses(src) == [
        (2, "imports torch._inductor.compile_fx"),
        (5, "imports make_fx"),
        (6, "calls compile_fx"),
    ], _compiler_uses(src)


ENTRY_FLOORS = ("cli", "__main__", "bench")


def test_only_the_entry_floors_import_the_facade():
    """`import graphtrain` / `from graphtrain import NAME` is the users' door; inside the package only the command
    line and the benchmarks use it, so every other module names what it depends on."""
    found = []
    for module, path in MODULES.items():
        if module == FACADE or _layer(module) in ENTRY_FLOORS:
            continue
        for line, target in _imports(module, path):
            if _resolve(target) == FACADE:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    assert not found, f"the facade imported outside {ENTRY_FLOORS} (import the module instead): {found}"
