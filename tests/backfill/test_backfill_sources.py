"""`pgoutbox backfill` over the whole history, from its three sources, with
real processes: 30 days of events; the archive
holds the 20 oldest, archived and dropped by `pgoutbox archive` run as a
pgoutbox_archiver login on Spark; the outbox keeps the last 10; the
handler's stream holds the last 2 (published as the relay publishes).

A new handler backfilled over everything, as a pgoutbox_backfiller login,
gets each event exactly once, each ordering key in emit order: the plan
names the three sources; the backfill is killed -9 while it reads the
archive and started again, and still nothing arrives twice that had been
recorded; one archived day whose Parquet file was replaced is refused with
ARCHIVE_TAMPERED (OB111), none of its events reaches the handler, and the
days after it still do."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import nats
import psycopg
import pytest
from psycopg.rows import dict_row

from pgoutbox.cli import main as cli
from pgoutbox.core import wire
from support.archival import spark_env
from support.roles import login
from support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.spark]

HANDLER = "late_audit"
SUBJECTS = ["shop.event.order_created.v1", "shop.event.order_paid.v1"]
DAYS, KEPT, STREAMED = 30, 10, 2
PER_DAY = 8
KEYS = 5
TAMPERED_AGO = 15  # an archived day in the middle of the archive's part


def utc(day: date, hours: float) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC) + timedelta(hours=hours)


def fill(conn: psycopg.Connection) -> dict[date, list[tuple[str, str]]]:
    """PER_DAY events of the handler's subjects a day (and one of another
    subject), COMPLETED as the relay leaves them. Returns (event_id,
    ordering_key) per day, in id order."""
    today = datetime.now(UTC).date()
    first = today - timedelta(days=DAYS)
    conn.execute("SELECT outbox.create_partitions(%s, %s)", (DAYS, first))
    n = 0
    for ago in range(DAYS, 0, -1):
        start = utc(today - timedelta(days=ago), 1)
        for i in range(PER_DAY):
            n += 1
            key = f"order-{n % KEYS}"
            kind = "order_created" if i % 2 == 0 else "order_paid"
            at = start + timedelta(minutes=i)
            conn.execute(
                "INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload,"
                " ordering_key, occurred_at, created_at) VALUES ('shop', 'order', %s, %s, %s, %s, %s, %s)",
                (key, kind, json.dumps({"schema_version": 1, "n": n}), key, at, at),
            )
        conn.execute(
            "INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload, created_at)"
            " VALUES ('shop', 'user', 'u', 'user_joined', '{\"schema_version\": 1}', %s)",
            (start,),
        )
    conn.execute(
        "UPDATE outbox.events SET status = 'PROCESSING', attempts = 1, claim_token = gen_random_uuid(),"
        " claimed_at = created_at, claimed_by = 'test', available_at = created_at"
    )
    conn.execute("UPDATE outbox.events SET status = 'COMPLETED', published_at = created_at")
    by_day: dict[date, list[tuple[str, str]]] = defaultdict(list)
    rows = conn.execute(
        "SELECT event_id::text, ordering_key, created_at FROM outbox.events WHERE subject = ANY(%s) ORDER BY id",
        (SUBJECTS,),
    )
    for event_id, key, created in rows:
        by_day[created.date()].append((event_id, key))
    return by_day


async def publish_last_days(conn: psycopg.Connection, url: str) -> int:
    """The last STREAMED days into SHOP_EVENTS, as the relay publishes them."""
    since = utc(datetime.now(UTC).date() - timedelta(days=STREAMED), 0)
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="SHOP_EVENTS", subjects=["shop.event.>"])
        with conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute("SELECT * FROM outbox.events WHERE created_at >= %s ORDER BY id", (since,)).fetchall()
        for row in rows:
            subject, body, headers = wire.to_nats(row)
            await js.publish(subject, body, headers=headers)
        return len(rows)
    finally:
        await nc.close()


def archive(owner: str, root: Path) -> None:
    """`pgoutbox archive` of the outbox's days older than KEPT, as the archiver, on
    this worker's SparkSession (the archive is where the backfill starts, not
    what is tested: a process of its own started a JVM more, at the run's
    busiest minutes)."""
    argv = ["archive", "--database-url", login(owner, "pgoutbox_archiver"), "--archive-uri", str(root)]
    assert cli.main([*argv, "--sources", "outbox", "--retention", f"{KEPT}d"]) == 0


@pytest.fixture
def world(spark, database_url, handler, nats_server, tmp_path):
    with psycopg.connect(database_url, autocommit=True) as conn:
        by_day = fill(conn)
        published = asyncio.run(publish_last_days(conn, nats_server.url))
    assert published == STREAMED * (PER_DAY + 1)
    root = tmp_path / "archive"
    archive(database_url, root)
    today = datetime.now(UTC).date()
    with psycopg.connect(database_url, autocommit=True) as conn:
        removed = conn.execute(
            "SELECT count(*) FROM outbox.archive_audit WHERE source = 'outbox.events' AND removed_at IS NOT NULL"
        ).fetchone()[0]
        kept = conn.execute("SELECT min(created_at) FROM outbox.events").fetchone()[0]
    assert removed == DAYS - KEPT and kept.date() == today - timedelta(days=KEPT)
    # Replace the day's Parquet files by those of the day before: a readable
    # archive, whose rows are not what was audited.
    tampered = today - timedelta(days=TAMPERED_AGO)
    target = root / "outbox_events" / f"day={tampered}"
    assert any(target.rglob("*.parquet"))
    shutil.rmtree(target)
    shutil.copytree(root / "outbox_events" / f"day={tampered - timedelta(days=1)}", target)
    manifests = tmp_path / "handlers"
    manifests.mkdir()
    (manifests / "late.toml").write_text(
        f'[[handler]]\nname = "{HANDLER}"\nurl = "{handler.url}"\nsubjects = {json.dumps(SUBJECTS)}\n'
    )
    registry = tmp_path / "handlers.registry.json"
    assert cli.main(["registry", "generate", "--manifest-dir", str(manifests), "--registry-file", str(registry)]) == 0
    return {
        "url": login(database_url, "pgoutbox_backfiller"),
        "owner": database_url,
        "nats": nats_server.url,
        "registry": registry,
        "state": tmp_path / "state.json",
        "by_day": by_day,
        "tampered": tampered,
    }


def command(world, *extra: str) -> list[str]:
    return [
        "nice",
        "-n",
        "5",
        sys.executable,
        "-m",
        "pgoutbox.cli.main",
        "backfill",
        "--handler",
        HANDLER,
        "--database-url",
        world["url"],
        "--nats-url",
        world["nats"],
        "--registry-file",
        str(world["registry"]),
        "--state-file",
        str(world["state"]),
        "--page-size",
        "4",
        *extra,
    ]


def environment() -> dict[str, str]:
    env = {k: v for k, v in spark_env().items() if not k.startswith(("OUTBOX_", "PG"))}
    return env | {"OUTBOX_SPARK_MASTER": "local[1]"}  # not default: one Spark core of the 2 this machine has


def inbox(owner: str) -> dict[str, str]:
    with psycopg.connect(owner, autocommit=True) as conn:
        rows = conn.execute("SELECT message_id::text, status FROM inbox.messages WHERE handler = %s", (HANDLER,))
        return dict(rows.fetchall())


def test_a_new_handler_gets_the_whole_history_from_archive_outbox_and_stream_once(world, handler, tmp_path):
    expected = [e for day, events in sorted(world["by_day"].items()) if day != world["tampered"] for e in events]
    refused = {mid for mid, _ in world["by_day"][world["tampered"]]}
    archived = sum(len(v) for d, v in world["by_day"].items() if d < world["tampered"])
    log = (tmp_path / "first.log").open("w")
    # 20 events/s: the first run is still in the archive's days when it is killed.
    first = subprocess.Popen(command(world, "--rate", "20"), stdout=log, stderr=subprocess.STDOUT, env=environment())
    try:
        wait_for(lambda: len(handler.calls) >= archived // 2, 300, f"the first run to deliver {archived // 2} events")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    plan = (tmp_path / "first.log").read_text()
    assert plan.startswith(f"backfill {HANDLER}: {', '.join(SUBJECTS)}\n"), plan
    assert f"  archive  {DAYS - KEPT} day(s) " in plan, plan
    assert f"  outbox   {(KEPT - STREAMED) * PER_DAY} event(s)" in plan, plan
    assert "  stream   SHOP_EVENTS " in plan, plan
    processed_at_kill = {mid for mid, status in inbox(world["owner"]).items() if status == "PROCESSED"}
    called_before = {c.message_id for c in handler.calls}
    assert len(called_before) < len(expected)

    second = subprocess.run(command(world), capture_output=True, text=True, env=environment(), timeout=900)
    assert second.returncode == 1, second.stdout + second.stderr  # the refused day
    assert "backfill: resuming in the archive after day" in second.stderr, second.stderr
    assert f"backfill: refused archived day {world['tampered']}: [OB111] ARCHIVE_TAMPERED" in second.stderr, (
        second.stderr
    )
    assert f"1 archived day(s) refused ({world['tampered']})" in second.stdout, second.stdout

    # Exactly once: every event but the refused day's PROCESSED, once each.
    assert inbox(world["owner"]) == {mid: "PROCESSED" for mid, _ in expected}
    calls = [c.message_id for c in handler.calls]
    assert not refused & set(calls)
    repeated = {mid for mid in calls if calls.count(mid) > 1}
    assert repeated <= called_before - processed_at_kill, repeated  # only what the kill cut short
    # In emit order per ordering key, across the three sources.
    first_calls = list(dict.fromkeys(calls))
    position = {mid: i for i, mid in enumerate(first_calls)}
    by_key: dict[str, list[str]] = defaultdict(list)
    for mid, key in expected:
        by_key[key].append(mid)
    for key, mids in by_key.items():
        assert sorted(mids, key=position.__getitem__) == mids, f"{key} out of emit order"
    # The stream's part came from the stream: the outbox part of the plan stops where it starts.
    assert os.path.exists(world["state"])
    state = json.loads(Path(world["state"]).read_text())
    assert state["phase"] == "stream" and state["stream_seq"] > 0, state
