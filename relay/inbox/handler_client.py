"""POSTs the event envelope to a handler over HTTP (httpx) and reports what
came back, without judging it: handler_contract decides what an answer means.

The body is the envelope minus its trace context, which travels as the W3C
`traceparent`/`tracestate` headers. `Idempotency-Key` carries the message id,
so a handler can deduplicate on its own too (defence in depth).

The request is built for cheapness: the body is serialised once, as bytes
(the inbox stores the same text plus the trace context); the handler's URL
and timeout are parsed once; connections are kept alive between calls.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

_TEXT_LIMIT = 300


@dataclass(frozen=True)
class HandlerAnswer:
    status: int | None  # None: no HTTP answer (timeout, connection error)
    error: str | None  # why there was no answer
    retry_after: float | None  # seconds, from a Retry-After header
    elapsed: float
    text: str = ""  # the start of the response body, for last_error

    @property
    def summary(self) -> str:
        if self.status is None:
            return str(self.error)
        text = " ".join(self.text.split())[:_TEXT_LIMIT]
        return f"HTTP {self.status}" + (f": {text}" if text else "")


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: ignored, the backoff applies


def request_headers(envelope: dict[str, Any], handler: str, delivery: int) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": envelope["message_id"],
        "Pgoutbox-Message-Id": envelope["message_id"],
        "Pgoutbox-Handler": handler,
        "Pgoutbox-Delivery": str(delivery),
    }
    headers.update({k: v for k, v in (envelope.get("trace") or {}).items() if isinstance(v, str)})
    return headers


def request_body(envelope: dict[str, Any]) -> bytes:
    """The envelope minus its trace context, as compact JSON."""
    return json.dumps({k: v for k, v in envelope.items() if k != "trace"}, separators=(",", ":")).encode()


# Idle connections are closed after this long; a handler's own keep-alive
# timeout should be longer (most servers: 5 s or more).
KEEPALIVE_EXPIRY = 4.0


class HandlerClient:
    """Calls handlers through single-connection httpx clients, pooled per
    origin: httpx's own connection pool scans every connection for every
    queued request, which measured here (bench/consumer_bench.py) at a few
    hundred requests/s for 64 concurrent calls on one client, against
    several times that with one client per connection."""

    def __init__(self, per_origin: int = 16):
        self._per_origin = per_origin
        self._idle: dict[str, asyncio.Queue[httpx.AsyncClient]] = {}
        self._created: dict[str, int] = {}
        self._all: list[httpx.AsyncClient] = []
        self._urls: dict[tuple[str, float], tuple[httpx.URL, dict[str, Any], str]] = {}
        # Loading the CA bundle costs ~25 ms: once, not once per client.
        self._tls = httpx.create_ssl_context()

    async def _take(self, origin: str) -> httpx.AsyncClient:
        idle = self._idle.get(origin)
        if idle is None:
            idle = self._idle[origin] = asyncio.Queue()
        if idle.empty() and self._created.get(origin, 0) < self._per_origin:
            self._created[origin] = self._created.get(origin, 0) + 1
            # No redirects: a 3xx is a misconfigured URL, reported as such.
            client = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=KEEPALIVE_EXPIRY),
                follow_redirects=False,
                verify=self._tls,
            )
            self._all.append(client)
            return client
        return await idle.get()

    def _parsed(self, url: str, timeout: float) -> tuple[httpx.URL, dict[str, Any], str]:
        """The URL, its request extensions (the timeout) and origin, made on first use only."""
        key = (url, timeout)
        parsed = self._urls.get(key)
        if parsed is None:
            target = httpx.URL(url)
            origin = str(target.copy_with(path="/", query=None, fragment=None))
            parsed = self._urls[key] = (target, {"timeout": httpx.Timeout(timeout).as_dict()}, origin)
        return parsed

    async def call(
        self, url: str, body: bytes, envelope: dict[str, Any], *, handler: str, delivery: int, timeout: float
    ) -> HandlerAnswer:
        """POSTs `body` (request_body(envelope)) with the envelope's headers."""
        started = time.monotonic()
        target, extensions, origin = self._parsed(url, timeout)
        # A request built here and sent as it is: none of the client's
        # defaults to merge (headers, cookies, auth, timeout) on every call.
        request = httpx.Request(
            "POST", target, content=body, headers=request_headers(envelope, handler, delivery), extensions=extensions
        )
        client = await self._take(origin)
        try:
            response = await client.send(request)
        except httpx.TimeoutException as exc:
            return HandlerAnswer(
                None, f"timeout after {timeout:g}s ({type(exc).__name__})", None, time.monotonic() - started
            )
        except httpx.TransportError as exc:
            return HandlerAnswer(
                None, f"connection error: {type(exc).__name__}: {exc}", None, time.monotonic() - started
            )
        finally:
            self._idle[origin].put_nowait(client)
        return HandlerAnswer(
            response.status_code,
            None,
            _retry_after(response.headers.get("Retry-After")),
            time.monotonic() - started,
            response.text[:_TEXT_LIMIT] if response.status_code >= 300 else "",
        )

    async def aclose(self) -> None:
        for client in self._all:
            await client.aclose()
