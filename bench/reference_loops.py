"""Hand-written reference loops for the consumer benchmark (bench/consumer_bench.py (g)):
what a consumer costs when written by hand for one handler, without the product.

  * no database: JetStream fetch -> raw keep-alive HTTP/1.1 POST per message -> ack;
  * hand-written inbox: fetch -> ONE `INSERT ... ON CONFLICT` of the batch into a
    plain table shaped like inbox.messages (a scratch schema: plain SQL, not the
    product's functions) -> raw POST per message -> ONE `UPDATE` of the batch -> ack.

Both decode each message the way the consumer does (wire.from_nats, request_body,
the same request headers), so that the same messages become the same requests
and the same stored rows on every side: what differs is the machinery around them.
The HTTP client is a pool of raw asyncio stream connections, one request at a time
on each (keep-alive), parsing only the status line and Content-Length.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

import nats.errors
import psycopg

from pgoutbox.core import wire
from pgoutbox.inbox.handler_client import request_body, request_headers

SCHEMA = "ref_inbox"


class RawHttp:
    """`size` keep-alive HTTP/1.1 connections to one origin, one request at a time on each."""

    def __init__(self, url: str, size: int):
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname or "127.0.0.1", parts.port or 80, parts.path or "/"
        self.size = size
        self._idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
        self._all: list[asyncio.StreamWriter] = []
        self._head = f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n".encode()

    async def open(self) -> None:
        for _ in range(self.size):
            reader, writer = await asyncio.open_connection(self.host, self.port)
            self._all.append(writer)
            self._idle.put_nowait((reader, writer))

    async def post(self, body: bytes, headers: dict[str, str]) -> int:
        """The answer's status code (its body is read and dropped)."""
        request = b"".join(
            (
                self._head,
                "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode(),
                b"Content-Length: %d\r\n\r\n" % len(body),
                body,
            )
        )
        reader, writer = await self._idle.get()
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            at = head.lower().find(b"\r\ncontent-length:")
            if at >= 0:
                length = int(head[at + 17 : head.index(b"\r\n", at + 2)])
                if length:
                    await reader.readexactly(length)
        finally:
            self._idle.put_nowait((reader, writer))
        return status

    async def close(self) -> None:
        for writer in self._all:
            writer.close()


def _decode(msg, handler: str) -> tuple[dict[str, Any], bytes, dict[str, str]]:
    """The envelope, request body and request headers, as the consumer makes them."""
    envelope = wire.from_nats(msg.subject, msg.data, msg.headers)
    return envelope, request_body(envelope), request_headers(envelope, handler, msg.metadata.num_delivered)


def _stored(envelope: dict[str, Any], body: bytes) -> str:
    """The stored envelope (JSON text): the body plus the trace context, as the consumer stores it."""
    trace = json.dumps(envelope.get("trace") or {}, separators=(",", ":"))
    return f'{body[:-1].decode()},"trace":{trace}}}'


async def fetch_loop(sub, n: int, batch: int, each, pause: float = 0.0) -> tuple[float, float]:
    """Fetches until n messages went through `each(msgs)`: (msg/s, this process's CPU us per message).
    `pause`: seconds between fetches (a moderate rate's rhythm: fetches of 5, 10 ms apart, as 500/s
    with the consumer's linger brings them)."""
    done = 0
    cpu, started = time.process_time(), time.perf_counter()
    while done < n:
        try:
            msgs = await sub.fetch(batch, timeout=2)
        except (TimeoutError, nats.errors.TimeoutError):
            continue
        await each(msgs)
        done += len(msgs)
        if pause:
            await asyncio.sleep(pause)
    return n / (time.perf_counter() - started), (time.process_time() - cpu) / n * 1e6


async def no_database(sub, n: int, url: str, concurrency: int, batch: int, handler: str) -> tuple[float, float]:
    """fetch -> raw POST per message (all of a fetch at once) -> ack."""
    http = RawHttp(url, concurrency)
    await http.open()

    async def call(msg) -> None:
        _, body, headers = _decode(msg, handler)
        status = await http.post(body, headers)
        if status != 200:
            raise RuntimeError(f"handler answered {status}")
        await msg.ack()

    async def each(msgs) -> None:
        await asyncio.gather(*(call(m) for m in msgs))

    try:
        return await fetch_loop(sub, n, batch, each)
    finally:
        await http.close()


def create_schema(url: str) -> None:
    """The scratch inbox table: inbox.messages' columns, defaults, checks and indexes (no trigger)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        conn.execute(f"CREATE TABLE IF NOT EXISTS {SCHEMA}.messages (LIKE inbox.messages INCLUDING ALL)")


# One statement per batch each way; ON CONFLICT as inbox.receive_batch does: a row
# seen before counts one more delivery unless it is settled, and only the rows
# inserted or counted come back to be processed (the rest are duplicates).
_INSERT = f"""
INSERT INTO {SCHEMA}.messages AS m (message_id, handler, subject, envelope)
SELECT i.id, %s, i.subject, i.envelope
FROM unnest(%b::uuid[], %b::text[], %b::jsonb[]) AS i (id, subject, envelope)
ON CONFLICT (message_id, handler) DO UPDATE SET attempts = m.attempts + 1
WHERE m.status IN ('RECEIVED', 'FAILED')
RETURNING m.message_id::text
"""
_UPDATE = f"""
UPDATE {SCHEMA}.messages SET status = 'PROCESSED', processed_at = greatest(now(), received_at)
WHERE handler = %s AND message_id = ANY(%b::uuid[]) AND status IN ('RECEIVED', 'FAILED')
"""


async def hand_written_inbox(
    sub, n: int, url: str, database_url: str, concurrency: int, batch: int, handler: str, pause: float = 0.0
) -> tuple[float, float]:
    """fetch -> ONE INSERT ... ON CONFLICT (committed) -> raw POST per message -> ONE UPDATE (committed) -> ack."""
    http = RawHttp(url, concurrency)
    await http.open()
    conn = await psycopg.AsyncConnection.connect(database_url, autocommit=True)

    async def call(msg, body: bytes, headers: dict[str, str]) -> str | None:
        status = await http.post(body, headers)
        return headers["Idempotency-Key"] if status == 200 else None

    async def each(msgs) -> None:
        decoded = [_decode(m, handler) for m in msgs]
        ids = [e["message_id"] for e, _, _ in decoded]
        cur = await conn.execute(
            _INSERT, (handler, ids, [e["subject"] for e, _, _ in decoded], [_stored(e, b) for e, b, _ in decoded])
        )
        todo = {row[0] for row in await cur.fetchall()}
        work = [call(m, b, h) for m, (e, b, h) in zip(msgs, decoded, strict=True) if e["message_id"] in todo]
        processed = [i for i in await asyncio.gather(*work) if i is not None]
        if len(processed) != len(work):
            raise RuntimeError("the handler refused a call")
        if processed:
            await conn.execute(_UPDATE, (handler, processed))
        for m in msgs:
            await m.ack()

    try:
        return await fetch_loop(sub, n, batch, each, pause)
    finally:
        await conn.close()
        await http.close()
