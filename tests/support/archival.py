"""Generated data for the archival tests: events of past days, written as the
table owner with explicit created_at (the insert policies still apply) and
walked to their status through the guarded transitions in bulk; inbox rows
for them with explicit received_at; readers that snapshot the rows of a
day from PostgreSQL or from the archive in one comparable form; and a
loopback Spark standalone cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from pgoutbox.dev.embedded import free_port
from support import jvm_archive

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
VENV_BIN = Path(sys.executable).parent
# How long a test waits for a Spark job in a process of its own: a deadline
# against a hang, not a bound on speed. On 2 cores, beside the rest of the
# suite and a CPU-bound process, one archival spark-submit took more than
# 600 s (2026-11-29); a wait for executors ends on its own after
# OUTBOX_SPARK_START_TIMEOUT.
SPARK_DEADLINE = 1800
# The suite's JVMs (Spark drivers, a cluster's daemons and executors) live
# seconds to minutes: the JIT's first tier and the serial collector. The
# optimising compiler's threads, compiling for a long life, nearly doubled
# their CPU (a short local session: 41.8 against 23.1 s, 2026-11-29) on a
# machine of 2 cores that the whole suite shares. How fast the JVM runs, not
# what Spark or pgoutbox do. With them, the class archive `make test` builds
# (support.jvm_archive). tests/conftest.py sets them for every Spark process
# the suite starts.
TEST_JVM_OPTIONS = jvm_archive.options()


def spark_home() -> Path:
    """The pip-installed pyspark: its bin/ holds spark-class and spark-submit."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def spark_env(**more: str) -> dict[str, str]:
    """The environment of a Spark process: our pyspark, our Python, loopback only."""
    return {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "PYSPARK_PYTHON": str(VENV_BIN / "python"),
        "SPARK_LOCAL_IP": "127.0.0.1",
        **more,
    }


# Values that a sloppy canonical form would confuse: the separator, the
# escape, the NULL mark as text, quotes, non-ASCII.
TRICKY = ["a|b", "c\\d", "\\N", 'q"uote', "ünï|cödé\\", ""]


def utc(day: date, hours: float = 0.0) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC) + timedelta(hours=hours)


def today() -> date:
    return datetime.now(UTC).date()


def create_partition(conn: psycopg.Connection, day: date) -> None:
    conn.execute("SELECT outbox.create_partitions(0, %s)", (day,))


def events(
    conn: psycopg.Connection,
    day: date,
    n: int,
    *,
    context: str = "sea",
    event_type: str = "created",
    dead: int = 0,
    failed: int = 0,
    pending: int = 0,
    publish_ms: int = 40,
) -> list[str]:
    """n events spread over the day: the first `dead` DEAD_LETTER, the next
    `failed` FAILED, the next `pending` PENDING, the rest COMPLETED with a
    publish latency of 1..publish_ms ms (varied per row). Returns event ids."""
    create_partition(conn, day)
    start = utc(day, 0.5)
    step = timedelta(hours=22) / max(n, 1)
    if day >= today():  # the policies refuse events from the future
        start, step = datetime.now(UTC) - timedelta(minutes=30), timedelta(seconds=1)
        if day == today():  # just after midnight, today's events stay on today
            start = max(start, utc(day))
    with conn.transaction():
        rows = conn.execute(
            """
            INSERT INTO outbox.events (
                context, aggregate_type, aggregate_id, event_type, payload, headers, tenant_id,
                occurred_at, created_at, available_at
            )
            SELECT %(context)s, 'order', 'agg-' || i, %(event_type)s,
                jsonb_build_object('schema_version', 1, 'n', i, 'note', (%(tricky)s::text[])[1 + i %% %(k)s]),
                CASE WHEN i %% 3 = 0 THEN '{"traceparent": "00-ab|cd-01"}'::jsonb ELSE '{}'::jsonb END,
                CASE WHEN i %% 2 = 0 THEN (%(tricky)s::text[])[1 + i %% %(k)s] END,
                %(start)s + (i - 1) * %(step)s, %(start)s + (i - 1) * %(step)s, %(start)s + (i - 1) * %(step)s
            FROM generate_series(1, %(n)s) AS i
            RETURNING id, event_id
            """,
            dict(context=context, event_type=event_type, tricky=TRICKY, k=len(TRICKY), start=start, step=step, n=n),
        ).fetchall()
        ids = [r[0] for r in sorted(rows)]
        walk = ids[: n - pending]
        if walk:
            conn.execute(
                """
                UPDATE outbox.events
                SET status = 'PROCESSING', attempts = 1, claim_token = gen_random_uuid(),
                    claimed_at = created_at, claimed_by = 'generator', available_at = created_at + interval '1 minute'
                WHERE id = ANY(%s)
                """,
                (walk,),
            )
        dead_ids, failed_ids = ids[:dead], ids[dead : dead + failed]
        done_ids = ids[dead + failed : n - pending]
        for status, chosen in (("DEAD_LETTER", dead_ids), ("FAILED", failed_ids)):
            if chosen:
                conn.execute(
                    "UPDATE outbox.events SET status = %s, last_error = %s WHERE id = ANY(%s)",
                    (status, "broker said \\N | no", chosen),
                )
        if done_ids:
            conn.execute(
                """
                UPDATE outbox.events
                SET status = 'COMPLETED', published_at = created_at + (1 + id %% %s) * interval '1 millisecond'
                WHERE id = ANY(%s)
                """,
                (publish_ms, done_ids),
            )
    return [str(r[1]) for r in sorted(rows)]


