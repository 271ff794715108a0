"""A rolling upgrade from the previous release (taken from git history) to
this checkout, under load, with real processes (docs/upgrading.md):

1. a database at the previous release's schema (its own migrations), its
   relay and consumer running, writers emitting, a fake HTTP handler
   recording every call;
2. this checkout's `pgoutbox migrate` applied while they run (the
   migrations after the previous release's schema version, whatever they
   are in this checkout);
3. the old relay restarted once on the migrated schema (a worker rescheduled
   mid-upgrade must start, not be refused);
4. the workers replaced one at a time: SIGTERM the old relay, start the new
   one; then the same for the consumer.

The ledger at the end: every committed event reached the handler exactly
once (the inbox's exactly-once across the consumer switch), no worker was
refused or crashed (exit codes, logs), each ran the code it was meant to,
and the delay each switch caused is printed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pgoutbox.core import migrate
from support.inbox import FakeHandler
from support.upgrade import (
    Delivery,
    Ledger,
    Worker,
    Writer,
    acked_everything,
    consumer_worker,
    current_build,
    delivered_since,
    handler_registry,
    latencies,
    ledger_problems,
    longest_silence,
    previous_release,
    relay_worker,
    schema_version,
    start_worker,
    summary,
)
from support.waiting import wait_for

pytestmark = pytest.mark.slow

HANDLER = "upgrade_check"
SUBJECT = "sea.event.order_created.v1"
ACK_WAIT = 30.0  # the handler's (the default), in seconds

# How long a step may take to show its event (a delivery, the ack floor): a deadline, not a
# bound of promptness; a worker restarted on a 2-core machine under the rest of the suite took
# more than 60 s to deliver again (a clean-clone run, 2026-11-29).
DEADLINE = 180
# The writers pause while this many committed events are still on their way to
# the handler (10 s of their 50 events/s): a machine too busy to deliver 50 events/s
# would otherwise build a backlog without bound, and each step below waits for the
# events committed after it, behind all of the backlog. A quiet machine delivers
# within a second, so that the bound only holds the load back on a loaded one.
BACKLOG = 500


def test_rolling_upgrade_from_the_previous_release(tmp_path, pg_server, nats_server, empty_database_url):
    old, new = previous_release(tmp_path), current_build()
    url, nats_url = empty_database_url, nats_server.url
    pending = [m.name for m in migrate.discover() if m.version > old.schema_version]
    print(
        f"\nprevious release: {old.version} (schema {old.schema_version}); current: {new.version} "
        f"(schema {new.schema_version}); migrations applied during the upgrade: {pending or 'none'}"
    )

    # 1. The previous release, as deployed: its schema, its streams, its workers.
    old.run("migrate", OUTBOX_DATABASE_URL=url)
    assert schema_version(url) == old.schema_version
    (tmp_path / "streams.toml").write_text('[defaults]\nduplicate_window = "2m"\n[streams.sea]\n')
    old.run("streams", OUTBOX_NATS_URL=nats_url, OUTBOX_STREAMS_FILE=str(tmp_path / "streams.toml"))
    handler = FakeHandler()
    ledger = Ledger()

    def backlog() -> int:
        return len(ledger.committed) - len(handler.calls)

    writers = [Writer(url, ledger, rate=25, name=f"w{i}", backlog=backlog, most=BACKLOG) for i in range(2)]
    workers: list[Worker] = []
    try:
        old_registry = handler_registry(old, tmp_path, HANDLER, handler.url, SUBJECT, tmp_path / "old.registry.json")
        old_relay = relay_worker(old, "relay-old", tmp_path, url, nats_url)
        old_consumer = consumer_worker(old, "consumer-old", tmp_path, url, nats_url, old_registry)
        for w in (old_relay, old_consumer):
            workers.append(w)  # listed first: the clean-up kills it even if its start fails
            start_worker(w)
        t0 = time.monotonic()
        for w in writers:
            w.start()
        wait_for(delivered_since(ledger, handler, t0, 50), DEADLINE, "the previous release delivering under load")

        # 2. This release's migrations, under load.
        t_migrate = time.monotonic()
        ran = new.run("migrate", OUTBOX_DATABASE_URL=url)
        t_migrated = time.monotonic()
        print(ran.stdout.strip())
        assert schema_version(url) == max(new.schema_version, old.schema_version)
        old.run("status", OUTBOX_DATABASE_URL=url)  # the old release still accepts the schema (exit 0)
        wait_for(
            delivered_since(ledger, handler, t_migrated), DEADLINE, "the old workers delivering on the migrated schema"
        )
        assert old_relay.alive() and old_consumer.alive(), "an old worker stopped after the migration"

        # 3. An old relay restarted on the migrated schema.
        assert old_relay.terminate() == 0
        again = relay_worker(old, "relay-old-again", tmp_path, url, nats_url)
        workers.append(again)
        start_worker(again)
        wait_for(delivered_since(ledger, handler, time.monotonic()), DEADLINE, "the restarted old relay delivering")

        # 4. One at a time: the relay, then the consumer.
        assert again.terminate() == 0
        new_relay = relay_worker(new, "relay-new", tmp_path, url, nats_url)
        workers.append(new_relay)
        start_worker(new_relay)
        new_registry = handler_registry(new, tmp_path, HANDLER, handler.url, SUBJECT, tmp_path / "new.registry.json")
        new_consumer = consumer_worker(new, "consumer-new", tmp_path, url, nats_url, new_registry)
        workers.append(new_consumer)
        wait_for(delivered_since(ledger, handler, time.monotonic()), DEADLINE, "the new relay delivering")
        assert old_consumer.terminate() == 0
        start_worker(new_consumer)
        wait_for(delivered_since(ledger, handler, time.monotonic()), DEADLINE, "the new consumer delivering")

        for w in writers:
            w.stop()
        t_end = time.monotonic()
        wait_for(
            lambda: set(ledger.committed) <= set(Delivery.of(handler).calls),
            60,
            "every committed event to reach the handler",
        )
        # Every message acked at the server: no delivery can still come, so a duplicate would have shown.
        wait_for(lambda: acked_everything(nats_url, HANDLER), DEADLINE, "the consumer's ack floor at the stream's end")
        assert new_relay.alive() and new_consumer.alive()
        assert new_relay.terminate() == 0
        assert new_consumer.terminate() == 0
    finally:
        for w in writers:
            w.stop()
        for w in workers:
            w.kill()
        handler.close()

    # The ledger.
    delivered = Delivery.of(handler)
    assert len(ledger.committed) > 200, f"too little load to say anything: {len(ledger.committed)} events"
    problems = ledger_problems(ledger, delivered)
    for w in workers:
        problems += w.problems()
        if w.returncode != 0:
            problems.append(f"{w.name} exited with {w.returncode}")
    assert not problems, "\n".join(problems)

    # Each worker ran the code it was meant to, and said which schema it found.
    for w, build, found in (
        (old_relay, old, old.schema_version),
        (old_consumer, old, old.schema_version),
        (again, old, schema_version(url)),
        (new_relay, new, schema_version(url)),
        (new_consumer, new, schema_version(url)),
    ):
        launched = w.launched()
        assert launched is not None, f"{w.name} printed no launch line"
        assert Path(launched["package"]) == build.package.resolve(), (w.name, launched, build)
        assert (launched["version"], launched["schema_version"]) == (build.version, build.schema_version)
        assert w.schema_versions_found() == [found], (w.name, w.schema_versions_found())
    assert old.package.resolve() != new.package.resolve()

    # The delay each step caused: commit -> handler call of the events
    # committed around it, and the longest stretch with no handler call.
    steps = [
        ("steady state, previous release", t0 + 1, t_migrate),
        ("migration", t_migrate - 1, t_migrated + 1),
        ("old relay restarted on the new schema", old_relay.stopped_at - 1, again.ready_at + 1),
        ("relay switch (old -> new)", again.stopped_at - 1, new_relay.ready_at + 1),
        ("consumer switch (old -> new)", old_consumer.stopped_at - 1, new_consumer.ready_at + 1),
        ("steady state, current release", new_consumer.ready_at + 1, t_end),
    ]
    report = {"events": len(ledger.committed), "handler_calls": sum(len(t) for t in delivered.calls.values())}
    report["writers_held_s"] = round(max(w.held for w in writers), 1)
    print(
        f"\n{report['events']} events committed, {report['handler_calls']} handler calls; "
        f"writers paused {report['writers_held_s']} s for a backlog of {BACKLOG}"
    )
    for name, start_at, end_at in steps:
        lat = latencies(ledger, delivered, start_at, end_at)
        silence = longest_silence(delivered, start_at, end_at)
        print(f"  {name:40s} {end_at - start_at:5.1f} s window: {summary(lat)}; longest gap {silence * 1000:.0f} ms")
        report[name] = {"max_latency_ms": round(max(lat, default=0) * 1000), "gap_ms": round(silence * 1000)}
    # Messages a stopped consumer had been sent for a pull still open wait
    # for their ack_wait before JetStream redelivers them.
    waited = [x for x in latencies(ledger, delivered, t0, t_end) if x >= ACK_WAIT * 0.9]
    print(f"  events that waited for the consumer's ack_wait ({ACK_WAIT:g} s): {len(waited)}")
    report["waited_for_ack_wait"] = len(waited)
    (tmp_path / "switch_delay.json").write_text(json.dumps(report, indent=2))
