"""The pieces of the "JetStream away" tests (tests/outbox/test_jetstream_away*.py,
test_jetstream_refusal.py): a nats-server without JetStream, a record of what
the relay's /readyz and jetstream gauge said, emits as a pgoutbox_writer login,
and the end state every outage test proves.

PGOUTBOX_TEST_JETSTREAM_OUTAGE (seconds) shortens the outage while developing
the tests; the suite runs them on the issue's 5 minutes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import nats.js.errors
import psycopg
from psycopg.types.json import Jsonb

from pgoutbox.dev.embedded import nats_server_binary
from support.outbox import msg_ids, status_counts, stream_messages
from support.roles import login
from support.waiting import wait_for

OUTAGE = float(os.environ.get("PGOUTBOX_TEST_JETSTREAM_OUTAGE", "300"))  # the 5 minutes
BEFORE, DURING = 20, 100  # events emitted before the outage, and while it lasts


class NoJetStream:
    """A nats-server on the given port without JetStream (no -js): clients
    connect, no stream answers, as while a cluster has lost its quorum."""

    def __init__(self, root: Path, port: int):
        self.root, self.port = root, port
        self.log = root / "nats-no-js.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        offset = self.log.stat().st_size if self.log.exists() else 0
        self.process = subprocess.Popen(
            [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(self.port), "-l", str(self.log)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def ready() -> bool:
            assert self.process is not None and self.process.poll() is None, f"nats-server exited: {self.log}"
            return self.log.exists() and "Server is ready" in self.log.read_text()[offset:]

        wait_for(ready, 30, "nats-server without JetStream")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)
        self.process = None


class Watch(threading.Thread):
    """What the relay's /readyz and pgoutbox_relay_jetstream_up said, sampled
    every half second while the test runs (the record, not a wait)."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port = port
        self.halt = threading.Event()
        self.reasons: list[str] = []
        self.gauge: list[float] = []  # each change of the gauge, in order

    def run(self) -> None:
        while not self.halt.wait(0.5):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=5) as r:
                    problems = json.load(r)["problems"]
            except urllib.error.HTTPError as answer:  # 503: not ready, with its reasons
                problems = json.load(answer)["problems"]
            except OSError:
                continue
            self.reasons.extend(p for p in problems if p.startswith("JetStream") and p not in self.reasons)
            value = gauge(self.port)
            if value is not None and (not self.gauge or self.gauge[-1] != value):
                self.gauge.append(value)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)


def gauge(port: int) -> float | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("pgoutbox_relay_jetstream_up "):
            return float(line.split()[1])
    return None


def emit(writer_url: str, n: int, first: int) -> None:
    with psycopg.connect(writer_url, autocommit=True) as conn:
        for i in range(first, first + n):
            conn.execute(
                "SELECT outbox.emit('order', %s, 'order_created', %s, context => 'sea')",
                (str(i), Jsonb({"schema_version": 1, "n": i})),
            )


def emit_during(writer_url: str, outage: float, watch: Watch) -> None:
    """DURING events spread over the outage; the first one starts the episode,
    which /readyz names within a minute (a probe's pause is at most 30 s)."""
    started = time.monotonic()
    emit(writer_url, 1, BEFORE)
    wait_for(lambda: watch.reasons, 60, "/readyz to say why JetStream is away", interval=0.5)
    for i in range(1, DURING):
        time.sleep(max(0.0, started + i * outage / DURING - time.monotonic()))  # pacing the emits, not a wait
        emit(writer_url, 1, BEFORE + i)
    time.sleep(max(0.0, started + outage - time.monotonic()))  # the outage lasts its whole length


def event_ids(url: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT event_id::text FROM outbox.events").fetchall()]


def assert_every_event_once(database_url: str, nats_url: str, log: Path) -> None:
    total = BEFORE + DURING
    wait_for(
        lambda: status_counts(database_url).get("COMPLETED", 0) == total,
        180,  # a probe's pause is at most 30 s; the backlog then goes in seconds
        "every event COMPLETED after JetStream came back",
        interval=1,
        detail=lambda: f"{status_counts(database_url)}",
    )
    assert status_counts(database_url) == {"COMPLETED": total}  # none dead-lettered, none waiting
    in_stream = msg_ids(wait_for(lambda: _read_stream(nats_url), 60, "the stream to answer a read", interval=1))
    assert len(in_stream) == total and sorted(in_stream) == sorted(event_ids(database_url))
    lines = log_lines(log)
    actions = [line.get("action") for line in lines]
    assert actions.count("jetstream_away") >= 1 and "dead_letter" not in actions
    back = [line for line in lines if line.get("action") == "jetstream_back"]
    assert back and back[-1]["handed_back"] >= 1, "the episode's end, with how many events were handed back"


def relay_settings(database_url: str, nats_url: str) -> dict[str, str]:
    """The defaults, but for the addresses and a free port for /metrics and /readyz."""
    return {
        "OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_relay"),
        "OUTBOX_NATS_URL": nats_url,
        "OUTBOX_RELAY_HTTP_PORT": "0",
    }


def log_lines(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def _read_stream(nats_url: str):
    """The stream's messages, or None while a stream just back from a lost
    quorum still answers this test's own reads with 503 (it is the ledger's
    read, not the relay under test)."""
    try:
        return asyncio.run(stream_messages(nats_url))
    except nats.js.errors.ServiceUnavailableError:
        return None
