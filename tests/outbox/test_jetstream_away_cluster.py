"""A 3-node JetStream cluster (stream replicas 3) that loses 2 of its nodes,
the stream's leader among them, for 5 minutes while 100 events are emitted,
with real processes on the defaults (as in
test_jetstream_away.py): every event reaches the stream exactly once, none is
dead-lettered, no operator acts; /readyz said why meanwhile; the gauge went
0, then 1. An xdist group of its own (a chain of about 6 minutes).
"""

from __future__ import annotations

import asyncio

import pytest

from harness.nats_cluster import NatsCluster, connect
from pgoutbox.outbox import streams
from support.jetstream_away import (
    BEFORE,
    OUTAGE,
    Watch,
    assert_every_event_once,
    emit,
    emit_during,
    gauge,
    relay_settings,
)
from support.outbox import status_counts
from support.roles import login
from support.waiting import wait_for
from support.workers import worker


@pytest.mark.slow
def test_a_cluster_that_loses_two_of_three_nodes_for_five_minutes_delays_events_and_dead_letters_none(
    database_url, tmp_path
):
    cluster = NatsCluster(tmp_path / "nats")
    cluster.start()
    writer = login(database_url, "pgoutbox_writer")
    try:
        asyncio.run(_replicated_stream(cluster))
        with worker(tmp_path, "relay", '"action": "started"', **relay_settings(database_url, cluster.urls)) as port:
            assert port
            watch = Watch(port)
            watch.start()
            try:
                emit(writer, BEFORE, 0)
                wait_for(lambda: status_counts(database_url) == {"COMPLETED": BEFORE}, 60, "the first events out")
                assert gauge(port) == 1.0  # before the outage
                leader = asyncio.run(cluster.stream_leader("SEA_EVENTS"))
                lost = [leader, (leader + 1) % 3]  # the stream's leader and a follower: no quorum left
                for i in lost:
                    cluster.kill(i)
                emit_during(writer, OUTAGE, watch)
                for i in lost:
                    cluster.start_node(i)
                assert_every_event_once(database_url, cluster.nodes[0].url, tmp_path / "relay.log")
                wait_for(lambda: watch.gauge[-1:] == [1.0], 30, "the gauge back at 1", interval=0.5)
            finally:
                watch.stop()
        assert 0.0 in watch.gauge and watch.gauge[-1] == 1.0, watch.gauge  # 0 during the outage, then 1
        assert any(r.startswith("JetStream not answering since ") for r in watch.reasons), watch.reasons
    finally:
        cluster.stop()


async def _replicated_stream(cluster: NatsCluster) -> None:
    nc = await connect(cluster.urls)
    try:
        await streams.apply(nc.jetstream(), streams.loads("[streams.sea]\nreplicas = 3\n"))
    finally:
        await nc.close()
    await cluster.stream_leader("SEA_EVENTS")  # elected: the stream takes messages
