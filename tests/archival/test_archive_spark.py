"""Archival on a real PostgreSQL and a real local Spark: export -> verify ->
audit -> drop/purge for several days, refusals, a crash between every pair
of steps, a damaged archive, a tampered partition, and proof that no row of
outbox.events is ever deleted one by one."""

from __future__ import annotations

import hashlib
import re
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest

from pgoutbox.core.errors import ArchivalRefused, ArchiveMismatch, SqlState
from pgoutbox_spark import archive, jdbc, storage
from pgoutbox_spark import database as db
from pgoutbox_spark.checksum import ChecksumColumn, Figures, figures
from support.archival import archived_rows, events, inbox_for, live_rows, today

pytestmark = pytest.mark.spark

OUTBOX, INBOX = db.OUTBOX, db.INBOX


class Crash(Exception):
    """Stands for the process dying at a step (nothing cleans up after it)."""


def crash_at(step: str):
    def hook(reached: str, unit) -> None:
        if reached == step:
            raise Crash(f"crashed after {step} of {unit.source} {unit.day}")

    return hook


def make_options(tmp_path: Path, **overrides) -> archive.ArchiveOptions:
    values = dict(
        archive_uri=storage.normalise_uri(str(tmp_path / "archive")),
        retention=timedelta(days=7),
        dead_letter_retention=timedelta(days=30),
        inbox_retention=timedelta(days=8),
        read_partitions=3,
        fetch_size=500,
        drop=True,
        lock_timeout=timedelta(seconds=5),
    )
    values.update(overrides)
    return archive.ArchiveOptions(**values)


def run(spark, conn, opts, hook=archive.no_hook):
    return archive.run(spark, conn, jdbc.from_connection(conn), opts, hook)


def by_unit(outcomes) -> dict:
    return {(o.source, o.day): o for o in outcomes}


def partition_exists(conn, day) -> bool:
    name = f"outbox.events_p{day:%Y%m%d}"
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()[0]


def day_path(opts, source, day) -> Path:
    return Path(storage.day_uri(opts.archive_uri, source, day).removeprefix("file://"))


def test_checksum_golden_vector_matches_postgres_and_python(spark):
    """The same row and expected value as pgtap/95_archival.sql."""
    text = (
        "00000000-0000-0000-0000-000000000001|h|sea.event.x.v1|\\N|PROCESSED"
        '|978307200500000|978307201500000|1|a\\|b\\\\c|{"k": "v\\|w"}'
    )
    expected = int(hashlib.md5(text.encode()).hexdigest()[:15], 16)
    frame = spark.sql(
        """SELECT '00000000-0000-0000-0000-000000000001' AS message_id, 'h' AS handler,
                  'sea.event.x.v1' AS subject, CAST(NULL AS STRING) AS envelope, 'PROCESSED' AS status,
                  TIMESTAMP '2001-01-01 00:00:00.5' AS received_at, TIMESTAMP '2001-01-01 00:00:01.5' AS processed_at,
                  1 AS attempts, 'a|b\\\\c' AS last_error, '{"k": "v|w"}' AS dlq_metadata"""
    )
    columns = [
        ChecksumColumn(n, k)
        for n, k in (
            ("message_id", "plain"),
            ("handler", "text"),
            ("subject", "text"),
            ("envelope", "text"),
            ("status", "text"),
            ("received_at", "timestamp"),
            ("processed_at", "timestamp"),
            ("attempts", "plain"),
            ("last_error", "text"),
            ("dlq_metadata", "text"),
        )
    ]
    assert expected == 669279814069009201
    assert figures(frame, columns) == Figures(1, Decimal(expected))


