"""A small HTTP/1.1 client for the one request the consumer makes: a POST
with a body already serialised, on kept-alive connections, per origin.

Why not httpx: for this request httpx (httpcore, h11, its request and
response models) cost most of the consumer's CPU per message (docs/benchmarks.md,
"The consumer bench"); the request here is one `writer.write` of bytes
built once, and the answer needs only its status, a few headers and the
start of its body.

What it speaks: HTTP/1.1 with Content-Length or chunked response bodies, or
a body that ends with the connection; 1xx interim answers are skipped;
`Connection: close` and HTTP/1.0 answers are honoured. TLS for https://.
A connection is reused only when its answer was read whole; an idle one
older than `keepalive_expiry` is closed rather than reused (servers close
theirs after a few seconds). A kept-alive connection the server closed
while idle fails before any byte of the answer: that request is sent once
more on a new connection (the handler never saw it, or saw it without
answering; handlers deduplicate on Idempotency-Key either way).

New connections to an origin open a few at a time (FRESH_AT_ONCE): a
connection counts as fresh from its connect until its first answer, and a
call that would open one more waits for a fresh one to answer, then takes
it if it came back idle. A burst of concurrent calls (a consumer starting on
a backlog: `concurrency` calls at once) would otherwise open that many
connections within a millisecond; a handler whose listen backlog is smaller
(Python's socketserver and http.server: 5) has the kernel drop the excess
handshakes, which it retransmits only after 1 s, 3 s, 7 s: the request
reaches the handler seconds late, the call times out although the handler
did the work, and the message is sent again (the handler called twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

# Bytes of an error answer kept for last_error; the rest is read and dropped.
TEXT_KEPT = 300
# Larger error bodies are not read to the end: the connection is closed instead.
_DRAIN_AT_MOST = 1 << 20
_HEAD_LIMIT = 64 * 1024
# Connections to one origin between their connect and their first answer,
# at most: under the smallest listen backlog in common use (5), so that a
# burst of calls never overflows a handler's accept queue.
FRESH_AT_ONCE = 4


class HttpError(Exception):
    """No usable answer: a connection refused or broken, a malformed answer.
    away: the handler never got the request in a way it could answer (no
    connection: refused, unreachable, a name that does not resolve, no
    connection within the timeout; or a new connection closed or reset
    before any byte of an answer), as opposed to an answer that was broken."""

    def __init__(self, text: str, *, away: bool = False):
        super().__init__(text)
        self.away = away


@dataclass(frozen=True)
class Target:
    """A handler URL, parsed once."""

    scheme: str
    host: str
    port: int
    path: bytes  # path and query, as sent in the request line
    host_header: bytes

    @property
    def origin(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        default = port == (443 if parts.scheme == "https" else 80)
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(parts.scheme, host, port, path.encode(), (shown if default else f"{shown}:{port}").encode())


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    text: str  # the start of the body (TEXT_KEPT characters at most)
    body: bytes = b""  # a 2xx answer's body, when the caller asked for it (post's `keep`)


@dataclass(eq=False)  # hashed by identity: the pool keeps a set of open ones
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    used_at: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Http1Pool:
    """Kept-alive connections per origin: at most `per_origin` at once (a
    caller beyond that waits for one to come back)."""

    def __init__(self, per_origin: int, keepalive_expiry: float, tls: ssl.SSLContext | None = None):
        self._per_origin = per_origin
        self._expiry = keepalive_expiry
        self._tls = tls
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._slots: dict[tuple[str, str, int], asyncio.Semaphore] = {}
        self._fresh: dict[tuple[str, str, int], asyncio.Semaphore] = {}
        self._open: set[_Connection] = set()

    async def post(self, target: Target, body: bytes, headers: bytes, timeout: float, keep: int = 0) -> Answer:
        """POSTs body with `headers` (complete `Name: value\\r\\n` lines);
        TimeoutError after `timeout` seconds, HttpError without an answer.
        `keep`: the most bytes of a 2xx answer's body to return (a batch
        handler's results); a longer one is an HttpError."""
        slots = self._slots.get(target.origin)
        if slots is None:
            slots = self._slots[target.origin] = asyncio.Semaphore(self._per_origin)
        request = b"".join(
            (
                b"POST ",
                target.path,
                b" HTTP/1.1\r\nHost: ",
                target.host_header,
                b"\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\n",
                headers,
                b"\r\n",
                body,
            )
        )
        loop = asyncio.get_running_loop()
        async with slots:
            # The timeout runs from when this call has a connection, or its
            # place to open one: waiting for a place (FRESH_AT_ONCE) is the
            # consumer's own queue, not the handler's time.
            deadline: float | None = None
            while True:
                conn, reused = await self._connection(target)
                if deadline is None:
                    deadline = loop.time() + timeout
                try:
                    async with asyncio.timeout_at(deadline):
                        if conn is None:
                            conn = await self._connect_fresh(target)
                        answer = await self._send(target, conn, reused, request, keep)
                except TimeoutError:
                    if conn is None:
                        raise HttpError(f"no connection within {timeout:g}s", away=True) from None
                    raise
                if answer is not None:
                    return answer

    async def _send(
        self, target: Target, conn: _Connection, reused: bool, request: bytes, keep: int = 0
    ) -> Answer | None:
        """The request on conn, and its answer; None: a kept-alive connection
        the server closed while idle, to send it again on another one."""
        try:
            answer, reuse = await self._exchange(conn, request, keep)
        except _StaleConnection:
            self._drop(conn)
            if reused:
                return None  # the server closed it while idle: once more, on a new one
            raise HttpError("the server closed the connection without answering", away=True) from None
        except BaseException:
            self._drop(conn)
            raise
        finally:
            if not reused:  # answered or gone: no longer fresh
                self._fresh[target.origin].release()
        if reuse:
            conn.used_at = time.monotonic()
            self._idle.setdefault(target.origin, []).append(conn)
        else:
            self._drop(conn)
        return answer

    def _reusable(self, target: Target) -> _Connection | None:
        idle = self._idle.get(target.origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.used_at < self._expiry and not conn.reader.at_eof():
                return conn
            self._drop(conn)
        return None

    async def _connection(self, target: Target) -> tuple[_Connection | None, bool]:
        """An idle connection (reused: True), or (None, False): one of the
        origin's FRESH_AT_ONCE places to open a new one (_connect_fresh),
        held until the caller releases it (after its first answer, or its
        failure)."""
        conn = self._reusable(target)
        if conn is not None:
            return conn, True
        fresh = self._fresh.get(target.origin)
        if fresh is None:
            fresh = self._fresh[target.origin] = asyncio.Semaphore(FRESH_AT_ONCE)
        await fresh.acquire()
        # A fresh connection answered while this call waited: it is idle now.
        conn = self._reusable(target)
        if conn is not None:
            fresh.release()
            return conn, True
        return None, False

    async def _connect_fresh(self, target: Target) -> _Connection:
        """A new connection, in the place _connection gave (given back if it fails)."""
        try:
            return await self._connect(target)
        except BaseException:
            self._fresh[target.origin].release()
            raise

    async def _connect(self, target: Target) -> _Connection:
        tls = None
        if target.scheme == "https":
            tls = self._tls or ssl.create_default_context()
        try:
            reader, writer = await asyncio.open_connection(
                target.host, target.port, ssl=tls, server_hostname=target.host if tls else None, limit=_HEAD_LIMIT
            )
        except OSError as exc:  # refused, unreachable, a name that does not resolve
            raise HttpError(f"{type(exc).__name__}: {exc}", away=True) from None
        conn = _Connection(reader, writer)
        self._open.add(conn)
        return conn

    def _drop(self, conn: _Connection) -> None:
        self._open.discard(conn)
        conn.close()

    async def _exchange(self, conn: _Connection, request: bytes, keep: int = 0) -> tuple[Answer, bool]:
        """Sends the request and reads the answer; whether the connection can be reused."""
        reader = conn.reader
        try:
            conn.writer.write(request)
            await conn.writer.drain()
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                status, version, headers = _head(head)
                if status >= 200:
                    break  # 1xx: an interim answer, the final one follows
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise _StaleConnection() from None
            raise HttpError("the answer ended before its headers did") from None
        except (ConnectionResetError, BrokenPipeError):
            raise _StaleConnection() from None
        except asyncio.LimitOverrunError:
            raise HttpError(f"the answer's headers exceed {_HEAD_LIMIT} bytes") from None
        except OSError as exc:
            raise HttpError(f"{type(exc).__name__}: {exc}") from None
        reuse = version == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
        wanted = keep if keep and 200 <= status < 300 else 0
        # One byte more than kept: a body longer than `keep` is seen as such.
        want = TEXT_KEPT if status >= 300 else (wanted + 1 if wanted else 0)
        try:
            body, whole = await _body(reader, status, headers, want=want)
        except asyncio.IncompleteReadError:
            raise HttpError("the connection closed in the middle of the answer's body") from None
        except OSError as exc:
            raise HttpError(f"{type(exc).__name__}: {exc}") from None
        if wanted:
            if not whole or len(body) > wanted:
                raise HttpError(f"the answer's body exceeds {min(wanted, _DRAIN_AT_MOST)} bytes")
            return Answer(status, headers, "", body), reuse
        text = body[: TEXT_KEPT * 4].decode("utf-8", "replace")[:TEXT_KEPT] if body else ""
        return Answer(status, headers, text), reuse and whole

    async def aclose(self) -> None:
        for conn in list(self._open):
            self._drop(conn)
        self._idle.clear()


class _StaleConnection(Exception):
    """The connection failed before any byte of the answer."""


def _head(head: bytes) -> tuple[int, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise HttpError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(code), version, headers


async def _body(reader: asyncio.StreamReader, status: int, headers: dict[str, str], want: int) -> tuple[bytes, bool]:
    """The first `want` bytes of the body (all of it read and dropped but
    those), and whether it was read whole so that the connection can carry
    the next request."""
    if status in (204, 304):
        return b"", True
    if "chunked" in headers.get("transfer-encoding", "").lower():
        kept = bytearray()
        total = 0
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise HttpError("malformed chunked body") from None
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers
                return bytes(kept), True
            total += size
            if total > _DRAIN_AT_MOST:
                return bytes(kept), False
            chunk = await reader.readexactly(size + 2)
            if len(kept) < want:
                kept += chunk[: min(size, want - len(kept))]
    length = headers.get("content-length")
    if length is not None:
        try:
            n = int(length)
        except ValueError:
            raise HttpError(f"malformed Content-Length {length[:40]!r}") from None
        if n > _DRAIN_AT_MOST:
            return await reader.read(want) if want else b"", False
        data = await reader.readexactly(n) if n else b""
        return data[:want], True
    # Neither: the body ends with the connection.
    data = await reader.read(_DRAIN_AT_MOST)
    return data[:want], False
