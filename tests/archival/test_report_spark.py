"""The delivery report, on a generated data set spread over archived-and-
removed, archived-not-yet-removed and live days, checked figure by figure
against the same metrics computed independently in SQL over a snapshot of
every row; and the same job run through spark-submit."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from pgoutbox.cli import main as cli
from pgoutbox_spark import report
from support.archival import SPARK_DEADLINE, events, inbox_for, today
from support.roles import login

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]

# The delivery metrics, written directly in SQL over the snapshot tables
# (expected_events, expected_messages): the definitions of spark/pgoutbox_spark/report.py,
# none of its code.
EXPECTED_SQL = """
WITH ev AS (
    SELECT (occurred_at AT TIME ZONE 'UTC')::date AS day, context, event_type, status,
        CASE WHEN status = 'COMPLETED'
            THEN (extract(epoch FROM published_at) - extract(epoch FROM created_at)) * 1000000 END AS pub
    FROM expected_events
),
ev_grains AS (
    SELECT day, context, event_type, status, pub FROM ev
    UNION ALL SELECT day, context, '*', status, pub FROM ev
),
o AS (
    SELECT day, context, event_type,
        count(*) AS events,
        count(*) FILTER (WHERE status = 'COMPLETED') AS published,
        count(*) FILTER (WHERE status = 'DEAD_LETTER') AS outbox_dead_letters,
        percentile_cont(0.5) WITHIN GROUP (ORDER BY pub) / 1000 AS publish_p50_ms,
        percentile_cont(0.95) WITHIN GROUP (ORDER BY pub) / 1000 AS publish_p95_ms,
        percentile_cont(0.99) WITHIN GROUP (ORDER BY pub) / 1000 AS publish_p99_ms
    FROM ev_grains GROUP BY 1, 2, 3
),
occurred AS (SELECT event_id, min(occurred_at) AS occurred_at FROM expected_events GROUP BY 1),
m AS (
    SELECT msg.*, coalesce((msg.envelope ->> 'occurred_at')::timestamptz, occurred.occurred_at) AS event_at
    FROM expected_messages AS msg LEFT JOIN occurred ON occurred.event_id = msg.message_id
),
mm AS (
    SELECT (coalesce(event_at, received_at) AT TIME ZONE 'UTC')::date AS day,
        split_part(subject, '.', 1) AS context, split_part(subject, '.', 3) AS event_type,
        status, attempts,
        status = 'PROCESSED' AND row_number() OVER (
            PARTITION BY message_id, handler, status = 'PROCESSED' ORDER BY received_at) > 1 AS dup,
        CASE WHEN status = 'PROCESSED'
            THEN (extract(epoch FROM processed_at) - extract(epoch FROM event_at)) * 1000000 END AS e2e
    FROM m
),
mm_grains AS (
    SELECT day, context, event_type, status, attempts, dup, e2e FROM mm
    UNION ALL SELECT day, context, '*', status, attempts, dup, e2e FROM mm
),
i AS (
    SELECT day, context, event_type,
        count(*) AS messages,
        count(*) FILTER (WHERE status = 'PROCESSED') AS processed,
        count(*) FILTER (WHERE status = 'DEAD_LETTER') AS inbox_dead_letters,
        sum(attempts - 1) AS inbox_conflicts,
        count(*) FILTER (WHERE dup) AS duplicate_processings,
        percentile_cont(0.5) WITHIN GROUP (ORDER BY e2e) / 1000 AS e2e_p50_ms,
        percentile_cont(0.95) WITHIN GROUP (ORDER BY e2e) / 1000 AS e2e_p95_ms,
        percentile_cont(0.99) WITHIN GROUP (ORDER BY e2e) / 1000 AS e2e_p99_ms
    FROM mm_grains GROUP BY 1, 2, 3
)
SELECT coalesce(o.day, i.day)::text AS day, coalesce(o.context, i.context) AS context,
    coalesce(o.event_type, i.event_type) AS event_type,
    coalesce(o.events, 0) AS events, coalesce(o.published, 0) AS published,
    o.published::float8 / nullif(o.events, 0) AS delivery_rate,
    coalesce(o.outbox_dead_letters, 0) AS outbox_dead_letters,
    o.outbox_dead_letters::float8 / nullif(o.events, 0) AS outbox_dead_letter_rate,
    o.publish_p50_ms, o.publish_p95_ms, o.publish_p99_ms,
    coalesce(i.messages, 0) AS messages, coalesce(i.processed, 0) AS processed,
    coalesce(i.inbox_dead_letters, 0) AS inbox_dead_letters,
    i.inbox_dead_letters::float8 / nullif(i.messages, 0) AS dlq_rate,
    coalesce(i.inbox_conflicts, 0) AS inbox_conflicts,
    i.inbox_conflicts::float8 / nullif(i.messages, 0) AS inbox_conflict_rate,
    coalesce(i.duplicate_processings, 0) AS duplicate_processings,
    i.duplicate_processings::float8 / nullif(i.processed, 0) AS duplicate_processing_rate,
    i.e2e_p50_ms, i.e2e_p95_ms, i.e2e_p99_ms
