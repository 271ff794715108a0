"""A handler of format "batch" (inbox/batch.py) with real processes:
`pgoutbox consume` on the defaults as a login in pgoutbox_consumer only, a
real PostgreSQL and nats-server, a real HTTP batch handler
(support.batch.BatchHandler): every message handled once in requests of
many; a 422 and a 500 in one batch each their own message's outcome (a dead
letter with its notice; a failure counted and retried), the others
processed; a key's messages in stream order, never two requests in flight
with one key; a 503 for the whole batch (the handler away) delays only,
counting no failure."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psycopg
import pytest

from support.batch import BatchHandler
from support.inbox import add_stream, dlq_messages, event, jetstream, publish, write_registry
from support.roles import login
from support.waiting import wait_for
from support.workers import worker

H = "billing_batch"


def _publish(nats_url: str, events: list[dict]) -> None:
    async def go() -> None:
        async with jetstream(nats_url) as js:
            await add_stream(js)
            for ev in events:
                await publish(js, ev)

    asyncio.run(go())


def _statuses(database_url: str) -> Counter:
    with psycopg.connect(database_url, autocommit=True) as conn:
        return Counter(
            dict(conn.execute("SELECT status, count(*) FROM inbox.messages WHERE handler = %s GROUP BY 1", (H,)))
        )


def _rows(database_url: str) -> dict[str, dict]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT message_id::text, status, last_error, dlq_metadata FROM inbox.messages WHERE handler = %s", (H,)
        ).fetchall()
    return {r[0]: {"status": r[1], "last_error": r[2], "dlq_metadata": r[3] or {}} for r in rows}


def _consume(tmp_path: Path, database_url: str, nats_url: str, url: str):
    spec = {"name": H, "url": url, "subjects": ["sea.event.order_created.v1"]}
    spec["format"] = "batch"  # not default: the format under test
    registry_file = write_registry(tmp_path, [spec])
    return worker(
        tmp_path,
        "consume",
        '"consumer started"',
        OUTBOX_DATABASE_URL=login(database_url, "pgoutbox_consumer"),
        OUTBOX_NATS_URL=nats_url,
        OUTBOX_REGISTRY_FILE=str(registry_file),
        OUTBOX_CONSUMER_HTTP_PORT="0",  # any free port: tests run side by side
    )


def test_a_batch_handler_gets_every_message_once_in_requests_of_many(database_url, nats_server, tmp_path):
    events = [event({"n": i}) for i in range(60)]
    ids = [ev["event_id"] for ev in events]
    _publish(nats_server.url, events)  # a backlog before the consumer starts: its fetches are full
    handler = BatchHandler()
    try:
        with _consume(tmp_path, database_url, nats_server.url, handler.url):
            wait_for(
                lambda: _statuses(database_url).get("PROCESSED") == len(ids),
                60,
                "every message processed",
                detail=lambda: f"{_statuses(database_url)}",
            )
        assert [handler.handled(i) for i in ids] == [1] * len(ids)
        sent = [m for r in handler.requests for m in r.message_ids]
        assert sorted(sent) == sorted(ids)
        assert max(len(r.message_ids) for r in handler.requests) > 1, "no request carried more than one message"
        assert len(handler.requests) < len(ids)
        assert all(r.headers["Pgoutbox-Handler"] == H for r in handler.requests)
        assert all(r.headers["Pgoutbox-Batch-Size"] == str(len(r.message_ids)) for r in handler.requests)
    finally:
        handler.close()


def test_a_422_and_a_500_in_one_batch_are_their_own_messages_outcomes(database_url, nats_server, tmp_path):
    poison = event({"answers": [422]})
    flaky = event({"answers": [500, 200]})
    fine = [event({"n": i}) for i in range(4)]
    _publish(nats_server.url, [fine[0], poison, fine[1], flaky, fine[2], fine[3]])
    handler = BatchHandler()
    try:
        with _consume(tmp_path, database_url, nats_server.url, handler.url):
            wait_for(
                lambda: _statuses(database_url) == Counter({"PROCESSED": 5, "DEAD_LETTER": 1}),
                60,
                "five processed and one dead letter",
                detail=lambda: f"{_statuses(database_url)}",
            )
            dlq = asyncio.run(_dlq(nats_server.url))
        first = handler.requests[0].message_ids
        assert poison["event_id"] in first and flaky["event_id"] in first  # one batch held both
        rows = _rows(database_url)
        assert rows[poison["event_id"]]["status"] == "DEAD_LETTER"
        assert rows[poison["event_id"]]["last_error"].startswith("HTTP 422")
        assert rows[flaky["event_id"]]["status"] == "PROCESSED"
        assert rows[flaky["event_id"]]["dlq_metadata"].get("failures") == 1
        assert handler.handled(flaky["event_id"]) == 2  # the 500, then the 200 of its retry
        assert handler.handled(poison["event_id"]) == 1
        for ev in fine:
            assert handler.handled(ev["event_id"]) == 1
            assert not rows[ev["event_id"]]["dlq_metadata"].get("failures")
        assert [m.headers["Nats-Msg-Id"].split(":")[0] for m in dlq] == [poison["event_id"]]  # its notice only
    finally:
        handler.close()


async def _dlq(nats_url: str) -> list:
    async with jetstream(nats_url) as js:
        return await dlq_messages(js, subject="sea.dlq.dead.")


def test_a_keys_messages_reach_the_batch_handler_in_stream_order_never_two_at_once(database_url, nats_server, tmp_path):
    keys = [f"order-{k}" for k in range(5)]
    events = []
    for i in range(100):  # more than two fetches (batch_size 32): batches wait for each other
        ev = event({"n": i})
        ev["ordering_key"] = keys[i % len(keys)]
        events.append(ev)
    _publish(nats_server.url, events)
    # Each request takes a while, so that the two batches the defaults allow
    # in flight (concurrency 64, batch_size 32) would overlap if they could.
    handler = BatchHandler(delay=0.2)
    try:
        with _consume(tmp_path, database_url, nats_server.url, handler.url):
            wait_for(
                lambda: _statuses(database_url).get("PROCESSED") == len(events),
                60,
                "every message processed",
                detail=lambda: f"{_statuses(database_url)}",
            )
        assert handler.overlaps == []
        for key in keys:
            published = [ev["event_id"] for ev in events if ev["ordering_key"] == key]
            seen = [m for r in handler.requests for m, k in zip(r.message_ids, r.keys, strict=True) if k == key]
            assert seen == published, key
    finally:
        handler.close()


def test_a_batch_answered_503_delays_its_messages_and_counts_no_failure(database_url, nats_server, tmp_path):
    events = [event({"n": i}) for i in range(10)]
    _publish(nats_server.url, events)
    handler = BatchHandler(whole=503)
    try:
        with _consume(tmp_path, database_url, nats_server.url, handler.url):
            # The first call, then the gate's probes (one message each): all away.
            wait_for(lambda: handler.answered.count(503) >= 3, 60, "three batches answered 503")
            rows = _rows(database_url)
            assert {r["status"] for r in rows.values()} == {"RECEIVED"}
            assert not any(r["dlq_metadata"].get("failures") for r in rows.values())
            handler.whole = None
            wait_for(
                lambda: _statuses(database_url).get("PROCESSED") == len(events),
                90,  # the probe's pause grows from 0.5 s, doubling: the third is 2 s
                "every message processed once the handler answers",
                detail=lambda: f"{_statuses(database_url)}",
            )
        rows = _rows(database_url)
        assert not any(r["dlq_metadata"].get("failures") for r in rows.values())
        assert [handler.handled(ev["event_id"]) for ev in events] == [1] * len(events)
        assert asyncio.run(_dlq(nats_server.url)) == []
    finally:
        handler.close()


class _Answering:
    """A batch handler that answers every request with answer(message ids) as a 200's body."""

    def __init__(self, answer):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"]
                out = answer([item["envelope"]["message_id"] for item in items])
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/batch"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _failed_rows(database_url: str, count: int) -> dict[str, dict] | None:
    """The handler's rows once `count` of them recorded a failure."""
    rows = _rows(database_url)
    return rows if sum(1 for r in rows.values() if r["dlq_metadata"].get("failures")) >= count else None


