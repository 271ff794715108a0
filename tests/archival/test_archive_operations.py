"""Archival as operators run it, on a real PostgreSQL and a real local Spark:
every failure outside SQL is one coded line for its day and the run goes on;
a failure that concerns every day is one line, exit code 5, nothing sealed;
two archivers at once; changes behind the seal; a void keeps its archive."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import pytest

from pgoutbox.cli import archive as archive_cli
from pgoutbox.cli import main as cli
from pgoutbox.core import settings
from pgoutbox.core.errors import ExitCode
from pgoutbox.dev.embedded import free_port
from pgoutbox_spark import archive, jdbc, storage
from pgoutbox_spark import database as db
from support.archival import SPARK_DEADLINE, archived_rows, events, inbox_for, live_rows, spark_env, today
from support.roles import login

pytestmark = pytest.mark.spark

OUTBOX, INBOX = db.OUTBOX, db.INBOX


def config(database_url: str, tmp_path: Path, **overrides) -> archive_cli.ArchiveConfig:
    values = dict(
        database_url=database_url,
        archive_uri=str(tmp_path / "archive"),
        inbox_retention="8d",
        read_partitions="2",
        fetch_size="500",
    )
    values.update(overrides)
    return settings.build(archive_cli.ArchiveConfig, environ={}, overrides=values)


def two_days(conn) -> list:
    """Two archivable days, outbox and inbox."""
    days = [today() - timedelta(days=k) for k in (12, 10)]
    for day in days:
        inbox_for(conn, events(conn, day, 12))
    return days


def day_lines(out: str) -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in (OUTBOX, INBOX):
            found.setdefault((parts[0], parts[1]), []).append(line)
    return found


def sealed_partitions(conn) -> int:
    return conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = '_050_archived_read_only'").fetchone()[0]


def partition_exists(conn, day) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f"outbox.events_p{day:%Y%m%d}",)).fetchone()[0]


# ------------------------------------------------ one day's failure is that day's


def closed_port_url(conn) -> str:
    return f"jdbc:postgresql://127.0.0.1:{free_port()}/{conn.info.dbname}"


def missing_database_url(conn) -> str:
    return f"jdbc:postgresql://127.0.0.1:{conn.info.port}/no_such_database"


@pytest.mark.parametrize(
    ("bad_url", "code", "cause"),
    [
        (closed_port_url, "JDBC_UNREACHABLE", "port closed (connection refused)"),
        (missing_database_url, "JDBC_NO_DATABASE", "the database does not exist"),
    ],
    ids=["port-closed", "database-missing"],
)
def test_a_jdbc_failure_is_one_line_per_day_and_the_next_run_finishes(
    spark, conn, database_url, tmp_path, capsys, bad_url, code, cause
):
    days = two_days(conn)
    url = bad_url(conn)
    host_port_db = urlparse(url.removeprefix("jdbc:"))

    assert archive_cli.archive_days(spark, conn, config(database_url, tmp_path, jdbc_url=url)) == 1

    out = capsys.readouterr().out
    lines = day_lines(out)
    assert "Traceback" not in out
    for day in days:
        for source in (OUTBOX, INBOX):
            (line,) = lines[(source, str(day))]  # one line, per day, for every day: the run went on
            assert " failed " in line and f"ArchiveFailure [{code}]" in line, line
            assert f"host 127.0.0.1, port {host_port_db.port}, database {host_port_db.path[1:]}" in line
            assert cause in line
    assert db.audits(conn) == []
    # What it left sealed, the next run finishes.
    assert archive_cli.archive_days(spark, conn, config(database_url, tmp_path)) == 0
    lines = day_lines(capsys.readouterr().out)
    assert all(" removed " in lines[(s, str(d))][0] for d in days for s in (OUTBOX, INBOX))
    assert not any(partition_exists(conn, d) for d in days)


def test_an_unwritable_day_folder_fails_that_source_and_the_inbox_goes_on(spark, conn, database_url, tmp_path, capsys):
    days = two_days(conn)
    root = tmp_path / "archive"
    root.mkdir()
    (root / "outbox_events").write_text("a file where the outbox's day folders would go")

    assert archive_cli.archive_days(spark, conn, config(database_url, tmp_path)) == 1

    out = capsys.readouterr().out
    lines = day_lines(out)
    assert "Traceback" not in out
    for day in days:
        (line,) = lines[(OUTBOX, str(day))]
        assert "ArchiveFailure [STORAGE_UNWRITABLE]" in line and "outbox_events" in line, line
        assert partition_exists(conn, day)
        (line,) = lines[(INBOX, str(day))]
        assert " removed " in line, line
    (root / "outbox_events").unlink()
    assert archive_cli.archive_days(spark, conn, config(database_url, tmp_path)) == 0
    assert not any(partition_exists(conn, d) for d in days)


def test_a_spark_failure_fails_its_day_only(spark, conn, database_url, tmp_path):
    days = two_days(conn)

    def failing_job(step, unit):
        if step == "sealed" and unit.day == days[0] and unit.source == OUTBOX:
            spark.sql("SELECT raise_error('an executor gave up')").collect()  # a real failing Spark job

    cfg = config(database_url, tmp_path)
    outcomes = archive.run(spark, conn, jdbc.from_connection(conn), archive_cli.options(cfg), failing_job)

    by_unit = {(o.source, o.day): o for o in outcomes}
    failed = by_unit[(OUTBOX, days[0])]
    assert failed.state == "failed" and failed.detail.startswith("ArchiveFailure [SPARK_FAILED]"), failed
    assert "an executor gave up" in failed.detail and "\n" not in failed.detail
    assert {o.state for k, o in by_unit.items() if k != (OUTBOX, days[0])} == {"removed"}
    assert partition_exists(conn, days[0]) and not partition_exists(conn, days[1])


@pytest.mark.parametrize(
    ("uri", "code", "needs"),
    [
        ("hdfs:///archive/pgoutbox", "STORAGE_NOT_CONFIGURED", "HADOOP_CONF_DIR"),
        ("s3a://bucket/archive", "STORAGE_NOT_CONFIGURED", "hadoop-aws"),
        ("gs://bucket/archive", "STORAGE_NOT_CONFIGURED", "gcs-connector"),
        ("{tmp}/a-file/archive", "STORAGE_UNWRITABLE", "a-file"),
    ],
    ids=["hdfs-without-conf", "s3a-without-jars", "gs-without-connector", "unwritable"],
)
def test_no_usable_archive_location_is_one_line_exit_5_and_nothing_sealed(
    spark, conn, database_url, tmp_path, capsys, monkeypatch, uri, code, needs
):
    monkeypatch.delenv("HADOOP_CONF_DIR", raising=False)
    two_days(conn)
    (tmp_path / "a-file").write_text("not a folder")
    argv = [
        "archive",
        "--database-url",
        login(database_url, "pgoutbox_archiver"),
        "--archive-uri",
        uri.format(tmp=tmp_path),
    ]

    assert cli.main([*argv, "--inbox-retention", "8d"]) == ExitCode.SPARK == 5

    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(f"pgoutbox archive: SparkUnavailable [{code}]: "), line
    assert needs in line and "nothing was sealed" in line
    assert sealed_partitions(conn) == 0
    assert conn.execute("SELECT count(*) FROM outbox.archive_seal").fetchone()[0] == 0
    assert db.audits(conn) == []


# ------------------------------------------------------------- two archivers


def test_two_archivers_at_once_each_day_once_no_false_failure(spark, conn, database_url, tmp_path, capsys):
    days = [today() - timedelta(days=k) for k in (13, 12, 11, 10)]
    for day in days:
        inbox_for(conn, events(conn, day, 10))
    before = {(s, d): live_rows(conn, s, d) for d in days for s in (OUTBOX, INBOX)}
    cfg = config(database_url, tmp_path)
    opts = archive_cli.options(cfg)
    first_holds_a_day, second_done = threading.Event(), threading.Event()

    def first_waits(step, unit):
        # The first archiver listed every day, then stalls on its first one
        # while the second does the rest: its day list goes stale.
        if step == "sealed" and not first_holds_a_day.is_set():
            first_holds_a_day.set()
            assert second_done.wait(300)

    results: dict[str, list] = {}

    def archiver(name: str, hook) -> None:
        with psycopg.connect(database_url, autocommit=True) as own:
            results[name] = archive.run(spark, own, jdbc.from_connection(own), opts, hook)

    first = threading.Thread(target=archiver, args=("first", first_waits))
    first.start()
    assert first_holds_a_day.wait(120)
    try:
        archiver("second", archive.no_hook)
    finally:
        second_done.set()
    first.join(300)
    assert not first.is_alive()

    codes = [archive_cli.print_outcomes(results[name], opts.archive_uri) for name in ("first", "second")]
    assert codes == [0, 0]
    out = capsys.readouterr().out
    assert " failed " not in out
    for source in (OUTBOX, INBOX):
        for day in days:
            states = sorted(o.state for name in results for o in results[name] if (o.source, o.day) == (source, day))
            assert states in (["busy", "removed"], ["done", "removed"]), (source, day, states)
            audits = [a for a in db.audits(conn, source) if a.day == day]
            assert len(audits) == 1 and audits[0].removed_at is not None
            assert archived_rows(spark, audits[0].archive_uri) == before[(source, day)]
    all_states = [o.state for name in results for o in results[name]]
    assert "done" in all_states, "the stale day list met days the other archiver had finished"


# --------------------------------------------------------- changes behind the seal


def replica_update(conn, day):
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(
            "UPDATE outbox.events SET last_error = 'forged' WHERE id = (SELECT min(id) FROM outbox.events"
            " WHERE created_at >= %s AND created_at < %s + interval '1 day')",
            (day, day),
        )


def replica_delete(conn, day):
    with conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(
            f"DELETE FROM outbox.events_p{day:%Y%m%d} WHERE id = (SELECT max(id) FROM outbox.events_p{day:%Y%m%d})"
        )


def disable_seal(conn, day):
    conn.execute(f"ALTER TABLE outbox.events_p{day:%Y%m%d} DISABLE TRIGGER _050_archived_read_only")


@pytest.mark.parametrize(
    ("step", "tamper", "code"),
    [
        ("sealed", replica_update, "OB062"),  # before the export: the archive would match the forged rows
        ("sealed", replica_delete, "OB062"),
        ("sealed", disable_seal, "OB062"),  # no change, but the seal no longer holds
        ("audited", replica_update, "OB053"),  # after the audit: the drop re-checks
    ],
    ids=["update-before-export", "delete-before-export", "triggers-disabled", "update-before-drop"],
)
def test_a_change_behind_the_seal_is_never_archived_silently(spark, conn, database_url, tmp_path, step, tamper, code):
    day = today() - timedelta(days=10)
    events(conn, day, 15)

    def owner_tampers(reached, unit):
        if reached == step and unit.source == OUTBOX:
            tamper(conn, day)

    cfg = config(database_url, tmp_path, sources="outbox")
    outcome = archive.run(spark, conn, jdbc.from_connection(conn), archive_cli.options(cfg), owner_tampers)[0]

    assert outcome.state == "failed" and f"ArchiveMismatch [{code}]" in outcome.detail, outcome
    assert partition_exists(conn, day), "nothing was dropped"
    audits = db.audits(conn, OUTBOX)
    assert all(a.removed_at is None for a in audits)
    if step == "sealed":
        assert audits == [], "no audit of rows changed since the seal"


def test_a_void_keeps_the_voided_archive_and_the_new_run_writes_beside_it(spark, conn, database_url, tmp_path):
    day = today() - timedelta(days=10)
    events(conn, day, 20)
    before = live_rows(conn, OUTBOX, day)
    cfg = config(database_url, tmp_path, sources="outbox", drop="false")
    opts = archive_cli.options(cfg)
    assert archive.run(spark, conn, jdbc.from_connection(conn), opts)[0].state == "archived"
    (first,) = db.audits(conn, OUTBOX)
    assert first.archive_uri == storage.day_uri(opts.archive_uri, OUTBOX, day)
    folder = Path(first.archive_uri.removeprefix("file:"))
    kept = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}
    assert any(p.suffix == ".parquet" for p in kept)

    conn.execute("SELECT outbox.void_archive('outbox.events', %s, 'tests: re-archive')", (day,))
    outcome = archive.run(
        spark, conn, jdbc.from_connection(conn), archive_cli.options(config(database_url, tmp_path, sources="outbox"))
    )[0]

    assert outcome.state == "removed", outcome
    voided, standing = db.audits(conn, OUTBOX)
    assert voided.id == first.id and voided.voided_at is not None and voided.archive_uri == first.archive_uri
    assert standing.archive_uri == storage.day_uri(opts.archive_uri, OUTBOX, day, attempt=2) != first.archive_uri
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()} == kept
    assert archived_rows(spark, voided.archive_uri) == archived_rows(spark, standing.archive_uri) == before


@pytest.mark.slow
def test_two_archiver_processes_at_once_both_exit_0(conn, database_url, tmp_path):
    """The operator's case: two `pgoutbox archive` processes started together
    on the same database and archive location, each with its own Spark."""
    days = [today() - timedelta(days=k) for k in (14, 13, 12, 11, 10)]
    for day in days:
        inbox_for(conn, events(conn, day, 10))
    env = spark_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_ARCHIVE_URI=str(tmp_path / "archive"),
        OUTBOX_INBOX_RETENTION="8d",
        OUTBOX_SPARK_MASTER="local[1]",
    )
    command = [sys.executable, "-m", "pgoutbox.cli.main", "archive"]
    procs = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"
    ]
    try:
        outputs = [p.communicate(timeout=SPARK_DEADLINE) for p in procs]  # two Sparks at once
    finally:
        for p in procs:  # a timeout leaves neither archiver running after the test
            if p.poll() is None:
                p.kill()
                p.wait()

    assert [p.returncode for p in procs] == [0, 0], outputs
    # the state column: a `done` line ("... removed by <who>") is the other archiver's day
    removed = [line for out, _ in outputs for line in out.splitlines() if line.split()[2:3] == ["removed"]]
    for source in (OUTBOX, INBOX):
        for day in days:
            assert len([line for line in removed if line.startswith(f"{source:15} {day} ")]) == 1, (source, day)
            audits = [a for a in db.audits(conn, source) if a.day == day]
            assert len(audits) == 1 and audits[0].removed_at is not None
    assert not any(" failed " in out or "Traceback" in err for out, err in outputs), outputs
