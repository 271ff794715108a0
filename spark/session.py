"""The SparkSession: `local[*]` by default, or whatever spark-submit set up.

Under spark-submit the driver is started by a JVM that already holds the
master, jars and the rest of the submitted configuration; settings given to
the builder would override them, so then only the SQL settings this job
depends on are set.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from pyspark.sql import SparkSession

# The job's results depend on these, wherever it runs: days are UTC days, and
# partition directory values (context=42) stay strings.
SQL_CONF = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.sources.partitionColumnTypeInference.enabled": "false",
}


def submitted() -> bool:
    """True when spark-submit started this driver (PySpark's own test)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def build(master: str, jars: str | None, app_name: str, conf: Mapping[str, str] | None = None) -> SparkSession:
    """A session; `conf` adds settings (ignored under spark-submit, like master)."""
    builder = SparkSession.builder.appName(app_name)
    if not submitted():
        for key, value in (conf or {}).items():
            builder = builder.config(key, value)
        builder = builder.master(master)
        if jars:
            builder = builder.config("spark.jars", jars)
        if master.startswith("local"):
            # Loopback only, no web UI: the machine is shared and ports are not ours.
            builder = (
                builder.config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.driver.host", "127.0.0.1")
                .config("spark.ui.enabled", "false")
                .config("spark.ui.showConsoleProgress", "false")
            )
    for key, value in SQL_CONF.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    for key, value in SQL_CONF.items():  # getOrCreate may have returned a running session
        spark.conf.set(key, value)
    spark.sparkContext.setLogLevel("WARN")
    return spark


@contextlib.contextmanager
def spark_session(master: str, jars: str | None, app_name: str) -> Iterator[SparkSession]:
    """A session for one command: reuses an active one (and leaves it running),
    else builds one and stops it afterwards."""
    active = SparkSession.getActiveSession()
    if active is not None:
        for key, value in SQL_CONF.items():
            active.conf.set(key, value)
        yield active
        return
    spark = build(master, jars, app_name)
    try:
        yield spark
    finally:
        spark.stop()
