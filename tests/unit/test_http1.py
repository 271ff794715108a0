"""The consumer's HTTP/1.1 client against real sockets: a server that
answers each request with raw bytes the test chooses, so that every framing
the client must read (Content-Length, chunked, to the end of the
connection, interim 1xx) and every way a connection ends is exercised."""

from __future__ import annotations

import asyncio

import pytest

from pgoutbox.inbox.handler_client import HandlerClient
from pgoutbox.inbox.http1 import FRESH_AT_ONCE, Http1Pool, HttpError, Target


class RawServer:
    """Answers the n-th request on each connection with answers[...]: bytes,
    "close" (close without answering) or "hang"."""

    def __init__(self, answers: list):
        self.answers = list(answers)
        self.requests: list[bytes] = []
        self.connections = 0
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/events?x=1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.tasks.append(asyncio.current_task())  # type: ignore[arg-type]
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(
                    next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
                )
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
                if answer == "close":
                    break
                if answer == "hang":
                    await asyncio.sleep(5)
                    break
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer or b"HTTP/1.0" in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        writer.close()


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def _post(pool: Http1Pool, url: str, timeout: float = 2.0):
    return await pool.post(Target.parse(url), b'{"a":1}', b"Content-Type: application/json\r\n", timeout)


async def test_a_kept_alive_connection_carries_every_request_and_the_request_is_complete():
    async with RawServer([OK]) as server:
        pool = Http1Pool(4, 4.0)
        answers = [await _post(pool, server.url) for _ in range(3)]
        await pool.aclose()
    assert [a.status for a in answers] == [200, 200, 200]
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /events?x=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Content-Length: 7\r\n" in first and first.endswith(b'\r\n\r\n{"a":1}')


@pytest.mark.parametrize(
    "raw, status, text, reused",
    [
        (
            b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nbad \r\n3;x=y\r\nday\r\n0\r\n\r\n",
            500,
            "bad day",
            True,
        ),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n", 204, "", True),
        (b"HTTP/1.1 422 No\r\nContent-Length: 4\r\nConnection: close\r\n\r\nnope", 422, "nope", False),
        (b"HTTP/1.0 503 Busy\r\n\r\nuntil the end", 503, "until the end", False),
        (b"HTTP/1.1 429 Slow\r\nRetry-After: 3\r\nContent-Length: 0\r\n\r\n", 429, "", True),
    ],
)
async def test_every_framing_is_read_whole_and_the_connection_kept_only_when_it_can_be(raw, status, text, reused):
    async with RawServer([raw, OK]) as server:
        pool = Http1Pool(4, 4.0)
        first = await _post(pool, server.url)
        second = await _post(pool, server.url)
        await pool.aclose()
    assert (first.status, first.text) == (status, text)
    assert second.status == 200
    assert server.connections == (1 if reused else 2)


async def test_a_connection_the_server_closed_while_idle_is_replaced_once():
    async with RawServer([OK, "close", OK]) as server:
        pool = Http1Pool(4, 4.0)
        assert (await _post(pool, server.url)).status == 200
        assert (await _post(pool, server.url)).status == 200  # closed without answering: sent again
        await pool.aclose()
    assert server.connections == 2 and len(server.requests) == 3


async def test_a_new_connection_closed_without_an_answer_is_an_error_not_a_loop():
    async with RawServer(["close"]) as server:
        pool = Http1Pool(4, 4.0)
        with pytest.raises(HttpError, match="closed the connection without answering"):
            await _post(pool, server.url)
        await pool.aclose()
    assert server.connections == 1


async def test_a_hanging_handler_times_out_and_its_connection_is_not_reused():
    async with RawServer(["hang", OK]) as server:
        pool = Http1Pool(4, 4.0)
        with pytest.raises(TimeoutError):
            await _post(pool, server.url, timeout=0.2)
        assert (await _post(pool, server.url)).status == 200
        await pool.aclose()
    assert server.connections == 2


async def test_malformed_answers_are_errors():
    async with RawServer([b"SSH-2.0-OpenSSH\r\n\r\n"]) as server:
        pool = Http1Pool(4, 4.0)
        with pytest.raises(HttpError, match="not an HTTP/1.x answer"):
            await _post(pool, server.url)
        await pool.aclose()