FROM o FULL JOIN i USING (day, context, event_type)
ORDER BY 1, 2, 3
"""


def generate(conn) -> dict:
    """Three old days (archived later), one recent and today (live), two
    contexts, two event types, dead letters on both sides, redeliveries,
    events nobody consumed, inbox rows without an envelope."""
    t = today()
    days = {"old": [t - timedelta(days=k) for k in (12, 11, 10)], "recent": t - timedelta(days=3), "today": t}
    spec = [("sea", "created", 40, 2), ("sea", "shipped", 17, 0), ("vibespro", "created", 23, 1)]
    for k, day in enumerate(days["old"] + [days["recent"]]):
        for context, event_type, n, dead in spec:
            ids = events(
                conn, day, n + 3 * k, context=context, event_type=event_type, dead=dead, publish_ms=30 + 50 * k
            )
            inbox_for(conn, ids[:-2], handler="billing", dead_every=9, envelope_every=2, e2e_ms=200 + 100 * k)
            if context == "sea":
                inbox_for(conn, ids[: n // 2], handler="audit", envelope_every=1, e2e_ms=700)
    ids = events(conn, days["today"], 12, context="sea", failed=1, pending=2)
    inbox_for(conn, ids[3:], handler="billing")
    return days


def read_csv(path: Path) -> dict[tuple, dict]:
    with path.open() as f:
        return {(r["day"], r["context"], r["event_type"]): r for r in csv.DictReader(f)}


def same(name: str, reported: str, expected) -> bool:
    """Equal, up to the rounding of the CSV's column (half its last decimal)."""
    if expected is None:
        return reported == ""
    if isinstance(expected, int):
        return int(reported) == expected
    decimals = report.DECIMALS[name]
    return len(reported.partition(".")[2]) <= decimals and math.isclose(
        float(reported), float(expected), rel_tol=0, abs_tol=0.5 * 10**-decimals + 1e-12
    )


