"""The archival job: for each eligible day (of outbox.events, inbox.messages
and inbox.commands), seal -> export -> verify -> audit -> remove: no row
leaves the database before a verified copy exists.

Every step is idempotent, so a run that dies anywhere is finished by the
next one, without loss or duplication:
  * seal: re-sealing a sealed partition is a no-op (and nothing can change
    a sealed partition, so every later read sees the same rows);
  * export: a day is written to a fresh staging folder and renamed over its
    final folder (storage.py), so a crash leaves no half-written day behind
    and a rewrite replaces rather than appends;
  * verify: the final folder is read back and its count and checksum are
    computed here, the same way the database computes them;
  * audit: record_archive compares them with the live rows and records them
    once (the same figures again return the same row);
  * remove: drop/purge compare the live rows with the audit once more, in
    the removing transaction; already removed returns 0.
A re-run that finds a standing audit re-verifies the archive against it
and skips the export when it matches.

Before anything is sealed the run checks what every day needs (preflight):
an archive location the executors share, Spark executors, and a writable
archive location; without them it stops with one line (SparkUnavailable,
exit code 5, or ConfigError) and nothing sealed. After that, each day
fails on its own: any error of JDBC, the file system or Spark becomes one
coded line for that day (failures.py) and the run goes on.

Any number of archivers may run at once: a day is handled under its
advisory lock by one of them; another reports it `busy`, and one whose day
list went stale while it waited finds the day's audit marked removed and
reports it `done`.

`hook(step, unit)` is called after each step (sealed, written, committed,
verified, audited, removed); the tests make it raise to stand for a crash.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date, timedelta

import psycopg
from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from pgoutbox.core.errors import ArchiveMismatch, ConfigError, PgOutboxError, SqlState

from . import database as db
from . import failures, jdbc, session, storage
from .checksum import ChecksumColumn, Figures, figures
from .failures import ArchiveFailure, Failure

Hook = Callable[[str, db.Unit], None]


def no_hook(step: str, unit: db.Unit) -> None:
    """Default hook: nothing."""


@dataclass(frozen=True)
class ArchiveOptions:
    archive_uri: str
    retention: timedelta
    dead_letter_retention: timedelta
    inbox_retention: timedelta
    read_partitions: int
    fetch_size: int
    drop: bool
    lock_timeout: timedelta
    sources: tuple[str, ...] = db.SOURCES
    command_retention: timedelta = timedelta(days=30)
    shared_storage: bool = False  # the operator says a local path is the same disk on every executor
    start_timeout: timedelta = timedelta(minutes=2)


@dataclass(frozen=True)
class Outcome:
    source: str
    day: date
    state: str  # removed | archived | blocked | busy | done | failed
    rows: int | None = None
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.state == "failed"


def plan(conn: psycopg.Connection, options: ArchiveOptions) -> list[db.Unit]:
    """Every day old enough to archive, per source, eligible or not."""
    found: list[db.Unit] = []
    for source in options.sources:
        retention = {
            db.OUTBOX: options.retention,
            db.INBOX: options.inbox_retention,
            db.COMMANDS: options.command_retention,
        }[source]
        found.extend(db.units(conn, source, retention, options.dead_letter_retention))
    return found


def split_archive(master: str, archive_uri: str, shared_storage: bool) -> str | None:
    """Why a local archive folder cannot be used under `master`, or None: a
    cluster master (anything but local[...]) runs executors on other hosts,
    and each would write its share of a day to its own disk. Needs no Spark:
    `pgoutbox archive` asks before it starts one (a master that does not
    answer would cost its whole start timeout first), preflight() again with
    the master spark-submit set."""
    if master.startswith("local") or not storage.is_local(archive_uri) or shared_storage:
        return None
    return (
        f"OUTBOX_ARCHIVE_URI={archive_uri} is a folder of one host's disk, and master {master} runs "
        "executors on other hosts: each would write its share of a day to its own disk. Use a shared "
        "file system (hdfs://, s3a://, gs://), or set OUTBOX_ARCHIVE_SHARED=true if this path is "
        "the same shared mount on every host"
    )


def preflight(spark: SparkSession, store: storage.Storage, target: jdbc.JdbcTarget, options: ArchiveOptions) -> int:
    """What every day needs, checked before anything is sealed; returns the
    number of executors. Raises ConfigError (a local archive folder under a
    cluster master) or SparkUnavailable (no executor, no usable archive
    location)."""
    problem = split_archive(spark.sparkContext.master or "", options.archive_uri, options.shared_storage)
    if problem is not None:
        raise ConfigError(problem)
    unconfigured = failures.hdfs_unconfigured(options.archive_uri, store.default_fs())
    if unconfigured is not None:
        raise failures.unavailable(unconfigured)
    try:
        store.check_writable(options.archive_uri)
    except (*failures.SPARK_ERRORS, ArchiveFailure, OSError) as exc:
        raise failures.unavailable(failures.classify(exc, jdbc_url=target.url, uri=options.archive_uri)) from exc
    return session.wait_for_executors(spark, options.start_timeout.total_seconds())


def run(
    spark: SparkSession,
    conn: psycopg.Connection,
    target: jdbc.JdbcTarget,
    options: ArchiveOptions,
    hook: Hook = no_hook,
) -> list[Outcome]:
    """Archives every eligible day; a day that fails is reported and the run
    goes on with the next one (nothing of a failed day is removed)."""
    store = storage.Storage(spark)
    preflight(spark, store, target, options)
    outcomes: list[Outcome] = []
    columns = {source: db.checksum_columns(conn, source) for source in options.sources}
    for unit in plan(conn, options):
        if not unit.eligible:
            outcomes.append(Outcome(unit.source, unit.day, "blocked", unit.row_count, unit.blocked_by or ""))
            continue
        try:
            outcomes.append(archive_unit(spark, conn, target, store, unit, options, columns[unit.source], hook))
        except PgOutboxError as exc:
            code = f" [{exc.code}]" if exc.code else ""
            message = " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            outcomes.append(Outcome(unit.source, unit.day, "failed", None, f"{type(exc).__name__}{code}: {message}"))
    return outcomes


def archive_unit(
    spark: SparkSession,
    conn: psycopg.Connection,
    target: jdbc.JdbcTarget,
    store: storage.Storage,
    unit: db.Unit,
    options: ArchiveOptions,
    columns: Sequence[ChecksumColumn],
    hook: Hook = no_hook,
) -> Outcome:
    if not db.try_lock(conn, unit):
        return Outcome(unit.source, unit.day, "busy", None, "another archiver is on this day")
    where = options.archive_uri
    try:
        audits = [a for a in db.audits(conn, unit.source) if a.day == unit.day]
        audit = next((a for a in audits if a.standing), None)
        if audit is not None and audit.removed_at is not None:
            # Listed before another archiver finished it: nothing left to do.
            return Outcome(unit.source, unit.day, "done", audit.row_count, f"removed by {audit.removed_by}")
        final = (
            audit.archive_uri
            if audit is not None
            else storage.free_day_uri(
                options.archive_uri, unit.source, unit.day, {a.archive_uri for a in audits if not a.standing}
            )
        )
        where = final
        source_frame, expected_rows = open_unit(spark, conn, target, unit, options)
        hook("sealed", unit)
        archived = None
        if audit is not None and store.exists(final):
            archived = readable_figures(spark, final, source_frame, columns)
            if archived != audit.figures:
                archived = None  # missing, damaged or different: export again from the live rows
        if archived is None:
            archived = export(spark, store, source_frame, unit, options.archive_uri, final, columns, hook)
        try:
            db.record(conn, unit.source, unit.day, archived, final)
        except ArchiveMismatch as exc:
            if exc.code == SqlState.ARCHIVE_MISMATCH and archived.row_count != expected_rows:
                raise ArchiveFailure(
                    Failure.ARCHIVE_INCOMPLETE,
                    f"{final} holds {archived.row_count} rows, the day {expected_rows}: nothing was removed "
                    "(an archive folder that the executors do not share?)",
                ) from exc
            raise
        hook("audited", unit)
        if not options.drop:
            return Outcome(unit.source, unit.day, "archived", archived.row_count, final)
        db.remove(conn, unit, options.lock_timeout)
        hook("removed", unit)
        return Outcome(unit.source, unit.day, "removed", archived.row_count, final)
    except (*failures.SPARK_ERRORS, OSError) as exc:
        raise failures.classify(exc, jdbc_url=target.url, uri=where) from exc
    finally:
        db.unlock(conn, unit)


def open_unit(
    spark: SparkSession, conn: psycopg.Connection, target: jdbc.JdbcTarget, unit: db.Unit, options: ArchiveOptions
) -> tuple[DataFrame, int]:
    """Seals an outbox partition and takes its seal figures (which
    record_archive and drop_archived compare with); returns the (lazy) JDBC
    frame of the unit's rows and how many rows its archive must hold (outbox:
    as sealed; inbox and command keys: as listed). An inbox day is read by
    received_at, a day of command keys by first_claimed_at (neither changes)."""
    read = dict(fetch_size=options.fetch_size)
    if unit.source == db.OUTBOX:
        if unit.partition is None:  # outbox.archive_units names every outbox day's partition
            raise ArchiveFailure(Failure.ARCHIVE_INCOMPLETE, f"outbox day {unit.day} has no partition")
        # The partition itself: exactly the relation that is verified and dropped.
        bounds = db.seal(conn, unit.partition, options.retention, options.dead_letter_retention, options.lock_timeout)
        sealed = db.seal_figures(conn, unit.partition)
        frame = jdbc.read(
            spark,
            target,
            jdbc.relation(conn, "outbox", unit.partition),
            **read,
            partition_column="id",
            lower=bounds.min_id,
            upper=None if bounds.max_id is None else bounds.max_id + 1,
            partitions=max(1, min(options.read_partitions, sealed.row_count)),
        )
        return frame, sealed.row_count
    table, column = ("commands", "first_claimed_at") if unit.source == db.COMMANDS else ("messages", "received_at")
    range_from, range_to = db.day_range(unit.day)
    frame = jdbc.read(
        spark,
        target,
        jdbc.relation(conn, "inbox", table),
        **read,
        partition_column=column,
        lower=range_from,
        upper=range_to,
        partitions=max(1, min(options.read_partitions, unit.row_count)),
    ).where((F.col(column) >= F.lit(range_from)) & (F.col(column) < F.lit(range_to)))
    return frame, unit.row_count


# The column a day's Parquet folders are split by: context for events and
# messages; command keys have none, so their handler.
PARTITION_BY = {db.OUTBOX: "context", db.INBOX: "context", db.COMMANDS: "handler"}


def export(
    spark: SparkSession,
    store: storage.Storage,
    source_frame: DataFrame,
    unit: db.Unit,
    archive_uri: str,
    final: str,
    columns: Sequence[ChecksumColumn],
    hook: Hook = no_hook,
) -> Figures:
    """Writes the day (partitioned by context, or handler for command keys)
    to staging, renames it into place (final), reads it back and returns its
    figures."""
    leftovers = storage.staging_day_uri(archive_uri, unit.source, unit.day)
    store.delete(leftovers)  # from runs that died mid-write; the day lock keeps others out
    staging = storage.fresh_staging_uri(archive_uri, unit.source, unit.day)
    source_frame.write.mode("errorifexists").partitionBy(PARTITION_BY[unit.source]).parquet(staging)
    hook("written", unit)
    store.replace(staging, final)
    store.delete(leftovers)
    hook("committed", unit)
    archived = readable_figures(spark, final, source_frame, columns)
    if archived is None:
        raise ArchiveFailure(Failure.STORAGE_FAILED, f"{final} cannot be read back")
    hook("verified", unit)
    return archived


def read_day(spark: SparkSession, uri: str, like: DataFrame) -> DataFrame:
    """A day folder, with the schema of the live rows (context or handler from the folder names)."""
    return spark.read.schema(like.schema).parquet(uri)


def readable_figures(
    spark: SparkSession, uri: str, like: DataFrame, columns: Sequence[ChecksumColumn]
) -> Figures | None:
    """The figures of an archived day, or None when it cannot be read."""
    try:
        return figures(read_day(spark, uri, like), columns)
    except (Py4JJavaError, PySparkException):
        return None
