"""Relays as real `pgoutbox relay` subprocesses, under the failures the issue
lists: kill -9 mid-batch, two relays side by side, NATS stopped under load,
PostgreSQL restarted under load, SIGTERM. The proof each time: every event
COMPLETED and each event id exactly once in the stream."""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import psycopg
import pytest

from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedPostgres, free_port
from support.outbox import RelayProcess, all_completed, apply_streams, emit, msg_ids, status_counts, stream_messages
from support.waiting import wait_for

pytestmark = pytest.mark.slow

# How long a backlog may take to drain: a deadline against a stuck relay, not a
# bound on speed. 30,000 events took more than 60 s with the suite beside a
# CPU-bound process on 2 cores (load average 19, 2026-11-29).
DRAIN = 300


def event_ids(url: str, status: str | None = None) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [
            r[0]
            for r in conn.execute(
                "SELECT event_id::text FROM outbox.events WHERE %(s)s::text IS NULL OR status = %(s)s", {"s": status}
            ).fetchall()
        ]


def assert_exactly_once(url: str, nats_url: str) -> None:
    """Every event COMPLETED, and the stream holds each event id exactly once."""
    counts = status_counts(url)
    assert set(counts) == {"COMPLETED"}, counts
    in_stream = msg_ids(asyncio.run(stream_messages(nats_url)))
    assert len(in_stream) == len(set(in_stream)), "an event id is in the stream twice"
    assert sorted(in_stream) == sorted(event_ids(url))


class Emitter(threading.Thread):
    """Emits `per_tx` events every `every` seconds until stopped, riding out
    database outages (reconnecting); the database is the record of what
    committed."""

    def __init__(self, url: str, per_tx: int = 10, every: float = 0.02):
        super().__init__(daemon=True)
        self.url, self.per_tx, self.every = url, per_tx, every
        self.halt = threading.Event()
        self.emitted = 0
        self.errors = 0

    def run(self) -> None:
        conn = None
        while not self.halt.is_set():
            try:
                conn = conn or psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                conn.execute(
                    "SELECT outbox.emit('order', i::text, 'order_created',"
                    " jsonb_build_object('schema_version', 1, 'n', i), context => 'sea')"
                    " FROM generate_series(%s::int, %s::int) AS i",
                    (self.emitted, self.emitted + self.per_tx - 1),
                )
                self.emitted += self.per_tx
            except psycopg.OperationalError:
                self.errors += 1
                conn = None
            time.sleep(self.every)
        if conn:
            conn.close()

    def stop(self) -> None:
        self.halt.set()
        self.join(10)


@pytest.fixture
def relays(tmp_path):
    started: list[RelayProcess] = []

    def make(name: str, database_url: str, nats_url: str, **settings) -> RelayProcess:
        relay = RelayProcess(tmp_path, name, database_url, nats_url, **settings)
        started.append(relay)
        return relay

    yield make
    for relay in started:
        relay.stop()


def test_kill_9_mid_batch_then_restart_publishes_each_event_exactly_once(database_url, nats_server, relays):
    asyncio.run(apply_streams(nats_server.url))
    n = 6000
    emit(database_url, n)
    first = relays(
        "relay-a", database_url, nats_server.url, relay_batch_size="200", relay_lease="3s", relay_publish_timeout="2s"
    )
    first.start().wait_started()
    wait_for(lambda: status_counts(database_url).get("COMPLETED", 0) >= 1000, 60, "1000 published")
    # Freeze the relay until it is caught between JetStream's acks and its
    # mark_published: then kill -9 lands on a batch that is in the stream but
    # still PROCESSING, the case only Nats-Msg-Id deduplication can save.
    for _ in range(100):
        first.proc.send_signal(signal.SIGSTOP)
        time.sleep(0.05)  # statements already sent finish meanwhile
        processing = set(event_ids(database_url, "PROCESSING"))
        published_unmarked = processing & set(msg_ids(asyncio.run(stream_messages(nats_server.url))))
        if published_unmarked:
            break
        first.proc.send_signal(signal.SIGCONT)
        time.sleep(0.01)
    first.kill()
    at_kill = status_counts(database_url)
    assert published_unmarked, "never caught the relay between publish and mark"
    assert at_kill.get("COMPLETED", 0) < n
    print(f"at kill -9: {at_kill}; {len(published_unmarked)} published but not yet marked")

    second = relays(
        "relay-b", database_url, nats_server.url, relay_batch_size="200", relay_lease="3s", relay_publish_timeout="2s"
    )
    second.start().wait_started()
    wait_for(all_completed(database_url, n), DRAIN, "every event COMPLETED")
    assert_exactly_once(database_url, nats_server.url)
    with psycopg.connect(database_url, autocommit=True) as conn:
        retaken = conn.execute(
            "SELECT count(*) FROM outbox.events WHERE event_id = ANY(%s::uuid[]) AND claimed_by = 'relay-b'",
            (list(processing),),
        ).fetchone()[0]
    assert retaken == len(processing), "the lease-expired batches were re-claimed by the new relay"


