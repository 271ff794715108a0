"""The archive checksum in Spark, identical to outbox.archive_figures() in
PostgreSQL (sql/93_archival_checksum.sql; sql/91_archival_audit.sql documents
the canonical form):

    row   concat_ws('|', rendered columns) -> md5 -> first 15 hex digits -> integer
    unit  (row count, exact sum of the row integers)

The columns and their rendering come from outbox.checksum_columns(), so both
sides always hash the same columns the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

NULL_MARK = "\\N"


@dataclass(frozen=True)
class ChecksumColumn:
    name: str
    kind: str  # plain | text | timestamp


@dataclass(frozen=True)
class Figures:
    row_count: int
    checksum: Decimal


def rendered(column: ChecksumColumn) -> Column:
    value = F.col(column.name)
    if column.kind == "plain":
        text = value.cast("string")
    elif column.kind == "text":
        escaped = F.replace(value.cast("string"), F.lit("\\"), F.lit("\\\\"))
        text = F.replace(escaped, F.lit("|"), F.lit("\\|"))
    elif column.kind == "timestamp":
        text = F.unix_micros(value).cast("string")
    else:
        raise ValueError(f"unknown checksum rendering {column.kind!r} for {column.name}")
    return F.coalesce(text, F.lit(NULL_MARK))


def row_text(columns: Sequence[ChecksumColumn]) -> Column:
    return F.concat_ws("|", *(rendered(c) for c in columns))


def row_hash(columns: Sequence[ChecksumColumn]) -> Column:
    """60-bit non-negative integer per row (as decimal: Spark sums it exactly)."""
    hex15 = F.substring(F.md5(row_text(columns)), 1, 15)
    return F.conv(hex15, 16, 10).cast("decimal(20,0)")


def figures(frame: DataFrame, columns: Sequence[ChecksumColumn]) -> Figures:
    (row,) = frame.agg(  # an aggregate without GROUP BY: exactly one row
        F.count(F.lit(1)).alias("row_count"),
        F.coalesce(F.sum(row_hash(columns)), F.lit(0)).cast("decimal(38,0)").alias("checksum"),
    ).collect()
    return Figures(int(row["row_count"]), Decimal(row["checksum"]))
