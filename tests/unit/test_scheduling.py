"""support.scheduling: under `--dist loadgroup` the longest chains go out first,
the three 5-minute outages each to a worker of its own with one quick test
queued behind them (so that the worker starts the outage at once), and the
rest to the other workers (pytest-xdist's scheduler, on fake workers that run
nothing)."""

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


class FakeItem:
    """What longest_chain_first reads of a collected test: its id and its slow marker."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid

    def get_closest_marker(self, name):
        return SimpleNamespace(name=name) if name == "slow" and "slow" in self.nodeid else None


def _config(workers: int):
    option = SimpleNamespace(loadscopereorder=True)
    values = {"tx": [f"{workers}*popen"], "dist": "loadgroup"}
    return SimpleNamespace(option=option, getvalue=values.__getitem__)


GROUPS = [
    *(f"tests/archival/test_s.py::test_{i}@spark" for i in range(8)),
    "tests/outbox/test_jetstream_away.py::test_away@jetstream-away",
    *(f"tests/chaos/test_chaos.py::test_{i}@chaos" for i in range(4)),
    "tests/inbox/test_handler_outage.py::test_out@handler-outage",
    "tests/outbox/test_jetstream_away_cluster.py::test_away@jetstream-away-cluster",
]
# The tests of no group in collection order; slow ones last, as the rolling
# upgrade is in the suite's collection.
SINGLES = [
    *(f"tests/a/test_a.py::test_{i}" for i in range(10)),
    "tests/b/test_b.py::test_quick_1",
    "tests/b/test_b.py::test_quick_2",
    "tests/c/test_c.py::test_slow_1",
    "tests/c/test_c.py::test_quick_3",
    "tests/c/test_c.py::test_slow_2",
    "tests/upgrade/test_u.py::test_slow_3",
]
QUICK_LAST = ["tests/b/test_b.py::test_quick_1", "tests/b/test_b.py::test_quick_2", "tests/c/test_c.py::test_quick_3"]


def _collection(singles: list[str] = SINGLES) -> list[str]:
    """As the workers collect it: a group of many tests first (xdist's own order
    would start it first), the outages among the tests of no group."""
    return GROUPS[:8] + singles[:5] + GROUPS[8:14] + singles[5:] + GROUPS[14:]


def _order(nodeids: list[str]) -> list[str]:
    items = [FakeItem(nodeid) for nodeid in nodeids]
    longest_chain_first(items)  # what each worker's collection hook does
    return [item.nodeid for item in items]


def _run(workers: int, singles: list[str] = SINGLES):
    collection = _order(_collection(singles))
    sched = LongestChainFirst(_config(workers))
    nodes = [FakeNode(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    return sched, nodes, collection


def _names(collection: list[str], indices: list[int]) -> list[str]:
    return [collection[i] for i in indices]


def test_the_groups_by_chain_then_the_tests_of_no_group_and_the_last_quick_ones_at_the_end():
    order = _order(_collection())
    assert sorted(order) == sorted(_collection())
    assert [group_of(n) for n in order[:3]] == ["jetstream-away-cluster", "jetstream-away", "handler-outage"]
    singles = [n for n in order if group_of(n) is None]
    # One quick test (not marked slow) per outage, the last ones in collection
    # order, goes behind the slow ones; the others keep their order.
    assert singles[-len(ALONE) :] == QUICK_LAST
    assert singles[: -len(ALONE)] == [n for n in SINGLES if n not in QUICK_LAST]
    assert order[-len(ALONE) :] == QUICK_LAST


def test_the_outages_start_first_each_on_its_own_worker_with_one_quick_test_behind():
    sched, nodes, collection = _run(6)
    assert sched.config.option.loadscopereorder is False
    first = [group_of(collection[node.sent[0]]) for node in nodes]
    assert first == ["jetstream-away-cluster", "jetstream-away", "handler-outage", "chaos", "spark", None]
    # Behind each outage one quick test from the queue's end, nothing more: an
    # xdist worker runs its test only once it knows the next one.
    assert [_names(collection, node.sent[1:]) for node in nodes[:3]] == [[q] for q in reversed(QUICK_LAST)]
    # The outage over, its worker takes more from the queue's front.
    sched.mark_test_complete(nodes[0], nodes[0].sent[0])
    taken = {i for node in nodes[1:] for i in node.sent}
    front = next(i for i, nodeid in enumerate(collection) if group_of(nodeid) is None and i not in taken)
    assert nodes[0].sent[2:] == [front]


def test_with_fewer_workers_than_outages_the_third_waits_for_a_worker():
    sched, nodes, collection = _run(2)
    assert [group_of(collection[n.sent[0]]) for n in nodes] == ["jetstream-away-cluster", "jetstream-away"]
    assert [_names(collection, n.sent[1:]) for n in nodes] == [[QUICK_LAST[2]], [QUICK_LAST[1]]]
    sched.mark_test_complete(nodes[1], nodes[1].sent[0])
    assert group_of(collection[nodes[1].sent[2]]) == "handler-outage"
    # The quick test before it done, the third outage gets one behind it.
    sched.mark_test_complete(nodes[1], nodes[1].sent[1])
    assert _names(collection, nodes[1].sent[3:]) == [QUICK_LAST[0]]


def test_only_a_test_of_no_group_goes_behind_an_outage():
    # No test of no group left to take (here none collected): the outage waits
    # for the end of the queue rather than hold a group behind it.
    sched, nodes, collection = _run(4, singles=[])
    assert [group_of(collection[n.sent[0]]) for n in nodes] == [
        "jetstream-away-cluster",
        "jetstream-away",
        "handler-outage",
        "chaos",
    ]
    assert all(len(n.sent) == 1 for n in nodes[:3])
    # The outage over, its worker takes the next unit as any other.
    sched.mark_test_complete(nodes[0], nodes[0].sent[0])
    assert group_of(collection[nodes[0].sent[1]]) == "spark"


def test_every_outage_group_is_ranked_and_the_report_adds_up_chains():
    assert ALONE <= set(CHAINS[: len(ALONE)])
    report = ChainReport()
    node = SimpleNamespace(gateway=SimpleNamespace(id="gw0"))
    for when, duration in (("setup", 1.0), ("call", 30.0), ("teardown", 2.0)):
        report.add(SimpleNamespace(nodeid="t.py::test_x@chaos", duration=duration, when=when, node=node, cpu=3.0))
    report.add(SimpleNamespace(nodeid="t.py::test_y", duration=4.0, when="call", node=node, cpu=10.0))
    report.add(SimpleNamespace(nodeid="t.py::test_z", duration=1.0, when="call", node=node))  # measured nowhere
    assert report.chains == {"chaos": 33.0} and report.tests["chaos"] == 1
    assert report.chain_cpu == {"chaos": 9.0, "(no group)": 10.0}
    lines = report.lines()
    assert lines[0].split() == ["chaos", "33", "s", "1", "tests", "9", "s", "cpu"]
    assert lines[1].split() == ["(no", "group)", "10", "s", "cpu"]
    assert lines[2] == "worker busy: gw0 38 s"
    assert lines[3:] == [
        "CPU of the tests and their waited commands: 19 s; the most:",
        "    10.0 s  t.py::test_y",
        "     9.0 s  t.py::test_x@chaos",
        "     0.0 s  t.py::test_z",
    ]
