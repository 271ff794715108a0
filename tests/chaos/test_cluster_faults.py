"""The cluster's fault kinds under the chaos ledger, each at least once, in a
slow group of their own: kill -9 of a node that does not lead the stream, a
rolling restart of the three nodes, a network partition of one node, a
PostgreSQL failover to its synchronous standby, and two of three nodes
stopped (quorum lost; tens of seconds here, five minutes and more in
`make chaos PROFILE=cluster`: the mechanism, the relay and the consumers
waiting for a stream that does not answer, is the same). Every worker runs
on the defaults, as its least-privileged login."""

from __future__ import annotations

import json

import pytest

from support.chaos_run import run_chaos

KINDS = ("kill_nats_node", "rolling_restart_nats", "partition_nats_node", "pg_failover", "jetstream_quorum_lost")


@pytest.mark.slow
def test_every_cluster_fault_kind_keeps_the_ledger():
    result = run_chaos(
        "--profile", "cluster-short", "--kinds", ",".join(KINDS), "--faults", str(len(KINDS)), "--seconds", "120"
    )
    figures = json.loads(result.stdout.split("figures: ", 1)[1].splitlines()[0])
    assert figures["topology"] == "cluster"
    assert figures["faults"] == dict.fromkeys(KINDS, 1), figures["faults"]
    # Each fault recovered: the harness fails a run whose fault failed or whose node did not come back.
    assert "FAULT FAILED" not in result.stdout and "NOT healthy" not in result.stdout
    assert figures["lost"] == figures["duplicated_side_effects"] == figures["stuck"] == 0
    assert figures["dead_letters_not_own"] == 0, figures["dead_letters_not_own_by_cause"]
    assert all(figures["by_fault_kind"][k]["events_during"] > 0 for k in KINDS), figures["by_fault_kind"]
    assert result.returncode == 0, "the ledger check failed: see VIOLATIONS above"
    assert "ledger OK: nothing lost, nothing processed twice, nothing stuck" in result.stdout
