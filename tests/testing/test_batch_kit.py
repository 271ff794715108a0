"""The test kit's call_batch_handler against examples/batch_handler.py, the
example batch handler, started as a process as its docstring runs it: each
event's result read from the one answer as the consumer reads it (200
processed, 422 a dead letter, 409 for a message id it counted already);
a malformed answer is each event's BATCH_ANSWER_MALFORMED failure."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pgoutbox.testing import call_batch_handler, event

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "batch_handler.py"


@pytest.fixture
def example_url():
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        yield line.split()[-1] + "/orders"
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_example_batch_handler_answers_each_event_under_the_consumers_contract(example_url):
    paid = event("order_created", {"schema_version": 1, "total": 30}, context="sea", aggregate_id="42")
    broken = event("order_created", {"schema_version": 1}, context="sea", aggregate_id="43")
    results = call_batch_handler(example_url, [paid, broken], handler="order_totals")
    assert [(r.status, r.action) for r in results] == [(200, "processed"), (422, "dead_letter")]
    assert results[1].text == "payload has no numeric total"
    assert [r.envelope["message_id"] for r in results] == [paid["event_id"], broken["event_id"]]
    assert results[0].request_headers["Pgoutbox-Batch-Size"] == "2"
    (again,) = call_batch_handler(example_url, [paid], handler="order_totals", delivery=2)
    assert (again.status, again.action) == (409, "processed")  # counted already: "already done"


def test_a_malformed_answer_is_each_events_coded_failure():
    class Page(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b"<html>ok</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        events = [event("order_created", {"schema_version": 1, "total": n}, context="sea") for n in (1, 2)]
        results = call_batch_handler(f"http://127.0.0.1:{server.server_address[1]}/x", events)
        assert [r.action for r in results] == ["retry", "retry"]
        assert all(r.error.startswith("BATCH_ANSWER_MALFORMED [OB063]: not JSON") for r in results)
    finally:
        server.shutdown()
        server.server_close()
