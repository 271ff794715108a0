"""The workers' shared HTTP endpoints, on a daemon thread (port 0: any free port):

GET /metrics   Prometheus text format (the worker's own CollectorRegistry)
GET /healthz   200 while the event loop is alive (it ticks every second)
               and the worker's liveness check, if any, reports no problem
               (the consumer: its NATS connection is not closed and its
               fetch loops run); 503 with the reasons otherwise
GET /readyz    200 when the worker's readiness check reports no problem;
               503 with the reasons otherwise

metrics_table() renders the workers' metrics as the table of docs/reference.md.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

from pgoutbox.core.errors import ConfigError

# The buckets of both event-age histograms (relay at publish, consumer at
# outcome), the same so that one dashboard reads both: fine around the
# end-to-end target (p99 < 500 ms, itself a bound so that the alert's ratio is
# exact), coarse up to the minute an outage makes of it.
AGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class HasRegistry(Protocol):
    """The workers' metrics: each owns its CollectorRegistry."""

    registry: CollectorRegistry


class HealthServer:
    """/metrics, /healthz, /readyz on a daemon thread (port 0: any free port)."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: HasRegistry,
        readiness: Callable[[], list[str]],
        liveness_timeout: float = 30.0,
        liveness: Callable[[], list[str]] | None = None,
        setting: str = "the HTTP port setting",
    ) -> None:
        self.metrics = metrics
        self.readiness = readiness
        self.liveness = liveness
        self.liveness_timeout = liveness_timeout
        self.last_tick = time.monotonic()
        server_self = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, generate_latest(server_self.metrics.registry), CONTENT_TYPE_LATEST)
                elif self.path == "/healthz":
                    age = time.monotonic() - server_self.last_tick
                    problems = [] if age < server_self.liveness_timeout else [f"event loop stalled for {age:.0f}s"]
                    problems += server_self.liveness() if server_self.liveness else []
                    self._json(
                        200 if not problems else 503,
                        {
                            "alive": not problems,
                            "loop_tick_age_seconds": round(age, 3),
                            "problems": problems,
                        },
                    )
                elif self.path == "/readyz":
                    problems = server_self.readiness()
                    self._json(503 if problems else 200, {"ready": not problems, "problems": problems})
                else:
                    self._json(404, {"error": "not found", "paths": ["/metrics", "/healthz", "/readyz"]})

            def _json(self, status: int, document: dict[str, Any]) -> None:
                self._send(status, json.dumps(document).encode(), "application/json")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # quiet: scrapes are not events
                pass

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:  # a port in use (another worker on this host?) or an address not ours
            raise ConfigError(f"cannot serve /metrics on {host}:{port} ({setting}): {exc.strerror}") from exc
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pgoutbox-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    async def ticking(self) -> None:
        """Ticks every second until cancelled: /healthz is alive while the event loop runs."""
        while True:
            self.tick()
            await asyncio.sleep(1)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def families(metrics: object) -> Iterator[tuple[str, str, tuple[str, ...], str]]:
    """(name as exposed, type, label names, help) of each metric a worker's
    metrics object holds, in declaration order (a counter's name with `_total`)."""
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            [family] = value.describe()
            name = f"{family.name}_total" if family.type == "counter" else family.name
            yield name, family.type, tuple(value._labelnames), family.documentation


def metrics_table(groups: Mapping[str, object]) -> str:
    """The markdown table of docs/reference.md: worker name -> its metrics object."""
    lines = ["| metric | type | labels | served by | meaning |", "|---|---|---|---|---|"]
    for worker, metrics in groups.items():
        for name, kind, labels, meaning in families(metrics):
            shown = ", ".join(f"`{label}`" for label in labels) or "*(none)*"
            lines.append(f"| `{name}` | {kind} | {shown} | {worker} | {meaning} |")
    return "\n".join(lines)
