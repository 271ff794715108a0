"""JDBC access for Spark, derived from the psycopg connection the job already
holds (so OUTBOX_DATABASE_URL and the libpq PG* variables both work), and the
parallel partitioned reads.

Spark reads relations by name (a sealed partition, or a table) and appends
its own range per reader (on id, or received_at) and any filter the job adds
(pushed down as WHERE): no SQL text is built here. Timestamp literals are
rendered in the JVM's time zone, which pgjdbc also gives the PostgreSQL
session, so instants survive whatever that zone is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import quote

import psycopg
from psycopg import sql
from pyspark.sql import DataFrame, SparkSession

from pgoutbox.core.errors import ConfigError

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


def relation(conn: psycopg.Connection, schema: str, name: str) -> str:
    """A quoted relation name for Spark's `dbtable`."""
    return sql.Identifier(schema, name).as_string(conn)


def _below(lower: int | datetime, upper: int | datetime) -> bool:
    """lower < upper for bounds of one kind: ids, or timestamps."""
    if isinstance(lower, datetime) and isinstance(upper, datetime):
        return lower < upper
    if isinstance(lower, int) and isinstance(upper, int):
        return lower < upper
    raise TypeError(f"partition bounds of two kinds: {lower!r}, {upper!r}")


def spark_bound(value: int | datetime) -> str:
    """A lowerBound/upperBound as Spark parses it (timestamps in the session
    time zone, which the job pins to UTC)."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
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
    if partition_column and partitions > 1 and lower is not None and upper is not None and _below(lower, upper):
        reader = (
            reader.option("partitionColumn", partition_column)
            .option("lowerBound", spark_bound(lower))
            .option("upperBound", spark_bound(upper))
            .option("numPartitions", str(partitions))
        )
    return reader.load()
