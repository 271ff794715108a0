"""The shop example's handler (docs/testing.md): a projection of orders that
the consumer calls over HTTP, answering as the handler contract says.

    python examples/shop/projection.py [--port 8083]

    POST /orders  (the consumer's envelope: message_id, event_type, payload, ...)
    200  order_created or order_paid applied
    409  this message was applied before (Idempotency-Key seen)
    422  an order_created without a positive integer total: it never will be
         applicable (the consumer dead-letters it)
    503  an order_paid for an order not created yet: the consumer retries it

It keeps the projection in memory, prints "listening on http://HOST:PORT"
once it accepts requests, and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Projection:
    def __init__(self) -> None:
        self.orders: dict[str, dict[str, Any]] = {}
        self.applied: set[str] = set()
        self.lock = threading.Lock()

    def apply(self, envelope: dict[str, Any]) -> int:
        payload = envelope.get("payload") or {}
        with self.lock:
            if envelope["message_id"] in self.applied:
                return 409
            kind = envelope.get("event_type")
            order_id = str(payload.get("order_id"))
            if kind == "order_created":
                total = payload.get("total")
                if type(total) is not int or total <= 0:
                    return 422
                self.orders[order_id] = {"customer": payload.get("customer"), "total": total, "paid": False}
            elif kind == "order_paid":
                if order_id not in self.orders:
                    return 503
                self.orders[order_id]["paid"] = True
            self.applied.add(envelope["message_id"])
            return 200


def serve(host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, Projection]:
    """Starts the handler on a thread; returns the server and its projection."""
    projection = Projection()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                status = projection.apply(json.loads(body))
            except (ValueError, KeyError, TypeError):
                status = 422
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, projection


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8083)
    args = parser.parse_args()
    server, _ = serve(args.host, args.port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"listening on http://{args.host}:{server.server_address[1]}", flush=True)
    stop.wait()
    server.shutdown()


if __name__ == "__main__":
    main()