async def test_the_handler_client_reports_answers_timeouts_and_refusals():
    async with RawServer([b"HTTP/1.1 503 Busy\r\nRetry-After: 2\r\nContent-Length: 5\r\n\r\nlater", "hang"]) as server:
        client = HandlerClient(per_origin=2)
        envelope = {"message_id": "0b6f3b4e-8c3c-4f55-9e7b-0b6f3b4e8c3c", "trace": {"traceparent": "00-ab-cd-01"}}
        busy = await client.call(server.url, b"{}", envelope, handler="billing", delivery=2, timeout=1)
        slow = await client.call(server.url, b"{}", envelope, handler="billing", delivery=3, timeout=0.2)
        await client.aclose()
    refused = await HandlerClient().call(
        "http://127.0.0.1:9/", b"{}", envelope, handler="billing", delivery=1, timeout=1
    )
    assert (busy.status, busy.retry_after, busy.summary) == (503, 2.0, "HTTP 503: later")
    assert b"Pgoutbox-Delivery: 2\r\n" in server.requests[0] and b"traceparent: 00-ab-cd-01\r\n" in server.requests[0]
    assert (slow.status, slow.summary) == (None, "timeout after 0.2s")
    assert refused.status is None and refused.summary.startswith("connection error: ConnectionRefusedError")


async def test_a_burst_of_calls_opens_new_connections_a_few_at_a_time():
    """17 calls at once (a consumer starting on a backlog: concurrency 16 + 1)
    open at most FRESH_AT_ONCE connections before one of them answers: a
    burst of 17 handshakes overflowed the listen backlog of a handler on
    Python's http.server (5), the kernel retransmitted the dropped ones 1 s,
    3 s later, the request reached the handler after the consumer's timeout,
    and the handler was called twice (tests/upgrade/test_rolling_upgrade.py)."""
    release = asyncio.Event()
    accepted: list[int] = []
    requests: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(len(accepted))
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                requests.append(head + await reader.readexactly(7))
                await release.wait()
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/events"
    pool = Http1Pool(17, 4.0)
    calls = [asyncio.create_task(_post(pool, url, timeout=30)) for _ in range(17)]
    while len(requests) < FRESH_AT_ONCE:  # every fresh connection has sent its request
        await asyncio.sleep(0.01)
    for _ in range(20):  # and no call opens one more while none has answered
        await asyncio.sleep(0)
    assert len(accepted) == FRESH_AT_ONCE
    release.set()
    answers = await asyncio.gather(*calls)
    await pool.aclose()
    server.close()
    assert [a.status for a in answers] == [200] * 17
    assert len(requests) == 17  # each request sent once
    assert FRESH_AT_ONCE <= len(accepted) <= 17


async def test_no_connection_is_away_and_a_broken_answer_is_not():
    with pytest.raises(HttpError) as refused:
        await _post(Http1Pool(4, 4.0), "http://127.0.0.1:9/")
    with pytest.raises(HttpError) as unresolved:
        await _post(Http1Pool(4, 4.0), "http://no-such-host.invalid/")
    async with RawServer(["close"]) as server:
        pool = Http1Pool(4, 4.0)
        with pytest.raises(HttpError) as reset:
            await _post(pool, server.url)
        await pool.aclose()
    async with RawServer([b"SSH-2.0-OpenSSH\r\n\r\n"]) as server:
        pool = Http1Pool(4, 4.0)
        with pytest.raises(HttpError) as malformed:
            await _post(pool, server.url)
        await pool.aclose()
    assert refused.value.away and unresolved.value.away and reset.value.away
    assert not malformed.value.away


async def test_waiting_for_a_place_to_connect_is_not_the_handlers_time():
    """8 calls at once, each answered after 1 s, with a timeout of 1.8 s:
    the 4 that wait for a fresh connection to answer (1 s) then take 1 s of
    the handler's time, within their timeout, which runs from when they have
    a connection."""
    held = 1.0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(7)
                await asyncio.sleep(held)  # the handler's time
                writer.write(OK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/events"
    pool = Http1Pool(8, 4.0)
    answers = await asyncio.gather(*(_post(pool, url, timeout=1.8) for _ in range(2 * FRESH_AT_ONCE)))
    await pool.aclose()
    server.close()
    assert [a.status for a in answers] == [200] * 2 * FRESH_AT_ONCE


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n0123\r\n6\r\n456789\r\n0\r\n\r\n",
    ],
)
async def test_a_kept_2xx_body_is_returned_whole_and_one_longer_than_kept_is_an_error(raw):
    """A batch handler's results (post's keep): all of a 2xx body up to keep
    bytes; a longer one is a broken answer, never a cut one read as results."""
    async with RawServer([raw]) as server:
        pool = Http1Pool(4, 4.0)
        target = Target.parse(server.url)
        whole = await pool.post(target, b"{}", b"", 2.0, keep=10)
        plain = await pool.post(target, b"{}", b"", 2.0)  # not asked for: nothing kept
        with pytest.raises(HttpError, match="exceeds 9 bytes"):
            await pool.post(target, b"{}", b"", 2.0, keep=9)
        await pool.aclose()
    assert (whole.status, whole.body) == (200, b"0123456789")
    assert (plain.status, plain.body, plain.text) == (200, b"", "")