def test_archive_verify_drop_several_days(spark, conn, pg_server, tmp_path):
    t = today()
    archived = [t - timedelta(days=k) for k in (12, 11, 10)]
    d40, d20, d9 = t - timedelta(days=40), t - timedelta(days=20), t - timedelta(days=9)
    ids = {}
    for k, day in enumerate(archived):
        ids[day] = events(conn, day, 30 + 10 * k, context=("sea", "vibespro")[k % 2])
        inbox_for(conn, ids[day])
    ids[d40] = events(conn, d40, 6, dead=2)  # dead letters older than dead_letter_retention
    inbox_for(conn, ids[d40], dead_every=2)
    events(conn, d20, 6, dead=1)  # a dead letter still within it
    events(conn, d9, 6, failed=1)  # a row still open
    inbox_for(conn, events(conn, t, 5))  # today: never touched
    before = {(s, d): live_rows(conn, s, d) for d in archived + [d40] for s in (OUTBOX, INBOX)}
    blocked_before = {d: live_rows(conn, OUTBOX, d) for d in (d20, d9)}

    # auto_explain logs the plan of every statement, nested ones included, of
    # every session on this database (ours, Spark's JDBC readers, the SQL
    # functions): a row-by-row DELETE on outbox.events could not hide.
    dbname = conn.info.dbname
    for setting, value in (
        ("session_preload_libraries", "auto_explain"),
        ("auto_explain.log_min_duration", "0"),
        ("auto_explain.log_nested_statements", "on"),
        ("auto_explain.log_verbose", "on"),
    ):
        conn.execute(f"ALTER DATABASE {dbname} SET {setting} = '{value}'")
    log = pg_server.root / "postgres.log"
    offset = log.stat().st_size
    opts = make_options(tmp_path)
    with psycopg.connect(conn.info.dsn, autocommit=True) as session:  # picks up the settings
        outcomes = by_unit(run(spark, session, opts))
    logged = log.read_text(errors="replace")[offset:]

    for day in archived + [d40]:
        for source in (OUTBOX, INBOX):
            o = outcomes[(source, day)]
            assert o.state == "removed", o
            assert archived_rows(spark, storage.day_uri(opts.archive_uri, source, day)) == before[(source, day)]
            assert live_rows(conn, source, day) == []
        assert not partition_exists(conn, day)
    assert outcomes[(OUTBOX, d20)].state == "blocked"
    assert "dead letters" in outcomes[(OUTBOX, d20)].detail
    assert outcomes[(OUTBOX, d9)].state == "blocked"
    assert "open rows" in outcomes[(OUTBOX, d9)].detail
    for day, rows in blocked_before.items():
        assert partition_exists(conn, day) and live_rows(conn, OUTBOX, day) == rows
    assert len(live_rows(conn, OUTBOX, t)) == 5 and len(live_rows(conn, INBOX, t)) == 5

    audits = db.audits(conn)
    assert sorted((a.source, a.day) for a in audits) == sorted(
        (s, d) for d in archived + [d40] for s in (OUTBOX, INBOX)
    )
    assert all(a.removed_at is not None and a.voided_at is None for a in audits)
    assert {a.row_count for a in audits if a.source == OUTBOX and a.day == d40} == {6}
    assert not Path(opts.archive_uri.removeprefix("file://"), "_staging").exists() or not any(
        Path(opts.archive_uri.removeprefix("file://"), "_staging").rglob("*.parquet")
    )

    assert "Delete on inbox.messages" in logged, "the nested purge DELETE must show: the check can see"
    # No row of outbox.events (nor of its partitions) is deleted, ever: a day leaves
    # by DROP, audited. The only DELETEs allowed in the outbox schema are of the
    # dropped day's rows in the tables kept beside its events: the dead-letter index
    # the console reads (outbox.dlq_entries, kept by triggers) and the delivered
    # scheduled events' rows (outbox.schedules).
    deleted = set(re.findall(r"Delete on (outbox\.\w+)", logged))
    assert deleted <= {"outbox.dlq_entries", "outbox.schedules"}, (
        f"an outbox table other than those kept beside the events lost rows: {deleted}"
    )
    assert "Query Text: SELECT outbox.drop_archived(" in logged

    # A second run finds nothing more to do and changes nothing.
    again = by_unit(run(spark, conn, opts))
    assert {o.state for o in again.values()} == {"blocked"}
    assert len(db.audits(conn)) == len(audits)


STEPS = ("sealed", "written", "committed", "verified", "audited", "removed")


@pytest.mark.parametrize("step", STEPS)
def test_a_crash_after_any_step_is_finished_by_the_next_run(spark, conn, tmp_path, step):
    day = today() - timedelta(days=10)
    ids = events(conn, day, 25, dead=2)
    inbox_for(conn, ids, dead_every=5)
    before = {s: live_rows(conn, s, day) for s in (OUTBOX, INBOX)}
    opts = make_options(tmp_path, dead_letter_retention=timedelta(days=9))

    with pytest.raises(Crash):
        run(spark, conn, opts, crash_at(step))
    crashed_audits = db.audits(conn)
    assert len(crashed_audits) == (1 if step in ("audited", "removed") else 0)
    assert partition_exists(conn, day) == (step != "removed")

    outcomes = by_unit(run(spark, conn, opts))

    for source in (OUTBOX, INBOX):
        assert archived_rows(spark, storage.day_uri(opts.archive_uri, source, day)) == before[source]
        assert live_rows(conn, source, day) == []
        audits = [a for a in db.audits(conn, source) if a.day == day]
        assert len(audits) == 1 and audits[0].removed_at is not None, audits
        assert audits[0].row_count == len(before[source])
    assert not partition_exists(conn, day)
    if step == "removed":
        assert (OUTBOX, day) not in outcomes  # gone: nothing left to do for it
    else:
        assert outcomes[(OUTBOX, day)].state == "removed"
    staging = Path(opts.archive_uri.removeprefix("file://"), "_staging")
    assert not staging.exists() or not any(staging.rglob("*.parquet")), "no half-written day is left behind"


