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


def parquet_files(spark: SparkSession, uri: str) -> int | None:
    """How many Parquet files the day folder holds (None: there is no such folder)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None, "the Spark session has stopped"
    path = jvm.org.apache.hadoop.fs.Path(uri)
    fs = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    if not fs.exists(path):
        return None
    found, files = 0, fs.listFiles(path, True)
    while files.hasNext():
        found += files.next().getPath().getName().endswith(".parquet")
    return found


def day_figures(spark: SparkSession, frame: DataFrame | None, columns: Sequence[ChecksumColumn]) -> Figures:
    """Row count and checksum of the whole day, as archive verification
    computes them. frame None: the folder holds no Parquet file, as a day
    without rows is written (Spark cannot read a schema from it): 0 rows,
    checksum 0."""
    if frame is None:
        return Figures(0, Decimal(0))
    try:
        return figures(frame, columns)
    except (Py4JJavaError, PySparkException) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Unreadable(first) from exc


def opened(spark: SparkSession, uri: str) -> DataFrame | None:
    """The day's rows, cached: the rows delivered are those the checksum was
    computed over, read once (a file swapped in between is not read)."""
    if parquet_files(spark, uri) == 0:
        return None
    try:
        return read_day(spark, uri).cache()
    except (Py4JJavaError, PySparkException) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Unreadable(f"{uri}: {first}") from exc


def _micros(value: int | None) -> datetime | None:
    return None if value is None else EPOCH + timedelta(microseconds=int(value))


def day_rows(
    frame: DataFrame, subjects: Sequence[str], since: datetime, until: datetime, after_id: int
) -> list[dict[str, Any]]:
    """The day's events of these subjects created in [since, until) with an id
    above after_id, in id order, as outbox.backfill_page returns them."""
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
    picked = frame.where(
        subject.isin(list(subjects)) & (created >= low) & (created < high) & (F.col("id") > after_id)
    ).select(
        F.col("id").cast("long").alias("id"),
        subject.alias("subject"),
        F.col("event_version").cast("int").alias("event_version"),
        *(F.col(c).cast("string").alias(c) for c in TEXT_COLUMNS),
        F.unix_micros(F.col("occurred_at")).alias("occurred_micros"),
        created.alias("created_micros"),
    )
    # Sorted here, not in Spark: an orderBy is a shuffle into
    # spark.sql.shuffle.partitions (200) partitions, which the driver would
    # then fetch one job at a time; a day's rows are held in a list anyway.
    out = []
    for row in picked.collect():
        event = row.asDict()
        event["occurred_at"] = _micros(event.pop("occurred_micros"))
        event["created_at"] = _micros(event.pop("created_micros"))
        out.append(event)
    out.sort(key=lambda e: e["id"])
    return out


class SparkReader:
    """pgoutbox.inbox.backfill.ArchiveReader on a Spark session: figures()
    then rows() of the same day read its files once."""

    def __init__(self, spark: SparkSession):
        self.spark = spark
        self.day: tuple[str, DataFrame | None] | None = None

    def figures(self, uri: str, columns: Sequence[tuple[str, str]]) -> tuple[int, Decimal]:
        """A day that is no Parquet any more has figures no audit can hold
        (-1 rows): the gate refuses it as tampered, like an altered one."""
        self.forget()
        try:
            frame = opened(self.spark, uri)
            self.day = (uri, frame)
            got = day_figures(self.spark, frame, [ChecksumColumn(name, kind) for name, kind in columns])
        except Unreadable:
            self.forget()
            return -1, Decimal(-1)
        return got.row_count, got.checksum

    def rows(
        self, uri: str, subjects: Sequence[str], since: datetime, until: datetime, after_id: int
    ) -> list[dict[str, Any]]:
        assert self.day is not None and self.day[0] == uri, "rows() of the day figures() verified"
        frame = self.day[1]
        try:
            return [] if frame is None else day_rows(frame, subjects, since, until, after_id)
        finally:
            self.forget()

    def forget(self) -> None:
        if self.day is not None and self.day[1] is not None:
            self.day[1].unpersist()
        self.day = None
