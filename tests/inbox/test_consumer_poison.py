"""No single message stops the consumer: DLQ
notices that fit under max_payload, a connection the server closes
re-established, foreign producers' messages processed with a well-formed
envelope or sent to `.invalid` with a reason naming the culprit, start-up
that waits for the servers and stops on a signal, /readyz that follows
PostgreSQL. Real nats-server, PostgreSQL and HTTP handler throughout."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psycopg
import pytest
from nats.js.api import StreamConfig

from harness.tcp_proxy import TcpProxy
from pgoutbox.cli import main as cli
from pgoutbox.core import migrate, wire
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from pgoutbox.outbox.publisher import message_size
from support.inbox import (
    add_stream,
    consumer_config,
    dlq_messages,
    event,
    inbox_row,
    jetstream,
    publish,
    running_consumer,
    write_registry,
)
from support.roles import login
from support.schema import newer_schema
from support.waiting import until

H = "billing"
SUBJECT = "sea.event.order_created.v1"
MAX_PAYLOAD = 64 * 1024


@pytest.fixture
def small_nats(tmp_path):
    """A nats-server whose max_payload is 64 KiB: payloads near it stay cheap."""
    conf = tmp_path / "small-nats.conf"
    conf.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    server = EmbeddedNats(tmp_path / "small-nats", extra_args=["-c", str(conf)])
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_pg():
    """A PostgreSQL of this test's own, since the test stops it."""
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-consumer-pg-"))
    server = EmbeddedPostgres(root, settings={"fsync": "off"})
    server.start()
    with psycopg.connect(server.url, autocommit=True) as conn:
        migrate.migrate(conn)
    yield server
    server.stop("immediate")
    shutil.rmtree(root, ignore_errors=True)


def _get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _registry(tmp_path, url: str) -> Path:
    return write_registry(tmp_path, [{"name": H, "url": url, "subjects": [SUBJECT]}])


def _padded_event(size: int, answers: list) -> dict:
    """An event whose message (payload and headers) takes exactly `size` bytes."""
    ev = event({"answers": answers, "pad": ""})
    _, body, headers = wire.to_nats(ev)
    ev["payload"]["pad"] = "p" * (size - message_size(body, headers))
    _, body, headers = wire.to_nats(ev)
    assert message_size(body, headers) == size
    return ev


def _row(database_url: str, message_id: str) -> dict:
    return inbox_row(database_url, message_id, H) or {}


async def _acked(js, count: int) -> bool:
    return (await js.consumer_info("SEA_EVENTS", H)).ack_floor.stream_seq == count


# -- point 2: the DLQ and the connection ---------------------------------------


