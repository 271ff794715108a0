"""Helpers for the relay tests: emitting events, reading a stream back,
running a relay in-process or as a real `pgoutbox relay` subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import psycopg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from pgoutbox.outbox import settings as relay_settings
from pgoutbox.outbox import streams
from pgoutbox.outbox.relay import OutboxRelay
from support.roles import as_role
from support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


def emit(
    url: str,
    n: int,
    *,
    context: str = "sea",
    keys: int | None = None,
    start: int = 0,
    event_type: str = "order_created",
    payload_bytes: int = 0,
) -> list[str]:
    """Emits n events in one transaction; ordering_key = i % keys when keys is given."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT outbox.emit('order', i::text, %(type)s,"
            " jsonb_build_object('schema_version', 1, 'n', i, 'pad', repeat('x', %(pad)s)),"
            " context => %(ctx)s,"
            " ordering_key => CASE WHEN %(keys)s::int IS NULL THEN NULL ELSE 'k' || (i %% %(keys)s::int) END,"
            " headers => jsonb_build_object('traceparent', '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'))"
            " FROM generate_series(%(lo)s::int, %(hi)s::int) AS i ORDER BY i",
            {"type": event_type, "pad": payload_bytes, "ctx": context, "keys": keys, "lo": start, "hi": start + n - 1},
        ).fetchall()
    return [str(r[0]) for r in rows]


def status_counts(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return dict(conn.execute("SELECT status, count(*) FROM outbox.events GROUP BY 1").fetchall())


def all_completed(url: str, n: int):
    return lambda: status_counts(url).get("COMPLETED", 0) == n


async def apply_streams(nats_url: str, contexts=("sea",), duplicate_window: str = "2m", **extra) -> None:
    toml = f'[defaults]\nduplicate_window = "{duplicate_window}"\n' + "".join(f"[streams.{c}]\n" for c in contexts)
    specs = streams.loads(toml, "test streams")
    nc = await nats.connect(nats_url)
    try:
        await streams.apply(nc.jetstream(), specs)
        for name, value in extra.items():  # e.g. max_msg_size on SEA_EVENTS
            info = await nc.jetstream().stream_info("SEA_EVENTS")
            await nc.jetstream().update_stream(info.config.evolve(**{name: value}))
    finally:
        await nc.close()


async def stream_messages(nats_url: str, stream: str = "SEA_EVENTS") -> list:
    """Every message of the stream, in stream order (ephemeral consumer, no acks)."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        info = await js.stream_info(stream)
        total = info.state.messages
        out = []
        if total:
            sub = await js.pull_subscribe(
                info.config.subjects[0],
                stream=stream,
                config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
            )
            # A loaded machine's JetStream may answer a pull with 503 (no
            # responders yet) or nothing within a fetch: that delays the read,
            # up to a minute, and only a stream that lacks messages fails it.
            deadline = asyncio.get_running_loop().time() + 60
            while len(out) < total:
                try:
                    out.extend(await sub.fetch(min(1000, total - len(out)), timeout=5))
                except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError):
                    if asyncio.get_running_loop().time() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            await sub.unsubscribe()
        return out
    finally:
        await nc.close()


def msg_ids(messages) -> list[str]:
    return [m.headers["Nats-Msg-Id"] for m in messages]


def relay_config(
    database_url: str, nats_url: str, *, as_owner: str | None = None, **overrides: str
) -> relay_settings.RelayConfig:
    """The relay command's configuration as a user gets it (docs/reference.md's
    defaults) on a free port, as a login in pgoutbox_relay only (as_owner: why
    not): a test that needs another value passes it, with its reason
    (`# not default: <why>`)."""
    base = {"database_url": as_role(database_url, "pgoutbox_relay", as_owner), "nats_url": nats_url, "http_port": "0"}
    return relay_settings.load(environ={}, overrides={**base, **overrides})


@contextlib.asynccontextmanager
async def running_relay(cfg, publisher=None):
    """An OutboxRelay running in this event loop until the block ends."""
    relay = OutboxRelay(cfg, publisher)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    started = asyncio.create_task(relay.started.wait())
    await asyncio.wait({task, started}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        started.cancel()
        task.result()  # raises what stopped it
    assert relay.started.is_set(), "relay did not start"
    try:
        yield relay
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


class RelayProcess:
    """`python -m pgoutbox.cli.main relay` as a real subprocess on the defaults, as
    a login in pgoutbox_relay only (as_owner: why not), configured by OUTBOX_*
    variables (`relay_lease="3s"`: OUTBOX_RELAY_LEASE)."""

    def __init__(
        self,
        log_dir: Path,
        name: str,
        database_url: str,
        nats_url: str,
        *,
        as_owner: str | None = None,
        **settings: str,
    ):
        self.log = log_dir / f"{name}.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
        self.env.update(
            {
                "OUTBOX_DATABASE_URL": as_role(database_url, "pgoutbox_relay", as_owner),
                "OUTBOX_NATS_URL": nats_url,
                "OUTBOX_RELAY_NAME": name,
                "OUTBOX_RELAY_HTTP_PORT": "0",
            }
        )
        self.env.update({f"OUTBOX_{k.upper()}": v for k, v in settings.items()})
        self.proc: subprocess.Popen | None = None

    def start(self) -> RelayProcess:
        self._log = self.log.open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pgoutbox.cli.main", "relay"],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        return self

    def wait_started(self, timeout: float = 30) -> None:
        def started():
            assert self.proc.poll() is None, f"relay exited with {self.proc.returncode}:\n{self.output()}"
            return '"action": "started"' in self.output()

        wait_for(started, timeout, f"relay to start ({self.log})")

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def log_entries(self) -> list[dict]:
        return [json.loads(line) for line in self.output().splitlines() if line.startswith("{")]

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 30) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc:
            self._log.close()


# A streams file: defaults, a stream by default and one with every option.
GOOD = """
[defaults]
max_age = "14d"
duplicate_window = "5m"

[streams.sea]

[streams.vibespro]
name = "VIBES"
subjects = ["vibespro.event.>", "vibespro.dlq.>"]
max_bytes = "512MiB"
storage = "memory"
"""
