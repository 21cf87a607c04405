"""The layout holds: each top-level package imports only what docs/architecture.md says it may, and no two
packages import each other, directly or around a cycle (static and function-level imports alike)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# package -> the packages it may import (docs/architecture.md, "Layout", says the same: a test checks it).
ALLOWED: dict[str, set[str]] = {
    "grayguard": set(),
    "exporters": {"grayguard"},
    "rules": {"grayguard"},
    "dashboards": {"grayguard", "rules"},
    "controller": {"grayguard", "exporters", "rules"},
    "sim": {"grayguard"},
    "localstack": {"grayguard", "controller", "exporters", "rules", "sim"},
    "bench": {"grayguard", "controller", "sim", "localstack"},
    "demo": {"grayguard", "controller", "localstack", "sim"},
}
PACKAGES = set(ALLOWED)


def imported_names(path: Path) -> list[str]:
    """Every absolute module name a module imports anywhere in its body (static and function-level imports)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def imported_packages(path: Path) -> set[str]:
    """Top-level grayguard packages a module imports: grayguard.controller.loop is `controller`, grayguard.config
    `grayguard` (the wheel maps every component under grayguard., the source tree resolves the same names)."""
    out = set()
    for name in imported_names(path):
        parts = name.split(".")
        if parts[0] == "grayguard":
            out.add(parts[1] if len(parts) > 1 and parts[1] in PACKAGES else "grayguard")
        elif parts[0] in PACKAGES:
            out.add(parts[0])
    return out


def package_graph(root: Path = REPO) -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the modules that import it."""
    graph: dict[str, dict[str, set[str]]] = {p: {} for p in PACKAGES}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            for dep in imported_packages(path) - {pkg}:
                graph[pkg].setdefault(dep, set()).add(str(path.relative_to(root)))
    return graph


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle in a directed graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_every_top_level_package_is_known():
    on_disk = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert on_disk == PACKAGES, "a new top-level package needs a line in ALLOWED and in docs/architecture.md"


def test_no_import_cycle_between_packages():
    graph = package_graph()
    assert find_cycle({p: set(d) for p, d in graph.items()}) is None


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_package_imports_only_what_it_may(pkg):
    graph = package_graph()
    extra = {dep: sorted(mods) for dep, mods in graph[pkg].items() if dep not in ALLOWED[pkg]}
    assert not extra, f"{pkg} may import only {sorted(ALLOWED[pkg])}; found {extra}"


def test_allowed_table_has_no_cycle():
    assert find_cycle(ALLOWED) is None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_checker_sees_function_level_imports(tmp_path):
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "x.py").write_text("def f():\n    from grayguard.controller.loop import Controller\n"
                                             "import grayguard.config\n")
    assert imported_packages(tmp_path / "rules" / "x.py") == {"controller", "grayguard"}


def test_nothing_imports_a_component_by_its_bare_folder_name():
    """`import controller` works in the source tree only, and beside grayguard.controller it would load every
    module twice (two registries, two clocks): the one name is grayguard.<component>, as the wheel installs it."""
    bare = {str(path.relative_to(REPO)): name for path in sorted(REPO.rglob("*.py"))
            if not path.relative_to(REPO).parts[0].startswith((".venv", ".git", "build"))
            for name in imported_names(path) if name.split(".")[0] in PACKAGES - {"grayguard"}}
    assert not bare, bare


def test_architecture_doc_states_the_same_layout():
    doc = (REPO / "docs" / "architecture.md").read_text()
    head = doc.split("\n## ", 2)[1]
    assert head.startswith("Layout"), "docs/architecture.md opens with the layout"
    rows = dict(re.findall(r"^\| `(\w+)/` \|[^|]*\| ([^|]*) \|$", head, re.M))
    assert set(rows) == PACKAGES
    for pkg, may in rows.items():
        assert set(re.findall(r"`(\w+)`", may)) == ALLOWED[pkg], pkg
