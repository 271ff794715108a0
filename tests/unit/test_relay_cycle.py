"""The relay loop without a server: the pause between claims, and the loop's
decisions (publish, mark, retry, dead-letter, wait for NATS, retry a mark) on
the in-memory fakes of tests/unit/fakes.py. tests/outbox/test_relay_loop.py
runs the same loop against a real PostgreSQL and nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import UTC, datetime, timedelta

from fakes import FakeOutboxStore, FakePublisher
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pgoutbox.core.errors import DatabaseUnavailable
from pgoutbox.core.otel import OtelTracer
from pgoutbox.outbox import settings as relay_settings
from pgoutbox.outbox.publisher import PublishError
from pgoutbox.outbox.relay import OutboxRelay
from pgoutbox.outbox.wakeups import Wakeups
from support.waiting import until


async def test_a_pause_ends_early_only_for_an_urgent_wake_up_or_stop():
    # not a race: one event loop, and only a wake-up, stop() or the 60 s timer can end a
    # pause or a wait: the 50 ms sleeps below let the task start, nothing else can happen
    wakeups = Wakeups(poll_interval=60)
    pause = asyncio.create_task(wakeups.pause(60))
    await asyncio.sleep(0.05)  # not a race: as above
    wakeups.wake()  # counted for the next wait, not ending the pause
    await asyncio.sleep(0.05)  # not a race: as above
    assert not pause.done()
    wakeups.wake(urgent=True)
    await asyncio.wait_for(pause, 5)
    await asyncio.wait_for(wakeups.wait(), 5)  # the wake-ups came: no wait
    wakeups.arm()
    waiting = asyncio.create_task(wakeups.wait())
    await asyncio.sleep(0.05)  # not a race: as above
    assert not waiting.done()
    wakeups.stop()
    await asyncio.wait_for(waiting, 5)
    await asyncio.wait_for(wakeups.pause(60), 5)  # stopped: no pause any more


# -- the relay loop on in-memory fakes (tests/unit/fakes.py) -------------------


@contextlib.asynccontextmanager
async def relay_on_fakes(store: FakeOutboxStore, publisher: FakePublisher, tracer=None):
    """OutboxRelay.run on the defaults, its three sessions and its publisher
    replaced by fakes; start-up (the schema and stream checks, the HTTP
    server) is left out, and so are wake-ups (a LISTEN session): the claim
    loop polls, at poll_interval, as it does without them."""
    cfg = relay_settings.load(
        environ={},
        overrides={
            "database_url": "postgresql://fake@127.0.0.1:1/fake",
            "nats_url": "nats://127.0.0.1:1",
            "wakeups": "false",
        },
    )
    relay = OutboxRelay(cfg, publisher, tracer)  # type: ignore[arg-type]
    relay.claims = relay.marks = relay.monitor = store  # type: ignore[assignment]

    async def start() -> None:
        pass

    relay._start = start  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await asyncio.wait_for(relay.started.wait(), 5)
    try:
        yield relay
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_claimed_events_are_published_in_order_then_marked_completed():
    store, publisher = FakeOutboxStore(), FakePublisher()
    ids = store.add(3)
    async with relay_on_fakes(store, publisher):
        await until(lambda: all(store.status(i) == "COMPLETED" for i in ids), 5, "three events completed")
    assert publisher.published == ids
    assert store.calls.count("mark_published") == 1 and "mark_failed" not in store.calls


async def test_a_transient_publish_failure_leaves_the_event_unmarked_and_due_later():
    store, publisher = FakeOutboxStore(), FakePublisher()
    ok, failing = store.add(2)
    publisher.failing[failing] = PublishError.JETSTREAM_ERROR  # a refusal that may clear
    async with relay_on_fakes(store, publisher):
        await until(lambda: store.status(failing) == "FAILED", 5, "the failure recorded")
        assert store.status(ok) == "COMPLETED"
        event = store.events[failing]
        assert event["last_error"].startswith("JETSTREAM_ERROR: ")
        assert event["retry_at"] > datetime.now(UTC) - timedelta(seconds=1)  # retried later, not dead
    assert failing not in publisher.published


async def test_a_permanent_code_dead_letters_at_once_and_the_rest_of_the_batch_is_published():
    store, publisher = FakeOutboxStore(), FakePublisher()
    first, poison, last = store.add(3)
    publisher.failing[poison] = PublishError.BAD_HEADER
    async with relay_on_fakes(store, publisher):
        await until(lambda: store.status(last) == "COMPLETED", 5, "the batch marked")
    assert store.status(first) == "COMPLETED" and store.status(poison) == "DEAD_LETTER"
    assert store.events[poison]["attempts"] == 1
    assert store.events[poison]["last_error"].startswith("BAD_HEADER: ")


async def test_a_transient_failure_at_max_attempts_dead_letters_and_says_it_gave_up():
    store, publisher = FakeOutboxStore(), FakePublisher()
    (event,) = store.add(1, attempts=9)  # the claim makes it the 10th, the default max_attempts
    publisher.failing[event] = PublishError.JETSTREAM_ERROR  # refused, not away: it counts
    async with relay_on_fakes(store, publisher):
        await until(lambda: store.status(event) != "PROCESSING" and store.status(event) != "PENDING", 5, "marked")
    assert store.status(event) == "DEAD_LETTER"
    assert store.events[event]["last_error"].endswith("(gave up after 10 attempts)")


async def test_a_publish_call_that_raises_fails_each_row_of_the_batch_not_the_relay():
    store, publisher = FakeOutboxStore(), FakePublisher()
    ids = store.add(2)
    publisher.broken = RuntimeError("boom")
    async with relay_on_fakes(store, publisher) as relay:
        await until(lambda: all(store.status(i) == "FAILED" for i in ids), 5, "both failed")
        assert relay.started.is_set() and not relay.stopping.is_set()
    assert all(store.events[i]["last_error"].startswith("JETSTREAM_ERROR: ") for i in ids)


async def test_nothing_is_claimed_while_nats_is_away():
    store, publisher = FakeOutboxStore(), FakePublisher()
    (event,) = store.add(1)
    publisher.connected = False
    looked = [0]
    wait_connected = publisher.wait_connected

    async def counted(timeout: float | None = None) -> bool:
        looked[0] += 1
        return await wait_connected(timeout)

    publisher.wait_connected = counted
    async with relay_on_fakes(store, publisher):
        # The event: the claim loop found NATS away three times (and did not claim).
        await until(lambda: looked[0] >= 3, 5, "the relay to find NATS away three times")
        assert "claim" not in store.calls and store.status(event) == "PENDING"
        publisher.connected = True
        await until(lambda: store.status(event) == "COMPLETED", 5, "published once NATS is back")


async def test_a_mark_that_finds_postgresql_away_is_tried_again_and_publishes_nothing_twice():
    store, publisher = FakeOutboxStore(), FakePublisher()
    (event,) = store.add(1)
    real_mark = store.mark_published

    async def mark_once_away(token, ids):
        store.mark_published = real_mark  # type: ignore[method-assign]
        raise DatabaseUnavailable("PostgreSQL unavailable (fake)")

    store.mark_published = mark_once_away  # type: ignore[method-assign]
    async with relay_on_fakes(store, publisher):
        await until(lambda: store.status(event) == "COMPLETED", 5, "marked after the retry")
    assert publisher.published == [event]


async def test_traced_a_batch_is_one_producer_span_linked_to_each_events_creation_context_and_names_its_failure():
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    store, publisher = FakeOutboxStore(), FakePublisher()
    created = (datetime.now(UTC) - timedelta(seconds=2)).isoformat().replace("+00:00", "Z")
    contexts = [(f"{n:032x}", f"{n:016x}") for n in (1, 2, 3)]
    ids = [
        store.add(1, created_at=created, headers=json.dumps({"traceparent": f"00-{t}-{s}-01"}))[0] for t, s in contexts
    ]
    publisher.failing[ids[1]] = PublishError.BAD_HEADER
    async with relay_on_fakes(store, publisher, OtelTracer(provider, "pgoutbox-relay", [])):
        await until(lambda: store.status(ids[2]) == "COMPLETED", 5, "the batch marked")
    (span,) = exported.get_finished_spans()
    assert span.name == "send sea.event.order_created.v1" and span.kind is SpanKind.PRODUCER
    assert span.parent is None and span.attributes["messaging.batch.message_count"] == 3
    assert [(f"{k.context.trace_id:032x}", f"{k.context.span_id:016x}") for k in span.links] == contexts
    assert [k.attributes["messaging.message.id"] for k in span.links] == ids
    assert all(1900 < k.attributes["pgoutbox.outbox.wait_ms"] < 60_000 for k in span.links)
    assert span.attributes["error.type"] == "BAD_HEADER" and span.attributes["pgoutbox.failed_count"] == 1
    assert span.status.status_code is StatusCode.ERROR


def test_a_backlog_beside_other_tenants_is_drained_in_smaller_claims():
    cfg = relay_settings.load(
        environ={},
        overrides={"database_url": "postgresql://fake@127.0.0.1:1/fake", "nats_url": "nats://127.0.0.1:1"},
    )
    relay = OutboxRelay(cfg, FakePublisher())  # type: ignore[arg-type]
    full, small = cfg.batch_size, cfg.batch_size // (4 * cfg.publish_batches)
    assert small == 31  # on the defaults

    def batch(counts: dict[str | None, int]) -> list[dict[str, str | None]]:
        return [{"tenant_id": t} for t, n in counts.items() for _ in range(n)]

    # one tenant's backlog, with a few events of others in the batch: smaller claims
    assert relay._drain_size(batch({"bulk": full - 3, "a": 2, None: 1}), full) == small
    # and so on until a claim comes back short (the loop then claims batch_size again)
    assert relay._drain_size(batch({"b": small}), small) == small
    # one tenant alone, or many busy tenants none of which has most of the batch: full claims
    assert relay._drain_size(batch({"bulk": full}), full) == full
    assert relay._drain_size(batch({f"t{i}": full // 10 for i in range(10)}), full) == full
