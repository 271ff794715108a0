"""`pgoutbox archive` and `report` without Spark: the plan (dry run), the
settings they add, and their refusals with stable codes."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from pgoutbox.cli import main as cli
from pgoutbox.core import migrate
from pgoutbox.core.errors import ExitCode
from pgoutbox.dev.embedded import free_port
from support.archival import events, today
from support.roles import login


def test_dry_run_lists_each_old_day_and_what_blocks_it(conn, database_url, capsys):
    d10, d9 = today() - timedelta(days=10), today() - timedelta(days=9)
    events(conn, d10, 3)
    events(conn, d9, 4, failed=1)
    assert cli.main(["archive", "--database-url", login(database_url, "pgoutbox_archiver"), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"outbox.events   {d10}           3 rows  eligible" in out
    assert f"outbox.events   {d9}           4 rows  blocked: open rows (PENDING, PROCESSING or FAILED)" in out
    sealed = conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = '_050_archived_read_only'").fetchone()[0]
    assert sealed == 0, "a dry run changes nothing"


def test_an_inbox_retention_below_the_stream_max_age_is_refused(database_url, capsys):
    code = cli.main(
        ["archive", "--database-url", login(database_url, "pgoutbox_archiver"), "--dry-run", "--inbox-retention", "2d"]
    )
    assert code == 2
    assert "[OB057]" in capsys.readouterr().err


def test_a_command_retention_below_the_retry_window_is_refused(database_url, capsys):
    code = cli.main(
        [
            "archive",
            "--database-url",
            login(database_url, "pgoutbox_archiver"),
            "--dry-run",
            "--command-retention",
            "2d",
        ]
    )
    assert code == 2
    assert "[OB057]" in capsys.readouterr().err


def test_unknown_sources_are_a_configuration_error(database_url, capsys):
    assert (
        cli.main(["archive", "--database-url", login(database_url, "pgoutbox_archiver"), "--sources", "outbox,logs"])
        == 2
    )
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
    assert (
        cli.main(["archive", "--database-url", login(database_url, "pgoutbox_archiver"), flag, value]) == ExitCode.USAGE
    )
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
    # as owner: that schema grants pgoutbox_archiver no outbox.schema_version() (42501 before any version check)
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
    archiver = login(database_url, "pgoutbox_archiver")
    assert cli.main(["archive", "--database-url", archiver, "--dry-run"]) == ExitCode.DATABASE
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pgoutbox archive: SchemaMismatch: ") and "run `pgoutbox migrate`" in line, line
    assert cli.main(["archive", "--database-url", archiver, "--dry-run", "--sources", "outbox,inbox"]) == 0


def _recording_java(tmp_path: Path) -> tuple[Path, Path]:
    """A JAVA_HOME whose java records that it was started, then fails: Spark
    starts its JVM through $JAVA_HOME/bin/java (spark-class)."""
    home, started = tmp_path / "jdk", tmp_path / "java-started"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text(f'#!/bin/sh\necho "$@" >> {started}\nexit 1\n')
    java.chmod(0o755)
    return home, started


def test_a_local_folder_under_a_cluster_master_is_refused_before_spark_starts(conn, database_url, tmp_path):
    """A configuration mistake costs no cluster time: a standalone master (here
    one that does not even answer, which would cost the whole Spark start) and
    a local archive folder are refused in one line, exit 2, with no JVM started
    and nothing sealed. The archiver's own login, on the defaults but those two."""
    events(conn, today() - timedelta(days=10), 3)
    home, started = _recording_java(tmp_path)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "SPARK_", "PYSPARK_"))}
    env = {
        **base,
        "JAVA_HOME": str(home),
        "OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_archiver"),
        "OUTBOX_SPARK_MASTER": f"spark://127.0.0.1:{free_port()}",  # what the test is about: a cluster master
        "OUTBOX_ARCHIVE_URI": str(tmp_path / "archive"),  # ... and a folder of this host's disk
    }
    done = subprocess.run(
        [sys.executable, "-m", "pgoutbox.cli.main", "archive"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # Spark gives an unanswering master about 100 s before it fails
    )
    assert done.returncode == ExitCode.USAGE, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("pgoutbox archive: ConfigError: OUTBOX_ARCHIVE_URI=file://"), line
    assert "OUTBOX_ARCHIVE_SHARED=true" in line, line
    assert not started.exists(), f"a JVM was started: {started.read_text()}"
    sealed = conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = '_050_archived_read_only'").fetchone()[0]
    assert sealed == 0


def test_the_recording_java_sees_a_spark_start(tmp_path):
    """The check above is not vacuous: a local Spark started with that
    JAVA_HOME goes through the recording java (and fails, exit 5)."""
    home, started = _recording_java(tmp_path)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "SPARK_", "PYSPARK_"))}
    code = (
        "from pgoutbox_spark import session\n"
        "from pgoutbox.core.errors import SparkUnavailable\n"
        "try:\n"
        "    session.build('local[1]', None, 'probe')\n"
        "except Exception as exc:\n"
        "    raise SystemExit(type(exc).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env={**base, "JAVA_HOME": str(home)}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0, done.stderr
    assert started.exists()