async def test_a_422_for_a_payload_just_under_max_payload_gets_a_notice_that_fits_and_consuming_goes_on(
    tmp_path, database_url, small_nats, handler
):
    cfg = consumer_config(
        database_url,
        small_nats.url,
        _registry(tmp_path, handler.url),
        # not default: the test is about the replay of this dead letter: due at once, looked for every 100 ms
        replay_base_delay="50ms",
        replay_max_delay="50ms",
        replay_poll_interval="100ms",
    )
    big = _padded_event(MAX_PAYLOAD - 40, [422])
    after = event()
    async with jetstream(small_nats.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            connection = consumer.nc
            await publish(js, big)
            # Dead-lettered, then its replay (larger than max_payload with the replay
            # headers) refused for good and parked with a code: not retried pass after pass.
            await until(
                lambda: (_row(database_url, big["event_id"]).get("last_error") or "").startswith(
                    "REPLAY_UNPUBLISHABLE: MAX_PAYLOAD"
                ),
                15,
                "the replay to be refused with its code",
            )
            await publish(js, after)
            await until(lambda: _row(database_url, after["event_id"]).get("status") == "PROCESSED", 10)
            assert consumer.nc is connection and connection.is_connected, "the connection was never lost"
            [notice] = await dlq_messages(js, subject=f"sea.dlq.dead.{H}.order_created.v1")
            original = await js.get_msg("SEA_EVENTS", 1)
            # An operator's redrive is refused the same way, with the same code.
            db = ["--database-url", login(database_url, "pgoutbox_admin")]
            assert await asyncio.to_thread(cli.main, ["redrive", H, big["event_id"], "--reason", "try", *db]) == 0
            await until(
                lambda: (
                    (_row(database_url, big["event_id"])["dlq_metadata"] or {}).get("redrives") == 1
                    and _row(database_url, big["event_id"])["status"] == "DEAD_LETTER"
                ),
                10,
            )
    assert message_size(notice.data, notice.headers) <= MAX_PAYLOAD
    body = json.loads(notice.data)
    assert body["message_id"] == big["event_id"] and body["reason"].startswith("HTTP 422")
    assert body["envelope"] is None and "max_payload" in body["envelope_omitted"]
    assert (body["stream"], body["stream_sequence"]) == ("SEA_EVENTS", 1)
    assert original.headers["Nats-Msg-Id"] == big["event_id"]  # where the notice points
    row = _row(database_url, big["event_id"])
    assert row["status"] == "DEAD_LETTER" and row["envelope"]["payload"] == big["payload"]  # kept whole
    assert row["last_error"].startswith("REPLAY_UNPUBLISHABLE: MAX_PAYLOAD")
    assert row["dlq_metadata"]["next_replay_at"] is None
    assert len(handler.calls_for(big["event_id"])) == 1 and len(handler.calls_for(after["event_id"])) == 1


async def test_a_notice_jetstream_refuses_as_too_large_is_replaced_by_one_referencing_the_original(
    tmp_path, database_url, nats_server, handler
):
    cfg = consumer_config(database_url, nats_server.url, _registry(tmp_path, handler.url))
    ev = _padded_event(8000, [422])
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        # An operator's DLQ stream with a small max_msg_size: the consumer keeps it.
        await js.add_stream(StreamConfig(name="SEA_DLQ", subjects=["sea.dlq.>"], max_msg_size=4096))
        async with running_consumer(cfg):
            await publish(js, ev)
            await until(lambda: _acked(js, 1), 10, "the message to be acknowledged")
            [notice] = await dlq_messages(js)
    body = json.loads(notice.data)
    assert body["envelope"] is None and "JetStream refused" in body["envelope_omitted"]
    assert (body["stream"], body["stream_sequence"]) == ("SEA_EVENTS", 1)
    row = _row(database_url, ev["event_id"])
    assert row["status"] == "DEAD_LETTER" and row["last_error"].startswith("HTTP 422")


async def test_a_dlq_publish_that_can_never_succeed_is_recorded_with_a_code_and_acked(
    tmp_path, database_url, nats_server, handler
):
    cfg = consumer_config(database_url, nats_server.url, _registry(tmp_path, handler.url))
    doomed, after = event({"answers": [422]}), event()
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg):
            await js.delete_stream("SEA_DLQ")  # no stream captures the notices any more
            await publish(js, doomed)
            await until(lambda: _acked(js, 1), 10, "the dead letter to be acknowledged")
            await publish(js, after)
            await until(lambda: _row(database_url, after["event_id"]).get("status") == "PROCESSED", 10)
    row = _row(database_url, doomed["event_id"])
    assert row["status"] == "DEAD_LETTER"
    assert row["last_error"].startswith("DLQ_UNPUBLISHABLE: NO_STREAM: ") and "HTTP 422" in row["last_error"]
    assert len(handler.calls_for(doomed["event_id"])) == 1


