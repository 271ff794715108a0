"""`pgoutbox archive` and `report` without Spark: the plan (dry run), the
settings they add, and their refusals with stable codes."""

from __future__ import annotations

from datetime import timedelta

import pytest

from pgoutbox.cli import main as cli
from pgoutbox.core import migrate
from pgoutbox.core.errors import ExitCode
from support.archival import events, today


def test_dry_run_lists_each_old_day_and_what_blocks_it(conn, database_url, capsys):
    d10, d9 = today() - timedelta(days=10), today() - timedelta(days=9)
    events(conn, d10, 3)
    events(conn, d9, 4, failed=1)
    assert cli.main(["archive", "--database-url", database_url, "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"outbox.events   {d10}           3 rows  eligible" in out
    assert f"outbox.events   {d9}           4 rows  blocked: open rows (PENDING, PROCESSING or FAILED)" in out
    sealed = conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = '_050_archived_read_only'").fetchone()[0]
    assert sealed == 0, "a dry run changes nothing"


def test_an_inbox_retention_below_the_stream_max_age_is_refused(database_url, capsys):
    code = cli.main(["archive", "--database-url", database_url, "--dry-run", "--inbox-retention", "2d"])
    assert code == 2
    assert "[OB057]" in capsys.readouterr().err


def test_a_command_retention_below_the_retry_window_is_refused(database_url, capsys):
    code = cli.main(["archive", "--database-url", database_url, "--dry-run", "--command-retention", "2d"])
    assert code == 2
    assert "[OB057]" in capsys.readouterr().err


def test_unknown_sources_are_a_configuration_error(database_url, capsys):
    assert cli.main(["archive", "--database-url", database_url, "--sources", "outbox,logs"]) == 2
    assert "OUTBOX_ARCHIVE_SOURCES" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "env"),
    [
        ("--lock-timeout", "0s", "OUTBOX_ARCHIVE_LOCK_TIMEOUT"),  # PostgreSQL reads 0 as "wait for ever"
        ("--lock-timeout", "0.5ms", "OUTBOX_ARCHIVE_LOCK_TIMEOUT"),  # rounds to 0 ms
        ("--lock-timeout", "2h", "OUTBOX_ARCHIVE_LOCK_TIMEOUT"),
        ("--spark-start-timeout", "0", "OUTBOX_SPARK_START_TIMEOUT"),
    ],
)
def test_a_wait_without_bound_is_refused_before_anything_runs(conn, database_url, capsys, flag, value, env):
    events(conn, today() - timedelta(days=10), 3)
    assert cli.main(["archive", "--database-url", database_url, flag, value]) == ExitCode.USAGE
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pgoutbox archive: ConfigError: {env}={value!r}: must be from "), line
    assert "wait for ever" in line
    sealed = conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = '_050_archived_read_only'").fetchone()[0]
    assert sealed == 0


def test_on_the_previous_schema_the_archiver_asks_for_migrate(conn, database_url, capsys):
    """This archiver takes seal figures, which the previous schema lacks: it
    refuses before anything is sealed (the previous release's archiver keeps
    working on the new schema, which only adds)."""
    previous = next(m.version for m in migrate.discover() if m.name.endswith("_archival_operations")) - 1
    migrate.migrate(conn, target=previous)
    events(conn, today() - timedelta(days=10), 3)
    assert cli.main(["archive", "--database-url", database_url]) == ExitCode.DATABASE
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pgoutbox archive: SchemaMismatch: ") and "run `pgoutbox migrate`" in line, line
    sealed = conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = '_050_archived_read_only'").fetchone()[0]
    assert sealed == 0


def test_on_a_schema_without_command_archival_the_archiver_asks_for_migrate(conn, database_url, capsys):
    """Schema 13 has no command inbox: archiving its keys (a default source)
    asks for migrate, in one line, before Spark; without them the run goes on."""
    previous = next(m.version for m in migrate.discover() if m.name.endswith("_command_inbox")) - 1
    migrate.migrate(conn, target=previous)
    assert cli.main(["archive", "--database-url", database_url, "--dry-run"]) == ExitCode.DATABASE
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pgoutbox archive: SchemaMismatch: ") and "run `pgoutbox migrate`" in line, line
    assert cli.main(["archive", "--database-url", database_url, "--dry-run", "--sources", "outbox,inbox"]) == 0