@pytest.mark.parametrize(
    "answer",
    [
        lambda ids: b"not json",
        lambda ids: b'{"results": []}',
        lambda ids: json.dumps({"results": [{"message_id": m, "status": 200} for m in reversed(ids)]}).encode(),
    ],
    ids=["not-json", "no-result", "out-of-order"],
)
def test_a_malformed_batch_answer_is_each_messages_coded_failure(database_url, nats_server, tmp_path, answer):
    events = [event({"n": i}) for i in range(3)]
    _publish(nats_server.url, events)
    handler = _Answering(answer)
    try:
        with _consume(tmp_path, database_url, nats_server.url, handler.url):
            rows = wait_for(lambda: _failed_rows(database_url, len(events)), 60, "each message's failure recorded")
        assert len(rows) == len(events)
        for row in rows.values():
            assert "BATCH_ANSWER_MALFORMED [OB063]" in row["last_error"], row["last_error"]
    finally:
        handler.close()


def test_an_unreadable_result_is_only_its_messages_coded_failure(database_url, nats_server, tmp_path):
    events = [event({"n": i}) for i in range(3)]
    bad = events[1]["event_id"]
    _publish(nats_server.url, events)

    def answer(ids: list[str]) -> bytes:
        return json.dumps({"results": [{"message_id": m, "status": "ok" if m == bad else 200} for m in ids]}).encode()

    handler = _Answering(answer)
    try:
        with _consume(tmp_path, database_url, nats_server.url, handler.url):
            rows = wait_for(lambda: _failed_rows(database_url, 1), 60, "the unreadable result's failure recorded")
            wait_for(lambda: _statuses(database_url).get("PROCESSED") == len(events) - 1, 60, "the others processed")
        assert "BATCH_RESULT_INVALID [OB064]" in rows[bad]["last_error"], rows[bad]
        assert [m for m, r in rows.items() if r["dlq_metadata"].get("failures")] == [bad]
    finally:
        handler.close()