def inbox_for(
    conn: psycopg.Connection,
    event_ids: list[str],
    *,
    handler: str = "billing",
    dead_every: int = 0,
    envelope_every: int = 1,
    e2e_ms: int = 300,
) -> None:
    """One inbox row per event (received 5 ms after publishing, or after the
    event when unpublished): PROCESSED after 1..e2e_ms ms from occurred_at,
    or DEAD_LETTER for every dead_every-th; attempts 1..3; an envelope with
    occurred_at on every envelope_every-th row (the rest must fall back to
    the outbox row)."""
    conn.execute(
        """
        INSERT INTO inbox.messages (
            message_id, handler, subject, envelope, status, received_at, processed_at, attempts, last_error
        )
        SELECT e.event_id, %(handler)s, e.subject,
            CASE WHEN e.id %% %(env)s = 0 THEN jsonb_build_object(
                'message_id', e.event_id, 'subject', e.subject,
                'occurred_at', to_char(e.occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'))
            END,
            CASE WHEN %(dead)s > 0 AND e.id %% %(dead)s = 0 THEN 'DEAD_LETTER' ELSE 'PROCESSED' END,
            coalesce(e.published_at, e.created_at) + interval '5 milliseconds',
            CASE WHEN %(dead)s > 0 AND e.id %% %(dead)s = 0 THEN NULL
                ELSE greatest(
                    coalesce(e.published_at, e.created_at) + interval '5 milliseconds',
                    e.occurred_at + (1 + (e.id * 7919) %% %(e2e)s) * interval '1 millisecond')
            END,
            1 + e.id %% 3,
            CASE WHEN %(dead)s > 0 AND e.id %% %(dead)s = 0 THEN 'handler said 422' END
        FROM outbox.events AS e
        WHERE e.event_id = ANY(%(ids)s::uuid[])
        """,
        dict(handler=handler, env=envelope_every, dead=dead_every, e2e=e2e_ms, ids=event_ids),
    )


# ------------------------------------------------------------- snapshots


def commands(
    conn: psycopg.Connection,
    day: date,
    handler: str,
    n: int,
    *,
    failed: int = 0,
    in_progress: int = 0,
    settled_after: timedelta = timedelta(seconds=2),
) -> list[str]:
    """n command keys of a handler first claimed over a past day, written as
    the table owner (first_claimed_at is not settable through
    claim_command): the first `failed` FAILED, the next `in_progress`
    IN_PROGRESS, the rest DONE with a result holding TRICKY text; settled
    `settled_after` after their claim. Returns the keys."""
    start = utc(day, 0.5)
    step = timedelta(hours=22) / max(n, 1)
    rows = conn.execute(
        """
        INSERT INTO inbox.commands AS c (
            handler, command_key, status, result, last_error, attempts, first_claimed_at, claimed_at, settled_at
        )
        SELECT %(handler)s, 'key-' || %(day)s || '-' || i || (%(tricky)s::text[])[1 + i %% %(k)s], s.status,
            CASE WHEN s.status = 'DONE'
                THEN jsonb_build_object('run_id', 'run-' || i, 'note', (%(tricky)s::text[])[1 + i %% %(k)s]) END,
            CASE WHEN s.status = 'FAILED' THEN 'workflow said \\N | no' END,
            1 + i %% 3, at, at, CASE WHEN s.status <> 'IN_PROGRESS' THEN at + %(settled)s END
        FROM generate_series(1, %(n)s) AS i
        CROSS JOIN LATERAL (SELECT %(start)s + (i - 1) * %(step)s AS at) AS t
        CROSS JOIN LATERAL (
            SELECT CASE WHEN i <= %(failed)s THEN 'FAILED'
                WHEN i <= %(failed)s + %(in_progress)s THEN 'IN_PROGRESS' ELSE 'DONE' END AS status
        ) AS s
        RETURNING c.command_key
        """,
        dict(
            handler=handler,
            day=day.isoformat(),
            tricky=TRICKY,
            k=len(TRICKY),
            start=start,
            step=step,
            n=n,
            failed=failed,
            in_progress=in_progress,
            settled=settled_after,
        ),
    ).fetchall()
    return [r[0] for r in rows]


def _micros(value: datetime | None) -> int | None:
    return None if value is None else (value - EPOCH) // timedelta(microseconds=1)


