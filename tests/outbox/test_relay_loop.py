"""The relay loop in-process, against a real PostgreSQL and nats-server:
publishing and the wire envelope, wake-ups, duplicates, permanent and
transient failures, per-key order under injected publish failures."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import httpx
import nats
import psycopg
import pytest

from pgoutbox.core import wire
from pgoutbox.dev.embedded import EmbeddedNats
from pgoutbox.outbox.publisher import Outcome, Publisher, PublishError
from support.outbox import (
    apply_streams,
    emit,
    msg_ids,
    relay_config,
    running_relay,
    status_counts,
    stream_messages,
)
from support.waiting import until


async def completed(url: str, n: int, timeout: float = 30) -> None:
    async def done():
        return status_counts(url).get("COMPLETED", 0) == n

    await until(done, timeout, f"{n} events COMPLETED")


def metric(relay, name: str, **labels) -> float:
    value = relay.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def metric_is(relay, name: str, expected: float, **labels) -> None:
    """Metrics are counted right after the mark commits: wait for them."""
    await until(lambda: metric(relay, name, **labels) == expected, 5, f"{name}{labels} == {expected}")
    assert metric(relay, name, **labels) == expected


async def test_relay_publishes_the_backlog_with_the_envelope_and_marks_it(database_url, nats_server):
    await apply_streams(nats_server.url)
    ids = emit(database_url, 50, keys=None)
    with psycopg.connect(database_url, autocommit=True) as conn:
        corr = conn.execute(
            "SELECT outbox.emit('order', '42', 'order_paid', '{\"schema_version\": 2, \"amount\": 12345678901234567890.123456789}',"
            " context => 'sea', event_version => 3, correlation_id => gen_random_uuid(),"
            " causation_id => gen_random_uuid(), tenant_id => 't1', ordering_key => 'order-42')"
        ).fetchone()[0]
    # not default: batches of 20, so that the backlog of this test takes several
    async with running_relay(relay_config(database_url, nats_server.url, batch_size="20")) as relay:
        await completed(database_url, 51)
        await metric_is(relay, "pgoutbox_relay_published_events_total", 51, context="sea")
    messages = await stream_messages(nats_server.url)
    assert sorted(msg_ids(messages)) == sorted(ids + [str(corr)])
    paid = next(m for m in messages if m.headers["Nats-Msg-Id"] == str(corr))
    assert paid.subject == "sea.event.order_paid.v3"
    # The payload's digits survive exactly (no float round trip).
    assert b"12345678901234567890.123456789" in paid.data
    env = wire.from_nats(paid.subject, paid.data, paid.headers)
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT event_type, event_version, aggregate_type, aggregate_id, correlation_id::text,"
            " causation_id::text, tenant_id, ordering_key, status, attempts, published_at IS NOT NULL"
            " FROM outbox.events WHERE event_id = %s",
            (corr,),
        ).fetchone()
    assert (
        env["event_type"],
        env["event_version"],
        env["aggregate_type"],
        env["aggregate_id"],
        env["correlation_id"],
        env["causation_id"],
        env["tenant_id"],
        env["ordering_key"],
    ) == row[:8]
    assert row[8:] == ("COMPLETED", 1, True)
    first = next(m for m in messages if m.headers["Nats-Msg-Id"] == ids[0])
    assert first.headers["traceparent"] == "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert json.loads(first.data) == {"schema_version": 1, "n": 0, "pad": ""}


async def test_a_notification_wakes_the_relay_long_before_the_fallback_poll(database_url, nats_server):
    await apply_streams(nats_server.url)
    cfg = relay_config(database_url, nats_server.url, poll_interval="60s")  # not default: the poll is out of reach
    async with running_relay(cfg) as relay:
        wakeups = relay.wakeups
        # Idle: the claim loop waits and the LISTEN session watches its socket (poll is 60 s away).
        await until(
            lambda: wakeups._listener is not None and wakeups._waiter is not None and not wakeups._waiter.done(),
            10,
            "the relay to wait on LISTEN",
        )
        started = time.monotonic()
        emit(database_url, 1)
        await completed(database_url, 1, timeout=30)
        # not a race: promptness is what this tests, a wake-up against a 60 s poll; 30 s
        # leaves a loaded 2-core machine room and still tells the two apart
        assert time.monotonic() - started < 30
        assert wakeups.received >= 1
        # Throttled: a second event right after the first sends no NOTIFY;
        # the re-check one throttle interval after the wake-up still gets it.
        emit(database_url, 1, start=1)
        emit(database_url, 1, start=2)
        await completed(database_url, 3, timeout=10)


def claim_tokens(url: str) -> list[str | None]:
    """The claim token of each event, in emit order (a batch shares one)."""
    with psycopg.connect(url, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT claim_token::text FROM outbox.events ORDER BY id").fetchall()]


async def test_events_announced_within_the_claim_interval_go_in_one_claim(database_url, nats_server):
    await apply_streams(nats_server.url)
    # not default: the test is about the claim interval; the poll out of reach
    cfg = relay_config(database_url, nats_server.url, poll_interval="60s", claim_interval="3s")
    emit(database_url, 1)  # taken by the relay's first claim
    async with running_relay(cfg) as relay:
        await completed(database_url, 1, timeout=30)
        # Five transactions, each of which may notify: all wait for the one
        # claim that comes claim_interval after the previous one.
        for i in range(1, 6):
            emit(database_url, 1, start=i)
        await completed(database_url, 6, timeout=30)
        first, *rest = claim_tokens(database_url)
        assert len(set(rest)) == 1 and first not in rest
        assert metric(relay, "pgoutbox_relay_batch_events_count") == 2


async def test_a_keys_next_event_is_not_held_back_by_the_claim_interval(database_url, nats_server):
    await apply_streams(nats_server.url)
    # not default: the test is about the claim interval; the poll out of reach
    cfg = relay_config(database_url, nats_server.url, poll_interval="60s", claim_interval="20s")
    emit(database_url, 3, keys=1)  # one key: three claims, each after the previous event was marked
    async with running_relay(cfg):
        # The first claim takes the first event; each successor is claimed as
        # soon as its predecessor is marked, not 20 s after the previous claim.
        await completed(database_url, 3, timeout=15)
    assert len(set(claim_tokens(database_url))) == 3


async def test_poll_only_relay_still_drains(database_url, nats_server):
    await apply_streams(nats_server.url)
    # not default: the test is about polling without wake-ups
    cfg = relay_config(database_url, nats_server.url, wakeups="false", poll_interval="200ms")
    async with running_relay(cfg) as relay:
        emit(database_url, 30)
        await completed(database_url, 30, timeout=10)
        assert relay.wakeups.received == 0


async def test_a_duplicate_ack_counts_as_published(database_url, nats_server):
    await apply_streams(nats_server.url)
    [event_id] = emit(database_url, 1)
    nc = await nats.connect(nats_server.url)
    await nc.jetstream().publish("sea.event.order_created.v1", b"{}", headers={"Nats-Msg-Id": event_id})
    await nc.close()
    async with running_relay(relay_config(database_url, nats_server.url)) as relay:
        await completed(database_url, 1)
        await metric_is(relay, "pgoutbox_relay_duplicate_events_total", 1, context="sea")
    assert msg_ids(await stream_messages(nats_server.url)) == [event_id]


async def test_no_stream_for_the_subject_dead_letters_at_once(database_url, nats_server):
    await apply_streams(nats_server.url)  # captures sea.event.> only
    good = emit(database_url, 5)
    [orphan] = emit(database_url, 1, context="nowhere", start=5)
    async with running_relay(relay_config(database_url, nats_server.url, max_attempts="10")) as relay:
        await completed(database_url, 5)

        async def dead():
            return status_counts(database_url).get("DEAD_LETTER") == 1

        await until(dead, 10, "the dead letter")
        await metric_is(relay, "pgoutbox_relay_dead_lettered_events_total", 1, context="nowhere", code="NO_STREAM")
    with psycopg.connect(database_url, autocommit=True) as conn:
        status, attempts, error = conn.execute(
            "SELECT status, attempts, last_error FROM outbox.events WHERE event_id = %s", (orphan,)
        ).fetchone()
    assert (status, attempts) == ("DEAD_LETTER", 1)
    assert error == "NO_STREAM: no JetStream stream captures subject 'nowhere.event.order_created.v1'"
    assert sorted(msg_ids(await stream_messages(nats_server.url))) == sorted(good)


async def test_oversize_messages_dead_letter_with_max_payload(database_url, tmp_path):
    # A server with a 4 KiB max_payload, and a stream that takes at most 2 KiB.
    conf = tmp_path / "nats.conf"
    conf.write_text("max_payload: 4096\n")
    server = EmbeddedNats(tmp_path / "nats", extra_args=["-c", str(conf)])
    server.start()
    try:
        await apply_streams(server.url, max_msg_size=2048)
        [small] = emit(database_url, 1, payload_bytes=100)
        [too_big_for_server] = emit(database_url, 1, payload_bytes=5000, start=1)
        [too_big_for_stream] = emit(database_url, 1, payload_bytes=2500, start=2)
        async with running_relay(relay_config(database_url, server.url)) as relay:

            async def settled():
                c = status_counts(database_url)
                return c.get("COMPLETED") == 1 and c.get("DEAD_LETTER") == 2

            await until(settled, 15, "one COMPLETED and two DEAD_LETTER")
            assert relay.publisher.connected  # the server never had to drop the connection
        with psycopg.connect(database_url, autocommit=True) as conn:
            errors = dict(
                conn.execute(
                    "SELECT event_id::text, last_error FROM outbox.events WHERE status = 'DEAD_LETTER'"
                ).fetchall()
            )
        assert errors[too_big_for_server].startswith("MAX_PAYLOAD: message of ")
        assert "exceeds the server's max_payload of 4096 bytes" in errors[too_big_for_server]
        assert errors[too_big_for_stream].startswith("MAX_PAYLOAD: [10054]")
        assert msg_ids(await stream_messages(server.url)) == [small]
    finally:
        server.stop()


class FlakyPublisher(Publisher):
    """The real publisher with injected faults: some messages fail before
    reaching NATS, some acks are "lost" after JetStream stored the message
    (so the retry is a duplicate), some events always fail."""

    def __init__(self, *args, fail=0.0, lose_ack=0.0, always_fail=(), seed=7, **kwargs):
        super().__init__(*args, **kwargs)
        self.fail, self.lose_ack, self.always_fail = fail, lose_ack, set(always_fail)
        self.rng = random.Random(seed)
        self.injected = 0

    async def publish_batch(self, rows):
        sent = [r for r in rows if str(r["event_id"]) not in self.always_fail and self.rng.random() >= self.fail]
        real = {o.event_id: o for o in await super().publish_batch(sent)}
        outcomes = []
        for r in rows:
            o = real.get(r["event_id"])
            if o is None or (o.ok and self.rng.random() < self.lose_ack):
                self.injected += 1
                o = Outcome(r["event_id"], code=PublishError.PUBLISH_TIMEOUT, detail="injected fault")
            outcomes.append(o)
        return outcomes


async def test_per_key_order_holds_in_the_stream_under_injected_publish_failures(database_url, nats_server):
    await apply_streams(nats_server.url)
    keys, per_key = 20, 20
    ids = emit(database_url, keys * per_key, keys=keys)
    # not default: the test is about publish failures and retries: many, quickly
    cfg = relay_config(
        database_url, nats_server.url, retry_base="5ms", retry_cap="40ms", max_attempts="200", batch_size="50"
    )
    flaky = FlakyPublisher(nats_server.url, timeout=cfg.publish_timeout, fail=0.3, lose_ack=0.1)
    async with running_relay(cfg, flaky) as relay:
        await completed(database_url, len(ids), timeout=90)
        await metric_is(relay, "pgoutbox_relay_published_events_total", len(ids), context="sea")
        assert metric(relay, "pgoutbox_relay_duplicate_events_total", context="sea") > 0  # lost acks were retried
        assert sum(s.value for s in relay.metrics.failed.collect()[0].samples if s.name.endswith("_total")) > 50
    assert flaky.injected > 50
    messages = await stream_messages(nats_server.url)
    assert sorted(msg_ids(messages)) == sorted(ids)  # each exactly once
    seen = defaultdict(list)
    for m in messages:
        seen[m.headers["Pgoutbox-Ordering-Key"]].append(json.loads(m.data)["n"])
    assert len(seen) == keys
    for key, ns in seen.items():
        assert ns == sorted(ns), f"key {key} out of order in the stream: {ns}"


async def test_retries_back_off_then_dead_letter_after_max_attempts(database_url, nats_server):
    await apply_streams(nats_server.url)
    doomed, *others = emit(database_url, 4, keys=None)
    [follower] = emit(database_url, 1, start=10, keys=None)
    # not default: the test is about the backoff and max_attempts
    cfg = relay_config(database_url, nats_server.url, retry_base="20ms", retry_cap="50ms", max_attempts="3")
    flaky = FlakyPublisher(nats_server.url, timeout=cfg.publish_timeout, always_fail={doomed})
    async with running_relay(cfg, flaky) as relay:

        async def dead():
            return status_counts(database_url).get("DEAD_LETTER") == 1

        await until(dead, 15, "the doomed event to be dead-lettered")
        await completed(database_url, 4)
        await metric_is(relay, "pgoutbox_relay_failed_events_total", 2, context="sea", code="PUBLISH_TIMEOUT")
        await metric_is(relay, "pgoutbox_relay_dead_lettered_events_total", 1, context="sea", code="PUBLISH_TIMEOUT")
    with psycopg.connect(database_url, autocommit=True) as conn:
        status, attempts, error = conn.execute(
            "SELECT status, attempts, last_error FROM outbox.events WHERE event_id = %s", (doomed,)
        ).fetchone()
    assert (status, attempts) == ("DEAD_LETTER", 3)
    assert error == "PUBLISH_TIMEOUT: injected fault (gave up after 3 attempts)"
    assert sorted(msg_ids(await stream_messages(nats_server.url))) == sorted(others + [follower])


async def test_health_readiness_and_metrics_endpoints(database_url, nats_server):
    await apply_streams(nats_server.url)
    # not default: the test is about readiness turning on a stall and the backlog metrics
    cfg = relay_config(
        database_url, nats_server.url, stall_after="1s", backlog_interval="200ms", publish_timeout="500ms"
    )
    async with running_relay(cfg) as relay, httpx.AsyncClient(base_url=f"http://127.0.0.1:{relay.http_port}") as http:
        emit(database_url, 10)
        await completed(database_url, 10)
        await metric_is(relay, "pgoutbox_relay_published_events_total", 10, context="sea")
        assert (await http.get("/healthz")).status_code == 200
        ready = await http.get("/readyz")
        assert ready.status_code == 200, ready.text
        text = (await http.get("/metrics")).text
        assert 'pgoutbox_relay_published_events_total{context="sea"} 10.0' in text
        for name in (
            "pgoutbox_relay_batch_events_bucket",
            "pgoutbox_relay_publish_duration_seconds_bucket",
            "pgoutbox_outbox_due_events",
            "pgoutbox_outbox_oldest_due_age_seconds",
            "pgoutbox_relay_ready",
        ):
            assert name in text
        # NATS goes away while work is due: not ready, and says why.
        nats_server.stop()
        emit(database_url, 5, start=10)

        async def not_ready():
            r = await http.get("/readyz")
            return r if r.status_code == 503 else None

        body = (await until(not_ready, 10, "readiness to fail")).json()
        assert "NATS unreachable" in body["problems"]
        await until(lambda: _stalled(http), 10, "the stall to be reported")
        nats_server.start()
        await completed(database_url, 15, timeout=20)

        async def ready_again():
            return (await http.get("/readyz")).status_code == 200

        await until(ready_again, 10, "readiness to recover")
        assert (await http.get("/nope")).status_code == 404


async def _stalled(http) -> bool:
    problems = (await http.get("/readyz")).json()["problems"]
    return any(p.startswith("no progress for") for p in problems)


async def test_the_relay_runs_with_only_the_pgoutbox_relay_role(database_url, nats_server):
    """Least privilege: a login that is granted pgoutbox_relay and nothing else."""
    await apply_streams(nats_server.url)
    login = f"relay_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {login} LOGIN IN ROLE pgoutbox_relay")
    try:
        emit(database_url, 20)
        relay_url = database_url.replace("postgresql://postgres@", f"postgresql://{login}@")
        async with running_relay(relay_config(relay_url, nats_server.url, partitions_every="1h")):
            await completed(database_url, 20)
        with psycopg.connect(relay_url, autocommit=True) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT count(*) FROM outbox.events")
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f"DROP ROLE {login}")


async def test_the_relay_keeps_daily_partitions_created_ahead(database_url, nats_server):
    await apply_streams(nats_server.url)
    far = (datetime.now(UTC) + timedelta(days=12)).strftime("events_p%Y%m%d")
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass(%s)", (f"outbox.{far}",)).fetchone()[0] is None
    # not default: the test is about days_ahead
    async with running_relay(relay_config(database_url, nats_server.url, days_ahead="12")):

        async def created():
            with psycopg.connect(database_url, autocommit=True) as conn:
                return conn.execute("SELECT to_regclass(%s)", (f"outbox.{far}",)).fetchone()[0] is not None

        await until(created, 10, f"partition {far}")
