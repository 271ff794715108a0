"""Applies migrations/NNNN_name.up.sql in order (and .down.sql to go back).

Each file is itself one transaction, serialised by an advisory lock and made
of idempotent DDL, so `psql -f` works as well as this runner, re-running is a
no-op and two runners at once are safe. The runner only decides which files
are pending from outbox.schema_migrations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import psycopg

from pgoutbox.core import db
from pgoutbox.core.errors import MigrationError, wrap_exceptions

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.(up|down)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    up: Path
    down: Path


def discover(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    found: dict[int, dict[str, Path]] = {}
    names: dict[int, str] = {}
    for path in sorted(directory.glob("*.sql")):
        m = _NAME.match(path.name)
        if not m:
            raise MigrationError(f"badly named migration file: {path.name}")
        version = int(m.group(1))
        name = f"{m.group(1)}_{m.group(2)}"
        if names.setdefault(version, name) != name:
            raise MigrationError(f"two migrations numbered {version}: {names[version]}, {name}")
        found.setdefault(version, {})[m.group(3)] = path
    if not found:
        raise MigrationError(f"no migrations in {directory}")
    migrations = []
    for expected, version in enumerate(sorted(found), start=1):
        if version != expected:
            raise MigrationError(f"migration numbering has a gap before {version:04d}")
        files = found[version]
        if set(files) != {"up", "down"}:
            raise MigrationError(f"migration {names[version]} needs both an up and a down file")
        migrations.append(Migration(version, names[version], files["up"], files["down"]))
    return migrations


applied_version = db.applied_version


def _run_file(conn: psycopg.Connection, path: Path) -> None:
    try:
        with wrap_exceptions():
            conn.execute(path.read_text())  # the file holds its own BEGIN/COMMIT
    except Exception:
        conn.execute("ROLLBACK")  # the file's BEGIN left a failed transaction open
        raise


def migrate(conn: psycopg.Connection, target: int | None = None, directory: Path = MIGRATIONS_DIR) -> list[str]:
    """Moves the schema to target (default: the latest); returns what ran."""
    if not conn.autocommit:
        raise MigrationError("migrate() needs an autocommit connection")
    migrations = discover(directory)
    latest = migrations[-1].version if migrations else 0
    target = latest if target is None else target
    if not 0 <= target <= latest:
        raise MigrationError(f"target {target} is not between 0 and {latest}")
    # The files serialise themselves, but the version read here decides which
    # files run: two migrate() calls must not both read version 3 and then
    # run 0004 one after the other on 6. A session lock on the files' own key
    # (a session does not block itself) covers the read and every file.
    conn.execute("SELECT pg_advisory_lock(hashtextextended('pgoutbox.migrate', 0))")
    try:
        current = applied_version(conn)
        ran = []
        for m in migrations:
            if current < m.version <= target:
                _run_file(conn, m.up)
                ran.append(f"up {m.name}")
        for m in reversed(migrations):
            if target < m.version <= current:
                _run_file(conn, m.down)
                ran.append(f"down {m.name}")
        return ran
    finally:
        conn.execute("SELECT pg_advisory_unlock(hashtextextended('pgoutbox.migrate', 0))")
