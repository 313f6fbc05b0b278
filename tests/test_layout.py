"""The package's layout is its architecture: layers, no import cycles, a parent side that never imports torch.

Imports are read from the source (``ast``), function-level ones included. Importing ``a.b.c``
runs ``a/__init__.py`` and ``a/b/__init__.py``, so a module also depends on its parent packages.
The root package ``autotune`` is the exception: it is the public facade (``autotune.tune``), the
top layer, and its module-level code imports only ``autotune.version`` (which imports nothing;
checked below), so running it on the way to any submodule can never re-enter another module; its
lazy attributes import the API on first use. So it is no one's dependency here, and no module
imports it by name (``from autotune import x``): the version lives in ``autotune.version``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "autotune"

# Lowest first. A module may import modules of its own layer or below, never above. `search` and
# `probe` share a layer and must not import each other: the parent side and the child side meet
# only in `api` (the probe evaluator behind the search loop's Evaluator interface) and `plan` (the plan-time checks).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("autotune.version", "autotune.errors", "autotune.units", "autotune.interrupts", "autotune.defaults"),
    ("autotune.params", "autotune.sharding"),
    ("autotune.records", "autotune.config_fields"),
    ("autotune.space", "autotune.models", "autotune.data", "autotune.lora"),
    ("autotune.storage",),
    ("autotune.studies",),
    ("autotune.search", "autotune.probe"),
    ("autotune.results", "autotune.workers"),
    ("autotune.report", "autotune.console"),
    ("autotune.options", "autotune.plan"),
    ("autotune.api",),
    ("autotune.cli",),
    ("autotune",),
)
SIBLINGS_APART = ("autotune.search", "autotune.probe")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _imports(path: Path, *, module_level_only: bool = False) -> set[str]:
    """The autotune modules ``path`` imports, resolved to modules that exist (function-level ones too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in MODULES)
    return found


ROOT = "autotune"


def _edges() -> dict[str, set[str]]:
    """Module -> the modules importing it runs: its imports, and their parent packages (the root aside)."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        targets = set()
        for target in _imports(path):
            targets.add(target)
            parts = target.split(".")
            targets.update(".".join(parts[:i]) for i in range(2, len(parts)))  # a.b.c runs a.b (not the root a)
        graph[name] = targets - {name, ROOT}  # the root: see the module docstring
    return graph


def _layer(module: str) -> int:
    best = (-1, -1)
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or module.startswith(prefix + "."):
                best = max(best, (len(prefix), index))
    assert best[1] >= 0, f"{module} belongs to no layer: add it to LAYERS in tests/test_layout.py"
    return best[1]


def test_every_module_has_a_layer() -> None:
    assert len(MODULES) > 30
    for module in MODULES:
        _layer(module)


def test_no_import_goes_up_a_layer_or_across_the_process_boundary() -> None:
    upward = []
    for module, targets in _edges().items():
        for target in targets:
            if _layer(target) > _layer(module):
                upward.append(f"{module} -> {target}")
            sides = [s for s in SIBLINGS_APART if module.startswith(s) or target.startswith(s)]
            if len(sides) == 2 and not (module.startswith(sides[0]) and target.startswith(sides[0])):
                upward.append(f"{module} -> {target} (search and probe never import each other)")
    assert upward == []


def test_no_import_cycles() -> None:
    graph = _edges()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == []


def test_the_root_package_runs_no_import_when_a_submodule_is_imported() -> None:
    """Its module level names only the version, a module that imports nothing."""
    assert _imports(MODULES["autotune"], module_level_only=True) == {"autotune.version"}
    assert _imports(MODULES["autotune.version"]) == set()


def test_subpackage_inits_import_nothing() -> None:
    """A package ``__init__`` that imported its modules would make every sibling import a cycle."""
    for name, path in MODULES.items():
        if path.name == "__init__.py" and name != "autotune":
            assert _imports(path) == set(), name


def test_the_layout_test_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch) -> None:
    """The checks above can fail: a planted cycle and an upward import are found."""
    graph = {"autotune.search.loop": {"autotune.api"}, "autotune.api": {"autotune.search.loop"}}
    monkeypatch.setattr(sys.modules[__name__], "_edges", lambda: graph)
    with pytest.raises(AssertionError):
        test_no_import_cycles()
    with pytest.raises(AssertionError):
        test_no_import_goes_up_a_layer_or_across_the_process_boundary()


def test_a_replayed_search_never_imports_torch() -> None:
    """The parent side runs without torch: import every search module and replay a search in a fresh interpreter."""
    table = Path(__file__).resolve().parent / "data" / "landscape_pythia-160m-l4.csv.gz"
    search_modules = sorted(m for m in MODULES if m.startswith("autotune.search"))
    code = (
        "import importlib, sys\n"
        f"for name in {search_modules!r}: importlib.import_module(name)\n"
        "from autotune.search.replay import load_table, replay_search\n"
        f"outcome = replay_search(load_table({str(table)!r}), budget_s=900, memory_ceiling_bytes=16 * 2**30, strategy='bayes')\n"
        "assert outcome.best_params is not None, outcome\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_no_module_imports_the_facade() -> None:
    assert [name for name, path in MODULES.items() if name != ROOT and ROOT in _imports(path)] == []


def test_the_product_never_imports_the_benchmarks_or_the_tests() -> None:
    """The wheel ships ``autotune/`` only: no module of it may import ``bench`` or ``tests`` (function-level
    imports included), so nothing the product runs depends on the checkout."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{name} -> {target}" for target in names if target.split(".")[0] in ("bench", "tests")]
    assert found == []
