"""What an operator sees of a worker: JSON logs on stderr, Prometheus metrics,
and liveness/readiness endpoints, all on one small HTTP listener.

    GET /metrics   Prometheus text format
    GET /healthz   200 while the event loop runs (liveness)
    GET /readyz    200 when ready, 503 with the reasons otherwise (JSON body)

The listener is a few lines of asyncio rather than a web framework: three
fixed GET routes do not justify a dependency.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable
from datetime import datetime, timezone

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .errors import ConfigError

# Attributes every LogRecord has; anything else came in through extra={...}.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then the extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "INFO", fmt: str = "json") -> None:
    """Route every log record to stderr, as JSON (or plain text for humans)."""
    if fmt not in ("json", "text"):
        raise ConfigError(f"log format must be json or text, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_pgoutbox", False)]:
        root.removeHandler(old)
    handler._pgoutbox = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    try:
        root.setLevel(level.upper())
    except ValueError as exc:
        raise ConfigError(f"unknown log level {level!r}") from exc
    logging.getLogger("nats").setLevel(logging.WARNING)


def parse_listen(text: str) -> tuple[str, int] | None:
    """'host:port' (port 0 = any free port) or 'off'."""
    if text.strip().lower() == "off":
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT or off, got {text!r}")
    return host or "0.0.0.0", int(port)


Readiness = Callable[[], tuple[bool, dict]]


class HealthServer:
    """Serves /metrics, /healthz and /readyz until stopped."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, readiness: Readiness):
        self.host, self.port = host, port
        self.registry = registry
        self.readiness = readiness
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        """Starts listening; returns the bound port (useful with port 0)."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def _respond(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            ready, detail = self.readiness()
            body = json.dumps({"ready": ready, **detail}, default=str).encode() + b"\n"
            return (200 if ready else 503), "application/json", body
        return 404, "text/plain", b"not found: try /metrics, /healthz, /readyz\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            method, _, rest = request.decode("latin-1").partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "text/plain", b"GET only\n"
            else:
                status, ctype, body = self._respond(path)
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}[status]
            head = (
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
