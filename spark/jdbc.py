"""JDBC access for Spark, derived from the psycopg connection the job already
holds (so OUTBOX_DATABASE_URL and the libpq PG* variables both work), and the
parallel partitioned reads.

Spark's readers see rows only through the SQL functions outbox.archive_rows()
and inbox.archive_rows(); PostgreSQL inlines them, so the range each reader
appends (id, or received_at) reaches the index.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from urllib.parse import quote

import psycopg
from psycopg import sql
from pyspark.sql import DataFrame, SparkSession

from pgoutbox.errors import ConfigError

DRIVER = "org.postgresql.Driver"


@dataclass(frozen=True)
class JdbcTarget:
    url: str
    properties: Mapping[str, str] = field(default_factory=dict)


def from_connection(conn: psycopg.Connection, url: str | None = None) -> JdbcTarget:
    """The JDBC URL and credentials of conn, or `url` when given (executors on
    a cluster may reach the database by another name)."""
    info = conn.info
    props = {"driver": DRIVER, "user": info.user, "ApplicationName": "pgoutbox-spark"}
    if info.password:
        props["password"] = info.password
    sslmode = info.get_parameters().get("sslmode")
    if sslmode:
        props["sslmode"] = sslmode
    if url:
        return JdbcTarget(url, props)
    host = info.host
    if not host or host.startswith("/"):
        raise ConfigError(
            f"JDBC needs TCP but the database connection uses the socket {host!r}: "
            "connect by host name or set OUTBOX_JDBC_URL"
        )
    if ":" in host:
        host = f"[{host}]"
    return JdbcTarget(f"jdbc:postgresql://{host}:{info.port}/{quote(info.dbname)}", props)


def rows_of(conn: psycopg.Connection, function: str, range_from: datetime, range_to: datetime) -> str:
    """The `dbtable` for Spark: the rows of a range, through an archive_rows function."""
    schema, name = function.split(".")
    query = sql.SQL("(SELECT * FROM {}.{}({}::timestamptz, {}::timestamptz)) AS rows_of").format(
        sql.Identifier(schema), sql.Identifier(name), sql.Literal(_text(range_from)), sql.Literal(_text(range_to))
    )
    return query.as_string(conn)


def _text(value: datetime) -> str:
    if value.tzinfo is None:
        raise ValueError("range bounds must be timezone-aware")
    return value.astimezone(timezone.utc).isoformat()


def spark_bound(value: int | datetime) -> str:
    """A lowerBound/upperBound as Spark parses it (timestamps in the session
    time zone, which the job pins to UTC)."""
    if isinstance(value, datetime):
        return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")
    return str(value)


def read(
    spark: SparkSession,
    target: JdbcTarget,
    dbtable: str,
    *,
    fetch_size: int,
    partition_column: str | None = None,
    lower: int | datetime | None = None,
    upper: int | datetime | None = None,
    partitions: int = 1,
) -> DataFrame:
    """A JDBC DataFrame; split into `partitions` parallel range reads over
    partition_column when bounds are known (they only set the stride: rows
    outside them go to the first or last reader, none are lost)."""
    reader = (
        spark.read.format("jdbc")
        .option("url", target.url)
        .option("dbtable", dbtable)
        .option("fetchsize", str(fetch_size))
    )
    for key, value in target.properties.items():
        reader = reader.option(key, value)
    if partition_column and partitions > 1 and lower is not None and upper is not None and lower < upper:
        reader = (
            reader.option("partitionColumn", partition_column)
            .option("lowerBound", spark_bound(lower))
            .option("upperBound", spark_bound(upper))
            .option("numPartitions", str(partitions))
        )
    return reader.load()
