"""The SparkSession: `local[*]` by default, or whatever spark-submit set up.

Under spark-submit the driver is started by a JVM that already holds the
master, jars and the rest of the submitted configuration; settings given to
the builder would override them, so then only the SQL settings this job
depends on are set.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping

from py4j.protocol import Py4JError
from pyspark.sql import SparkSession

from pgoutbox.core.errors import SparkUnavailable

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
    else builds one and stops it afterwards. A session that cannot start is
    SparkUnavailable (one line, exit code 5)."""
    active = SparkSession.getActiveSession()
    if active is not None:
        for key, value in SQL_CONF.items():
            active.conf.set(key, value)
        yield active
        return
    try:
        spark = build(master, jars, app_name)
    except Exception as exc:  # the JVM did not start, a bad master URL, ...
        reason = " / ".join(line.strip() for line in str(exc).splitlines()[:3] if line.strip())
        raise SparkUnavailable(f"Spark did not start (master {master}): {type(exc).__name__}: {reason}") from exc
    try:
        yield spark
    finally:
        spark.stop()


def is_local(spark: SparkSession) -> bool:
    return (spark.sparkContext.master or "").startswith("local")


def executors(spark: SparkSession) -> int:
    """Executors registered with the driver (the driver's own entry left out)."""
    try:
        infos = spark.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    except Py4JError:  # the context gave up (no master answered)
        return 0
    return max(0, len(infos) - 1)


def wait_for_executors(spark: SparkSession, timeout: float) -> int:
    """Waits up to `timeout` seconds for a cluster to give the job at least one
    executor; returns how many it has. A local master runs in the driver: 1.

    A cluster whose workers cannot offer what the job asks for
    (spark.executor.memory, spark.executor.cores), or an unreachable master,
    gives none, and Spark would wait for ever; this is the bound."""
    if is_local(spark):
        return 1
    deadline = time.monotonic() + timeout
    while True:
        found = executors(spark)
        if found:
            return found
        if time.monotonic() >= deadline:
            conf = spark.sparkContext.getConf()
            memory = conf.get("spark.executor.memory", "1g")
            cores = conf.get("spark.executor.cores", "(all of a worker's)")
            raise SparkUnavailable(
                f"no Spark executor registered within {timeout:g}s at {spark.sparkContext.master}: the master "
                f"is unreachable, or no worker can offer spark.executor.memory={memory} and "
                f"spark.executor.cores={cores} (OUTBOX_SPARK_START_TIMEOUT); nothing was sealed"
            )
        time.sleep(0.5)