def test_two_relays_side_by_side_publish_20000_events_exactly_once(database_url, nats_server, relays):
    asyncio.run(apply_streams(nats_server.url))
    n = 20_000
    emit(database_url, n)
    pair = [relays(name, database_url, nats_server.url, relay_batch_size="250") for name in ("relay-1", "relay-2")]
    for relay in pair:
        relay.start()
    for relay in pair:
        relay.wait_started()
    wait_for(all_completed(database_url, n), 120, "every event COMPLETED", interval=0.25)
    assert_exactly_once(database_url, nats_server.url)
    with psycopg.connect(database_url, autocommit=True) as conn:
        by_relay = dict(conn.execute("SELECT claimed_by, count(*) FROM outbox.events GROUP BY 1").fetchall())
    assert set(by_relay) == {"relay-1", "relay-2"}, by_relay


def test_nats_stopped_under_load_then_restarted_loses_nothing(database_url, nats_server, relays):
    asyncio.run(apply_streams(nats_server.url))
    relay = relays(
        "relay-n",
        database_url,
        nats_server.url,
        relay_publish_timeout="1s",
        relay_retry_base="100ms",
        relay_retry_cap="1s",
    )
    relay.start().wait_started()
    emitter = Emitter(database_url)
    emitter.start()

    def logged(action: str):
        return lambda: any(e.get("action") == action for e in relay.log_entries())

    try:
        wait_for(lambda: status_counts(database_url).get("COMPLETED", 0) >= 100, 60, "the relay publishing under load")
        nats_server.stop()
        wait_for(logged("nats_disconnected"), 30, "the relay to see NATS gone")
        # not a race: the outage must last (the relay retries and hands back meanwhile)
        time.sleep(4)
        assert relay.proc.poll() is None, "the relay must keep running while NATS is down"
        nats_server.start()
        wait_for(logged("nats_reconnected"), 60, "the relay to reconnect")
    finally:
        emitter.stop()
    assert emitter.emitted > 500
    wait_for(all_completed(database_url, emitter.emitted), DRAIN, "the backlog to drain")
    assert_exactly_once(database_url, nats_server.url)
    actions = {e.get("action") for e in relay.log_entries()}
    assert {"nats_disconnected", "nats_reconnected"} <= actions


@pytest.fixture
def own_pg():
    """A PostgreSQL of this test's own, since the test restarts it."""
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-relay-pg-"))
    server = EmbeddedPostgres(root, settings={"fsync": "off"})
    server.start()
    with psycopg.connect(server.url, autocommit=True) as conn:
        migrate.migrate(conn)
    yield server
    server.stop("immediate")
    shutil.rmtree(root, ignore_errors=True)


def test_postgresql_restarted_under_load_relay_reconnects_and_loses_nothing(own_pg, nats_server, relays):
    asyncio.run(apply_streams(nats_server.url))
    url = own_pg.url
    relay = relays("relay-p", url, nats_server.url)
    relay.start().wait_started()
    emitter = Emitter(url)
    emitter.start()
    try:
        time.sleep(1.5)
        own_pg.restart()
        time.sleep(1.5)
    finally:
        emitter.stop()
    assert emitter.errors > 0, "the emitter should have seen the restart"
    assert relay.proc.poll() is None, "the relay must survive the restart"
    committed = len(event_ids(url))
    assert committed >= emitter.emitted > 500
    wait_for(all_completed(url, committed), DRAIN, "the backlog to drain")
    assert_exactly_once(url, nats_server.url)
    actions = [e.get("action") for e in relay.log_entries()]
    assert "db_retry" in actions or "listen_lost" in actions


def test_sigterm_finishes_the_in_flight_batches_and_exits_0(database_url, nats_server, relays):
    asyncio.run(apply_streams(nats_server.url))
    # A backlog the relay cannot drain between two polls of the test (it
    # publishes some 20,000 events/s on a quiet machine).
    n = 30000
    emit(database_url, n)
    relay = relays("relay-t", database_url, nats_server.url, relay_batch_size="200")
    relay.start().wait_started()
    wait_for(lambda: status_counts(database_url).get("COMPLETED", 0) >= 500, 60, "500 published")
    assert relay.terminate(timeout=20) == 0
    counts = status_counts(database_url)
    assert "PROCESSING" not in counts, f"claimed batches left behind: {counts}"
    assert counts.get("COMPLETED", 0) < n, "the relay should have stopped claiming"
    # Everything published was marked, and nothing marked is missing.
    in_stream = msg_ids(asyncio.run(stream_messages(nats_server.url)))
    assert sorted(in_stream) == sorted(event_ids(database_url, "COMPLETED"))
    assert any(e.get("action") == "stopping" for e in relay.log_entries())
    after = relays("relay-u", database_url, nats_server.url)
    after.start().wait_started()
    wait_for(all_completed(database_url, n), DRAIN, "the rest to drain")
    assert_exactly_once(database_url, nats_server.url)


def test_relay_waits_for_an_unreachable_nats_at_start_up_and_sigterm_still_exits_0(database_url, relays):
    port = free_port()
    relay = relays("relay-w", database_url, f"nats://127.0.0.1:{port}", relay_http_listen="off").start()
    wait_for(lambda: '"nats_error"' in relay.output(), 30, "a NATS connection error in the log")
    assert relay.proc.poll() is None, "the relay must keep waiting for NATS"
    assert relay.terminate(timeout=20) == 0
    assert any(e.get("action") == "stopped" for e in relay.log_entries())
    assert status_counts(database_url) == {}  # nothing claimed
    unknown = [e for e in relay.log_entries() if e.get("action") == "unknown_setting"]
    assert [e["variable"] for e in unknown] == ["OUTBOX_RELAY_HTTP_LISTEN"]
    assert "did you mean OUTBOX_RELAY_HTTP_" in unknown[0]["event"]
