"""Archival throughput on a real PostgreSQL and a local Spark (not a test:
it prints figures).

    .venv/bin/python bench/archive_bench.py [--rows 1000000] [--read-partitions 4]

One day partition of --rows COMPLETED events is generated through the
guarded path (insert policies, then PENDING -> PROCESSING -> COMPLETED), then
in the same Spark session:
  1. warm-up: a bare JDBC read of 50,000 rows to Parquet (JIT, driver load);
  2. bare: the same partitioned JDBC read of the whole day, written to Parquet
     partitioned by context: the floor any archiver pays (run twice, the
     faster counts: the machine is shared);
  3. archival: the full pipeline on the same day: seal, export (the same read
     and write, to staging, then rename), re-read and checksum in Spark,
     record (checksum in PostgreSQL), drop (checksum again, DROP TABLE).
It prints rows/s for 2 and 3, their ratio, and where the time of 3 went.
The machine is shared: the load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

import machine
from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedPostgres

JAR = "/usr/share/java/postgresql.jar"


def generate(conn: psycopg.Connection, day, rows: int) -> float:
    started = time.perf_counter()
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    conn.execute("SELECT outbox.create_partitions(0, %s)", (day,))
    conn.execute(
        """
        INSERT INTO outbox.events (
            context, aggregate_type, aggregate_id, event_type, payload, headers,
            occurred_at, created_at, available_at
        )
        SELECT (ARRAY['sea', 'vibespro', 'billing'])[1 + i %% 3], 'order', 'order-' || i,
            (ARRAY['order_created', 'order_paid', 'order_shipped', 'order_cancelled'])[1 + i %% 4],
            jsonb_build_object('schema_version', 1, 'order_id', i, 'total', (i %% 10000) / 100.0,
                'currency', 'EUR', 'lines', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || (i %% 997),
                'qty', 1 + i %% 5))),
            jsonb_build_object('traceparent', '00-' || md5(i::text) || '-' || left(md5((i + 1)::text), 16) || '-01'),
            t, t, t
        FROM generate_series(1, %s) AS i,
            LATERAL (SELECT %s::timestamptz + (i * interval '80 milliseconds') AS t) AS x
        """,
        (rows, start),
    )
    conn.execute(
        """UPDATE outbox.events SET status = 'PROCESSING', attempts = 1, claim_token = gen_random_uuid(),
            claimed_at = created_at, claimed_by = 'bench', available_at = created_at + interval '1 minute'
        WHERE created_at >= %s AND created_at < %s""",
        (start, start + timedelta(days=1)),
    )
    conn.execute(
        """UPDATE outbox.events SET status = 'COMPLETED', published_at = created_at + interval '15 milliseconds'
        WHERE created_at >= %s AND created_at < %s""",
        (start, start + timedelta(days=1)),
    )
    conn.execute(f"VACUUM (FREEZE, ANALYZE) outbox.events_p{day:%Y%m%d}")
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--read-partitions", type=int, default=4)
    parser.add_argument("--fetch-size", type=int, default=10_000)
    parser.add_argument("--bare-runs", type=int, default=2, help="bare reads; the fastest is the floor")
    args = parser.parse_args()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

    from pgoutbox_spark import archive, jdbc, session, storage
    from pgoutbox_spark import database as db

    work = Path(tempfile.mkdtemp(prefix="pgoutbox-archive-bench-"))
    pg_root = Path(tempfile.mkdtemp(prefix="pgoutbox-archive-bench-pg-"))  # handed to postgres
    server = EmbeddedPostgres(pg_root, settings={"fsync": "off", "synchronous_commit": "off"})
    server.start()
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            migrate.migrate(conn)
            day = datetime.now(UTC).date() - timedelta(days=10)
            print(f"generating {args.rows:,} events for {day} through the guarded path ...", flush=True)
            gen = generate(conn, day, args.rows)
            size = conn.execute(
                "SELECT pg_size_pretty(pg_total_relation_size(%s))", (f"outbox.events_p{day:%Y%m%d}",)
            ).fetchone()[0]
            print(f"  {gen:.1f} s; partition {size}")

            target = jdbc.from_connection(conn)
            partition = f"events_p{day:%Y%m%d}"
            sealed_bounds = conn.execute(f"SELECT min(id), max(id) FROM outbox.{partition}").fetchone()
            load_before = os.getloadavg()
            ticks = machine.cpu_ticks()
            with session.spark_session("local[*]", JAR, "pgoutbox-archive-bench") as spark:

                def bare(limit_rows: int | None, out: Path) -> float:
                    low, high = sealed_bounds[0], sealed_bounds[1] + 1
                    if limit_rows:
                        high = low + limit_rows
                    frame = jdbc.read(
                        spark,
                        target,
                        jdbc.relation(conn, "outbox", partition),
                        fetch_size=args.fetch_size,
                        partition_column="id",
                        lower=low,
                        upper=high,
                        partitions=args.read_partitions,
                    )
                    if limit_rows:
                        frame = frame.where(frame.id < high)
                    started = time.perf_counter()
                    frame.write.mode("overwrite").partitionBy("context").parquet(str(out))
                    return time.perf_counter() - started

                bare(50_000, work / "warmup")
                # The machine is shared: the faster of two bare runs is the floor.
                bare_runs = [bare(None, work / f"bare{i}") for i in range(args.bare_runs)]
                bare_s = min(bare_runs)

                steps: list[tuple[str, float]] = []
                mark = [time.perf_counter()]

                def hook(step, unit):
                    now = time.perf_counter()
                    steps.append((step, now - mark[0]))
                    mark[0] = now

                opts = archive.ArchiveOptions(
                    archive_uri=storage.normalise_uri(str(work / "archive")),
                    retention=timedelta(days=7),
                    dead_letter_retention=timedelta(days=30),
                    inbox_retention=timedelta(days=14),
                    read_partitions=args.read_partitions,
                    fetch_size=args.fetch_size,
                    drop=True,
                    lock_timeout=timedelta(seconds=5),
                    sources=(db.OUTBOX,),
                )
                started = time.perf_counter()
                mark[0] = started
                outcomes = archive.run(spark, conn, target, opts, hook)
                archive_s = time.perf_counter() - started
            load_after = os.getloadavg()
            steal = machine.steal_since(ticks)
        (outcome,) = outcomes
        assert outcome.state == "removed" and outcome.rows == args.rows, outcome
    finally:
        server.stop("immediate")
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(pg_root, ignore_errors=True)

    names = {
        "sealed": "seal (checks, triggers) + seal figures (checksum in PostgreSQL)",
        "written": "export: JDBC read + Parquet write",
        "committed": "commit (rename)",
        "verified": "verify: re-read + checksum in Spark",
        "audited": "record: checksum in PostgreSQL",
        "removed": "drop: checksum again + DROP TABLE",
    }
    print(
        f"\nmachine: {os.cpu_count()} cores; load average before {load_before[0]:.2f}, "
        f"after {load_after[0]:.2f} (shared with other work); {steal} during the Spark runs"
    )
    print(f"rows: {args.rows:,}; read partitions: {args.read_partitions}; fetch size: {args.fetch_size}")
    print(
        f"bare JDBC read -> Parquet : {bare_s:7.1f} s  {args.rows / bare_s:10,.0f} rows/s"
        f"  (fastest of {', '.join(f'{s:.1f}' for s in bare_runs)} s)"
    )
    print(f"audited archival          : {archive_s:7.1f} s  {args.rows / archive_s:10,.0f} rows/s")
    print(
        f"ratio archival / bare     : {(args.rows / archive_s) / (args.rows / bare_s):.2f} of the bare "
        f"throughput ({archive_s / bare_s:.2f}x the time)"
    )
    print("where the archival time went:")
    for step, seconds in steps:
        print(f"  {names[step]:66} {seconds:6.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
