"""pgoutbox archive: export closed days of outbox.events and inbox.messages
to Parquet on Spark, verify them, record the audit, then drop the partition
or purge the inbox day (spark/archive.py, package pgoutbox_spark; the rules are in SQL)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from pgoutbox.core import db, settings
from pgoutbox.core.errors import ConfigError
from pgoutbox.core.settings import option

COMMAND = "archive"
HELP = (
    "Archive closed days to Parquet on Spark: seal, export, verify, audit, then drop the "
    "partition / purge the inbox day; safe to re-run after a crash."
)

SOURCE_NAMES = {"outbox": "outbox.events", "inbox": "inbox.messages"}


def interval(text: str) -> timedelta:
    return timedelta(seconds=settings.duration(text))


def sources(text: str) -> tuple[str, ...]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SOURCE_NAMES]
    if unknown or not names:
        raise ValueError(f"sources are a comma-separated subset of {', '.join(SOURCE_NAMES)}")
    return tuple(SOURCE_NAMES[s] for s in names)


# Shared with `pgoutbox report`.
SPARK_MASTER = settings.Setting(
    "spark_master",
    "OUTBOX_SPARK_MASTER",
    "local[*]",
    "Spark master when not started by spark-submit (which then sets it)",
)
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
        )
    )
    dead_letter_retention: timedelta = option(
        settings.Setting(
            "dead_letter_retention",
            "OUTBOX_ARCHIVE_DEAD_LETTER_RETENTION",
            "30d",
            "A day holding DEAD_LETTER rows waits this long (time to requeue or replay them)",
            interval,
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
        )
    )
    drop: bool = option(
        settings.Setting(
            "drop",
            "OUTBOX_ARCHIVE_DROP",
            "true",
            "Remove archived days (drop the partition / purge the inbox day); false: export and audit only",
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
        )
    )
    sources: tuple[str, ...] = option(
        settings.Setting(
            "sources",
            "OUTBOX_ARCHIVE_SOURCES",
            "outbox,inbox",
            "Which tables to archive: outbox, inbox or both",
            sources,
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


def options(cfg: ArchiveConfig):
    from pgoutbox_spark.archive import ArchiveOptions
    from pgoutbox_spark.storage import normalise_uri

    return ArchiveOptions(
        archive_uri=normalise_uri(cfg.archive_uri),
        retention=cfg.retention,
        dead_letter_retention=cfg.dead_letter_retention,
        inbox_retention=cfg.inbox_retention,
        read_partitions=cfg.read_partitions,
        fetch_size=cfg.fetch_size,
        drop=cfg.drop,
        lock_timeout=cfg.lock_timeout,
        sources=cfg.sources,
    )


def _print_plan(units) -> None:
    for u in units:
        state = "eligible" if u.eligible else f"blocked: {u.blocked_by}"
        print(f"{u.source:15} {u.day}  {u.row_count:>10} rows  {state}")
    if not units:
        print("nothing old enough to archive")


def run(cfg: ArchiveConfig, args) -> int:
    try:
        from pgoutbox_spark import archive, jdbc, session
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(f"pgoutbox archive needs the spark extra (pip install 'pgoutbox[spark]'): {exc}") from exc
    opts = options(cfg)
    with db.connect(cfg.database_url, check_schema=True) as conn:
        if cfg.dry_run:
            _print_plan(archive.plan(conn, opts))
            return 0
        target = jdbc.from_connection(conn, cfg.jdbc_url)
        with session.spark_session(cfg.spark_master, cfg.spark_jars, "pgoutbox-archive") as spark:
            outcomes = archive.run(spark, conn, target, opts)
    for o in outcomes:
        rows = "" if o.rows is None else f"{o.rows} rows"
        print(f"{o.source:15} {o.day}  {o.state:8} {rows:>14}  {o.detail}")
    failed = sum(o.failed for o in outcomes)
    done = sum(o.state in ("removed", "archived") for o in outcomes)
    print(f"archived {done} day(s) to {opts.archive_uri}; {failed} failed")
    return 1 if failed else 0
