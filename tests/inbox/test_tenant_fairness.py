"""Fair handling between tenants with real processes on the defaults (only
addresses and ports set), each worker as its least-privileged login: a relay
and `pgoutbox consume`, a real HTTP handler whose calls take 5 s for one
tenant and 5 ms for another. The slow tenant's events come first, twice as
many as the handler's concurrency: without a per-tenant limit they would
take every call (64) and the other tenant's events would wait behind both
rounds of them. With the default tenant_concurrency (a quarter: 16), the
slow tenant never has more than 16 calls in flight, the fast tenant's
events are all processed while the slow tenant's are still being called,
and the held ones, waiting more than ack_wait (30 s) for their turn, are
neither redelivered, nak'ed nor failed: every event of both ends PROCESSED
after exactly one delivery and one call.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pgoutbox.inbox import tenants
from support.inbox import add_stream, jetstream, write_registry
from support.jetstream_away import relay_settings
from support.roles import login
from support.waiting import wait_for
from support.workers import worker

pytestmark = pytest.mark.slow

H = "billing"
CONCURRENCY = 64  # OUTBOX_CONSUMER_CONCURRENCY's default
LIMIT = tenants.default(CONCURRENCY)  # tenant_concurrency's default: 16
SLOW, FAST = 2 * CONCURRENCY, 24
SLOW_CALL, FAST_CALL = 5.0, 0.005  # seconds a call of each tenant takes
ACK_WAIT = 30.0  # OUTBOX_CONSUMER_ACK_WAIT's default


class TenantHandler:
    """The handler, in this process: answers 200 after the call's time for the
    body's tenant_id, and records each call (message id, tenant, start, end)
    and the most calls of each tenant it had at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str, float, float]] = []
        self.running: Counter = Counter()
        self.most: Counter = Counter()
        handler = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                tenant, started = body["tenant_id"], time.monotonic()
                with handler.lock:
                    handler.running[tenant] += 1
                    handler.most[tenant] = max(handler.most[tenant], handler.running[tenant])
                time.sleep(SLOW_CALL if tenant == "slow" else FAST_CALL)
                with handler.lock:
                    handler.running[tenant] -= 1
                    handler.calls.append((body["message_id"], tenant, started, time.monotonic()))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/events"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _emit(writer_url: str, tenant: str, n: int) -> None:
    with psycopg.connect(writer_url, autocommit=True) as conn:
        conn.execute(
            "SELECT outbox.emit('order', i::text, 'order_created', %s, context => 'sea', tenant_id => %s)"
            " FROM generate_series(1, %s) AS i ORDER BY i",
            (Jsonb({"schema_version": 1}), tenant, n),
        )


def _published(database_url: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM outbox.events WHERE status = 'COMPLETED'").fetchone()[0]


def _processed(database_url: str) -> Counter:
    """PROCESSED inbox rows of the handler, per tenant."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT envelope->>'tenant_id', count(*) FROM inbox.messages"
            " WHERE handler = %s AND status = 'PROCESSED' GROUP BY 1",
            (H,),
        ).fetchall()
    return Counter(dict(rows))


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    needle = f'{name}{{handler="{H}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(needle))


def test_a_slow_tenant_keeps_to_its_share_of_calls_and_the_other_tenants_events_flow_past_it(
    database_url, nats_server, tmp_path
):
    handler = TenantHandler()
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    asyncio.run(_stream(nats_server.url))
    writer = login(database_url, "pgoutbox_writer")
    consumer_settings = {  # the defaults, but for the addresses and a free port for /metrics
        "OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_consumer"),
        "OUTBOX_NATS_URL": nats_server.url,
        "OUTBOX_REGISTRY_FILE": str(registry_file),
        "OUTBOX_CONSUMER_HTTP_PORT": "0",
    }
    try:
        with (
            worker(tmp_path, "relay", '"action": "started"', **relay_settings(database_url, nats_server.url)),
            worker(tmp_path, "consume", '"consumer started"', **consumer_settings) as port,
        ):
            assert port
            _emit(writer, "slow", SLOW)
            # The slow tenant's events are all in the stream before the fast tenant's.
            wait_for(lambda: _published(database_url) == SLOW, 60, "the slow tenant's events published")
            _emit(writer, "fast", FAST)
            most_held = 0.0

            def fast_done() -> bool:
                nonlocal most_held
                most_held = max(most_held, _metric(port, "pgoutbox_consumer_tenant_held_messages"))
                return _processed(database_url)["fast"] == FAST

            # not a race: the slow tenant's calls go on for 8 rounds of 5 s (40 s) behind its limit;
            # without one the fast events would come after all of them
            wait_for(fast_done, 60, "every event of the fast tenant processed", interval=0.2)
            slow_then = _processed(database_url)["slow"]
            with handler.lock:
                slow_running = handler.running["slow"]
            assert slow_then < SLOW and slow_running > 0, (slow_then, slow_running)
            wait_for(
                lambda: _processed(database_url)["slow"] == SLOW,
                180,  # 8 rounds of 16 calls of 5 s, on a loaded machine
                "every event of the slow tenant processed",
                interval=1,
                detail=lambda: f"{_processed(database_url)}",
            )
            redeliveries = _metric(port, "pgoutbox_consumer_redeliveries_total")
            holds = _metric(port, "pgoutbox_consumer_tenant_holds_total")
            held_after = _metric(port, "pgoutbox_consumer_tenant_held_messages")
            info = asyncio.run(_durable(nats_server.url))
    finally:
        handler.close()
    calls = Counter(message_id for message_id, *_ in handler.calls)
    assert len(calls) == SLOW + FAST and set(calls.values()) == {1}  # each event called exactly once
    assert handler.most["slow"] == LIMIT  # the limit held, and was the limit
    slow_starts = sorted(started for _, tenant, started, _ in handler.calls if tenant == "slow")
    # The last ones waited in hand for longer than ack_wait: most of the slow events were held at once.
    assert slow_starts[-1] - slow_starts[0] > ACK_WAIT and most_held >= SLOW - 2 * LIMIT, most_held
    assert holds >= SLOW - LIMIT and held_after == 0
    assert redeliveries == 0 and info.num_redelivered == 0  # none came back for the wait
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT status, attempts, dlq_metadata FROM inbox.messages WHERE handler = %s", (H,)
        ).fetchall()
    assert len(rows) == SLOW + FAST
    assert {(status, attempts) for status, attempts, _ in rows} == {("PROCESSED", 1)}  # one delivery each
    assert not any((meta or {}).get("failures") for *_, meta in rows)  # no failure counted


async def _stream(nats_url: str) -> None:
    async with jetstream(nats_url) as js:
        await add_stream(js)


async def _durable(nats_url: str):
    async with jetstream(nats_url) as js:
        return await js.consumer_info("SEA_EVENTS", H)
