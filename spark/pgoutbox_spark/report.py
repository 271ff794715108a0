"""The delivery report, over the archive and the live tables.

Rows come from the archive for every day with a standing (not voided) audit
row, and from the live tables for every other day, so a day archived but not
yet removed is counted once.

Grain: (day, context, event_type), plus one row per (day, context) with
event_type '*' over all types (percentiles cannot be added up, so the rollup
is computed from the rows, not from the finer groups). The day is the UTC day
of the event's occurred_at; an inbox row takes it from its envelope, else
from the outbox row of the same event (message_id = event_id), else from its
own received_at. context and event_type of an inbox row come from its subject
({context}.event.{event_type}.v{n}).

Metrics (the delivery targets; docs/archival.md has the reasoning):
  delivery_rate              published (COMPLETED) / events
  outbox_dead_letter_rate    outbox DEAD_LETTER (discarded ones too) / events
  dlq_rate                   inbox DEAD_LETTER / inbox messages
  inbox_conflict_rate        redeliveries the inbox caught (attempts - 1) / messages
  duplicate_processing_rate  processings beyond the first of a (message, handler),
                             across archive and live / processed
  publish_p50/p95/p99_ms     published_at - created_at, COMPLETED events
  e2e_p50/p95/p99_ms         processed_at - occurred_at, PROCESSED inbox rows
Percentiles are exact, interpolated like PostgreSQL's percentile_cont.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from datetime import date
from typing import Any

import psycopg
from pyspark.sql import Column, DataFrame, GroupedData, SparkSession, Window
from pyspark.sql import functions as F

from . import database as db
from . import jdbc, storage

ALL_TYPES = "*"
PERCENTILES = (0.5, 0.95, 0.99)
KEYS = ("day", "context", "event_type")
MICROS_PER_DAY = 86_400_000_000

COLUMNS = (
    "day",
    "context",
    "event_type",
    "events",
    "published",
    "delivery_rate",
    "outbox_dead_letters",
    "outbox_dead_letter_rate",
    "publish_p50_ms",
    "publish_p95_ms",
    "publish_p99_ms",
    "messages",
    "processed",
    "inbox_dead_letters",
    "dlq_rate",
    "inbox_conflicts",
    "inbox_conflict_rate",
    "duplicate_processings",
    "duplicate_processing_rate",
    "e2e_p50_ms",
    "e2e_p95_ms",
    "e2e_p99_ms",
)
COUNTS = (
    "events",
    "published",
    "outbox_dead_letters",
    "messages",
    "processed",
    "inbox_dead_letters",
    "inbox_conflicts",
    "duplicate_processings",
)


def utc_day(column: Column) -> Column:
    """The UTC day of a timestamp, whatever the session time zone."""
    return F.date_from_unix_date(F.floor(F.unix_micros(column) / MICROS_PER_DAY).cast("int"))


def rows(
    spark: SparkSession,
    conn: psycopg.Connection,
    target: jdbc.JdbcTarget,
    source: str,
    *,
    fetch_size: int,
    read_partitions: int,
) -> DataFrame:
    """All rows of a source: the archived days from Parquet, the rest live."""
    split: tuple[str, Any, Any]
    schema, table = source.split(".")
    if source == db.OUTBOX:
        day_column = "created_at"
        low, high = db.id_range(conn)
        split = ("id", low, None if high is None else high + 1)
    else:
        day_column = "received_at"
        split = ("received_at", *db.received_range(conn))
    column, lower, upper = split
    live = jdbc.read(
        spark,
        target,
        jdbc.relation(conn, schema, table),
        fetch_size=fetch_size,
        partition_column=column,
        lower=lower,
        upper=upper,
        partitions=read_partitions,
    )
    archived_days = [a for a in db.audits(conn, source) if a.standing]
    if not archived_days:
        return live
    live = live.where(~utc_day(F.col(day_column)).isin([a.day for a in archived_days]))
    by_root: dict[str, list[str]] = {}
    for audit in archived_days:
        by_root.setdefault(storage.day_root(audit.archive_uri), []).append(audit.archive_uri)
    frame = live
    for root, uris in by_root.items():
        archived = spark.read.schema(live.schema).option("basePath", root).parquet(*uris)
        frame = frame.unionByName(archived.drop("day"))
    return frame


def _percentiles(value: Column, prefix: str) -> list[Column]:
    exact = F.percentile(value, list(PERCENTILES))
    return [(exact[i] / F.lit(1000.0)).alias(f"{prefix}_p{round(p * 100)}_ms") for i, p in enumerate(PERCENTILES)]


def _micros_between(later: str, earlier: Column | str) -> Column:
    earlier = F.col(earlier) if isinstance(earlier, str) else earlier
    return F.unix_micros(F.col(later)) - F.unix_micros(earlier)


def _with_grains(frame: DataFrame, aggregate: Callable[[GroupedData], DataFrame]) -> DataFrame:
    """aggregate() per (day, context, event_type) and per (day, context) with event_type '*'."""
    fine = aggregate(frame.groupBy(*KEYS))
    rollup = aggregate(frame.withColumn("event_type", F.lit(ALL_TYPES)).groupBy(*KEYS))
    return fine.unionByName(rollup)


def outbox_metrics(events: DataFrame) -> DataFrame:
    completed = F.col("status") == "COMPLETED"
    frame = events.select(
        utc_day(F.col("occurred_at")).alias("day"),
        "context",
        "event_type",
        "status",
        F.when(completed, _micros_between("published_at", "created_at")).alias("publish_micros"),
    )
    return _with_grains(
        frame,
        lambda grouped: grouped.agg(
            F.count(F.lit(1)).alias("events"),
            F.count(F.when(completed, 1)).alias("published"),
            # A discarded dead letter stays DEAD_LETTER on both sides. DISCARDED: the
            # status a pre-release build (schema 16 and 17) gave one, in its archives.
            F.count(F.when(F.col("status").isin("DEAD_LETTER", "DISCARDED"), 1)).alias("outbox_dead_letters"),
            *_percentiles(F.col("publish_micros"), "publish"),
        ),
    )


def inbox_metrics(messages: DataFrame, events: DataFrame) -> DataFrame:
    occurred = events.groupBy(F.col("event_id").alias("message_id")).agg(
        F.min("occurred_at").alias("event_occurred_at")
    )
    # The n-th processing of a (message, handler) is a duplicate for n > 1:
    # possible only across archive and live (the inbox key forbids it within).
    nth = Window.partitionBy("message_id", "handler", "is_processed").orderBy("received_at")
    frame = (
        messages.join(occurred, "message_id", "left")
        .withColumn(
            "occurred_at",
            F.coalesce(
                F.try_to_timestamp(F.get_json_object(F.col("envelope"), "$.occurred_at")),
                F.col("event_occurred_at"),
            ),
        )
        .withColumn("is_processed", F.col("status") == "PROCESSED")
        .select(
            utc_day(F.coalesce(F.col("occurred_at"), F.col("received_at"))).alias("day"),
            F.split_part(F.col("subject"), F.lit("."), F.lit(1)).alias("context"),
            F.split_part(F.col("subject"), F.lit("."), F.lit(3)).alias("event_type"),
            "status",
            "attempts",
            (F.col("is_processed") & (F.row_number().over(nth) > 1)).alias("duplicate"),
            F.when(F.col("is_processed"), _micros_between("processed_at", F.col("occurred_at"))).alias("e2e_micros"),
        )
    )
    return _with_grains(
        frame,
        lambda grouped: grouped.agg(
            F.count(F.lit(1)).alias("messages"),
            F.count(F.when(F.col("status") == "PROCESSED", 1)).alias("processed"),
            F.count(F.when(F.col("status") == "DEAD_LETTER", 1)).alias("inbox_dead_letters"),
            F.sum(F.col("attempts") - 1).alias("inbox_conflicts"),
            F.count(F.when(F.col("duplicate"), 1)).alias("duplicate_processings"),
            *_percentiles(F.col("e2e_micros"), "e2e"),
        ),
    )


def _rate(numerator: str, denominator: str) -> Column:
    return F.when(F.col(denominator) > 0, F.col(numerator) / F.col(denominator))


def delivery_report(events: DataFrame, messages: DataFrame) -> DataFrame:
    table = outbox_metrics(events).join(inbox_metrics(messages, events), list(KEYS), "full_outer")
    for name in COUNTS:
        table = table.withColumn(name, F.coalesce(F.col(name), F.lit(0)).cast("long"))
    table = (
        table.withColumn("delivery_rate", _rate("published", "events"))
        .withColumn("outbox_dead_letter_rate", _rate("outbox_dead_letters", "events"))
        .withColumn("dlq_rate", _rate("inbox_dead_letters", "messages"))
        .withColumn("inbox_conflict_rate", _rate("inbox_conflicts", "messages"))
        .withColumn("duplicate_processing_rate", _rate("duplicate_processings", "processed"))
    )
    return table.select(*COLUMNS).orderBy(*KEYS)


def build(
    spark: SparkSession,
    conn: psycopg.Connection,
    target: jdbc.JdbcTarget,
    *,
    fetch_size: int,
    read_partitions: int,
) -> DataFrame:
    read = dict(fetch_size=fetch_size, read_partitions=read_partitions)
    events = rows(spark, conn, target, db.OUTBOX, **read).cache()  # used by both sides
    messages = rows(spark, conn, target, db.INBOX, **read)
    return delivery_report(events, messages)


# CSV precision: rates to a millionth (0.0001 %, finer than the tightest
# target, 99.99 %), milliseconds to the microsecond the timestamps carry.
DECIMALS = {name: 6 for name in COLUMNS if name.endswith("_rate")} | {
    name: 3 for name in COLUMNS if name.endswith("_ms")
}


def _cell(name: str, value: Any) -> object:
    if value is None:
        return ""
    if isinstance(value, date):
        return value.isoformat()
    if name in DECIMALS:
        # Fixed point, trailing zeros dropped: 0.999950, not 0.9999500000000001 or 1e-06.
        return f"{float(value):.{DECIMALS[name]}f}".rstrip("0").rstrip(".")
    return value


def to_csv(records: Sequence[dict[str, Any]]) -> bytes:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(COLUMNS), lineterminator="\n")
    writer.writeheader()
    for record in records:
        writer.writerow({k: _cell(k, v) for k, v in record.items()})
    return out.getvalue().encode()


def write(spark: SparkSession, table: DataFrame, report_uri: str, *, title: str) -> dict[str, str]:
    """Writes the table (Parquet and CSV) and the chart (PNG); returns their URIs."""
    from .chart import render  # matplotlib only when a chart is drawn

    store = storage.Storage(spark)
    root = report_uri.rstrip("/")
    paths = {
        "parquet": f"{root}/delivery_report.parquet",
        "csv": f"{root}/delivery_report.csv",
        "png": f"{root}/delivery_report.png",
    }
    table.coalesce(1).write.mode("overwrite").parquet(paths["parquet"])
    records = [row.asDict() for row in table.collect()]
    store.write_bytes(paths["csv"], to_csv(records))
    store.write_bytes(paths["png"], render([r for r in records if r["event_type"] == ALL_TYPES], title=title))
    return paths