def test_a_damaged_archive_is_rewritten_before_anything_is_removed(spark, conn, tmp_path):
    day = today() - timedelta(days=10)
    events(conn, day, 20)
    before = live_rows(conn, OUTBOX, day)
    opts = make_options(tmp_path, sources=(OUTBOX,))
    with pytest.raises(Crash):
        run(spark, conn, opts, crash_at("audited"))
    final = day_path(opts, OUTBOX, day)
    for part in final.rglob("*.parquet"):  # a torn file, and a stray partial one
        part.write_bytes(part.read_bytes()[:40])
    (final / "context=sea" / "part-99999-stray.parquet").write_bytes(b"PAR1")
    leftover = Path(storage.staging_day_uri(opts.archive_uri, OUTBOX, day).removeprefix("file://"), "dead-run")
    leftover.mkdir(parents=True)
    (leftover / "part-00000.parquet").write_bytes(b"PAR1 half")

    outcomes = by_unit(run(spark, conn, opts))

    assert outcomes[(OUTBOX, day)].state == "removed"
    assert archived_rows(spark, storage.day_uri(opts.archive_uri, OUTBOX, day)) == before
    assert not leftover.exists()
    assert not partition_exists(conn, day)


def test_a_partition_changed_after_its_audit_is_not_dropped(spark, conn, tmp_path):
    day = today() - timedelta(days=10)
    ids = events(conn, day, 15, dead=0)
    opts = make_options(tmp_path, sources=(OUTBOX,), dead_letter_retention=timedelta(days=7))
    first = by_unit(run(spark, conn, make_options(tmp_path, sources=(OUTBOX,), drop=False)))
    assert first[(OUTBOX, day)].state == "archived"

    with conn.transaction():  # tampering: only a trigger-bypassing owner can change a sealed partition
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(
            'UPDATE outbox.events SET payload = \'{"schema_version": 1, "forged": true}\' WHERE event_id = %s',
            (ids[3],),
        )

    outcome = by_unit(run(spark, conn, opts))[(OUTBOX, day)]
    assert outcome.state == "failed"
    assert "ArchiveMismatch [OB062]" in outcome.detail  # the re-run's record: changed since the seal
    assert partition_exists(conn, day)
    with pytest.raises(ArchiveMismatch) as info:
        db.remove(conn, db.units(conn, OUTBOX, opts.retention, opts.dead_letter_retention)[0], opts.lock_timeout)
    assert info.value.code == SqlState.ARCHIVE_MISMATCH
    assert partition_exists(conn, day)
    (audit,) = db.audits(conn, OUTBOX)
    assert audit.removed_at is None and audit.voided_at is None
    assert len(live_rows(conn, OUTBOX, day)) == 15


def test_a_day_with_an_open_row_is_refused_and_left_alone(spark, conn, tmp_path):
    day = today() - timedelta(days=10)
    events(conn, day, 8, pending=1)
    before = live_rows(conn, OUTBOX, day)
    opts = make_options(tmp_path, sources=(OUTBOX,))
    outcome = by_unit(run(spark, conn, opts))[(OUTBOX, day)]
    assert outcome.state == "blocked" and "open rows" in outcome.detail
    assert live_rows(conn, OUTBOX, day) == before
    assert not day_path(opts, OUTBOX, day).exists()
    assert db.audits(conn) == []
    # Even asked directly, the database refuses to seal it.
    with pytest.raises(ArchivalRefused) as info:
        db.seal(conn, f"events_p{day:%Y%m%d}", opts.retention, opts.dead_letter_retention, opts.lock_timeout)
    assert info.value.code == SqlState.NOT_CLOSED


def test_a_drop_that_cannot_get_its_lock_gives_up_and_the_next_run_finishes(spark, conn, tmp_path):
    day = today() - timedelta(days=10)
    events(conn, day, 12)
    before = live_rows(conn, OUTBOX, day)
    opts = make_options(tmp_path, sources=(OUTBOX,), lock_timeout=timedelta(milliseconds=500))
    with psycopg.connect(conn.info.dsn) as long_reader:  # an open transaction that has read outbox.events
        long_reader.execute("SELECT count(*) FROM outbox.events").fetchone()
        outcome = by_unit(run(spark, conn, opts))[(OUTBOX, day)]
        assert outcome.state == "failed" and "[OB059]" in outcome.detail, outcome
        assert partition_exists(conn, day)
        (audit,) = db.audits(conn, OUTBOX)
        assert audit.removed_at is None
    outcome = by_unit(run(spark, conn, opts))[(OUTBOX, day)]
    assert outcome.state == "removed"
    assert archived_rows(spark, storage.day_uri(opts.archive_uri, OUTBOX, day)) == before
    assert not partition_exists(conn, day)
    assert [a.id for a in db.audits(conn, OUTBOX)] == [audit.id], "the same audit row, now removed"
