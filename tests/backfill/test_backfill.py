"""`pgoutbox backfill` with real processes (docs/backfill.md): days of
events kept in the outbox's day partitions, a new handler of the registry
(a real HTTP server), the command run as a login holding only
pgoutbox_backfiller. It prints its plan first; every event reaches the
handler's inbox PROCESSED exactly once, each ordering key in emit order;
killed with SIGKILL in the middle and started again, it resumes after the
last page it finished and the inbox skips what was done, so still exactly
once; a 422 dead-letters that event only (exit 1); a range older than the
outbox keeps is refused (exit 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from pgoutbox.cli import main as cli
from support.roles import login
from support.waiting import wait_for

HANDLER = "late_projection"
SUBJECTS = ["shop.event.order_created.v1", "shop.event.order_paid.v1"]
DAYS = 5  # the 30 days of the issue, scaled down in count: one partition per day all the same
PER_DAY = 40
KEYS = 7


@pytest.fixture
def world(database_url, handler, tmp_path):
    """The outbox holding DAYS days of events (and an event of another
    subject each day), the registry naming the handler, a backfiller login."""
    # DAYS whole days that ended yesterday: every event (01:00 to 01:40 of its day)
    # lies in the past at any hour the suite runs (emit refuses a future occurred_at).
    first = datetime.now(UTC).date() - timedelta(days=DAYS)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT outbox.create_partitions(%s, %s)", (DAYS, first))
        n = 0
        for day in range(DAYS):
            start = datetime(first.year, first.month, first.day, 1, tzinfo=UTC) + timedelta(days=day)
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
        expected = conn.execute(
            "SELECT event_id::text, ordering_key FROM outbox.events WHERE subject = ANY(%s) ORDER BY id", (SUBJECTS,)
        ).fetchall()
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
        "registry": registry,
        "state": tmp_path / "state.json",
        "expected": expected,
    }


def command(world, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pgoutbox.cli.main",
        "backfill",
        "--handler",
        HANDLER,
        "--database-url",
        world["url"],
        "--registry-file",
        str(world["registry"]),
        "--state-file",
        str(world["state"]),
        "--page-size",  # pages of 50 (the default is 500): the state file moves several times in a run
        "50",
        *extra,
    ]


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}


def inbox(owner: str) -> dict[str, str]:
    with psycopg.connect(owner, autocommit=True) as conn:
        rows = conn.execute("SELECT message_id::text, status FROM inbox.messages WHERE handler = %s", (HANDLER,))
        return dict(rows.fetchall())


def assert_exactly_once_in_key_order(world, handler) -> None:
    expected = world["expected"]
    assert inbox(world["owner"]) == {mid: "PROCESSED" for mid, _ in expected}
    first_calls: list[str] = []
    for call in handler.calls:
        if call.message_id not in first_calls:
            first_calls.append(call.message_id)
    assert sorted(first_calls) == sorted(mid for mid, _ in expected)
    by_key: dict[str, list[str]] = defaultdict(list)
    for mid, key in expected:
        by_key[key].append(mid)
    position = {mid: i for i, mid in enumerate(first_calls)}
    for key, mids in by_key.items():
        assert sorted(mids, key=position.__getitem__) == mids, f"{key} out of emit order"


@pytest.mark.slow
def test_a_backfill_killed_in_the_middle_still_delivers_every_event_once_in_key_order(world, handler, tmp_path):
    total = len(world["expected"])
    log = (tmp_path / "first.log").open("w")
    # 40 events/s (the default is 200): a run of several seconds, to be killed in the middle.
    first = subprocess.Popen(command(world, "--rate", "40"), stdout=log, stderr=subprocess.STDOUT, env=environment())
    try:
        wait_for(lambda: len(handler.calls) >= 130, 60, "the first run to deliver 130 events")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    processed_at_kill = {mid for mid, status in inbox(world["owner"]).items() if status == "PROCESSED"}
    called_before = [c.message_id for c in handler.calls]
    plan = (tmp_path / "first.log").read_text()
    assert plan.startswith(f"backfill {HANDLER}: {', '.join(SUBJECTS)}\n"), plan
    assert f"  outbox   {total} event(s)" in plan, plan
    done_before = len({c.message_id for c in handler.calls})
    assert 130 <= done_before < total

    metrics = tmp_path / "backfill.prom"
    second = subprocess.run(
        command(world, "--metrics-file", str(metrics)), capture_output=True, text=True, env=environment(), timeout=120
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert "backfill: resuming in the outbox after event id" in second.stderr, second.stderr
    assert f"backfilled {HANDLER}: " in second.stdout and "0 dead-lettered" in second.stdout, second.stdout
    assert_exactly_once_in_key_order(world, handler)
    shown = metrics.read_text()
    assert f'pgoutbox_backfill_planned_events{{handler="{HANDLER}"}} {float(total)}' in shown, shown
    assert f'pgoutbox_backfill_events{{handler="{HANDLER}",outcome="dead"}} 0.0' in shown, shown
    # Called again only for what the kill cut short: events in flight, whose
    # outcome had not committed (at most one per lane: --concurrency 8).
    calls = [c.message_id for c in handler.calls]
    repeated = {mid for mid in calls if calls.count(mid) > 1}
    assert repeated <= set(called_before) - processed_at_kill, repeated
    assert len(calls) - total == len(repeated) <= 8, (len(calls) - total, repeated)

    again = subprocess.run(command(world), capture_output=True, text=True, env=environment(), timeout=120)
    assert again.returncode == 0 and len(handler.calls) == len(calls), again.stdout + again.stderr


def test_a_422_dead_letters_that_event_and_the_others_still_arrive(world, handler):
    poison = world["expected"][3][0]
    answers = {poison: 422}

    def pick(call):  # the FakeHandler answers from the payload: give this one its answer
        call.body["payload"]["answers"] = [answers.get(call.message_id, 200)]

    handler.on_request = pick
    done = subprocess.run(
        command(world, "--rate", "1000"), capture_output=True, text=True, env=environment(), timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 dead-lettered" in done.stdout
    statuses = inbox(world["owner"])
    assert statuses.pop(poison) == "DEAD_LETTER"
    assert set(statuses.values()) == {"PROCESSED"} and len(statuses) == len(world["expected"]) - 1


def test_a_range_older_than_the_outbox_keeps_is_refused(world, handler):
    old = (datetime.now(UTC) - timedelta(days=DAYS + 3)).isoformat()
    done = subprocess.run(command(world, "--since", old), capture_output=True, text=True, env=environment(), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("pgoutbox backfill: RangeNotKept") and "before the oldest event" in done.stderr
    assert handler.calls == []
