"""The consumer on the product's defaults, as an operator runs it: `pgoutbox
consume` processes logged in as a member of pgoutbox_consumer only, the
README's manifest (max_deliver = 5, every other value default), a
PostgreSQL of the test's own that it stops and starts, a real nats-server.

Nothing the consumer is handed may vanish, whatever fails: a PostgreSQL
outage longer than max_deliver x the retry delay only delays; a kill of every
consumer process while messages sit at their last allowed failure costs them
nothing; a foreign header that Python cannot even parse is that message's own
`.invalid` notice, and every processing slot comes back."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

import psycopg
import pytest

from pgoutbox.core import migrate
from pgoutbox.dev.embedded import EmbeddedPostgres, free_port
from support.inbox import FakeHandler, add_stream, dlq_messages, event, jetstream, publish, write_registry
from support.waiting import until

H = "billing"
SUBJECT = "sea.event.order_created.v1"
LOGIN = "consumer_app"

pytestmark = pytest.mark.slow


@pytest.fixture
def own_pg():
    """A PostgreSQL of this test's own (the suite's is shared: it cannot be
    stopped), migrated, with a login that is a member of pgoutbox_consumer only."""
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-outage-"))
    root.chmod(0o755)
    server = EmbeddedPostgres(root)
    server.start()
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            migrate.migrate(conn)
            conn.execute(f"CREATE ROLE {LOGIN} LOGIN IN ROLE pgoutbox_consumer")
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


def _rows(server: EmbeddedPostgres) -> dict[str, dict]:
    with psycopg.connect(server.dsn(), autocommit=True, row_factory=psycopg.rows.dict_row) as conn:
        return {
            str(r["message_id"]): r
            for r in conn.execute("SELECT message_id, status, attempts, dlq_metadata FROM inbox.messages")
        }


class Consumers:
    """`pgoutbox consume` processes with the defaults (only addresses given)."""

    def __init__(self, tmp_path: Path, database_url: str, nats_url: str, registry_file: Path):
        self.tmp_path = tmp_path
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))},
            "OUTBOX_DATABASE_URL": database_url,
            "OUTBOX_NATS_URL": nats_url,
            "OUTBOX_REGISTRY_FILE": str(registry_file),
        }
        self.procs: list[tuple[subprocess.Popen, int]] = []

    def start(self) -> int:
        port = free_port()
        log = open(self.tmp_path / f"consumer-{len(self.procs)}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "pgoutbox.cli.main", "consume"],
            env={**self.env, "OUTBOX_CONSUMER_HTTP_PORT": str(port)},
            stdout=log,
            stderr=log,
        )
        self.procs.append((proc, port))
        return port

    def kill_all(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc, _ in self.procs:
            proc.wait(10)

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.tmp_path.glob("consumer-*.log")))


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    needle = f'{name}{{handler="{H}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(needle))


def ready(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).status == 200
    except OSError:
        return False


@contextlib.contextmanager
def consumers(tmp_path, own_pg, nats_server, handler_url):
    # The README's manifest: max_deliver = 5, every other value default.
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler_url, "subjects": [SUBJECT], "timeout": "10s", "max_deliver": 5}]
    )
    url = f"postgresql://{LOGIN}@127.0.0.1:{own_pg.port}/postgres"
    group = Consumers(tmp_path, url, nats_server.url, registry_file)
    try:
        yield group
    finally:
        group.stop()


async def test_a_postgresql_outage_longer_than_max_deliver_retries_only_delays(tmp_path, own_pg, nats_server):
    """30 s without PostgreSQL while 20 messages arrive: afterwards each is
    handled once, and nothing is dead-lettered for the outage."""
    handler = FakeHandler()
    try:
        with consumers(tmp_path, own_pg, nats_server, handler.url) as group:
            async with jetstream(nats_server.url) as js:
                await add_stream(js)
                port = group.start()
                await until(lambda: ready(port), 30, "the consumer to be ready")
                warm = event()
                await publish(js, warm)
                await until(lambda: _rows(own_pg).get(warm["event_id"], {}).get("status") == "PROCESSED", 20)

                own_pg.stop("fast")
                events = [event() for _ in range(20)]
                for ev in events:
                    await publish(js, ev)
                # not a race: the outage must outlast max_deliver's retries (that is the test's point)
                await asyncio.sleep(30)
                assert handler.calls and len(handler.calls) == 1, "no handler call without PostgreSQL"
                own_pg.start()

                ids = {ev["event_id"] for ev in events}
                await until(
                    lambda: sum(1 for i, r in _rows(own_pg).items() if i in ids and r["status"] == "PROCESSED") == 20,
                    60,
                    "every message to be processed after the outage",
                )
                dlq = await dlq_messages(js)
                await until(lambda: metric(port, "pgoutbox_consumer_in_flight_messages") == 0, 10, "every slot back")
        calls = collections.Counter(c.message_id for c in handler.calls)
        assert {i: calls[i] for i in ids} == dict.fromkeys(ids, 1), "each message handled exactly once"
        assert dlq == []
        assert "PostgreSQL away" in group.logs() and "PostgreSQL back" in group.logs()
    finally:
        handler.close()


async def test_killing_every_consumer_at_the_last_allowed_failure_costs_the_messages_nothing(
    tmp_path, own_pg, nats_server
):
    """The handler fails four times (max_deliver 5 allows five failures); as
    the fifth call of the first message arrives, both consumer processes are
    killed -9. Restarted, they deliver again: the killed deliveries recorded
    no failure, the handler now succeeds, and every message ends PROCESSED."""
    killed = threading.Event()
    group_box: list = []  # the consumers, then the call that killed them

    def on_request(call) -> None:
        n = sum(1 for c in handler.calls if c.message_id == call.message_id)
        if n == 5 and not group_box[1:]:
            group_box.append(call)
            group_box[0].kill_all()
            killed.set()

    handler = FakeHandler(answers=[500, 500, 500, 500, 200])
    handler.on_request = on_request
    try:
        with consumers(tmp_path, own_pg, nats_server, handler.url) as group:
            group_box.append(group)
            async with jetstream(nats_server.url) as js:
                await add_stream(js)
                ports = [group.start(), group.start()]
                for port in ports:
                    await until(lambda p=port: ready(p), 30, "the consumers to be ready")
                events = [event() for _ in range(5)]
                for ev in events:
                    await publish(js, ev)
                await until(killed.is_set, 60, "a message's fifth call")
                assert all(proc.poll() is not None for proc, _ in group.procs)
                before = _rows(own_pg)
                ports = [group.start(), group.start()]
                ids = {ev["event_id"] for ev in events}
                await until(
                    lambda: sum(1 for i, r in _rows(own_pg).items() if i in ids and r["status"] == "PROCESSED") == 5,
                    90,
                    "every message to be processed",
                )
                dlq = await dlq_messages(js)
        killed_rows = [r for r in before.values() if r["dlq_metadata"].get("failures") == 4]
        assert killed_rows, "at least one message was at its last allowed failure when the consumers died"
        assert dlq == []
        rows = _rows(own_pg)
        assert all(rows[i]["dlq_metadata"]["failures"] == 4 for i in ids)
    finally:
        handler.close()


async def test_a_version_header_python_cannot_parse_is_its_own_invalid_notice_and_every_slot_comes_back(
    tmp_path, own_pg, nats_server
):
    """Pgoutbox-Event-Version "0...01" with 4,400 digits (int() refuses over
    4,300), a tenant ending in U+00A0 (a NATS client strips it when
    publishing: no replay could carry it) and a bad id beside a `Status: 1`
    header: each goes to `.invalid` with a reason. Well-formed messages beside
    them are processed, one with a `Status: 404` header included (NATS
    clients take such a message for the end of a fetch), and the in-flight
    gauge is back to zero."""
    handler = FakeHandler()
    try:
        with consumers(tmp_path, own_pg, nats_server, handler.url) as group:
            async with jetstream(nats_server.url) as js:
                await add_stream(js)
                port = group.start()
                await until(lambda: ready(port), 30, "the consumer to be ready")
                long_version, spaced, good = event(), event(), event()
                for ev in (long_version, spaced):
                    subject, body, headers = _raw(ev)
                    if ev is long_version:
                        headers["Pgoutbox-Event-Version"] = "0" * 4399 + "1"
                    else:
                        headers["Pgoutbox-Tenant-Id"] = "t\u00a0"
                    await _publish_raw(nats_server, subject, body, headers)
                # A Status header: NATS clients take such a message for the
                # server's own status reply; it is a message all the same.
                status_404, status_1 = event(), event()
                for ev, status in ((status_404, "404"), (status_1, "1")):
                    subject, body, headers = _raw(ev)
                    headers["Status"] = status
                    if ev is status_1:
                        headers["Nats-Msg-Id"] = "1"
                    await js.publish(subject, body, headers=headers)
                await publish(js, good)
                await until(lambda: len(handler.calls) == 2, 20, "the good messages")
                await until(lambda: _invalid_count(js, 3), 20, "three .invalid notices")
                await until(lambda: metric(port, "pgoutbox_consumer_in_flight_messages") == 0, 10, "every slot back")
                notices = [json.loads(m.data) for m in await dlq_messages(js, subject=f"sea.dlq.dead.{H}.invalid")]
        reasons = sorted(n["reason"] for n in notices)
        assert "Nats-Msg-Id '1' is not a UUID" in reasons[0]
        assert "Pgoutbox-Event-Version" in reasons[1] and "contradicts the subject" in reasons[1]
        assert "Pgoutbox-Tenant-Id" in reasons[2] and "white space" in reasons[2]
        assert all(r.startswith("INVALID_MESSAGE [OB020]") for r in reasons)
        assert sorted(c.message_id for c in handler.calls) == sorted([good["event_id"], status_404["event_id"]])
        assert "Task exception was never retrieved" not in group.logs()
    finally:
        handler.close()


def _raw(ev: dict) -> tuple[str, bytes, dict[str, str]]:
    from pgoutbox.core import wire

    return wire.to_nats(ev)


async def _publish_raw(nats_server, subject: str, body: bytes, headers: dict[str, str]) -> None:
    """Publishes header values exactly as given, as a foreign client may (nats-py
    would strip Unicode white space): the protocol's HPUB, over a plain socket."""
    import socket

    head = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    hbytes = head.encode()
    with socket.create_connection(("127.0.0.1", nats_server.port), timeout=5) as sock:
        sock.recv(4096)  # INFO
        sock.sendall(b'CONNECT {"verbose":false,"headers":true}\r\n')
        sock.sendall(
            f"HPUB {subject} {len(hbytes)} {len(hbytes) + len(body)}\r\n".encode() + hbytes + body + b"\r\nPING\r\n"
        )
        got = b""
        while b"PONG" not in got:
            got += sock.recv(4096)
    await _stored(nats_server, headers["Nats-Msg-Id"])


async def _stored(nats_server, msg_id: str) -> None:
    async with jetstream(nats_server.url) as js:
        await until(lambda: _has(js, msg_id), 10, "the raw message in the stream")


async def _has(js, msg_id: str) -> bool:
    info = await js.stream_info("SEA_EVENTS")
    for seq in range(max(info.state.first_seq, 1), info.state.last_seq + 1):
        msg = await js.get_msg("SEA_EVENTS", seq)
        if (msg.headers or {}).get("Nats-Msg-Id") == msg_id:
            return True
    return False


async def _invalid_count(js, count: int) -> bool:
    return len(await dlq_messages(js, subject=f"sea.dlq.dead.{H}.invalid")) == count
