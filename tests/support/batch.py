"""A real HTTP handler of format "batch" for the consumer tests (stdlib
server on a free port, in a thread): each message's result comes from its
payload's "answers" list, one entry per call for that message (the last one
repeats), as FakeHandler does for single messages. It records each request
(the message ids and ordering keys it carried, in order) and whether two
requests in flight at once ever carried the same ordering key."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class BatchRequest:
    message_ids: list[str]
    keys: list[str | None]
    deliveries: list[int]
    headers: dict


@dataclass
class BatchHandler:
    """`whole`: a status the whole batch gets instead of results (e.g. 503:
    the handler away), until set to None. `delay`: seconds each request takes."""

    whole: int | None = None
    delay: float = 0.0
    requests: list[BatchRequest] = field(default_factory=list)
    answered: list[int] = field(default_factory=list)  # the status of each request, in order
    overlaps: list[str] = field(default_factory=list)  # keys two requests in flight carried at once

    def __post_init__(self):
        fake = self
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._calls: dict[str, int] = {}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                items = json.loads(raw)["messages"]
                envelopes = [item["envelope"] for item in items]
                request = BatchRequest(
                    [e["message_id"] for e in envelopes],
                    [e.get("ordering_key") for e in envelopes],
                    [item["delivery"] for item in items],
                    dict(self.headers),
                )
                keys = {k for k in request.keys if k is not None}
                with fake._lock:
                    whole = fake.whole
                    fake.requests.append(request)
                    fake.overlaps.extend(k for k in keys if fake._in_flight.get(k))
                    for k in keys:
                        fake._in_flight[k] = fake._in_flight.get(k, 0) + 1
                    results = []
                    for e in envelopes:
                        n = fake._calls.get(e["message_id"], 0)
                        if whole is None:
                            fake._calls[e["message_id"]] = n + 1
                        answers = (e.get("payload") or {}).get("answers") or [200]
                        status = int(answers[min(n, len(answers) - 1)])
                        results.append({"message_id": e["message_id"], "status": status, "error": f"answer {status}"})
                status = whole or 200
                try:
                    time.sleep(fake.delay)
                    out = json.dumps({"results": results} if whole is None else {"away": True}).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                finally:
                    with fake._lock:
                        fake.answered.append(status)
                        for k in keys:
                            fake._in_flight[k] -= 1

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/batch"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def handled(self, message_id: str) -> int:
        """How many requests answered with results carried this message."""
        with self._lock:
            return self._calls.get(message_id, 0)

    def close(self):
        self._server.shutdown()
        self._server.server_close()
