"""dev.embedded.hold_ports: while a test's server is down its port stays its
own (a cluster node's restart after a 5-minute outage once found its monitor
port taken): nothing else binds it, a client is refused as before, and the
server binds and listens over it when it starts again. Loopback sockets only,
no server."""

from __future__ import annotations

import errno
import socket

import pytest

from pgoutbox.dev.embedded import free_port, hold_ports, release_ports


def test_a_held_port_is_refused_to_others_and_to_clients_and_taken_back_by_its_server():
    port = free_port()
    held = hold_ports(port)
    try:
        assert len(held) == 1
        with socket.socket() as other, pytest.raises(OSError) as exc:
            other.bind(("127.0.0.1", port))  # free_port()'s bind, another process's server
        assert exc.value.errno == errno.EADDRINUSE
        with socket.socket() as client, pytest.raises(ConnectionRefusedError):
            client.connect(("127.0.0.1", port))  # down, as without the hold
        with socket.socket() as server:  # nats-server and PostgreSQL bind with SO_REUSEADDR
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
    finally:
        release_ports(held)
    assert held == []


def test_a_port_someone_else_holds_is_left_to_them():
    with socket.socket() as taker:
        taker.bind(("127.0.0.1", 0))
        taker.listen()
        assert hold_ports(taker.getsockname()[1]) == []
