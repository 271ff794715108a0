"""Applies migrations/NNNN_name.up.sql in order (and .down.sql to go back).

Each file is itself one transaction, serialised by an advisory lock and made
of idempotent DDL, so `psql -f` works as well as this runner, re-running is a
no-op and two runners at once are safe. The runner only decides which files
are pending from outbox.schema_migrations.

On a database where pgoutbox is installed as a PostgreSQL extension
(docs/extension.md) the same chain runs as the extension's scripts: the runner
asks for ALTER EXTENSION pgoutbox UPDATE TO the target instead of running files.

The files ship inside the package (pgoutbox/migrations/, pgoutbox/sql/: in
the checkout these are links to the top-level folders, their one copy) and are
read through importlib.resources.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from importlib import resources
from pathlib import Path

import psycopg
import psycopg.errors
from psycopg import sql

from pgoutbox.core import db
from pgoutbox.core.errors import MigrationError, wrap_exceptions

log = logging.getLogger(__name__)

# A migration's DDL takes strong locks on tables the running workers use (a
# rolling upgrade migrates under their load). Waiting behind a worker while
# holding a lock it needs next is a deadlock, which PostgreSQL settles by
# aborting one side after deadlock_timeout (1 s): often the worker. So each
# lock is waited for at most LOCK_TIMEOUT (below deadlock_timeout, so that
# the migration gives way first); the file, one idempotent transaction, then
# rolls back and runs again after a pause, for at most LOCK_WAIT in all.
LOCK_TIMEOUT = timedelta(milliseconds=500)
LOCK_WAIT = 300.0  # seconds
_LOCK_STATES = ("55P03", "40P01")  # lock_not_available, deadlock_detected

MIGRATIONS_DIR = Path(str(resources.files("pgoutbox").joinpath("migrations")))
EXTENSION = "pgoutbox"
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


def _giving_way(conn: psycopg.Connection, run: Callable[[], None], what: str, lock_timeout: timedelta) -> None:
    """run() with each lock waited for at most lock_timeout; again after a
    pause while it loses a lock wait or a deadlock, for at most LOCK_WAIT."""
    deadline = time.monotonic() + LOCK_WAIT
    pause, attempt = 0.1, 1
    conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{lock_timeout.total_seconds() * 1000:.0f}ms")))
    try:
        while True:
            try:
                run()
                return
            except psycopg.Error as exc:
                if exc.sqlstate not in _LOCK_STATES or time.monotonic() + pause > deadline:
                    raise
                log.warning(
                    "%s gave way to a lock a running worker holds (attempt %d): %s; again in %.1fs",
                    what,
                    attempt,
                    exc.diag.message_primary,
                    pause,
                    extra={"action": "migrate_lock_retry"},
                )
            time.sleep(pause)
            pause, attempt = min(pause * 2, 5.0), attempt + 1
    finally:
        conn.execute("RESET lock_timeout")


def _run_file(conn: psycopg.Connection, path: Path) -> None:
    try:
        with wrap_exceptions():
            conn.execute(path.read_text())  # the file holds its own BEGIN/COMMIT
    except Exception:
        conn.execute("ROLLBACK")  # the file's BEGIN left a failed transaction open
        raise


def extension_version(conn: psycopg.Connection) -> int | None:
    """The version of the pgoutbox extension installed in the database (None: not an extension)."""
    row = conn.execute("SELECT extversion FROM pg_catalog.pg_extension WHERE extname = %s", (EXTENSION,)).fetchone()
    return int(row[0]) if row else None


def _extension_command(conn: psycopg.Connection, template: str, version: int, *, down: bool = False) -> None:
    """Runs template ({} the extension, {} the version) against the extension files on the server."""
    statement = sql.SQL(template).format(sql.Identifier(EXTENSION), sql.Literal(str(version)))
    try:
        with wrap_exceptions():
            conn.execute(statement)
    except (psycopg.errors.UndefinedFile, psycopg.errors.InvalidParameterValue) as exc:
        if down:
            # Down scripts ship only back to the first version the extension
            # was released at (docs/extension.md): newer files do not help.
            raise MigrationError(
                f"the pgoutbox extension does not go back to version {version}"
                f" ({exc.diag.message_primary}); see docs/extension.md, Upgrade and go back"
            ) from exc
        # No control file, or no script leading to the version: the server has
        # older (or no) extension files than this release.
        raise MigrationError(
            f"the server has no pgoutbox extension files for version {version}"
            f" ({exc.diag.message_primary}); install this release's with `make -C extension install`"
        ) from exc


def _migrate_extension(conn: psycopg.Connection, installed: int | None, target: int) -> list[str]:
    """CREATE EXTENSION (installed None) or ALTER EXTENSION ... UPDATE TO target,
    then the day partitions the first migration makes (never extension members)."""
    ran = []
    if installed is None:
        _extension_command(conn, "CREATE EXTENSION {} VERSION {}", target)
        ran.append(f"CREATE EXTENSION {EXTENSION} VERSION '{target}'")
    elif installed != target:
        _extension_command(conn, "ALTER EXTENSION {} UPDATE TO {}", target, down=target < installed)
        ran.append(f"ALTER EXTENSION {EXTENSION} UPDATE TO '{target}' (from '{installed}')")
    with wrap_exceptions():
        conn.execute("SELECT count(*) FROM outbox.create_partitions()")
    return ran


def migrate(
    conn: psycopg.Connection,
    target: int | None = None,
    directory: Path = MIGRATIONS_DIR,
    *,
    extension: bool = False,
    lock_timeout: timedelta = LOCK_TIMEOUT,
) -> list[str]:
    """Moves the schema to target (default: the latest); returns what ran.
    A database with the pgoutbox extension is moved by ALTER EXTENSION; with
    extension=True an empty one gets CREATE EXTENSION instead of the files."""
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
        installed = extension_version(conn)
        current = applied_version(conn)
        if installed is not None or extension:
            if installed is None and current > 0:
                raise MigrationError("pgoutbox is installed here by plain migrations, not as an extension")
            if target == 0:
                raise MigrationError(f"an extension is removed with DROP EXTENSION {EXTENSION}, not by a migration")
            done: list[str] = []

            def update() -> None:  # reads the version again: an earlier attempt may have moved it
                done[:] = _migrate_extension(conn, extension_version(conn), target)

            _giving_way(conn, update, "the extension's update", lock_timeout)
            return done
        ran: list[str] = []
        for m in migrations:
            if current < m.version <= target:
                _giving_way(conn, partial(_run_file, conn, m.up), m.up.name, lock_timeout)
                ran.append(f"up {m.name}")
        for m in reversed(migrations):
            if target < m.version <= current:
                _giving_way(conn, partial(_run_file, conn, m.down), m.down.name, lock_timeout)
                ran.append(f"down {m.name}")
        return ran
    finally:
        conn.execute("SELECT pg_advisory_unlock(hashtextextended('pgoutbox.migrate', 0))")


# `pg_restore -l` lines: "<id>; <class> <oid> <TYPE> <schema> <name> [<name>] <owner>".
_TOC_EXTENSION = re.compile(rf"^\d+; \d+ \d+ EXTENSION - {EXTENSION} ", re.M)
_TOC_ENTRY = re.compile(r"^\d+; \d+ \d+ (INDEX ATTACH|INDEX|CONSTRAINT) (outbox|inbox) (\S+)(?: (\S+))? ")


def restore_list(toc: str) -> tuple[str, int]:
    """The table of contents of an extension-mode dump (`pg_restore -l`) with
    the entries a restore must skip commented out, and how many.

    pg_dump writes the day partitions of outbox.events (never extension
    members) as CREATE TABLE + ATTACH PARTITION, and their indexes and primary
    key after the data, expecting the parent's indexes to come after them too.
    In an extension-mode restore the parent comes whole with CREATE EXTENSION,
    so ATTACH PARTITION already builds each partition's indexes: the dumped
    ones would fail as duplicates. A dump without the extension (plain
    migrations) is returned unchanged: there the parent's indexes need them."""
    if not _TOC_EXTENSION.search(toc):
        return toc, 0
    lines = toc.splitlines(keepends=True)
    attached = {m.group(3) for line in lines if (m := _TOC_ENTRY.match(line)) and m.group(1) == "INDEX ATTACH"}
    out, skipped = [], 0
    for line in lines:
        m = _TOC_ENTRY.match(line)
        if m and (m.group(4) if m.group(1) == "CONSTRAINT" else m.group(3)) in attached:
            out.append(";" + line)
            skipped += 1
        else:
            out.append(line)
    return "".join(out), skipped
