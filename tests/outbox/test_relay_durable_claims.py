"""Nothing is published before it is durable: a primary with a synchronous
standby, a `pgoutbox relay` on its defaults (a login in pgoutbox_relay only),
a writer in pgoutbox_writer only.

The standby stops. A writer's COMMIT then waits for it; the wait is cancelled
(a client's timeout, `pg_cancel_backend`), which leaves the transaction
committed on the primary and visible there, but not on the standby: a
failover now would lose the event and its business change. The relay claims
the event, and its claim's commit waits for the standby as any commit does
(so does the claim floor's step, when it comes first), so nothing reaches the
stream until the standby is back and has the event. A relay whose claims did
not wait published it at once.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from pathlib import Path

import psycopg
import pytest
from psycopg.types.json import Jsonb

from harness.pg_standby import StandbyPair
from pgoutbox.core import migrate
from support.jetstream_away import relay_settings
from support.outbox import apply_streams, msg_ids, status_counts, stream_messages
from support.roles import login
from support.waiting import wait_for
from support.workers import worker


@pytest.fixture
def synchronous_pair():
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-sync-pair-"))
    root.chmod(0o755)  # PostgreSQL runs as the postgres user below it
    pair = StandbyPair(root, synchronous=True)
    pair.start()
    with psycopg.connect(pair.url(), autocommit=True) as conn:
        migrate.migrate(conn)
    yield pair
    pair.stop("immediate")
    shutil.rmtree(root, ignore_errors=True)


def test_an_event_committed_only_on_the_primary_is_not_published_until_the_standby_has_it(
    synchronous_pair, nats_server, tmp_path
):
    pair = synchronous_pair
    url = pair.url()
    writer_url = login(url, "pgoutbox_writer")
    asyncio.run(apply_streams(nats_server.url))
    with worker(tmp_path, "relay", '"action": "started"', **relay_settings(url, nats_server.url)):
        pair.standby.stop("fast")

        # A writer's COMMIT waits for the standby; its wait is cancelled.
        writer = psycopg.connect(writer_url)
        event_id = writer.execute(
            "SELECT outbox.emit('order', '1', 'order_created', %s, context => 'sea')", (Jsonb({"schema_version": 1}),)
        ).fetchone()[0]
        committing = threading.Thread(target=writer.commit)
        committing.start()
        with psycopg.connect(url, autocommit=True) as owner:

            def waiting_for_standby(user: str) -> bool:
                return bool(
                    owner.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND usename LIKE %s",
                        (user,),
                    ).fetchone()[0]
                )

            wait_for(lambda: waiting_for_standby("t_writer_%"), 30, "the writer's commit waiting for the standby")
            owner.execute("SELECT pg_cancel_backend(%s)", (writer.info.backend_pid,))
            committing.join(30)
            assert not committing.is_alive()
            # Committed on the primary only, and visible there.
            assert sum(status_counts(url).values()) == 1

            # The relay's claim commits and waits for the standby too (its claim of
            # the event, or the claim floor's step before it, which also writes):
            # a relay that did not wait would have published the event by now.
            wait_for(
                lambda: waiting_for_standby("t_relay_%") or asyncio.run(stream_messages(nats_server.url)),
                60,
                "the relay's claim waiting for the standby",
            )
        assert asyncio.run(stream_messages(nats_server.url)) == [], "published before the standby had the event"

        pair.standby.start()  # it catches up; the claim's commit returns
        wait_for(lambda: status_counts(url) == {"COMPLETED": 1}, 60, "the event published once the standby has it")
        assert msg_ids(asyncio.run(stream_messages(nats_server.url))) == [str(event_id)]
        writer.close()
