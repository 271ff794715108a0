"""The classes a Spark JVM loads, archived once per virtualenv (the JDK's
class-data sharing: a dynamic archive, `-XX:ArchiveClassesAtExit`), so that
each JVM the suite starts maps them instead of loading, parsing and
verifying them again. A short local session took 9.6 s of the JVM's CPU and
22-26 s to start without it, 4.8-5.2 s and 9.5-14.5 s with it (2026-11-30,
2 cores shared with a test run). Like the JIT options beside it
(support.archival.TEST_JVM_OPTIONS): how fast the JVM starts, not what
Spark or pgoutbox do.

`make test` builds it (`python tests/support/jvm_archive.py`) while the unit
tier runs on the other core. It lives in the virtualenv, next to the pyspark
whose jars it holds (the archive is valid only for the class path it was
dumped with): a new virtualenv builds a new one. A JVM given an archive it
cannot use (none yet, another class path) runs without it, silently: the
`cds` log tags are off, else a mismatch prints a warning on the JVM's
stdout."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ARCHIVE = Path(sys.prefix) / "spark-classes.jsa"
# The options every one of the suite's JVMs gets (support.archival).
JIT = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
QUIET = "-Xlog:cds=off,cds+dynamic=off"


def options() -> str:
    """The suite's JVM options: with the archive when it has been built."""
    return f"{JIT} {QUIET} -XX:SharedArchiveFile={ARCHIVE}" if ARCHIVE.exists() else JIT


# What the dump runs: a local session that writes and reads Parquet and
# aggregates, as the archival jobs do (JDBC's driver comes from spark.jars,
# a class loader of Spark's own, which a dynamic archive does not hold).
_JOB = """
import os, sys
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
from pgoutbox_spark import session
s = session.build("local[2]", None, "pgoutbox-class-archive")
df = s.range(2000).selectExpr("id", "id % 7 AS k", "cast(id AS string) AS v", "current_timestamp() AS t")
df.write.mode("overwrite").partitionBy("k").parquet(sys.argv[1])
back = s.read.parquet(sys.argv[1])
back.groupBy("k").agg({"id": "count", "v": "max"}).orderBy("k").collect()
back.selectExpr("sha2(concat_ws('|', id, v), 256) AS h").agg({"h": "max"}).collect()
s.stop()
"""


def build() -> bool:
    """Dump the archive unless there is one; False when the dump failed."""
    if ARCHIVE.exists():
        return True
    with tempfile.TemporaryDirectory(prefix="pgoutbox-jsa-") as tmp:
        dumped = Path(tmp) / "classes.jsa"
        opts = f"{JIT} {QUIET} -XX:ArchiveClassesAtExit={dumped}"
        env = {**os.environ, "SPARK_SUBMIT_OPTS": opts}
        run = subprocess.run(
            [sys.executable, "-c", _JOB, str(Path(tmp) / "parquet")],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if run.returncode != 0 or not dumped.exists():
            tail = (run.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"jvm_archive: no class archive, the suite's JVMs start without one ({tail})", file=sys.stderr)
            return False
        os.replace(dumped, ARCHIVE)  # atomic: a JVM sees no archive or the whole one
    return True


if __name__ == "__main__":
    build()
