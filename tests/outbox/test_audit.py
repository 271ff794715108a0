"""`pgoutbox audit` against a real stream that lost messages (deleted through
the JetStream API): it reports exactly those, `--repair` requeues them, a relay
publishes them again, and the ledger closes: nothing lost, nothing processed
twice, nothing stuck. Also: the duplicate-window rule, an audit next to a live
relay, and one-line errors for operator mistakes."""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import threading
import time

import nats
import psycopg
import pytest

from harness.tcp_proxy import TcpProxy
from pgoutbox.cli import audit as audit_command
from pgoutbox.core import migrate, settings
from pgoutbox.core.errors import BrokerUnavailable
from pgoutbox.dev.embedded import free_port
from pgoutbox.outbox import audit
from support.inbox import consumer_config, inbox_row, running_consumer, write_registry
from support.outbox import (
    ROOT,
    apply_streams,
    emit,
    msg_ids,
    relay_config,
    running_relay,
    status_counts,
    stream_messages,
)
from support.roles import login
from support.waiting import until

STREAM = "SEA_EVENTS"
H = "billing"


def options(**kw) -> audit.Options:
    # bucket=7: several buckets even for a few dozen events
    return audit.Options(**{"slack": 0.5, "sample": 1000, "bucket": 7, "page": 16, "fetch": 10, **kw})


async def run_audit(database_url: str, nats_url: str, **kw) -> tuple[audit.Report, list[str]]:
    lines: list[str] = []
    nc = await nats.connect(nats_url)
    try:
        opts = options(**kw)
        async with audit.workspace(opts) as root:
            report = await audit.audit_stream(database_url, nc, STREAM, opts, root, lines.append)
    finally:
        await nc.close()
    return report, lines


