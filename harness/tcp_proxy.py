"""One TCP proxy on loopback for the tests that need a network that misbehaves
on demand, in front of nats-server or PostgreSQL:

    drop_client_bytes()   from now on, what clients send never reaches the
                          server (acks lost) while the server's bytes still arrive
    open.clear()/.set()   new connections are closed at once while existing ones
                          keep flowing (a server unreachable for a while)
    port=                 listen on a given port (a server that comes up at a
                          known address only when start() is called)
    cut() / heal()        every connection closed and new ones refused, until
                          heal() (a network partition between two processes)
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    def __init__(self, upstream_port: int, *, port: int = 0, start: bool = True):
        self.upstream = ("127.0.0.1", upstream_port)
        self.port = port
        self.dropping = threading.Event()
        self.open = threading.Event()
        self.open.set()
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        if start:
            self.start()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def drop_client_bytes(self) -> None:
        """From now on, bytes from clients never reach the server."""
        self.dropping.set()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream)
            except OSError:  # the server is down: so is the connection through us
                client.close()
                continue
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, from_client: bool) -> None:
        try:
            while data := source.recv(65536):
                if from_client and self.dropping.is_set():
                    continue
                target.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, target):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Closes every connection through the proxy and refuses new ones until heal()."""
        self.open.clear()
        self._close_connections()

    def heal(self) -> None:
        self.open.set()

    def _close_connections(self) -> None:
        sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked in recv()
            s.close()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        self._close_connections()
