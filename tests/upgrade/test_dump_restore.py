"""Backup and restore of a database in the middle of work (docs/upgrading.md
"Backup and restore"): pg_dump in plain format (replayed with psql) and in custom
format (pg_restore) into a new database of the same cluster, then a relay
and a consumer carry on there, and the ledger shows nothing lost and nothing
repeated.

The database holds, when it is dumped:
  * events COMPLETED and handled (a relay and a consumer ran, then stopped);
  * PROCESSING under a lease: claimed by a real relay whose bytes to NATS
    are dropped (a proxy), killed (SIGKILL) while it waits for the acks; half
    of them then published to JetStream in the relay's wire format, as if its
    bytes had arrived. The restored relay reclaims them after the lease and
    publishes them with the same Nats-Msg-Id, which JetStream deduplicates;
  * FAILED with a retry scheduled and DEAD_LETTER (requeued after the
    restore), made through outbox.claim and outbox.mark_failed as a relay
    does, and PENDING;
  * a sealed partition and a sealed and audited one (outbox.seal_partition,
    then outbox.record_archive with the live figures, as the archiver does
    once it has read its export back; no Spark export is made here);
  * inbox rows in every state: PROCESSED (handled), and for three of the
    published-but-unmarked events RECEIVED (a consumer died before the
    handler answered), FAILED (the handler failed, redelivery pending) and
    DEAD_LETTER (poison, parked).
After the restore: the catalog (owners, grants, triggers, the event trigger)
and every table's rows and sequences equal the source's; a relay and a
consumer run on the restored database; every event is COMPLETED and once in
the stream; the handler got every event it had not handled yet exactly once,
and nothing else; the sealed partitions are still read-only and the audited
one is dropped by outbox.drop_archived (its figures still match)."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import nats
import psycopg
import pytest
from psycopg.rows import dict_row

from conftest import create_database, drop_database
from harness.tcp_proxy import TcpProxy
from pgoutbox.core import wire
from pgoutbox.core.errors import SqlState
from pgoutbox.dev.embedded import PG_BIN
from support import archival
from support.inbox import FakeHandler
from support.outbox import msg_ids, status_counts, stream_messages
from support.roles import login
from support.upgrade import (
    Delivery,
    Worker,
    acked_everything,
    consumer_worker,
    contents,
    current_build,
    differences,
    dump_and_restore,
    handler_registry,
    relay_worker,
    schema_catalog,
    start_worker,
)
from support.waiting import wait_for

pytestmark = pytest.mark.slow

HANDLER = "restore_check"
SUBJECT = "sea.event.order_created.v1"
# not default: the relay that is killed holds its claims this long (30 s by default):
# the restored relay reclaims its events after it
LEASE = 10.0


def start_all(*workers: Worker, started: list[Worker]) -> None:
    """Starts them (recorded in `started` first, for the clean-up)."""
    started += workers
    for w in workers:
        start_worker(w)


def emit(conn: psycopg.Connection, n: int, tag: str) -> list[str]:
    rows = conn.execute(
        "SELECT outbox.emit('order', %s || i, 'order_created', jsonb_build_object('schema_version', 1, 'n', i),"
        " context => 'sea') FROM generate_series(1, %s) AS i",
        (tag, n),
    ).fetchall()
    return [str(r[0]) for r in rows]


# An event emitted with the caller's own id (a UUIDv5): its register
# (outbox.event_keys) is dumped and restored with it.
KEYED = "6ba7b810-9dad-51d1-80b4-00c04fd43001"


def emit_keyed(conn: psycopg.Connection, n: int) -> str:
    return str(
        conn.execute(
            "SELECT outbox.emit('order', 'keyed', 'order_created', jsonb_build_object('schema_version', 1, 'n', %s),"
            " context => 'sea', event_id => %s)",
            (n, KEYED),
        ).fetchone()[0]
    )


def claim(conn: psycopg.Connection, worker: str, ids: list[str]) -> str:
    """Claims these events, as a relay does (they must be the only ones due); returns the claim token."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute("SELECT * FROM outbox.claim(%s, %s, interval '30 seconds')", (worker, len(ids))).fetchall()
    assert sorted(str(r["event_id"]) for r in rows) == sorted(ids), "claimed other events than these"
    return str(rows[0]["claim_token"])