def _canonical(row: dict) -> tuple:
    out = []
    for key in sorted(row):
        value = row[key]
        if isinstance(value, datetime):
            value = _micros(value)
        elif isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True)
        elif value is not None and not isinstance(value, (int, str, bool)):
            value = str(value)
        out.append((key, value))
    return tuple(out)


def live_rows(conn: psycopg.Connection, source: str, day: date) -> list[tuple]:
    """The rows of a day, straight from PostgreSQL, sorted."""
    lo, hi = utc(day), utc(day + timedelta(days=1))
    query = {
        "outbox.events": "SELECT * FROM outbox.events WHERE created_at >= %s AND created_at < %s",
        "inbox.messages": "SELECT * FROM inbox.messages WHERE received_at >= %s AND received_at < %s",
        "inbox.commands": "SELECT * FROM inbox.commands WHERE first_claimed_at >= %s AND first_claimed_at < %s",
    }[source]
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(query, (lo, hi)).fetchall()
    return sorted(_canonical(r) for r in rows)


def archived_rows(spark, uri: str) -> list[tuple]:
    """The rows of an archived day folder, in the same form as live_rows."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import TimestampType

    frame = spark.read.parquet(uri)
    frame = frame.select(
        *[
            F.unix_micros(F.col(f.name)).alias(f.name) if isinstance(f.dataType, TimestampType) else F.col(f.name)
            for f in frame.schema.fields
        ]
    )
    out = []
    for row in frame.collect():
        record = row.asDict()
        for key in ("payload", "headers", "envelope", "dlq_metadata", "result"):
            if record.get(key) is not None:
                record[key] = json.loads(record[key])
        out.append(_canonical(record))
    return sorted(out)


# ------------------------------------------------- a loopback Spark cluster


class SparkCluster:
    """A Spark standalone master and `workers` workers on 127.0.0.1 (free
    ports, one core and `memory` each), started with spark-class from the
    venv's pyspark; stopped by PID. Their JSON status pages tell which
    executors ran where."""

    def __init__(self, root: Path, workers: int = 2, memory: str = "1g"):
        self.root = root
        self.count = workers
        self.memory = memory
        self.procs: list[subprocess.Popen] = []
        self.port = free_port()
        self.ui = free_port()
        self.worker_uis = [free_port() for _ in range(workers)]

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _spark_class(self, name: str, *args: str, log: str) -> None:
        # No REST submission server: it would listen on a fixed port (6066).
        env = spark_env(SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false")
        out = (self.root / log).open("wb")
        self.procs.append(
            subprocess.Popen(
                [str(spark_home() / "bin" / "spark-class"), name, *args], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        )

    # A deadline the workers' registration ends, not a bound: three JVMs took over
    # 3 minutes to start at load average 50 on 2 cores (a clean-clone run beside two soaks).
    def start(self, timeout: float = 600) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._spark_class(
            "org.apache.spark.deploy.master.Master",
            *("--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(self.ui)),
            log="master.log",
        )
        for i, ui in enumerate(self.worker_uis):
            work = self.root / f"worker{i}"
            work.mkdir(exist_ok=True)
            self._spark_class(
                "org.apache.spark.deploy.worker.Worker",
                *("--host", "127.0.0.1", "--port", str(free_port()), "--webui-port", str(ui)),
                *("--cores", "1", "--memory", self.memory, "--work-dir", str(work), self.url),
                log=f"worker{i}.log",
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                alive = [w for w in self.master()["workers"] if w["state"] == "ALIVE"]
            except (OSError, ValueError):  # not listening yet, or an empty page while it starts
                alive = []
            if len(alive) == self.count:
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the Spark cluster did not come up; logs in {self.root}")

    @staticmethod
    def _json(port: int) -> dict:
        # A hang guard, not a bound: a worker's UI answered in more than 5 s
        # beside the suite and a CPU-bound process (2026-11-29).
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/", timeout=60) as response:
            return json.loads(response.read())

    def master(self) -> dict:
        return self._json(self.ui)

    def worker_pages(self) -> list[dict]:
        return [self._json(ui) for ui in self.worker_uis]

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()


def tasks_per_executor(event_log_dir: Path, app_id: str) -> dict[str, int]:
    """Finished tasks per executor id, from the application's Spark event log."""
    # One file, or a folder of rolled files (eventlog_v2_<app id>/events_<n>_<app id>).
    (log,) = [p for p in event_log_dir.iterdir() if app_id in p.name]
    files = sorted(log.glob("events_*")) if log.is_dir() else [log]
    counts: dict[str, int] = {}
    for line in (line for f in files for line in f.read_text().splitlines()):
        event = json.loads(line)
        if event.get("Event") == "SparkListenerTaskEnd":
            executor = event["Task Info"]["Executor ID"]
            counts[executor] = counts.get(executor, 0) + 1
    return counts
