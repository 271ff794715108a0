"""Three nats-server nodes clustered on loopback (JetStream, one store folder
each), for the chaos soak and the tests that need a broker that loses a node.

Every route between two nodes runs through a TCP proxy of its own, one per
direction (node i dials node j through proxy (i, j)), so that a network
partition of one node is the closing of the proxies on its routes: both
sides stay up and keep their clients, they just cannot see each other. The
nodes advertise an unreachable route address, so that no node learns a
direct route to another (bypassing the proxies) through the cluster's
gossip; the explicit routes through the proxies are retried forever.

    cluster = NatsCluster(root); cluster.start()
    cluster.urls                      "nats://127.0.0.1:p1,nats://...:p2,..." (OUTBOX_NATS_URL)
    cluster.kill(i) / start_node(i)   kill -9 of a node, and back
    cluster.restart(i)                SIGTERM, then start again
    cluster.partition(i) / heal(i)    cut node i's routes, and restore them
    cluster.wait_healthy(i)           until node i's /healthz says every replica on it is current
    await cluster.stream_leader(name) index of the node leading a stream
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
from nats.js.api import ClusterInfo

from harness.tcp_proxy import TcpProxy
from pgoutbox.dev.embedded import EmbeddedNats, free_port, hold_ports, release_ports

CLUSTER_NAME = "pgoutbox"


async def connect(urls: str, **options: Any) -> nats.NATS:
    """A client on every node of a comma-separated URL list, without nats-py's
    traceback on stderr for each node that is down at the moment."""

    async def quiet(exc: Exception) -> None:
        pass

    options = {"connect_timeout": 2, "max_reconnect_attempts": 2, "reconnect_time_wait": 0.2, **options}
    return await nats.connect(urls.split(","), error_cb=quiet, **options)


def node_name(i: int) -> str:
    return f"n{i + 1}"


@dataclass
class NatsCluster:
    root: Path
    size: int = 3
    nodes: list[EmbeddedNats] = field(default_factory=list)
    route_ports: list[int] = field(default_factory=list)
    proxies: dict[tuple[int, int], TcpProxy] = field(default_factory=dict)
    monitor_ports: list[int] = field(default_factory=list)
    held: dict[int, list[socket.socket]] = field(default_factory=dict, repr=False)  # a node's ports while it is down
    proxies_held: list[socket.socket] = field(default_factory=list, repr=False)  # the proxies' ports until they start

    def __post_init__(self) -> None:
        if not self.nodes:
            self.route_ports = [free_port() for _ in range(self.size)]
            # (i, j): node i dials node j's route port through this proxy.
            self.proxies = {
                (i, j): TcpProxy(self.route_ports[j], port=free_port(), start=False)
                for i in range(self.size)
                for j in range(self.size)
                if i != j
            }
            self.monitor_ports = [free_port() for _ in range(self.size)]
            client_ports = [free_port() for _ in range(self.size)]
            nowhere = free_port()  # nothing listens here: gossiped route addresses lead nowhere
            self.nodes = [
                EmbeddedNats(
                    self.root / node_name(i),
                    port=client_ports[i],
                    extra_args=[
                        "-n",
                        node_name(i),
                        "-m",
                        str(self.monitor_ports[i]),
                        "--cluster_name",
                        CLUSTER_NAME,
                        "--cluster",
                        f"nats://127.0.0.1:{self.route_ports[i]}",
                        "--cluster_advertise",
                        f"127.0.0.1:{nowhere}",
                        "--routes",
                        ",".join(f"nats://127.0.0.1:{self.proxies[i, j].port}" for j in range(self.size) if j != i),
                    ],
                )
                for i in range(self.size)
            ]
            # Every port chosen here is held until its node or proxy binds it:
            # the nodes start one after the other, seconds after the choice,
            # and meanwhile another test's server took one (a node exited at
            # start-up, its port in use).
            self.held = {
                i: hold_ports(client_ports[i], self.route_ports[i], self.monitor_ports[i]) for i in range(self.size)
            }
            self.proxies_held = hold_ports(*(p.port for p in self.proxies.values()))

    @property
    def urls(self) -> str:
        """Every node's client URL, comma-separated (what OUTBOX_NATS_URL takes)."""
        return ",".join(n.url for n in self.nodes)

    @property
    def url(self) -> str:
        return self.urls

    def start(self, timeout: float = 30) -> str:
        release_ports(self.proxies_held)
        for proxy in self.proxies.values():
            proxy.start()
        for i in range(self.size):
            self.start_node(i)
        self.wait_for_jetstream(timeout)
        return self.urls

    def start_node(self, i: int) -> None:
        release_ports(self.held.pop(i, []))
        self.nodes[i].start()

    def wait_for_jetstream(self, timeout: float = 30) -> None:
        """Until the JetStream meta group has a leader that answers (API calls
        work) and every node says it is current (/healthz): before that, a
        stream of three replicas can find no peers to place them on."""
        asyncio.run(self._wait_for_jetstream(timeout))

    async def _wait_for_jetstream(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                nc = await connect(self.urls)
                try:
                    await nc.jetstream(timeout=2).account_info()
                    if all(self.healthy(i) for i in range(self.size)):
                        return
                    last = TimeoutError("a node is not current yet (/healthz)")
                finally:
                    await nc.close()
            except Exception as exc:  # no meta leader yet, a node still starting...
                last = exc
            await asyncio.sleep(0.25)
        raise TimeoutError(f"JetStream cluster not ready after {timeout}s: {last!r}")

    def healthy(self, i: int) -> bool:
        """The node's own /healthz: up, and every stream and consumer replica on it current."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_ports[i]}/healthz", timeout=2) as r:
                return bool(json.load(r).get("status") == "ok")
        except (OSError, ValueError):  # refused, 503 (HTTPError is an OSError), unreadable
            return False

    def wait_healthy(self, i: int, timeout: float = 60) -> bool:
        """Until node i reports healthy (what a rolling restart waits for before the next node)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.healthy(i):
                return True
            time.sleep(0.25)
        return False

    def running(self, i: int) -> bool:
        process = self.nodes[i].process
        return process is not None and process.poll() is None

    def kill(self, i: int) -> None:
        """kill -9 of node i (no lame-duck mode, no flush)."""
        process = self.nodes[i].process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()
            # Its client, route and monitor ports stay its own until it starts again.
            self.held[i] = hold_ports(self.nodes[i].port, self.route_ports[i], self.monitor_ports[i])
        self.nodes[i].process = None

    def restart(self, i: int) -> None:
        """A clean stop (SIGTERM) and a start."""
        self.nodes[i].restart()

    def partition(self, i: int) -> None:
        """Cuts every route between node i and the others, both directions."""
        for (a, b), proxy in self.proxies.items():
            if i in (a, b):
                proxy.cut()

    def heal(self, i: int) -> None:
        for (a, b), proxy in self.proxies.items():
            if i in (a, b):
                proxy.heal()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
            release_ports(node.held)
        for held in self.held.values():
            release_ports(held)
        self.held.clear()
        release_ports(self.proxies_held)
        for proxy in self.proxies.values():
            proxy.close()

    def index(self, name: str | None) -> int | None:
        names = [node_name(i) for i in range(self.size)]
        return names.index(name) if name in names else None

    async def stream_cluster(self, stream: str, timeout: float = 5) -> ClusterInfo | None:
        """The stream's cluster info (leader and replicas) from the JetStream API."""
        nc = await connect(self.urls)
        try:
            return (await nc.jetstream(timeout=timeout).stream_info(stream)).cluster
        finally:
            await nc.close()

    async def stream_leader(self, stream: str, timeout: float = 30) -> int:
        """The index of the node that leads the stream now (waits for an election)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = await self.stream_cluster(stream)
                leader = self.index(info.leader if info else None)
                if leader is not None:
                    return leader
            except (TimeoutError, nats.errors.Error, nats.js.errors.Error):
                pass  # no leader at this moment
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream {stream} has no leader after {timeout}s")
            await asyncio.sleep(0.25)

    async def wait_until_current(self, stream: str, timeout: float = 60) -> bool:
        """Until the stream has a leader and every replica is current and online."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                info = await self.stream_cluster(stream)
                if info and info.leader and all(r.current and not r.offline for r in info.replicas or []):
                    if len(info.replicas or []) == self.size - 1:
                        return True
            except (TimeoutError, nats.errors.Error, nats.js.errors.Error):
                pass
            await asyncio.sleep(0.5)
        return False
