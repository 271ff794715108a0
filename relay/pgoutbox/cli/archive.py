"""pgoutbox archive: export closed days of outbox.events, inbox.messages and
inbox.commands to Parquet on Spark, verify them, record the audit, then drop
the partition or purge the inbox or command day (spark/pgoutbox_spark/archive.py,
package pgoutbox_spark; the rules are in SQL)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import psycopg

from pgoutbox.core import bounds, db, settings
from pgoutbox.core.errors import ConfigError, SchemaMismatch
from pgoutbox.core.settings import option

if TYPE_CHECKING:  # the spark extra: imported when a command needs it
    from pgoutbox_spark.archive import ArchiveOptions

COMMAND = "archive"
HELP = (
    "Archive closed days to Parquet on Spark: seal, export, verify, audit, then drop the "
    "partition / purge the inbox or command day; safe to re-run after a crash."
)

SOURCE_NAMES = {"outbox": "outbox.events", "inbox": "inbox.messages", "commands": "inbox.commands"}


def interval(text: str) -> timedelta:
    return timedelta(seconds=settings.duration(text))


def start_timeout(text: str) -> timedelta:
    return settings.bound(text, floor=timedelta(seconds=1), ceiling=timedelta(hours=1))


def sources(text: str) -> tuple[str, ...]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SOURCE_NAMES]
    if unknown or not names:
        raise ValueError(f"sources are a comma-separated subset of {', '.join(SOURCE_NAMES)}")
    return tuple(SOURCE_NAMES[s] for s in names)


# Shared with `pgoutbox report` (and `pgoutbox backfill`, which reads archived days).
SPARK_MASTER = settings.SPARK_MASTER
SPARK_JARS = settings.Setting(
    "spark_jars",
    "OUTBOX_SPARK_JARS",
    "/usr/share/java/postgresql.jar",
    "JDBC driver jar(s) for spark.jars when not started by spark-submit (comma-separated)",
)
JDBC_URL = settings.Setting(
    "jdbc_url",
    "OUTBOX_JDBC_URL",
    None,
    "JDBC URL Spark reads from (default: derived from the database connection; user and password come from it too)",
)
READ_PARTITIONS = settings.Setting(
    "read_partitions",
    "OUTBOX_SPARK_READ_PARTITIONS",
    "4",
    "Parallel JDBC readers per day (range-split on id / received_at)",
    settings.positive_int,
)
FETCH_SIZE = settings.Setting(
    "fetch_size",
    "OUTBOX_SPARK_FETCH_SIZE",
    "10000",
    "JDBC fetch size (rows per round trip)",
    settings.positive_int,
)


@dataclass(frozen=True)
class SparkJobConfig:
    """What every Spark job of pgoutbox needs (archive, report)."""

    database_url: str | None = option(settings.DATABASE_URL)
    spark_master: str = option(SPARK_MASTER)
    spark_jars: str = option(SPARK_JARS)
    jdbc_url: str | None = option(JDBC_URL)
    read_partitions: int = option(READ_PARTITIONS)
    fetch_size: int = option(FETCH_SIZE)


@dataclass(frozen=True)
class ArchiveConfig(SparkJobConfig):
    archive_uri: str = option(
        settings.Setting(
            "archive_uri",
            "OUTBOX_ARCHIVE_URI",
            ".data/archive",
            "Where the Parquet archive goes: a folder, or any Hadoop-compatible URI (hdfs://, s3a://)",
        )
    )
    retention: timedelta = option(
        settings.Setting(
            "retention",
            "OUTBOX_ARCHIVE_RETENTION",
            "7d",
            "Archive outbox day partitions whose day ended longer ago than this",
            interval,
            bound=bounds.RETENTION,
        )
    )
    dead_letter_retention: timedelta = option(
        settings.Setting(
            "dead_letter_retention",
            "OUTBOX_ARCHIVE_DEAD_LETTER_RETENTION",
            "30d",
            "A day holding DEAD_LETTER rows waits this long (time to requeue or replay them)",
            interval,
            bound=bounds.RETENTION,
        )
    )
    inbox_retention: timedelta = option(
        settings.Setting(
            "inbox_retention",
            "OUTBOX_INBOX_RETENTION",
            "14d",
            "Archive inbox days older than this; refused below the streams' max_age "
            "(inbox.retention_policy, 7d by default)",
            interval,
            bound=bounds.RETENTION,
        )
    )
    command_retention: timedelta = option(
        settings.Setting(
            "command_retention",
            "OUTBOX_COMMAND_RETENTION",
            "30d",
            "Archive days of command keys once every key settled longer ago than this (a retried command "
            "is answered for at least this long); refused below the clients' retry window "
            "(inbox.command_policy, 7d by default)",
            interval,
            bound=bounds.RETENTION,
        )
    )
    drop: bool = option(
        settings.Setting(
            "drop",
            "OUTBOX_ARCHIVE_DROP",
            "true",
            "Remove archived days (drop the partition / purge the inbox or command day); false: export and audit only",
            settings.boolean,
        )
    )
    lock_timeout: timedelta = option(
        settings.Setting(
            "lock_timeout",
            "OUTBOX_ARCHIVE_LOCK_TIMEOUT",
            "5s",
            "Longest wait for the locks to seal or drop a partition (then: busy, retried next run)",
            interval,
            bound=bounds.LOCK_TIMEOUT,
        )
    )
    sources: tuple[str, ...] = option(
        settings.Setting(
            "sources",
            "OUTBOX_ARCHIVE_SOURCES",
            "outbox,inbox,commands",
            "Which tables to archive: a comma-separated subset of outbox, inbox, commands",
            sources,
        )
    )
    archive_shared: bool = option(
        settings.Setting(
            "archive_shared",
            "OUTBOX_ARCHIVE_SHARED",
            "false",
            "true: a local OUTBOX_ARCHIVE_URI is one shared mount on every Spark host (refused otherwise "
            "under a cluster master)",
            settings.boolean,
        )
    )
    spark_start_timeout: timedelta = option(
        settings.Setting(
            "spark_start_timeout",
            "OUTBOX_SPARK_START_TIMEOUT",
            "2m",
            "Longest wait for a cluster to give the job an executor, before anything is sealed; 1s to 1h",
            start_timeout,
        )
    )
    dry_run: bool = option(
        settings.Setting(
            "dry_run",
            "OUTBOX_ARCHIVE_DRY_RUN",
            "false",
            "Only list the days old enough to archive and what blocks each (no Spark)",
            settings.boolean,
        )
    )


CONFIG = ArchiveConfig
SETTINGS = settings.of(CONFIG)


def options(cfg: ArchiveConfig) -> ArchiveOptions:
    from pgoutbox_spark.archive import ArchiveOptions
    from pgoutbox_spark.storage import normalise_uri

    return ArchiveOptions(
        archive_uri=normalise_uri(cfg.archive_uri),
        retention=cfg.retention,
        dead_letter_retention=cfg.dead_letter_retention,
        inbox_retention=cfg.inbox_retention,
        command_retention=cfg.command_retention,
        read_partitions=cfg.read_partitions,
        fetch_size=cfg.fetch_size,
        drop=cfg.drop,
        lock_timeout=cfg.lock_timeout,
        sources=cfg.sources,
        shared_storage=cfg.archive_shared,
        start_timeout=cfg.spark_start_timeout,
    )


def _print_plan(units: list[Any]) -> None:
    for u in units:
        state = "eligible" if u.eligible else f"blocked: {u.blocked_by}"
        print(f"{u.source:15} {u.day}  {u.row_count:>10} rows  {state}")
    if not units:
        print("nothing old enough to archive")


def run(cfg: ArchiveConfig, args: argparse.Namespace) -> int:
    try:
        from pgoutbox_spark import archive, session
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(f"pgoutbox archive needs the spark extra (pip install 'pgoutbox[spark]'): {exc}") from exc
    if not session.submitted():  # under spark-submit the master is spark-submit's: preflight() checks it
        problem = archive.split_archive(cfg.spark_master, options(cfg).archive_uri, cfg.archive_shared)
        if problem is not None:
            raise ConfigError(problem)
    with db.connect(cfg.database_url, check_schema=True) as conn:
        check_sources(conn, cfg.sources)
        if cfg.dry_run:
            _print_plan(archive.plan(conn, options(cfg)))
            return 0
        check_schema(conn)
        with session.spark_session(cfg.spark_master, cfg.spark_jars, "pgoutbox-archive") as spark:
            return archive_days(spark, conn, cfg)


def check_schema(conn: psycopg.Connection[Any]) -> None:
    from pgoutbox_spark import database

    if not database.has_seal_figures(conn):
        raise SchemaMismatch("this archiver takes seal figures (outbox.seal_figures): run `pgoutbox migrate`")


def check_sources(conn: psycopg.Connection[Any], names: tuple[str, ...]) -> None:
    """Command keys are archived from schema 14 on (the dry run lists them too)."""
    from pgoutbox_spark import database

    if database.COMMANDS in names and not database.has_command_archival(conn):
        raise SchemaMismatch(
            "archiving command keys needs schema 14 (inbox.archivable_command_days): run `pgoutbox migrate`, "
            "or leave commands out of OUTBOX_ARCHIVE_SOURCES"
        )


def archive_days(spark: Any, conn: psycopg.Connection[Any], cfg: ArchiveConfig) -> int:
    """The run on a session already started: one line per day, then a summary;
    1 when a day failed."""
    from pgoutbox_spark import archive, jdbc

    opts = options(cfg)
    outcomes = archive.run(spark, conn, jdbc.from_connection(conn, cfg.jdbc_url), opts)
    return print_outcomes(outcomes, opts.archive_uri)


def print_outcomes(outcomes: list[Any], archive_uri: str) -> int:
    """One line per day (removed, archived, blocked, busy, done or failed with
    its code), a summary; the exit code: 1 when a day failed."""
    for o in outcomes:
        rows = "" if o.rows is None else f"{o.rows} rows"
        print(f"{o.source:15} {o.day}  {o.state:8} {rows:>14}  {o.detail}", flush=True)
    failed = sum(o.failed for o in outcomes)
    done = sum(o.state in ("removed", "archived") for o in outcomes)
    print(f"archived {done} day(s) to {archive_uri}; {failed} failed", flush=True)
    return 1 if failed else 0