async def publish(nats_url: str, rows: list[dict]) -> None:
    """What the dead relay had published before it died: the relay's wire format."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        for row in rows:
            subject, body, headers = wire.to_nats(row)
            await js.publish(subject, body, headers=headers)
    finally:
        await nc.close()


def killed_mid_publish(relay: Worker, proxy: TcpProxy, url: str, nats_url: str) -> list[str]:
    """Events a real relay claims and publishes while its bytes to NATS are
    dropped, killed (SIGKILL) while it waits for the acks: PROCESSING under
    its lease. Half of them are then published as that relay would have had
    its bytes arrived (its wire format): JetStream holds them, the outbox
    does not know. Returns the ids, the published ones first."""
    proxy.drop_client_bytes()
    with psycopg.connect(url, autocommit=True) as conn:
        ids = emit(conn, 8, "processing-")
        wait_for(
            lambda: conn.execute(
                "SELECT count(*) = 8 FROM outbox.events WHERE event_id = ANY(%s::uuid[]) AND status = 'PROCESSING'",
                (ids,),
            ).fetchone()[0],
            10,
            "the relay to claim them",
        )
        relay.kill()
        with conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute("SELECT * FROM outbox.events WHERE event_id = ANY(%s::uuid[]) ORDER BY id", (ids,))
            claimed = rows.fetchall()
    assert {r["status"] for r in claimed} == {"PROCESSING"} and {r["claimed_by"] for r in claimed} == {relay.name}
    asyncio.run(publish(nats_url, claimed[:4]))
    return [str(r["event_id"]) for r in claimed]


def mid_work(url: str, processing: list[str]) -> dict[str, list[str]]:
    """The other states listed in the module's docstring; returns the event ids of each."""
    ids: dict[str, list[str]] = {"processing": processing, "published": processing[:4]}
    with psycopg.connect(url, autocommit=True) as conn:
        ids["dead"] = emit(conn, 3, "dead-")
        token = claim(conn, "relay-a", ids["dead"])
        conn.execute(
            "SELECT outbox.mark_failed(%s, %s::uuid[], %s::text[], %s::timestamptz[])",
            (token, ids["dead"], ["broker said no"] * 3, [None] * 3),
        )
        ids["failed"] = emit(conn, 4, "failed-")
        token = claim(conn, "relay-a", ids["failed"])
        conn.execute(
            "SELECT outbox.mark_failed(%s, %s::uuid[], %s::text[], ARRAY_FILL(now() + interval '3 seconds', ARRAY[4]))",
            (token, ids["failed"], ["publish timed out"] * 4),
        )
        ids["pending"] = emit(conn, 8, "pending-") + [emit_keyed(conn, 1)]
        # The inbox of the consumer that saw three of the published events.
        received, failed, dead = ids["published"][:3]
        for message_id in (received, failed, dead):
            conn.execute("SELECT inbox.receive(%s, %s, %s)", (message_id, HANDLER, SUBJECT))
        conn.execute("SELECT inbox.record_error(%s, %s, 'HTTP 503: busy')", (failed, HANDLER))
        conn.execute("SELECT inbox.record_error(%s, %s, 'HTTP 422: poison', dead => true)", (dead, HANDLER))
        ids["inbox_dead"] = [dead]
        # Past days: one sealed partition, one sealed and audited.
        for back, audited in ((4, True), (3, False)):
            day = archival.today() - timedelta(days=back)
            archival.inbox_for(conn, archival.events(conn, day, 20), handler="billing")
            name = conn.execute("SELECT outbox._partition_name(%s)", (day,)).fetchone()[0]
            conn.execute("SELECT * FROM outbox.seal_partition(%s, retention => interval '1 day')", (name,))
            ids["sealed" if not audited else "audited"] = [name]
            if audited:
                conn.execute(
                    "SELECT outbox.record_archive('outbox.events', %(day)s, f.row_count, f.checksum, %(uri)s)"
                    " FROM outbox.archive_figures('outbox.events', %(day)s) AS f",
                    {"day": day, "uri": f"file:///archive/outbox/{day}"},
                )
    return ids