async def test_a_connection_the_server_closes_is_re_established_and_healthz_says_so_meanwhile(
    tmp_path, database_url, nats_server, handler
):
    proxy = TcpProxy(nats_server.port)
    cfg = consumer_config(database_url, proxy.url, _registry(tmp_path, handler.url), http_port="0")
    before, after = event(), event()
    try:
        async with jetstream(nats_server.url) as js:
            await add_stream(js)
            async with running_consumer(cfg) as consumer:
                port, first = consumer.health.port, consumer.nc
                await publish(js, before)
                await until(lambda: consumer.metrics.value(H, "processed") == 1, 10)
                assert (await asyncio.to_thread(_get, port, "/healthz"))[0] == 200
                proxy.open.clear()  # NATS unreachable for new connections for a while
                # A message the client lets through (payload within max_payload) and the
                # server refuses (headers included it is not): -ERR, connection closed.
                await first.publish("sea.elsewhere", b"x" * (first.max_payload - 8), headers={"Pad": "y" * 64})
                # nats-py closes the connection when it reads the -ERR first, and
                # reconnects by itself when it sees the socket's end first: both happen.
                await until(lambda: first.is_closed or first.is_reconnecting, 10, "the server to drop the connection")
                closed = first.is_closed
                status, health = await asyncio.to_thread(_get, port, "/healthz")
                # Both sides of the race are checked: closed, the consumer re-establishes the
                # connection and /healthz says so meanwhile; reconnecting, nats-py does it by
                # itself and the process is alive (unless it has closed since).
                if closed or first.is_closed:
                    assert status == 503 and "NATS connection closed (being re-established)" in health["problems"]
                else:
                    assert status == 200, health
                status, ready = await asyncio.to_thread(_get, port, "/readyz")
                assert status == 503 and "not connected to NATS" in ready["problems"]
                proxy.open.set()
                await until(
                    lambda: (
                        (consumer.nc is not first or not closed)
                        and consumer.nc.is_connected
                        and consumer.problems() == []
                    ),
                    15,
                    "the connection to be re-established",
                )
                assert (await asyncio.to_thread(_get, port, "/healthz"))[0] == 200
                await publish(js, after)
                await until(lambda: _row(database_url, after["event_id"]).get("status") == "PROCESSED", 10)
    finally:
        proxy.close()


async def test_healthz_fails_when_a_fetch_loop_is_dead(tmp_path, database_url, nats_server, handler):
    cfg = consumer_config(database_url, nats_server.url, _registry(tmp_path, handler.url), http_port="0")
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            assert (await asyncio.to_thread(_get, consumer.health.port, "/healthz"))[0] == 200
            loop = consumer._loops[0]
            loop.cancel()
            # The loop has ended, not a pause that may fall short; bounded, so
            # that a cancellation the loop loses fails here rather than hangs.
            await asyncio.wait_for(asyncio.gather(loop, return_exceptions=True), 30)
            status, health = await asyncio.to_thread(_get, consumer.health.port, "/healthz")
    assert status == 503 and health["problems"] == ["1 fetch loop(s) ended"]


# -- point 3: foreign producers -------------------------------------------------