async def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str, str]:
    """`pgoutbox audit ...` as a real process (without blocking the relay running in this loop)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pgoutbox.cli.main",
        "audit",
        *args,
        env={**base, **(env or {})},
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    return proc.returncode or 0, out.decode(), err.decode()


async def delete(nats_url: str, ids: list[str]) -> None:
    """Deletes the messages of these events from the stream (JetStream API)."""
    messages = await stream_messages(nats_url)
    seq = {m.headers["Nats-Msg-Id"]: m.metadata.sequence.stream for m in messages}
    nc = await nats.connect(nats_url)
    try:
        for event_id in ids:
            assert await nc.jetstream().delete_msg(STREAM, seq[event_id])
    finally:
        await nc.close()


def completed(url: str, n: int):
    return lambda: status_counts(url) == {"COMPLETED": n}


def requeue_log(url: str) -> list[tuple]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            "SELECT event_id::text, from_status, reason, published_at_before IS NOT NULL FROM outbox.requeue_log"
        ).fetchall()


async def test_audit_finds_the_deleted_messages_and_repair_closes_the_ledger(
    database_url, nats_server, handler, tmp_path
):
    url = nats_server.url
    await apply_streams(url, duplicate_window="2s")
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    consumer = consumer_config(database_url, url, registry_file)
    # not default: the stream's duplicate window is 2 s (the re-publish must pass it) and the lease must be shorter
    async with running_relay(relay_config(database_url, url, lease="1500ms", publish_timeout="1s")):
        first = emit(database_url, 30)
        await until(completed(database_url, 30), 20, "batch 1 relayed")
        async with running_consumer(consumer) as c:  # batch 1 is consumed before the loss
            await until(lambda: c.metrics.value(H, "processed") == 30, 20, "batch 1 consumed")
        second = emit(database_url, 20, start=30)  # batch 2 is lost before any consumer saw it
        await until(completed(database_url, 50), 20, "batch 2 relayed")
        stream_order = msg_ids(await stream_messages(url))
        lost = [stream_order[0], stream_order[-1], *first[5:8], *second[3:6]]  # the head and tail too
        await delete(url, lost)

        report, progress = await run_audit(database_url, url, progress_every=0)
        assert sorted(report.sample) == sorted(lost)
        assert (report.checked, report.missing.count, report.read) == (50, len(lost), 50 - len(lost))
        assert sum(m.count for m in report.by_subject.values()) == len(lost)
        assert any("outbox pass" in line for line in progress) and any("stream pass" in line for line in progress)

        # Past the duplicate window (2 s) and the slack, JetStream takes the re-publish.
        await asyncio.sleep(3)  # not a race: the duplicate window (2 s) must pass, time is the event
        env = {"OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_admin"), "OUTBOX_NATS_URL": url}
        code, out, err = await cli(STREAM, "--slack", "0.5s", env=env)  # without --repair: read-only
        assert (code, err) == (1, ""), out + err
        assert f"{len(lost)} of them can be requeued for republishing now" in out
        assert status_counts(database_url) == {"COMPLETED": 50} and requeue_log(database_url) == []
        code, out, err = await cli(
            STREAM,
            "--repair",
            "--reason",
            "messages deleted in the audit test",
            "--slack",
            "0.5s",
            "--sample",
            "100",
            env=env,
        )
        assert (code, err) == (0, ""), out + err
        assert f"requeued {len(lost)} events for republishing" in out
        assert f"MISSING {len(lost)} events" in out
        await until(lambda: len(requeue_log(database_url)) == len(lost), 10, "the requeues logged")
        await until(completed(database_url, 50), 20, "the lost events relayed again")

    # The stream holds every event exactly once again.
    again = collections.Counter(msg_ids(await stream_messages(url)))
    assert again == collections.Counter(first + second)
    # The consumer gets the republished ones: batch 2's lost events for the first
    # time, batch 1's as duplicates the inbox recognises.
    async with running_consumer(consumer) as c:
        await until(lambda: c.metrics.value(H, "processed") == 20, 20, "batch 2 consumed")
        await until(lambda: c.metrics.value(H, "duplicate") == len(set(lost) & set(first)), 20, "the duplicates")
    # The ledger.
    calls = collections.Counter(call.message_id for call in handler.calls)
    assert calls == collections.Counter(first + second), "each event reached the handler exactly once"
    assert all((inbox_row(database_url, e, H) or {}).get("status") == "PROCESSED" for e in first + second)
    assert status_counts(database_url) == {"COMPLETED": 50}
    assert sorted(requeue_log(database_url)) == sorted(
        (e, "COMPLETED", "messages deleted in the audit test", True) for e in lost
    )
    # And the audit agrees.
    report, _ = await run_audit(database_url, url)
    assert (report.checked, report.missing.count, report.read) == (50, 0, 50)


async def test_repair_leaves_events_inside_the_duplicate_window_and_says_when(database_url, nats_server):
    """JetStream drops a re-publish whose Nats-Msg-Id it saw within the
    duplicate window, even after the message was deleted: such an event is
    reported, not requeued (a relay would mark it COMPLETED on the duplicate ack
    and the stream would still lack it)."""
    url = nats_server.url
    await apply_streams(url, duplicate_window="1h")
    async with running_relay(relay_config(database_url, url)):
        ids = emit(database_url, 5)
        await until(completed(database_url, 5), 20, "relayed")
    await delete(url, ids[:1])
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_NATS_URL": url, "OUTBOX_AUDIT_REASON": "lost"}
    code, out, err = await cli(STREAM, "--repair", "--slack", "1s", env=env)
    assert (code, err) == (1, ""), out + err
    assert "MISSING 1 events" in out and ids[0] in out
    assert "run `pgoutbox audit --repair` again after" in out
    assert status_counts(database_url) == {"COMPLETED": 5} and requeue_log(database_url) == []
    # Why: the same message id is still a duplicate for JetStream.
    nc = await nats.connect(url)
    try:
        ack = await nc.jetstream().publish("sea.event.order_created.v1", b"{}", headers={"Nats-Msg-Id": ids[0]})
    finally:
        await nc.close()
    assert ack.duplicate
    assert ids[0] not in msg_ids(await stream_messages(url))


async def test_audit_next_to_a_live_relay_reports_only_what_was_lost(database_url, nats_server):
    """Relays keep completing events while the audit reads both sides: they are
    neither reported missing nor slowed down (the audit holds no lock or long
    transaction)."""
    url = nats_server.url
    await apply_streams(url)
    stop = threading.Event()
    written = [0]

    def writer():
        while not stop.is_set():
            emit(database_url, 20, start=1000 + written[0])
            written[0] += 20
            time.sleep(0.02)

    async with running_relay(relay_config(database_url, url)):
        ids = emit(database_url, 200)
        await until(completed(database_url, 200), 30, "relayed")
        lost = ids[10:13]
        await delete(url, lost)
        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        try:
            await until(lambda: written[0] >= 100, 10, "the writer to run")
            before = status_counts(database_url).get("COMPLETED", 0)
            report, _ = await run_audit(database_url, url, bucket=50, page=50, fetch=25)
            after = status_counts(database_url).get("COMPLETED", 0)
        finally:
            stop.set()
            await asyncio.to_thread(thread.join, 10)
        total = 200 + written[0]
        await until(completed(database_url, total), 30, "the writer's events relayed")
    assert sorted(report.sample) == sorted(lost)
    assert report.missing.count == 3
    assert report.checked >= before, "every event completed before the audit started was checked"
    assert after > before, "the relay kept completing events during the audit"


async def test_operator_mistakes_get_one_line_and_an_exit_code(database_url, nats_server, pg_server):
    url = nats_server.url
    await apply_streams(url)
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_NATS_URL": url}
    nowhere = f"nats://127.0.0.1:{free_port()}"
    down_db = f"host=127.0.0.1 port={free_port()} dbname=x user=postgres connect_timeout=2"
    cases = [
        (("--repair", STREAM), env, 2, "needs a reason"),
        (("NOPE",), env, 2, "stream NOPE not found"),
        ((STREAM,), {**env, "OUTBOX_NATS_URL": nowhere}, 4, "cannot connect to NATS"),
        ((STREAM,), {**env, "OUTBOX_DATABASE_URL": down_db}, 3, "DatabaseUnavailable"),
        ((STREAM, "--slack", "soon"), env, 2, "OUTBOX_AUDIT_SLACK"),
    ]
    for args, case_env, code, text in cases:
        got, out, err = await cli(*args, env=case_env)
        assert (got, len(err.strip().splitlines())) == (code, 1), (args, out, err)
        assert text in err and "Traceback" not in err, err
    # --repair needs this release's schema: a database migrated to the one before is told to migrate.
    repair_migration = next(m for m in migrate.discover() if m.name.endswith("_broker_loss_repair"))
    with psycopg.connect(database_url, autocommit=True) as conn:
        migrate.migrate(conn, target=repair_migration.version - 1)
    got, out, err = await cli("--repair", "--reason", "x", STREAM, env=env)
    assert got == 3 and "run `pgoutbox migrate`" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("fault", ["connection closed", "server silent"])
async def test_losing_nats_in_the_middle_of_an_audit_is_one_broker_error(database_url, nats_server, fault):
    url = nats_server.url
    await apply_streams(url)
    async with running_relay(relay_config(database_url, url)):
        emit(database_url, 20)
        await until(completed(database_url, 20), 20, "relayed")
    proxy = TcpProxy(nats_server.port)
    cfg = settings.build(
        audit_command.AuditConfig, environ={}, overrides={"database_url": database_url, "nats_url": proxy.url}
    )

    def say(line: str) -> None:  # the fault strikes between the outbox pass and the stream pass
        if "outbox pass done" in line:
            proxy.close() if fault == "connection closed" else proxy.drop_client_bytes()

    try:
        with pytest.raises(BrokerUnavailable, match="lost NATS during the audit") as raised:
            await asyncio.wait_for(audit_command.audit_streams(cfg, [STREAM], False, say), 30)
    finally:
        proxy.close()
    assert raised.value.exit_code == 4
