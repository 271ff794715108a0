"""migrations/ is well named (split from tests/schema/test_migrations.py,
which builds and compares the catalogs on a real server)."""

from __future__ import annotations

import re
from pathlib import Path

from pgoutbox.core import migrate as m

ROOT = Path(__file__).resolve().parents[2]


def test_migration_files_are_properly_named():
    files = sorted(p.name for p in (ROOT / "migrations").iterdir())
    assert files, "no migrations"
    for name in files:
        assert re.fullmatch(r"\d{4}_[a-z0-9_]+\.(up|down)\.sql", name), name
    found = m.discover()
    assert [x.version for x in found] == list(range(1, len(found) + 1))
    for x in found:
        assert "cannot undo" in x.down.read_text(), f"{x.down.name} must say what it cannot undo"
