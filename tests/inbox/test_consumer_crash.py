"""kill -9 of a real consumer process between the handler's success and the
ack: after a restart the handler is not called again for that message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from harness.tcp_proxy import TcpProxy
from pgoutbox.dev.embedded import free_port
from support.inbox import FakeHandler, add_stream, consumer_metric, event, inbox_row, jetstream, publish, write_registry
from support.roles import login
from support.waiting import until

H = "billing"


def _start(env: dict[str, str], log_path) -> subprocess.Popen:
    log = open(log_path, "ab")
    return subprocess.Popen([sys.executable, "-m", "pgoutbox.cli.main", "consume"], env=env, stdout=log, stderr=log)


def _metric(port: int, outcome: str) -> float:
    return consumer_metric(port, H, outcome)


@pytest.mark.slow
async def test_kill_9_between_handler_success_and_ack_does_not_call_the_handler_again(
    tmp_path, database_url, nats_server
):
    handler = FakeHandler()
    proxy = TcpProxy(nats_server.port)
    # The handler's success is the moment the network starts losing what the
    # consumer sends: mark_processed commits (PostgreSQL is reached directly),
    # the ack never reaches the server.
    handler.on_request = lambda call: proxy.drop_client_bytes()
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))},
        "OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_consumer"),
        "OUTBOX_NATS_URL": proxy.url,
        "OUTBOX_REGISTRY_FILE": str(registry_file),
        "OUTBOX_CONSUMER_ACK_WAIT": "2s",  # not default: the test is about the redelivery after ack_wait (30 s)
        "OUTBOX_CONSUMER_HTTP_PORT": "0",
    }
    ev = event()
    first = second = None
    try:
        async with jetstream(nats_server.url) as js:
            await add_stream(js)
            first = _start(env, tmp_path / "first.log")
            await publish(js, ev)
            await until(  # a deadline the row ends: a consumer's start took over 20 s at load average 40
                lambda: (inbox_row(database_url, ev["event_id"], H) or {}).get("status") == "PROCESSED",
                120,
                "the handler's success to be recorded",
            )
            first.send_signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL
            info = await js.consumer_info("SEA_EVENTS", H)
            assert (info.ack_floor.stream_seq, info.num_ack_pending) == (0, 1), "killed before the ack"

            port = free_port()
            second = _start(
                {**env, "OUTBOX_NATS_URL": nats_server.url, "OUTBOX_CONSUMER_HTTP_PORT": str(port)},
                tmp_path / "second.log",
            )

            async def acked():
                return (await js.consumer_info("SEA_EVENTS", H)).ack_floor.stream_seq == 1

            await until(acked, 20, "the redelivery to be acknowledged")
            assert _metric(port, "duplicate") == 1 and _metric(port, "processed") == 0
            second.send_signal(signal.SIGTERM)  # graceful: drains and exits 0
            assert second.wait(15) == 0
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        proxy.close()
        handler.close()
    assert len(handler.calls) == 1
    row = inbox_row(database_url, ev["event_id"], H)
    assert row["status"] == "PROCESSED" and row["attempts"] == 1
    log = (tmp_path / "second.log").read_text()
    assert '"event": "consumer started"' in log and '"event": "consumer stopped"' in log
