"""The definitions the newest migration repeats are generated from sql/
(scripts/gen_migrations.py): the suite fails when one drifts."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen_migrations.py"


def run(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args], capture_output=True, text=True, check=False
    )


def copy_of_the_repository(tmp_path: Path) -> Path:
    """sql/ and migrations/; a newest migration that repeats no definition
    (one that only grants) gets a generated block, so the checks below have one."""
    for folder in ("sql", "migrations"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    path = newest(tmp_path)
    text = path.read_text()
    if "\n-- generated from " not in text:
        block = "-- generated from sql/00_schemas.sql: outbox.schema_version\n-- end generated\n\n"
        at = text.rindex("COMMIT;\n")
        path.write_text(text[:at] + block + text[at:])
        assert run(root=tmp_path).returncode == 0
    return tmp_path


def newest(root: Path) -> Path:
    return sorted((root / "migrations").glob("*.up.sql"))[-1]


def first_block(root: Path = ROOT) -> tuple[str, str]:
    """The sql/ file and function of the newest migration's first generated block."""
    found = re.search(
        r"^-- generated from (sql/[0-9a-z_]+\.sql): ([a-z_]+\.[a-z_0-9]+)$", newest(root).read_text(), re.M
    )
    assert found, "the newest migration repeats no definition"
    return found.group(1), found.group(2)


def test_the_newest_migration_repeats_sql_exactly():
    result = run("--check")
    assert result.returncode == 0, result.stderr


def test_a_changed_definition_is_drift_until_regenerated(tmp_path):
    root = copy_of_the_repository(tmp_path)
    before = newest(root).read_text().splitlines()
    source, function = first_block(root)
    api = root / source
    old = f"CREATE OR REPLACE FUNCTION {function}("
    assert old in api.read_text()
    api.write_text(api.read_text().replace(old, "-- A new line above it.\n" + old))

    drift = run("--check", root=root)
    assert drift.returncode == 1
    assert "make generate/migrations" in drift.stderr

    assert run(root=root).returncode == 0
    assert run("--check", root=root).returncode == 0
    text = newest(root).read_text()
    block = text.split(f"-- generated from {source}: {function}\n", 1)[1]
    assert "-- A new line above it.\n" + old in block.split("-- end generated", 1)[0]
    assert sorted(set(text.splitlines()) - set(before)) == ["-- A new line above it."], "only the block changed"


def test_a_definition_outside_a_block_is_refused(tmp_path):
    root = copy_of_the_repository(tmp_path)
    path = newest(root)
    source, function = first_block(root)
    marker = f"-- generated from {source}: {function}\n"
    text = path.read_text()
    start = text.index(marker)
    end = text.index("-- end generated\n", start)
    path.write_text(text[:start] + text[start + len(marker) : end] + text[end + len("-- end generated\n") :])

    result = run("--check", root=root)
    assert result.returncode == 1
    assert f"{function} is defined outside" in result.stderr


def test_a_block_naming_no_definition_is_refused(tmp_path):
    root = copy_of_the_repository(tmp_path)
    path = newest(root)
    _, function = first_block(root)
    path.write_text(path.read_text().replace(f": {function}\n", ": outbox.no_such_function\n", 1))

    result = run("--check", root=root)
    assert result.returncode == 1
    assert "defines no function outbox.no_such_function" in result.stderr


def test_a_marker_left_in_a_released_migration_is_drift_until_taken_out(tmp_path):
    """Starting a new migration releases the previous one: its blocks stop
    being generated, and their markers (which would claim they still equal
    sql/) go, comment lines only."""
    root = copy_of_the_repository(tmp_path)
    # The newest released migration that defines something (a grants-only one has no CREATE).
    older = [p for p in sorted((root / "migrations").glob("*.up.sql"))[:-1] if "\nCREATE " in p.read_text()][-1]
    before = older.read_text()
    assert "-- generated from " not in before and "-- end generated" not in before
    at = before.index("\nCREATE ") + 1
    older.write_text(before[:at] + "-- generated from sql/00_schemas.sql: outbox.schema_version\n" + before[at:])

    result = run("--check", root=root)
    assert result.returncode == 1
    assert f"{older.name}:1: a released migration carries generated-block markers" in result.stderr

    assert run(root=root).returncode == 0
    assert older.read_text() == before
    assert run("--check", root=root).returncode == 0
