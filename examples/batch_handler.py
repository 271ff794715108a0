"""A handler of format "batch", runnable, stdlib only: it keeps a running
total per order of the `total` of each order_created event, and answers one
result per message (docs/handlers.md, "Batch handlers").

    python examples/batch_handler.py [--port 8081]

Its manifest:

    [[handler]]
    name = "order_totals"
    url = "http://127.0.0.1:8081/orders"
    subjects = ["sea.event.order_created.v1"]
    format = "batch"
    batch_size = 100

Per message: 200 once counted, 409 for a message id it counted already (a
redelivery: "already done"), 422 for a payload without a numeric `total` (it
can never succeed: a dead letter). A request that is not a batch gets 400,
which the consumer counts as every message's failure.

It prints "listening on http://HOST:PORT" once it accepts requests, and
stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOTALS: dict[str, float] = {}  # aggregate_id -> sum of totals
SEEN: set[str] = set()  # message ids counted (a real handler keeps them with its data)
LOCK = threading.Lock()


def result(envelope: dict) -> dict:
    """One message's result."""
    message_id = envelope["message_id"]
    total = (envelope.get("payload") or {}).get("total")
    if isinstance(total, bool) or not isinstance(total, (int, float)):
        return {"message_id": message_id, "status": 422, "error": "payload has no numeric total"}
    with LOCK:
        if message_id in SEEN:
            return {"message_id": message_id, "status": 409}
        SEEN.add(message_id)
        key = envelope["aggregate_id"]
        TOTALS[key] = TOTALS.get(key, 0) + total
    return {"message_id": message_id, "status": 200}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        try:
            messages = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"]
            # In the order of the request, one result per message: the consumer requires both.
            body, status = json.dumps({"results": [result(m["envelope"]) for m in messages]}).encode(), 200
        except (ValueError, KeyError, TypeError) as exc:
            body, status = json.dumps({"error": f"not a batch: {exc}"}).encode(), 400
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def serve(host: str = "127.0.0.1", port: int = 8081) -> ThreadingHTTPServer:
    """The handler, serving in a thread; .shutdown() stops it."""
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8081)
    args = parser.parse_args()
    server = serve(args.host, args.port)
    print(f"listening on http://{args.host}:{server.server_address[1]}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()


if __name__ == "__main__":
    main()
