"""How `make test` spreads the server tier over its workers (`--dist loadgroup`),
and the chains it measures.

A group (tests/conftest.py `_GROUPS`) runs on one worker, one test after the
other: its chain. The run lasts at least as long as its longest chain, plus
whatever that chain waited before it started. pytest-xdist 3.8 hands out the
work units (a group, or a test of no group) largest first by test count, and
gives a worker a second unit as soon as it has two tests or fewer left: a
one-test group that lasts five minutes went out among the single tests, late,
and had another unit queued behind it on its worker. `LongestChainFirst`
hands out the groups longest chain first (`CHAINS`, then the tests of no
group) and queues one quick test behind a group that is still running on a
worker of its own (`ALONE`), nothing more: the three outages of five minutes
start at once, side by side, each on its worker, mostly waiting while the
other workers take the rest. The quick test is there because an xdist worker
runs a test only once it knows the next one (or is told to stop): alone, an
outage waited for the end of the queue, 15 minutes into a clean-clone run.
`longest_chain_first` puts one such test per outage at the end of the
collection, a test of no group not marked slow (the last ones in collection
order), so that the queue's last units are the ones to take: whatever runs
after a 5-minute outage on its worker runs at the busiest time of the run, and
a test of seconds is the one that does not mind.

`ChainReport` prints, at the end of a run under xdist, each group's chain
(its tests' durations added up) and each worker's busy time: the figures
tests/README.md gives."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

from xdist.scheduler import LoadGroupScheduling

# The groups, longest chain first (seconds measured on the 2-core machine: tests/README.md),
# but the outages of ALONE first of all: each holds a worker for its five minutes anyway.
CHAINS = (
    "jetstream-away-cluster",
    "jetstream-away",
    "handler-outage",
    "outage",
    "chaos-check",
    "chaos",
    "spark",
    "spark-ops",
    "chaos-cluster-faults",
    "browser",
    "chaos-cluster",
    "install",
)
# Groups that wait through a 5-minute outage on the defaults: nothing waits behind them.
ALONE = frozenset({"jetstream-away", "jetstream-away-cluster", "handler-outage"})


def group_of(nodeid: str) -> str | None:
    """The group a node id names (`path::test@group`), as LoadGroupScheduling reads it."""
    return nodeid.rsplit("@", 1)[-1] if nodeid.rfind("@") > nodeid.rfind("]") else None


def longest_chain_first(items: list[Any]) -> None:
    """Sorts the collected items (in place, stably): the groups by CHAINS, then
    every other test in collection order, but for the last quick tests (one per
    group of ALONE), which go last: LongestChainFirst takes them from the
    queue's end to run behind the outages. Every worker collects the same order,
    which LongestChainFirst keeps."""
    rank = {name: i for i, name in enumerate(CHAINS)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid) or "", len(rank)))
    quick = [item for item in items if group_of(item.nodeid) is None and not item.get_closest_marker("slow")]
    behind = quick[-len(ALONE) :]
    moved = {id(item) for item in behind}
    items[:] = [item for item in items if id(item) not in moved] + behind


class LongestChainFirst(LoadGroupScheduling):
    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # the collection's order, not the count of tests per unit

    def _reschedule(self, node: Any) -> None:
        assigned = self.assigned_work.get(node, {})
        for scope, unit in assigned.items():
            if scope in ALONE and not all(unit.values()):
                # Its worker takes more once the outage test is over, but one quick
                # test goes behind it now: an xdist worker runs a test only once it
                # knows the next one (or is told to stop), so an outage test alone on
                # its worker would not start before the end of the queue.
                if not node.shutting_down and self._pending_of(assigned) < 2 and self._quick_unit_last():
                    self._assign_last_unit(node)
                return
        super()._reschedule(node)

    def _quick_unit_last(self) -> bool:
        """The queue ends with a test of no group (longest_chain_first put the quick ones last)."""
        if not self.workqueue:
            return False
        unit = self.workqueue[next(reversed(self.workqueue))]
        return all(group_of(nodeid) is None for nodeid in unit)

    def _assign_last_unit(self, node: Any) -> None:
        scope, unit = self.workqueue.popitem(last=True)
        self.assigned_work.setdefault(node, {})[scope] = unit
        collection = self.registered_collections[node]
        node.send_runtest_some([collection.index(nodeid) for nodeid, done in unit.items() if not done])


def cpu_seconds() -> float:
    """CPU this process and its waited-for children have used: a test's
    commands, Spark jobs and chaos runs (subprocess.run waits for them, and
    they for theirs); not the servers a fixture detaches (PostgreSQL, NATS)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class ChainReport:
    """Durations (and CPU, where a worker measured it: `cpu` on the report)
    added up per group and per worker, from the controller's reports; on a
    machine whose cores are all busy, CPU is what a shorter run must take
    away, not wall time."""

    TOP = 15  # tests listed by CPU

    def __init__(self) -> None:
        self.chains: dict[str, float] = defaultdict(float)
        self.tests: dict[str, int] = defaultdict(int)
        self.workers: dict[str, float] = defaultdict(float)
        self.chain_cpu: dict[str, float] = defaultdict(float)
        self.test_cpu: dict[str, float] = defaultdict(float)

    def add(self, report: Any) -> None:
        group = group_of(report.nodeid)
        cpu = getattr(report, "cpu", 0.0)
        self.chain_cpu[group or "(no group)"] += cpu
        self.test_cpu[report.nodeid] += cpu
        if group:
            self.chains[group] += report.duration
            self.tests[group] += report.when == "call"
        node = getattr(report, "node", None)
        if node is not None:
            self.workers[node.gateway.id] += report.duration

    def lines(self) -> list[str]:
        out = [
            f"{name:24} {self.chains[name]:7.0f} s  {self.tests[name]:3} tests  {self.chain_cpu[name]:6.0f} s cpu"
            for name in self._longest(self.chains)
        ]
        out.append(f"{'(no group)':24} {'':9}  {'':9}  {self.chain_cpu['(no group)']:6.0f} s cpu")
        out.append("worker busy: " + ", ".join(f"{w} {self.workers[w]:.0f} s" for w in sorted(self.workers)))
        out.append(f"CPU of the tests and their waited commands: {sum(self.test_cpu.values()):.0f} s; the most:")
        out += [f"  {self.test_cpu[t]:6.1f} s  {t}" for t in self._longest(self.test_cpu)[: self.TOP]]
        return out

    @staticmethod
    def _longest(chains: dict[str, float]) -> list[str]:
        return sorted(chains, key=lambda name: -chains[name])
