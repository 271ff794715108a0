"""A handler process stopped for 5 minutes while events flow,
with real processes on the defaults (only addresses and ports set), each
worker with a least-privileged login: every event reaches the handler
exactly once after it is back, none is dead-lettered (nor FAILED), no
operator acts; the consumer's /readyz said why meanwhile and
pgoutbox_consumer_handler_up went 0, then 1. An xdist group of its own (a
chain of about 6 minutes). PGOUTBOX_TEST_HANDLER_OUTAGE shortens the outage
for a quick look.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import psycopg
import pytest

from support.handler_process import HandlerProcess
from support.inbox import add_stream, dlq_messages, jetstream, write_registry
from support.jetstream_away import emit, event_ids, log_lines, relay_settings
from support.roles import login
from support.waiting import wait_for
from support.workers import worker

pytestmark = pytest.mark.slow

H = "billing"
OUTAGE = float(os.environ.get("PGOUTBOX_TEST_HANDLER_OUTAGE", "300"))  # the 5 minutes
BEFORE, DURING = 20, 100  # events emitted before the outage, and while it lasts


class ConsumerWatch(threading.Thread):
    """What the consumer's /readyz and pgoutbox_consumer_handler_up said,
    sampled every half second while the test runs (the record, not a wait)."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port = port
        self.halt = threading.Event()
        self.reasons: list[str] = []
        self.gauge: list[float] = []  # each change of the gauge, in order

    def run(self) -> None:
        needle = f'pgoutbox_consumer_handler_up{{handler="{H}"}} '
        while not self.halt.wait(0.5):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=5) as r:
                    problems = json.load(r)["problems"]
            except urllib.error.HTTPError as answer:  # 503: not ready, with its reasons
                problems = json.load(answer)["problems"]
            except OSError:
                continue
            self.reasons.extend(p for p in problems if p.startswith(f"handler {H}") and p not in self.reasons)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith(needle):
                    value = float(line.split()[1])
                    if not self.gauge or self.gauge[-1] != value:
                        self.gauge.append(value)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)


def _inbox(database_url: str) -> Counter:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return Counter(
            dict(conn.execute("SELECT status, count(*) FROM inbox.messages WHERE handler = %s GROUP BY 1", (H,)))
        )


def _failures(database_url: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*) FROM inbox.messages WHERE handler = %s AND dlq_metadata ? 'failures'", (H,)
        ).fetchone()[0]


def test_a_handler_stopped_for_five_minutes_delays_its_events_and_dead_letters_none(
    database_url, nats_server, tmp_path
):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    handler = HandlerProcess(port, tmp_path / "calls.txt", tmp_path / "handler.log")
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    asyncio.run(_stream(nats_server.url))
    writer = login(database_url, "pgoutbox_writer")
    consumer_settings = {  # the defaults, but for the addresses and a free port for /metrics and /readyz
        "OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_consumer"),
        "OUTBOX_NATS_URL": nats_server.url,
        "OUTBOX_REGISTRY_FILE": str(registry_file),
        "OUTBOX_CONSUMER_HTTP_PORT": "0",
    }
    handler.start()
    try:
        with (
            worker(tmp_path, "relay", '"action": "started"', **relay_settings(database_url, nats_server.url)),
            worker(tmp_path, "consume", '"consumer started"', **consumer_settings) as consumer_port,
        ):
            assert consumer_port
            watch = ConsumerWatch(consumer_port)
            watch.start()
            try:
                emit(writer, BEFORE, 0)
                wait_for(lambda: len(handler.called()) == BEFORE, 60, "the first events handled")
                handler.stop()
                started = time.monotonic()
                for i in range(DURING):
                    time.sleep(max(0.0, started + i * OUTAGE / DURING - time.monotonic()))  # pacing the emits
                    emit(writer, 1, BEFORE + i)
                # not a race: the outage lasts its whole length, then the check
                time.sleep(max(0.0, started + OUTAGE - time.monotonic()))
                assert not _inbox(database_url).get("DEAD_LETTER") and not _inbox(database_url).get("FAILED")
                handler.start()
                wait_for(
                    lambda: _inbox(database_url).get("PROCESSED", 0) == BEFORE + DURING,
                    180,  # a probe's pause is at most 30 s; the backlog then goes in seconds
                    "every event processed after the handler came back",
                    interval=1,
                    detail=lambda: f"{_inbox(database_url)}",
                )
                wait_for(lambda: watch.gauge[-1:] == [1.0], 30, "the gauge back at 1", interval=0.5)
                dlq = asyncio.run(_dlq(nats_server.url))
            finally:
                watch.stop()
    finally:
        handler.stop()
    calls = Counter(handler.called())
    assert sorted(calls) == sorted(event_ids(database_url))  # every event reached the handler
    assert [m for m, n in calls.items() if n > 1] == []  # each exactly once
    assert _inbox(database_url) == {"PROCESSED": BEFORE + DURING}
    assert _failures(database_url) == 0 and dlq == []
    assert 0.0 in watch.gauge and watch.gauge[-1] == 1.0, watch.gauge  # 0 during the outage, then 1
    assert any(r.startswith(f"handler {H} not answering since ") for r in watch.reasons), watch.reasons
    actions = [line.get("action") for line in log_lines(tmp_path / "consume.log")]
    assert actions.count("handler_away") >= 1 and actions.count("handler_back") >= 1
    assert not any(line.get("event") == "dead-lettered" for line in log_lines(tmp_path / "consume.log"))


async def _stream(nats_url: str) -> None:
    async with jetstream(nats_url) as js:
        await add_stream(js)


async def _dlq(nats_url: str) -> list:
    async with jetstream(nats_url) as js:
        return await dlq_messages(js)
