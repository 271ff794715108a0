"""Prometheus metrics and the health endpoints of the consumer and replayer.

    GET /metrics   Prometheus text format
    GET /healthz   200 while the event loop is alive (it ticks every second)
    GET /readyz    200 when NATS and PostgreSQL are reachable and every
                   durable is bound; 503 with the reasons otherwise

Each Consumer owns its own CollectorRegistry, so several can share a process
(tests, the benchmark) without clashing on metric names.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

OUTCOMES = ("processed", "duplicate", "parked", "dead_lettered", "retried", "invalid", "error")


class ConsumerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.messages = Counter(
            "pgoutbox_consumer_messages", "Deliveries handled, by handler and outcome "
            "(processed, duplicate = already processed and skipped, parked = already dead-lettered, "
            "dead_lettered, retried, invalid = unreadable, error = infrastructure failure, not acked)",
            ["handler", "outcome"], registry=r,
        )
        self.redeliveries = Counter(
            "pgoutbox_consumer_redeliveries", "Deliveries with num_delivered > 1", ["handler"], registry=r,
        )
        self.handler_latency = Histogram(
            "pgoutbox_consumer_handler_latency_seconds", "HTTP handler call duration", ["handler"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.in_flight = Gauge(
            "pgoutbox_consumer_in_flight", "Messages being processed", ["handler"], registry=r,
        )
        self.backlog = Gauge(
            "pgoutbox_inbox_backlog", "inbox.backlog(): unprocessed, failed and dead_letter rows",
            ["context", "handler", "kind"], registry=r,
        )
        self.oldest_unprocessed_age = Gauge(
            "pgoutbox_inbox_oldest_unprocessed_age_seconds", "Age of the oldest unprocessed inbox row",
            ["context", "handler"], registry=r,
        )
        self.replays = Counter(
            "pgoutbox_replayer_published", "Dead letters re-published by the replayer", ["handler"],
            registry=r,
        )

    def count(self, handler: str, outcome: str) -> None:
        self.messages.labels(handler, outcome).inc()

    def value(self, handler: str, outcome: str) -> float:
        """The current count (for tests and the benchmark)."""
        return self.registry.get_sample_value(
            "pgoutbox_consumer_messages_total", {"handler": handler, "outcome": outcome}
        ) or 0.0

    def set_backlog(self, rows: list[dict], now: float) -> None:
        self.backlog.clear()
        self.oldest_unprocessed_age.clear()
        for row in rows:
            labels = (row["context"], row["handler"])
            self.backlog.labels(*labels, "unprocessed").set(row["unprocessed"])
            self.backlog.labels(*labels, "failed").set(row["failed"])
            self.backlog.labels(*labels, "dead_letter").set(row["dead_letter"])
            oldest = row["oldest_unprocessed_at"]
            self.oldest_unprocessed_age.labels(*labels).set(now - oldest.timestamp() if oldest else 0)


class HealthServer:
    """/metrics, /healthz, /readyz on a daemon thread (port 0: any free port)."""

    def __init__(self, host: str, port: int, metrics: ConsumerMetrics,
                 readiness: Callable[[], list[str]], liveness_timeout: float = 30.0):
        self.metrics = metrics
        self.readiness = readiness
        self.liveness_timeout = liveness_timeout
        self.last_tick = time.monotonic()
        server_self = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path == "/metrics":
                    self._send(200, generate_latest(server_self.metrics.registry), CONTENT_TYPE_LATEST)
                elif self.path == "/healthz":
                    age = time.monotonic() - server_self.last_tick
                    ok = age < server_self.liveness_timeout
                    self._json(200 if ok else 503, {"alive": ok, "loop_tick_age_seconds": round(age, 3)})
                elif self.path == "/readyz":
                    problems = server_self.readiness()
                    self._json(503 if problems else 200, {"ready": not problems, "problems": problems})
                else:
                    self._json(404, {"error": "not found", "paths": ["/metrics", "/healthz", "/readyz"]})

            def _json(self, status, document):
                self._send(status, json.dumps(document).encode(), "application/json")

            def _send(self, status, body, content_type):
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet: scrapes are not events
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pgoutbox-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