def expect_state(url: str, ids: dict[str, list[str]]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        status = dict(conn.execute("SELECT event_id::text, status FROM outbox.events").fetchall())
        inbox = dict(conn.execute("SELECT message_id::text, status FROM inbox.messages WHERE handler = %s", (HANDLER,)))
    for kind, expected in (("dead", "DEAD_LETTER"), ("processing", "PROCESSING"), ("failed", "FAILED")):
        assert {status[e] for e in ids[kind]} == {expected}, kind
    assert {status[e] for e in ids["pending"]} == {"PENDING"}
    received, failed, dead = ids["published"][:3]
    assert (inbox[received], inbox[failed], inbox[dead]) == ("RECEIVED", "FAILED", "DEAD_LETTER")
    assert {inbox[e] for e in ids["done"]} == {"PROCESSED"}


def guards_and_wakeups_work(url: str) -> list[str]:
    """What a restore could silently lose: the event trigger that refuses
    DETACH PARTITION (a superuser's object), and the wake-up NOTIFY of emit."""
    with psycopg.connect(url, autocommit=True) as conn:
        part = conn.execute("SELECT outbox._partition_name((now() AT TIME ZONE 'UTC')::date)").fetchone()[0]
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(f"ALTER TABLE outbox.events DETACH PARTITION outbox.{part}")
        assert refused.value.sqlstate == SqlState.DELETE_FORBIDDEN
        conn.execute("LISTEN outbox_v1")
        with psycopg.connect(url, autocommit=True) as writer:
            conn.execute("SELECT pg_sleep(0.05)")  # past the notify throttle
            emitted = emit(writer, 1, "wakeup-")
        heard = [n.payload for n in conn.notifies(timeout=5, stop_after=1)]
        assert heard == ["sea"], heard
    return emitted


@pytest.mark.parametrize("fmt", ["plain", "custom"])
def test_a_restored_database_carries_on(fmt, tmp_path, pg_server, nats_server, database_url):
    build = current_build()
    nats_url = nats_server.url
    (tmp_path / "streams.toml").write_text('[defaults]\nduplicate_window = "2m"\n[streams.sea]\n')
    build.run("streams", OUTBOX_NATS_URL=nats_url, OUTBOX_STREAMS_FILE=str(tmp_path / "streams.toml"))
    handler = FakeHandler()
    registry = handler_registry(build, tmp_path, HANDLER, handler.url, SUBJECT, tmp_path / "registry.json")
    restored_name = create_database(pg_server, "template0")
    restored = pg_server.dsn(restored_name)
    started: list[Worker] = []
    proxy = TcpProxy(nats_server.port)  # the source relay's way to NATS, cut before it is killed
    try:
        # The source at work: a first batch handled end to end, then the rest.
        relay = relay_worker(
            build, "relay-source", tmp_path, login(database_url, "pgoutbox_relay"), proxy.url, lease=LEASE
        )
        consumer = consumer_worker(
            build, "consumer-source", tmp_path, login(database_url, "pgoutbox_consumer"), nats_url, registry
        )
        start_all(relay, consumer, started=started)
        with psycopg.connect(database_url, autocommit=True) as conn:
            done = emit(conn, 20, "done-")
        wait_for(lambda: set(done) <= set(Delivery.of(handler).calls), 30, "the first batch to be handled")
        assert consumer.terminate() == 0
        ids = mid_work(database_url, killed_mid_publish(relay, proxy, database_url, nats_url))
        ids["done"] = done
        expect_state(database_url, ids)
        before_calls = Delivery.of(handler).calls

        # Backup and restore.
        dump_and_restore(PG_BIN, database_url, restored, fmt, tmp_path)
        diff = differences(schema_catalog(PG_BIN, database_url), schema_catalog(PG_BIN, restored))
        assert not diff, f"the restored catalog differs:\n{diff}"
        assert contents(restored) == contents(database_url)
        expect_state(restored, ids)

        ids["wakeup"] = guards_and_wakeups_work(restored)

        # Carry on, on the restored database only.
        with psycopg.connect(restored, autocommit=True) as conn:
            # The caller's id is still held: a retry writes nothing, other content is refused.
            assert emit_keyed(conn, 1) == KEYED
            assert conn.execute("SELECT count(*) FROM outbox.events WHERE event_id = %s", (KEYED,)).fetchone()[0] == 1
            with pytest.raises(psycopg.Error) as conflict:
                emit_keyed(conn, 2)
            assert conflict.value.sqlstate == SqlState.EVENT_ID_CONFLICT
            max_id = conn.execute("SELECT max(id) FROM outbox.events").fetchone()[0]
            moved = conn.execute(
                "SELECT outbox.requeue(%s::uuid[], 'restored: broker is back')", (ids["dead"],)
            ).fetchone()[0]
            assert moved == len(ids["dead"])
        relay = relay_worker(build, f"relay-restored-{fmt}", tmp_path, login(restored, "pgoutbox_relay"), nats_url)
        consumer = consumer_worker(
            build, f"consumer-restored-{fmt}", tmp_path, login(restored, "pgoutbox_consumer"), nats_url, registry
        )
        start_all(relay, consumer, started=started)
        with psycopg.connect(restored, autocommit=True) as conn:
            ids["after"] = emit(conn, 10, "after-")
            new_ids = conn.execute(
                "SELECT min(id) FROM outbox.events WHERE event_id = ANY(%s::uuid[])", (ids["after"],)
            )
            assert new_ids.fetchone()[0] > max_id, "the identity sequence went back"
        expected = set(ids["processing"]) - set(ids["inbox_dead"])
        expected |= set(ids["failed"]) | set(ids["pending"]) | set(ids["dead"]) | set(ids["after"]) | set(ids["wakeup"])
        wait_for(lambda: expected <= set(Delivery.of(handler).calls), 60, "every unhandled event to reach the handler")
        wait_for(lambda: set(status_counts(restored)) == {"COMPLETED"}, 30, "every event COMPLETED")
        # Every message acked at the server: no delivery can still come, so a repeated call would have shown.
        wait_for(lambda: acked_everything(nats_url, HANDLER), 60, "the consumer's ack floor at the stream's end")
        assert relay.terminate() == 0 and consumer.terminate() == 0

        # The ledger.
        calls = Delivery.of(handler).calls
        after_restore = {e: len(t) - len(before_calls.get(e, [])) for e, t in calls.items()}
        after_restore = {e: n for e, n in after_restore.items() if n}
        assert {e: n for e, n in after_restore.items() if n != 1} == {}, "handled more than once"
        assert set(after_restore) == expected, (
            f"missing {expected - set(after_restore)}, unexpected {set(after_restore) - expected}"
        )
        assert all(len(t) == 1 for t in calls.values()), "an event was handled twice across the restore"
        in_stream = msg_ids(asyncio.run(stream_messages(nats_url)))
        assert len(in_stream) == len(set(in_stream)), "an event id is in the stream twice"
        with psycopg.connect(restored, autocommit=True) as conn:
            live = {
                r[0]
                for r in conn.execute(
                    "SELECT event_id::text FROM outbox.events WHERE subject = %s", (SUBJECT,)
                ).fetchall()
            }
            assert set(in_stream) == live
            inbox = dict(
                conn.execute(
                    "SELECT message_id::text, status FROM inbox.messages WHERE handler = %s", (HANDLER,)
                ).fetchall()
            )
            assert {e: s for e, s in inbox.items() if s != "PROCESSED"} == {ids["inbox_dead"][0]: "DEAD_LETTER"}
            assert set(inbox) == live
            # Archival carries on: the sealed partition is still read-only,
            # the audited one still matches its audit and is dropped.
            with pytest.raises(psycopg.Error) as refused:
                conn.execute(f"UPDATE outbox.{ids['sealed'][0]} SET last_error = 'x'")
            assert refused.value.sqlstate == SqlState.ARCHIVED_READ_ONLY
            assert conn.execute("SELECT outbox.drop_archived(%s)", (ids["audited"][0],)).fetchone()[0] == 20
        problems = [p for w in started for p in w.problems()]
        assert not problems, "\n".join(problems)
        print(
            f"\n{fmt}: {len(expected)} events handled after the restore, each once; "
            f"{len(in_stream)} distinct ids in the stream ({len(ids['published'])} republished and deduplicated)"
        )
        (tmp_path / "ledger.json").write_text(json.dumps({k: len(v) for k, v in ids.items()}))
    finally:
        for w in started:
            w.kill()
        handler.close()
        proxy.close()
        drop_database(pg_server, restored_name)
