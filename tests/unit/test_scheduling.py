"""support.scheduling: under `--dist loadgroup` the longest chains go out first,
the three 5-minute outages each to a worker of its own with nothing queued
behind them, and the rest to the other workers (pytest-xdist's scheduler, on
fake workers that run nothing)."""

from __future__ import annotations

from types import SimpleNamespace

from support.scheduling import ALONE, CHAINS, ChainReport, LongestChainFirst, group_of, longest_chain_first


class FakeNode:
    """What the scheduler calls on a worker: send_runtest_some, shutdown."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices):
        self.sent += list(indices)

    def shutdown(self):
        self.shutting_down = True


def _config(workers: int):
    option = SimpleNamespace(loadscopereorder=True)
    values = {"tx": [f"{workers}*popen"], "dist": "loadgroup"}
    return SimpleNamespace(option=option, getvalue=values.__getitem__)


def _collection() -> list[str]:
    """As the workers collect it: a group of many tests first (xdist's own order
    would start it first), the outages among the tests of no group."""
    ids = [f"tests/archival/test_s.py::test_{i}@spark" for i in range(8)]
    ids += [f"tests/a/test_a.py::test_{i}" for i in range(10)]
    ids += ["tests/outbox/test_jetstream_away.py::test_away@jetstream-away"]
    ids += [f"tests/chaos/test_chaos.py::test_{i}@chaos" for i in range(4)]
    ids += ["tests/inbox/test_handler_outage.py::test_out@handler-outage"]
    ids += [f"tests/b/test_b.py::test_{i}" for i in range(10)]
    ids += ["tests/outbox/test_jetstream_away_cluster.py::test_away@jetstream-away-cluster"]
    return ids


def _run(workers: int):
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in _collection()]
    longest_chain_first(items)  # what each worker's collection hook does
    collection = [item.nodeid for item in items]
    sched = LongestChainFirst(_config(workers))
    nodes = [FakeNode(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    return sched, nodes, collection


def test_the_outages_start_first_each_on_its_own_worker_with_nothing_behind():
    sched, nodes, collection = _run(6)
    assert sched.config.option.loadscopereorder is False
    first = [group_of(collection[node.sent[0]]) for node in nodes]
    assert first == ["jetstream-away-cluster", "jetstream-away", "handler-outage", "chaos", "spark", None]
    for node in nodes[:3]:
        assert len(node.sent) == 1, [collection[i] for i in node.sent]
    # The outage over, its worker takes more.
    sched.mark_test_complete(nodes[0], nodes[0].sent[0])
    assert len(nodes[0].sent) > 1 or nodes[0].shutting_down


def test_with_fewer_workers_than_outages_the_third_waits_for_a_worker():
    sched, nodes, collection = _run(2)
    assert [group_of(collection[n.sent[0]]) for n in nodes] == ["jetstream-away-cluster", "jetstream-away"]
    assert all(len(n.sent) == 1 for n in nodes)
    sched.mark_test_complete(nodes[1], nodes[1].sent[0])
    assert group_of(collection[nodes[1].sent[1]]) == "handler-outage"


def test_every_outage_group_is_ranked_and_the_report_adds_up_chains():
    assert ALONE <= set(CHAINS[: len(ALONE)])
    report = ChainReport()
    node = SimpleNamespace(gateway=SimpleNamespace(id="gw0"))
    for when, duration in (("setup", 1.0), ("call", 30.0), ("teardown", 2.0)):
        report.add(SimpleNamespace(nodeid="t.py::test_x@chaos", duration=duration, when=when, node=node))
    report.add(SimpleNamespace(nodeid="t.py::test_y", duration=4.0, when="call", node=node))
    assert report.chains == {"chaos": 33.0} and report.tests["chaos"] == 1
    assert report.lines()[-1] == "worker busy: gw0 37 s"
