"""The package's architecture as a test: every import points down, and no two
modules import each other, directly or around a circle.

    cli, dev          entry points: commands, embedded servers, the demo
      |
    outbox | inbox    the two sides; neither imports the other
      |
    core              errors, settings, wire format, database layer, logs
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "relay" / "pgoutbox"
# What each part may import (besides itself and the package root).
ALLOWED = {
    "core": set(),
    "outbox": {"core"},
    "inbox": {"core"},
    "cli": {"core", "outbox", "inbox"},
    "dev": {"core", "outbox", "inbox", "cli"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["pgoutbox", *parts])


def imports(path: Path) -> set[str]:
    """Every pgoutbox module this file imports, at any depth of the file (lazy imports count)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("pgoutbox."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "pgoutbox" or target.startswith("pgoutbox."):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {m: {i for i in imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_every_module_belongs_to_a_part():
    loose = [m for m in MODULES if m != "pgoutbox" and part(m) is None]
    assert loose == [], f"modules outside core/outbox/inbox/cli/dev: {loose}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    mine = part(module)
    up = sorted(
        i for i in GRAPH[module] if part(i) not in (None, mine) and part(i) not in ALLOWED.get(mine or "", set())
    )
    if mine is None:  # the package root imports nothing of its parts
        up = sorted(i for i in GRAPH[module] if part(i) is not None)
    assert up == [], f"{module} ({mine}) imports upward or sideways: {up}"


def test_no_import_circle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import circle: " + " -> ".join(cycle))


def test_the_test_sees_a_violation(tmp_path):
    """The checker itself: an upward import in a scratch file is found."""
    (tmp_path / "x.py").write_text("from pgoutbox.cli import main\n")
    global PACKAGE
    saved = PACKAGE
    try:
        PACKAGE = tmp_path
        assert imports(tmp_path / "x.py") >= {"pgoutbox.cli", "pgoutbox.cli.main"}
    finally:
        PACKAGE = saved
