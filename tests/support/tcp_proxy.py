"""A TCP proxy in front of nats-server that can start dropping what the
client sends (its acks among them) while still delivering what the server
sends: a network that loses acks, on demand."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    def __init__(self, upstream_port: int):
        self.upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"nats://127.0.0.1:{self.port}"
        self.dropping = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_client_bytes(self) -> None:
        """From now on, bytes from clients never reach the server."""
        self.dropping.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
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
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()
        for s in self._sockets:
            s.close()
