"""`pgoutbox backfill` reading an archived day of outbox.events back from its
Parquet folder, with the archival job's own machinery: the same Spark
session builder, the same read of a day folder, the same checksum
(checksum.figures over outbox.checksum_columns). The figures are computed
over the whole day as it lies on storage, before any row of it is used, and
the caller hands them to outbox.backfill_verify_archived_day, which refuses
a day that is not what was audited (OB111).

Timestamps are taken as epoch microseconds and rebuilt in Python as UTC:
PySpark would hand them back as naive datetimes of the driver's local zone.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from .checksum import ChecksumColumn, Figures, figures

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# The columns a backfill delivers (outbox.backfill_page's), besides the two
# timestamps, taken as text: uuids and jsonb are strings in the archive.
TEXT_COLUMNS = (
    "event_id",
    "context",
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "payload",
    "headers",
    "correlation_id",
    "causation_id",
    "tenant_id",
    "ordering_key",
)


class Unreadable(Exception):
    """The day's folder cannot be read as Parquet (gone, or not Parquet any more)."""


def read_day(spark: SparkSession, uri: str) -> DataFrame:
    """A day folder as the archive wrote it (context from the folder names)."""
    return spark.read.parquet(uri)


def day_figures(spark: SparkSession, uri: str, columns: Sequence[ChecksumColumn]) -> Figures:
    """Row count and checksum of the whole day, as archive verification computes them."""
    try:
        return figures(read_day(spark, uri), columns)
    except (Py4JJavaError, PySparkException) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Unreadable(f"{uri}: {first}") from exc


def _micros(value: int | None) -> datetime | None:
    return None if value is None else EPOCH + timedelta(microseconds=int(value))


def day_rows(
    spark: SparkSession, uri: str, subjects: Sequence[str], since: datetime, until: datetime, after_id: int
) -> list[dict[str, Any]]:
    """The day's events of these subjects created in [since, until) with an id
    above after_id, in id order, as outbox.backfill_page returns them."""
    frame = read_day(spark, uri)
    subject = F.concat_ws(
        ".",
        F.col("context"),
        F.lit("event"),
        F.col("event_type"),
        F.concat(F.lit("v"), F.col("event_version").cast("string")),
    )
    created = F.unix_micros(F.col("created_at"))
    low = int((since - EPOCH) / timedelta(microseconds=1))
    high = int((until - EPOCH) / timedelta(microseconds=1))
    picked = (
        frame.where(subject.isin(list(subjects)) & (created >= low) & (created < high) & (F.col("id") > after_id))
        .select(
            F.col("id").cast("long").alias("id"),
            subject.alias("subject"),
            F.col("event_version").cast("int").alias("event_version"),
            *(F.col(c).cast("string").alias(c) for c in TEXT_COLUMNS),
            F.unix_micros(F.col("occurred_at")).alias("occurred_micros"),
            created.alias("created_micros"),
        )
        .orderBy("id")
    )
    out = []
    for row in picked.toLocalIterator():
        event = row.asDict()
        event["occurred_at"] = _micros(event.pop("occurred_micros"))
        event["created_at"] = _micros(event.pop("created_micros"))
        out.append(event)
    return out


class SparkReader:
    """pgoutbox.inbox.backfill.ArchiveReader on a Spark session."""

    def __init__(self, spark: SparkSession):
        self.spark = spark

    def figures(self, uri: str, columns: Sequence[tuple[str, str]]) -> tuple[int, Decimal]:
        """A day that is no Parquet any more has figures no audit can hold
        (-1 rows): the gate refuses it as tampered, like an altered one."""
        try:
            got = day_figures(self.spark, uri, [ChecksumColumn(name, kind) for name, kind in columns])
        except Unreadable:
            return -1, Decimal(-1)
        return got.row_count, got.checksum

    def rows(
        self, uri: str, subjects: Sequence[str], since: datetime, until: datetime, after_id: int
    ) -> list[dict[str, Any]]:
        return day_rows(self.spark, uri, subjects, since, until, after_id)