def test_report_matches_sql_over_archive_and_live(spark, conn, database_url, tmp_path, capsys):
    days = generate(conn)
    conn.execute("CREATE TABLE expected_events AS SELECT * FROM outbox.events")
    conn.execute("CREATE TABLE expected_messages AS SELECT * FROM inbox.messages")
    archive_uri, report_dir = tmp_path / "archive", tmp_path / "report"
    archiver = login(database_url, "pgoutbox_archiver")
    common = ["--database-url", archiver, "--archive-uri", str(archive_uri), "--dead-letter-retention", "9d"]

    # Outbox days archived and dropped; the oldest inbox day purged; the two
    # other old inbox days archived but not purged (in both places at once).
    assert cli.main(["archive", *common, "--inbox-retention", "11d"]) == 0
    assert cli.main(["archive", *common, "--sources", "inbox", "--inbox-retention", "8d", "--no-drop"]) == 0
    audits = conn.execute(
        "SELECT source, day, removed_at IS NOT NULL FROM outbox.archive_audits() ORDER BY 1, 2"
    ).fetchall()
    old = days["old"]
    assert audits == [
        ("inbox.messages", old[0], True),
        ("inbox.messages", old[1], False),
        ("inbox.messages", old[2], False),
    ] + [("outbox.events", d, True) for d in old]

    # A redelivery after the oldest inbox day was purged is processed again:
    # the report must see that duplicate across archive and live.
    conn.execute(
        """
        INSERT INTO inbox.messages (message_id, handler, subject, envelope, status, received_at, processed_at)
        SELECT message_id, handler, subject, envelope, 'PROCESSED', now() - interval '1 minute', now()
        FROM expected_messages
        WHERE handler = 'billing' AND status = 'PROCESSED'
            AND received_at < %s::date + 1 AND received_at >= %s::date AND envelope IS NOT NULL
        ORDER BY message_id LIMIT 1
        """,
        (old[0], old[0]),
    )
    conn.execute(
        "INSERT INTO expected_messages SELECT * FROM inbox.messages WHERE received_at > now() - interval '2 minutes'"
    )

    assert cli.main(["report", "--database-url", archiver, "--report-uri", str(report_dir)]) == 0
    out = capsys.readouterr().out
    assert "delivery_report.png" in out

    reported = read_csv(report_dir / "delivery_report.csv")
    cur = conn.execute(EXPECTED_SQL)
    names = [c.name for c in cur.description]
    expected = {(r[0], r[1], r[2]): dict(zip(names, r)) for r in cur.fetchall()}
    assert set(reported) == set(expected)
    assert len(expected) == 13 + 9, "types per day and context, plus a rollup per day and context"
    mismatches = [
        (key, name, row[name], expected[key][name])
        for key, row in reported.items()
        for name in names[3:]
        if not same(name, row[name], expected[key][name])
    ]
    assert mismatches == []
    duplicated = sum(int(r["duplicate_processings"]) for k, r in reported.items() if k[2] == "*")
    assert duplicated == 1
    assert (
        sum(int(r["events"]) for k, r in reported.items() if k[2] == "*")
        == conn.execute("SELECT count(*) FROM expected_events").fetchone()[0]
    )

    png = (report_dir / "delivery_report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert any((report_dir / "delivery_report.parquet").glob("*.parquet"))
    keep = os.environ.get("KEEP_DELIVERY_REPORT_PNG")  # to look at the chart after a run
    if keep:
        Path(keep).write_bytes(png)
        Path(keep).with_suffix(".csv").write_bytes((report_dir / "delivery_report.csv").read_bytes())


@pytest.mark.slow
def test_the_same_job_runs_under_spark_submit(conn, database_url, tmp_path):
    day = today() - timedelta(days=10)
    events(conn, day, 30, context="sea")
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_archiver"),
        "OUTBOX_ARCHIVE_URI": str(tmp_path / "archive"),
    }
    spark_submit = Path(sys.executable).parent / "spark-submit"
    result = subprocess.run(
        [
            str(spark_submit),
            "--master",
            "local[2]",
            "--jars",
            "/usr/share/java/postgresql.jar",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.driver.host=127.0.0.1",
            str(ROOT / "relay" / "pgoutbox" / "cli" / "submit.py"),
            "archive",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=SPARK_DEADLINE,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert f"{day}  removed" in result.stdout
    assert conn.execute("SELECT to_regclass(%s)", (f"outbox.events_p{day:%Y%m%d}",)).fetchone()[0] is None
    assert any((tmp_path / "archive" / "outbox_events" / f"day={day}").rglob("*.parquet"))
