"""The pipeline on a three-node JetStream cluster (streams at replicas 3):
the stream leader killed (kill -9) under load, then the chaos ledger; and the
relay's start-up check counting the replicas the cluster really holds, with a
node killed and with a node cut off by a network partition; and the fault
registry the soak draws from."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from chaos import faults
from harness.nats_cluster import NatsCluster, connect
from pgoutbox.outbox import streams
from support.chaos_run import run_chaos


@pytest.mark.slow
def test_stream_leader_kill_under_load_keeps_the_ledger():
    result = run_chaos("--profile", "cluster-short", "--kinds", "kill_nats_leader", "--seconds", "30", "--faults", "2")
    assert result.returncode == 0
    assert "ledger OK: nothing lost, nothing processed twice, nothing stuck" in result.stdout
    figures = json.loads(result.stdout.split("figures: ", 1)[1].splitlines()[0])
    assert figures["topology"] == "cluster"
    assert figures["faults"] == {"kill_nats_leader": 2}
    assert figures["lost"] == figures["duplicated_side_effects"] == figures["stuck"] == 0
    # Under load: events committed while a kill was under way (how many depends on what else loads the machine).
    assert figures["committed"] > 0 and figures["by_fault_kind"]["kill_nats_leader"]["events_during"] > 0
    # Each kill hit the leader of the moment, and another node took over.
    # (From the fault log at the end; the same lines are printed as each fault ends, prefixed "fault i/n:".)
    kills = [
        line for line in result.stdout.splitlines() if " kill_nats_leader n" in line and not line.startswith("fault ")
    ]
    assert len(kills) == 2 and all("new leader n" in k and "healthy after" in k for k in kills)
    for line in kills:
        killed, new = line.split("kill_nats_leader ")[1].split(" (new leader ")
        assert killed != new.split(" ")[0]


async def _replicas(cluster: NatsCluster, via: int, name: str) -> streams.Replicas:
    nc = await connect(cluster.nodes[via].url)
    try:
        findings = await streams.check(nc.jetstream(), 30, streams.loads("[streams.sea]\nreplicas = 3\n"))
        return findings.replicas[name]
    finally:
        await nc.close()


async def _until(cluster: NatsCluster, via: int, predicate, timeout: float = 30) -> streams.Replicas:
    deadline = time.monotonic() + timeout
    while True:
        seen = await _replicas(cluster, via, "SEA_EVENTS")
        if predicate(seen) or time.monotonic() > deadline:
            return seen
        await asyncio.sleep(0.5)


@pytest.mark.slow
def test_startup_check_counts_the_replicas_the_cluster_holds(tmp_path):
    cluster = NatsCluster(tmp_path / "nats")
    cluster.start()
    try:
        asyncio.run(_kill_and_partition(cluster))
    finally:
        cluster.stop()


async def _kill_and_partition(cluster: NatsCluster) -> None:
    nc = await connect(cluster.urls)
    js = nc.jetstream()
    await streams.apply(js, streams.loads("[streams.sea]\nreplicas = 3\n"))
    await cluster.stream_leader("SEA_EVENTS")  # elected: the stream takes messages
    for i in range(20):
        await js.publish("sea.event.x.v1", b"{}", headers={"Nats-Msg-Id": str(i)})
    await nc.close()
    assert await cluster.wait_until_current("SEA_EVENTS")
    leader = await cluster.stream_leader("SEA_EVENTS")
    healthy = await _until(cluster, leader, lambda r: r.current == 3)
    assert (healthy.configured, healthy.current, healthy.leader) == (3, 3, f"n{leader + 1}")

    # kill -9 of a follower: the configuration still says 3, the cluster holds 2.
    follower = (leader + 1) % 3
    cluster.kill(follower)
    seen = await _until(cluster, leader, lambda r: r.current < 3)
    assert (seen.configured, seen.current) == (3, 2) and seen.behind == (f"n{follower + 1}",)
    nc = await connect(cluster.nodes[leader].url)
    findings = await streams.check(nc.jetstream(), 30, streams.loads("[streams.sea]\nreplicas = 3\n"))
    await nc.close()
    assert any("SEA_EVENTS: 2 of 3 replica(s) current" in d for d in findings.durability)
    cluster.start_node(follower)
    assert await cluster.wait_until_current("SEA_EVENTS")

    # A partition: the follower is up, its routes are cut; the leader sees it fall behind.
    cluster.partition(follower)
    seen = await _until(cluster, leader, lambda r: r.current < 3)
    assert seen.current == 2 and seen.behind == (f"n{follower + 1}",)
    cluster.heal(follower)
    back = await _until(cluster, leader, lambda r: r.current == 3)
    assert back.current == 3


def test_a_fault_kind_is_one_registration():
    builtin = {k.name for k in faults.kinds_for("cluster")}
    assert {
        "kill_nats_leader",
        "kill_nats_node",
        "rolling_restart_nats",
        "partition_nats_node",
        "pg_failover",
        "jetstream_quorum_lost",
        "postgres_outage_long",
        "handler_down",
        "upcaster_raises",
    } <= builtin
    single = {k.name for k in faults.kinds_for("single")}
    assert "restart_nats" not in builtin and {"restart_nats", "jetstream_away"} <= single
    assert "jetstream_away" not in builtin and "jetstream_quorum_lost" not in single
    assert {k.name for k in faults.REGISTRY.values() if k.long} == {
        "jetstream_away",
        "jetstream_quorum_lost",
        "postgres_outage_long",
        "handler_down",
    }

    @faults.fault("test_only_kind", topologies=("cluster",))
    def _inject(pipeline, rng) -> str:
        return ""

    try:
        assert "test_only_kind" in {k.name for k in faults.kinds_for("cluster")}
        assert "test_only_kind" not in {k.name for k in faults.kinds_for("single")}
        with pytest.raises(ValueError, match="registered twice"):
            faults.fault("test_only_kind")(_inject)
        with pytest.raises(ValueError, match="not for topology single"):
            faults.kinds_for("single", ("test_only_kind",))
    finally:
        del faults.REGISTRY["test_only_kind"]


def test_an_unknown_fault_kind_is_a_usage_error():
    result = run_chaos("--profile", "cluster-short", "--kinds", "kill_nats_leader,no_such_fault")
    assert result.returncode == 2
    assert "no_such_fault" in result.stderr and "kill_nats_leader" in result.stderr