async def _foreign(tmp_path, database_url, nats_url, handler, messages, *, processed: int = 0, later=()):
    """Publishes raw (subject, body, headers) messages, then, once they are
    handled, `later` ones; returns once every one is acknowledged: the
    handler's calls, the `.invalid` reasons by stream sequence, the inbox rows."""
    cfg = consumer_config(database_url, nats_url, _registry(tmp_path, handler.url))
    async with jetstream(nats_url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:

            def handled() -> float:
                return sum(consumer.metrics.value(H, o) for o in ("invalid", "processed", "duplicate"))

            for batch, total in ((messages, len(messages)), (later, len(messages) + len(later))):
                for subject, body, headers in batch:
                    await js.publish(subject, body, headers=headers)
                await until(lambda total=total: handled() == total, 15, "every message to be handled")
            assert consumer.metrics.value(H, "processed") == processed
            assert consumer.metrics.value(H, "duplicate") == len(later)
            invalid = {
                json.loads(m.data)["stream_sequence"]: json.loads(m.data)
                for m in await dlq_messages(js, subject=f"sea.dlq.dead.{H}.invalid")
            }
            info = await js.consumer_info("SEA_EVENTS", H)
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT message_id::text, envelope FROM inbox.messages ORDER BY received_at").fetchall()
    assert info.num_ack_pending == 0 and info.num_pending == 0, "every event-stream message acked"
    return handler.calls, invalid, rows


async def test_message_ids_are_canonical_uuid_text_or_refused_never_dropped(
    tmp_path, database_url, nats_server, handler
):
    good = uuid.uuid4()
    refused = [
        f"{{{good}}}",
        f"urn:uuid:{good}",
        good.hex,
        str(good)[:9] + "-" + str(good)[9:],
        str(good)[:-1] + "g",
        f"{good}:extra",
        "",
        "x" * 500,
    ]
    messages = [(SUBJECT, b'{"n": 1}', {"Nats-Msg-Id": str(good).upper()})]
    messages += [(SUBJECT, b'{"n": 2}', {"Nats-Msg-Id": value}) for value in refused]
    messages.append((SUBJECT, b'{"n": 3}', None))
    same = [(SUBJECT, b'{"n": 1}', {"Nats-Msg-Id": str(good)})]  # the same id, in its other case: a duplicate
    calls, invalid, rows = await _foreign(
        tmp_path, database_url, nats_server.url, handler, messages, processed=1, later=same
    )
    [call] = calls
    assert call.body["message_id"] == str(good)
    assert call.headers["Idempotency-Key"] == call.headers["Pgoutbox-Message-Id"] == str(good)
    assert rows == [(str(good), {**call.body, "trace": {}})]
    assert sorted(invalid) == list(range(2, len(messages) + 1))
    for seq, notice in invalid.items():
        assert notice["reason"].startswith("INVALID_MESSAGE [OB020]: header Nats-Msg-Id"), notice["reason"]
        assert notice["raw"]["body"] == ('{"n": 2}' if seq < len(messages) else '{"n": 3}')


BAD_BODIES = [
    (b"", "body is empty"),
    (b"[1, 2]", "body is an array, not a JSON object"),
    (b"42", "body is a number, not a JSON object"),
    (b'"text"', "body is a string, not a JSON object"),
    (b"null", "body is null, not a JSON object"),
    (b"true", "body is a boolean, not a JSON object"),
    (b'{"a": "\xff"}', "body is not UTF-8 (byte 7)"),
    (b'{"a": ', "body is not JSON"),
    (b'{"a": NaN}', "body is not JSON"),
    (b'{"a": 1e999}', "body contains a number out of range"),
    (b'{"a": "x\\u0000y"}', "body contains a NUL character"),
    (b'{"a": "\\ud800"}', "body contains an unpaired surrogate"),
    (b'{"a": ' * 5000 + b"1" + b"}" * 5000, "body is JSON nested too deeply"),
]


async def test_bodies_that_are_not_json_objects_go_to_invalid_with_the_body_named(
    tmp_path, database_url, nats_server, handler
):
    messages = [(SUBJECT, body, {"Nats-Msg-Id": str(uuid.uuid4())}) for body, _ in BAD_BODIES]
    calls, invalid, rows = await _foreign(tmp_path, database_url, nats_server.url, handler, messages)
    assert calls == [] and rows == []
    for seq, (_, expected) in enumerate(BAD_BODIES, start=1):
        assert invalid[seq]["reason"].startswith(f"INVALID_MESSAGE [OB020]: {expected}"), invalid[seq]["reason"]


async def test_the_subject_gives_context_type_and_version_and_contradicting_headers_are_refused(
    tmp_path, database_url, nats_server, handler
):
    def msg(headers: dict) -> tuple:
        return SUBJECT, b'{"n": 1}', {"Nats-Msg-Id": str(uuid.uuid4()), **headers}

    agreeing = msg({"pgoutbox-context": "sea", "PGOUTBOX-EVENT-TYPE": "order_created", "Pgoutbox-Event-Version": "1"})
    bare = msg({})
    # Values pass through as sent, control characters and non-ASCII included.
    odd = msg({"Pgoutbox-Aggregate-Id": "a\x01b\x1fc\x7f", "Pgoutbox-Tenant-Id": "ténant ☃"})
    odd = (
        odd[0],
        json.dumps({"text": "tab\there\x01\x1f\u2028\U0001f600", "n": 12345678901234567890}).encode(),
        odd[2],
    )
    contradicting = [
        ({"Pgoutbox-Context": "land"}, "header Pgoutbox-Context 'land' contradicts the subject ('sea')"),
        ({"pgoutbox-context": "land"}, "header pgoutbox-context 'land' contradicts the subject ('sea')"),
        ({"Pgoutbox-Event-Type": "order_paid"}, "header Pgoutbox-Event-Type 'order_paid' contradicts"),
        ({"Pgoutbox-Event-Version": "2"}, "header Pgoutbox-Event-Version '2' contradicts the subject (1)"),
        ({"Pgoutbox-Event-Version": "v1"}, "header Pgoutbox-Event-Version 'v1' contradicts the subject (1)"),
        ({"Pgoutbox-Context": "sea", "pgoutbox-context": "land"}, "headers Pgoutbox-Context and pgoutbox-context"),
        ({"Pgoutbox-Aggregate-Id": "a\x00b"}, "header Pgoutbox-Aggregate-Id contains a NUL character"),
        ({"traceparent": "00-\x01"}, "header traceparent '00-\\x01' has characters an HTTP header cannot carry"),
    ]
    messages = [agreeing, bare, odd] + [msg(headers) for headers, _ in contradicting]
    calls, invalid, rows = await _foreign(tmp_path, database_url, nats_server.url, handler, messages, processed=3)
    by_id = {c.message_id: c.body for c in calls}
    for sent in (agreeing, bare, odd):
        body = by_id[sent[2]["Nats-Msg-Id"]]
        assert (body["context"], body["event_type"], body["event_version"]) == ("sea", "order_created", 1)
    assert by_id[bare[2]["Nats-Msg-Id"]]["aggregate_id"] is None
    odd_body = by_id[odd[2]["Nats-Msg-Id"]]
    assert odd_body["aggregate_id"] == "a\x01b\x1fc\x7f" and odd_body["tenant_id"] == "ténant ☃"
    assert odd_body["payload"] == json.loads(odd[1])
    for seq, (_, expected) in enumerate(contradicting, start=4):
        assert invalid[seq]["reason"].startswith(f"INVALID_MESSAGE [OB020]: {expected}"), invalid[seq]["reason"]


async def test_a_replay_whose_original_subject_does_not_parse_or_is_not_the_handlers_goes_to_invalid(
    tmp_path, database_url, nats_server, handler
):
    cfg = consumer_config(database_url, nats_server.url, _registry(tmp_path, handler.url))
    originals = ["sea.event.order created.v1", "garbage", "sea.event.order_created.v0", "sea.event.order_paid.v1", None]
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            for original in originals:
                headers = {"Nats-Msg-Id": f"{uuid.uuid4()}:replay:{H}:0:abcd"}
                if original is not None:
                    headers["Pgoutbox-Original-Subject"] = original
                await js.publish(f"sea.dlq.replay.{H}", b'{"n": 1}', headers=headers)
            await until(lambda: consumer.metrics.value(H, "invalid") == len(originals), 10)
            notices = await dlq_messages(js, subject=f"sea.dlq.dead.{H}.invalid")
    reasons = [json.loads(m.data)["reason"] for m in notices]
    assert handler.calls == []
    assert reasons == [
        "INVALID_MESSAGE [OB020]: subject 'sea.event.order created.v1' is not {context}.event.{event_type}.v{version}",
        "INVALID_MESSAGE [OB020]: subject 'garbage' is not {context}.event.{event_type}.v{version}",
        "INVALID_MESSAGE [OB020]: subject 'sea.event.order_created.v0' is not {context}.event.{event_type}.v{version}",
        f"INVALID_MESSAGE [OB020]: subject 'sea.event.order_paid.v1' is not one handler {H} consumes",
        "INVALID_MESSAGE [OB020]: header Pgoutbox-Original-Subject is missing on a replay",
    ]


# -- point 6: start-up, signals, readiness ---------------------------------------


def _command(args: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    out = open(log_path, "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "pgoutbox.cli.main", *args], env={**clean, **env}, stdout=out, stderr=subprocess.STDOUT
    )


def _wait_for_text(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in {path.read_text(errors='replace')!r}")
        time.sleep(0.05)


@pytest.mark.parametrize(
    "command, down, sig",
    [
        ("consume", "nats", signal.SIGTERM),
        ("consume", "nats", signal.SIGINT),
        ("consume", "postgres", signal.SIGTERM),
        ("replay", "nats", signal.SIGINT),
        ("replay", "postgres", signal.SIGTERM),
    ],
)
def test_a_signal_during_start_up_with_a_server_unreachable_stops_promptly(
    tmp_path, database_url, nats_server, handler, command, down, sig
):
    nowhere = free_port()
    env = {
        "OUTBOX_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{nowhere}/app" if down == "postgres" else database_url,
        "OUTBOX_NATS_URL": f"nats://user:secret@127.0.0.1:{nowhere}" if down == "nats" else nats_server.url,
        "OUTBOX_REGISTRY_FILE": str(_registry(tmp_path, handler.url)),
        "OUTBOX_CONSUMER_HTTP_PORT": "0",
    }
    log_path = tmp_path / "out.log"
    proc = _command([command], env, log_path)
    try:
        expected = (
            f"cannot connect to NATS at 127.0.0.1:{nowhere} (OUTBOX_NATS_URL or --nats-url)"
            if down == "nats"
            else f"cannot connect to PostgreSQL at 127.0.0.1:{nowhere} database app (OUTBOX_DATABASE_URL or --database-url; the PG* variables when unset)"
        )
        _wait_for_text(log_path, expected, 20)
        time.sleep(3)  # several attempts
        sent = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(10)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log_path.read_text()
    # not a race: promptness is what this tests (a signal ends the start-up's retries at once);
    # 10 s leaves a loaded 2-core machine room, far below a retry schedule's minutes
    assert code == 0 and took < 10, (code, took, output)
    assert "Traceback" not in output and "secret" not in output
    retry_lines = [line for line in output.splitlines() if expected in line]
    assert len(retry_lines) == 1, output  # rate-limited: one line per 5 s at most


def test_an_unusable_schema_ends_consume_and_replay_with_one_line_and_exit_3(
    tmp_path, database_url, empty_database_url, nats_server, handler
):
    newer_schema(database_url)  # a contract release that no longer serves this code
    registry_file = str(_registry(tmp_path, handler.url))
    for command in ("consume", "replay"):
        for url, expected in (
            (database_url, "SchemaMismatch: database schema is at version 99"),
            (empty_database_url, "SchemaMismatch: no pgoutbox schema at"),
        ):
            log_path = tmp_path / f"{command}.log"
            proc = _command(
                [command],
                {
                    "OUTBOX_DATABASE_URL": url,
                    "OUTBOX_NATS_URL": nats_server.url,
                    "OUTBOX_REGISTRY_FILE": registry_file,
                    "OUTBOX_CONSUMER_HTTP_PORT": "0",
                },
                log_path,
            )
            assert proc.wait(30) == 3
            output = log_path.read_text()
            assert output.splitlines()[-1].startswith(f"pgoutbox {command}: {expected}"), output
            assert "Traceback" not in output


def test_replay_once_answers_an_unreachable_server_with_one_line(tmp_path, database_url, nats_server):
    nowhere = free_port()
    for env, code, expected in (
        (
            {
                "OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_consumer"),
                "OUTBOX_NATS_URL": f"nats://127.0.0.1:{nowhere}",
            },
            4,
            f"pgoutbox replay: BrokerUnavailable: cannot connect to NATS at 127.0.0.1:{nowhere} (OUTBOX_NATS_URL or --nats-url)",
        ),
        (
            {
                "OUTBOX_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{nowhere}/app",
                "OUTBOX_NATS_URL": nats_server.url,
            },
            3,
            f"pgoutbox replay: DatabaseUnavailable: cannot connect to PostgreSQL at 127.0.0.1:{nowhere} database app",
        ),
    ):
        log_path = tmp_path / "once.log"
        proc = _command(["replay", "--once"], env, log_path)
        assert proc.wait(30) == code
        output = log_path.read_text()
        assert output.splitlines()[-1].startswith(expected) and "Traceback" not in output, output


async def test_readyz_turns_not_ready_within_its_check_interval_when_postgresql_stops(
    tmp_path, own_pg, nats_server, handler
):
    # not default: the test is about the check interval (backlog_interval, 15 s): 1 s
    cfg = consumer_config(
        own_pg.url, nats_server.url, _registry(tmp_path, handler.url), http_port="0", backlog_interval="1s"
    )
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            port = consumer.health.port

            assert (await asyncio.to_thread(_get, port, "/readyz"))[0] == 200
            await asyncio.to_thread(own_pg.stop, "fast")
            stopped = time.monotonic()
            await until(lambda: asyncio.to_thread(_not_ready, port), 15, "/readyz to report PostgreSQL")
            # not a race: promptness is what this tests; the check interval (1 s) and 4 s of
            # slack for a loaded 2-core machine, far below the default interval's 15 s
            assert time.monotonic() - stopped < 1 + 4
            assert (await asyncio.to_thread(_get, port, "/healthz"))[0] == 200  # alive: not a restart case
            await asyncio.to_thread(own_pg.start)
            await until(lambda: asyncio.to_thread(lambda: _get(port, "/readyz")[0] == 200), 10, "readiness back")
            ev = event()
            await publish(js, ev)
            await until(lambda: consumer.metrics.value(H, "processed") == 1, 10)


def _not_ready(port: int) -> bool:
    status, body = _get(port, "/readyz")
    return status == 503 and "PostgreSQL unreachable (last call failed)" in body["problems"]
