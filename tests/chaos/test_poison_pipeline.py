"""Poison-proof pipeline, generatively: hostile emits and foreign NATS
messages (tests/poison.py, one strategy per class of input) pushed through
emit -> relay -> JetStream -> consumer -> a real HTTP handler while ordinary
events flow, on a real PostgreSQL and a real nats-server.

One world per module: a database, a nats-server with the SEA_EVENTS stream,
one `pgoutbox relay` and one `pgoutbox consume` process, a recording HTTP
handler. Each Hypothesis example:
  1. emits one poison candidate in its own transaction, or publishes one
     foreign message straight to the stream;
  2. emits one ordinary event right after it;
  3. asserts, with bounded waits:
     * the emit is refused with an OB code (SQLSTATE OBnnn), or its event ends
       COMPLETED or DEAD_LETTER with a coded last_error (`CODE: text`); an
       accepted event on a subscribed subject also ends PROCESSED or
       DEAD_LETTER in the inbox;
     * a foreign message that reached the stream ends PROCESSED or DEAD_LETTER
       in inbox.messages (under its canonical UUID) or as a `.invalid` notice in
       the DLQ that names its stream sequence;
     * what the handler received is a well-formed envelope: canonical
       message_id (= Idempotency-Key), context, event type and version from the
       subject, a JSON object as payload, emitted values unaltered;
     * the ordinary event reaches the handler within LATENCY seconds;
     * neither process exited;
     * nothing is left PROCESSING / PENDING / FAILED in outbox.events nor
       RECEIVED / FAILED in inbox.messages.
A failed example marks the world dirty; the next one first probes it and
rebuilds it (fresh database, nats-server and processes) when it is broken, so
that each example is judged on its own and shrinking stays meaningful.

Each kind of failure raises its own AssertionError subclass (WorkerExited,
OrdinaryEventDelayed, NoOutcome, UncodedRefusal, UncodedDeadLetter,
MalformedEnvelope, ValuesAltered), so that Hypothesis reports and shrinks each
kind separately rather than only the first it met.

Profiles (PGOUTBOX_HYPOTHESIS_PROFILE): "ci" (default, bounded: 25 examples
per class, the whole module in about two minutes when nothing fails, part of
`make test`) and "long" (`make test/poison`, 200 per class);
PGOUTBOX_POISON_EXAMPLES overrides the count of either. Select classes with
-k, e.g. `pytest tests/test_poison_pipeline.py -k "[times]"`. A failure
prints @reproduce_failure(...) to replay it.

Two refusals happen before any pgoutbox code runs and are accepted as such:
a NUL in a text argument (psycopg refuses to send it: PostgreSQL text cannot
hold NUL) and \\u0000 in a JSON argument (jsonb's input function refuses it
with 22P05 while casting the caller's value).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos.poison import CLASSES, CONTEXT, EVENT_TYPE, SUBJECTS, EmitCase, ForeignCase, refusal_problem
from conftest import create_database, drop_database
from pgoutbox.dev.embedded import EmbeddedNats
from support.inbox import write_registry
from support.outbox import apply_streams
from support.roles import as_role

ROOT = Path(__file__).resolve().parents[2]
HANDLER = "fuzz"
STREAM = "SEA_EVENTS"
DLQ_STREAM = "SEA_DLQ"
LATENCY = 5.0  # an ordinary event behind a poison one: generous for a loaded 2-core machine
# A poison event or message reaching its end. Both workers run on the defaults,
# where a content failure taken for a transient one is retried for minutes (10
# publish attempts with backoff up to 60 s; 5 deliveries with naks from 1 s up):
# it must be recognised as permanent (dead-lettered at once), not outlived.
TERMINAL = 12.0
SETTLE = 20.0
CODED = re.compile(r"^[A-Z][A-Z0-9_]+: ")

_COMMON = dict(deadline=None, database=None, print_blob=True, suppress_health_check=list(HealthCheck))
settings.register_profile("ci", max_examples=int(os.environ.get("PGOUTBOX_POISON_EXAMPLES", "25")), **_COMMON)
settings.register_profile("long", max_examples=int(os.environ.get("PGOUTBOX_POISON_EXAMPLES", "200")), **_COMMON)
PROFILE = settings.get_profile(os.environ.get("PGOUTBOX_HYPOTHESIS_PROFILE", "ci"))


def as_sent(value: str | None) -> str | None:
    """A header value as it reaches a consumer: nats-py strips it and turns CR/LF into spaces."""
    return value.strip().translate(str.maketrans({"\r": " ", "\n": " "})).strip() if value else value


def canonical(text: str | None) -> str | None:
    """The canonical UUID text of a message id Python can read as a UUID."""
    try:
        return str(uuid.UUID(text)) if text else None
    except (ValueError, TypeError, AttributeError):
        return None


# -- the handler -----------------------------------------------------------------


@dataclass
class Call:
    envelope: Any  # the parsed request body (None: not JSON)
    headers: dict[str, str]
    at: float


@dataclass
class RecordingHandler:
    """Answers payload["answer"] (200 or 422) when the payload is an object
    carrying one, else 200; records every call by canonical message id."""

    calls: dict[str, list[Call]] = field(default_factory=dict)

    def __post_init__(self):
        fake = self
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    envelope = json.loads(raw)
                except ValueError:
                    envelope = None
                mid = envelope.get("message_id") if isinstance(envelope, dict) else None
                key = canonical(mid) or str(mid)
                with fake._lock:
                    fake.calls.setdefault(key, []).append(Call(envelope, dict(self.headers), time.monotonic()))
                payload = envelope.get("payload") if isinstance(envelope, dict) else None
                answer = payload.get("answer") if isinstance(payload, dict) else None
                answer = answer if answer in (200, 422) else 200
                self.send_response(answer)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/events"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def calls_for(self, message_id: str) -> list[Call]:
        with self._lock:
            return list(self.calls.get(message_id, []))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# -- processes and the world -------------------------------------------------------


class Worker:
    """`python -m pgoutbox.cli.main <command>` as a subprocess, logging to a file."""

    def __init__(self, command: str, log: Path, env: dict[str, str], ready: str):
        self.command, self.log, self.ready = command, log, ready
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
        self.env.update(env)
        self._out = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pgoutbox.cli.main", command],
            env=self.env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    def tail(self, lines: int = 6) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n      ".join(line[:400] for line in text.splitlines()[-lines:])

    def died(self) -> str | None:
        """Why it is no longer running (None: running)."""
        code = self.proc.poll()
        if code is None:
            return None
        return f"the {self.command} process exited with code {code}; its last log lines:\n      {self.tail()}"

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.ready not in self.log.read_text(errors="replace"):
            if (why := self.died()) or time.monotonic() > deadline:
                raise AssertionError(why or f"{self.command} did not start within {timeout}s:\n      {self.tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()


class Loop:
    """An asyncio loop in a thread, for the test's own NATS calls."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 15.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class World:
    def __init__(self, pg_server, root: Path):
        self.pg_server, self.root = pg_server, root
        self.handler = RecordingHandler()
        self.loop = Loop()
        self.generation = 0
        self.dirty = False
        self.rebuilds = 0
        self.workers: list[Worker] = []
        self.nats: EmbeddedNats | None = None
        self.db_name: str | None = None
        self.ordinary = 0
        # How many foreign examples were checked end to end, and how many never reached
        # the stream (by the client's or the server's refusal): the test asserts on both.
        self.foreign_checked = 0
        self.foreign_refused: dict[str, int] = {}

    # -- life cycle ---
    def build(self) -> None:
        self.generation += 1
        here = self.root / f"g{self.generation}"
        here.mkdir(parents=True)
        self.db_name = create_database(self.pg_server)
        self.url = self.pg_server.dsn(self.db_name)
        self.nats = EmbeddedNats(here / "nats")
        self.nats.start()
        self.loop.run(apply_streams(self.nats.url, contexts=(CONTEXT,)))
        registry = write_registry(
            here,
            [
                {
                    "name": HANDLER,
                    "url": self.handler.url,
                    "subjects": list(SUBJECTS),
                    # not default: a dead letter stays parked (automated replays, from 30 s on, would re-run an earlier example's message during a later one)
                    "replay_max_attempts": 0,
                    "concurrency": 8,
                }
            ],
        )
        common = {"OUTBOX_NATS_URL": self.nats.url, "OUTBOX_LOG_LEVEL": "INFO"}
        self.workers = [
            Worker(
                "relay",
                here / "relay.log",
                {
                    **common,
                    "OUTBOX_DATABASE_URL": as_role(self.url, "pgoutbox_relay"),
                    "OUTBOX_RELAY_NAME": "fuzz-relay",
                    "OUTBOX_RELAY_HTTP_PORT": "0",
                },
                '"action": "started"',
            ),
            Worker(
                "consume",
                here / "consumer.log",
                {
                    **common,
                    "OUTBOX_DATABASE_URL": as_role(self.url, "pgoutbox_consumer"),
                    "OUTBOX_REGISTRY_FILE": str(registry),
                    "OUTBOX_CONSUMER_HTTP_PORT": "0",
                    "OUTBOX_REPLAY_WORKER": "fuzz",
                },
                "consumer started",
            ),
        ]
        for w in self.workers:
            w.wait_ready()
        self.nc = self.loop.run(nats.connect(self.nats.url, name="poison-test"))
        self.js = self.nc.jetstream(timeout=5)
        self.db = psycopg.connect(self.url, autocommit=True, options="-c statement_timeout=30s")
        self.invalid: dict[int, dict] = {}  # stream sequence -> .invalid notice body
        self.dlq_next = 1
        self.dirty = False

    def teardown(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []
        if getattr(self, "nc", None) is not None:
            try:
                self.loop.run(self.nc.close(), 10)
            except Exception:
                pass
            self.nc = None
        if getattr(self, "db", None) is not None:
            self.db.close()
            self.db = None
        if self.nats:
            self.nats.stop()
            self.nats = None
        if self.db_name:
            drop_database(self.pg_server, self.db_name)
            self.db_name = None

    def close(self) -> None:
        self.teardown()
        self.loop.close()
        self.handler.close()

    def ensure_healthy(self) -> None:
        """After a failed example: keep the world if it still works, else rebuild it."""
        if not self.dirty:
            return
        problems = self.died()
        if not problems:
            problems = self.await_ordinary(self.emit_ordinary())
        if not problems:
            problems = self.await_settled(timeout=5)
        if problems:
            self.rebuilds += 1
            self.teardown()
            self.build()
        self.dirty = False

    # -- observations ---
    def died(self) -> list[str]:
        return [why for w in self.workers if (why := w.died())]

    def poll(self, probe, timeout: float):
        """probe() until truthy; stops early (returning None) when a worker died."""
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value or self.died() or time.monotonic() > deadline:
                return value
            time.sleep(0.05)

    def emit_ordinary(self) -> tuple[str, float]:
        self.ordinary += 1
        event_id = self.db.execute(
            "SELECT outbox.emit('order', %s, %s, %s::jsonb, context => %s)",
            (
                f"ordinary-{self.ordinary}",
                EVENT_TYPE,
                json.dumps({"schema_version": 1, "ordinary": self.ordinary}),
                CONTEXT,
            ),
        ).fetchone()[0]
        return str(event_id), time.monotonic()

    def await_ordinary(self, emitted: tuple[str, float]) -> list[str]:
        event_id, at = emitted
        calls = self.poll(lambda: self.handler.calls_for(event_id), LATENCY)
        if not calls:
            return [
                f"the ordinary event {event_id} emitted after it did not reach the handler within {LATENCY}s"
                + self._state()
            ]
        return []

    def _state(self) -> str:
        try:
            outbox = self.db.execute("SELECT status, count(*) FROM outbox.events GROUP BY 1 ORDER BY 1").fetchall()
            inbox = self.db.execute("SELECT status, count(*) FROM inbox.messages GROUP BY 1 ORDER BY 1").fetchall()
        except psycopg.Error as exc:
            return f" (state unknown: {exc.sqlstate} {exc})"
        return f" (outbox {dict(outbox)}, inbox {dict(inbox)})"

    def unsettled(self) -> list[str]:
        rows = self.db.execute(
            "SELECT 'outbox', status, count(*), min(left(coalesce(last_error, ''), 200)) FROM outbox.events"
            " WHERE status IN ('PENDING', 'PROCESSING', 'FAILED') GROUP BY 2"
            " UNION ALL SELECT 'inbox', status, count(*), min(left(coalesce(last_error, ''), 200))"
            " FROM inbox.messages WHERE status IN ('RECEIVED', 'FAILED') GROUP BY 2"
        ).fetchall()
        return [
            f"{n} {status} in {table}" + (f" (last_error {err!r})" if err else "") for table, status, n, err in rows
        ]

    def await_settled(self, timeout: float = SETTLE) -> list[str]:
        self.poll(lambda: not self.unsettled(), timeout)
        left = self.unsettled()
        return [f"left after {timeout}s: {', '.join(left)}"] if left else []

    def outbox_row(self, event_id: str) -> dict | None:
        row = self.db.execute(
            "SELECT status, last_error, subject FROM outbox.events WHERE event_id = %s", (event_id,)
        ).fetchone()
        return None if row is None else {"status": row[0], "last_error": row[1], "subject": row[2]}

    def inbox_row(self, message_id: str) -> dict | None:
        row = self.db.execute(
            "SELECT status, last_error FROM inbox.messages WHERE message_id = %s AND handler = %s",
            (message_id, HANDLER),
        ).fetchone()
        return None if row is None else {"status": row[0], "last_error": row[1]}

    def invalid_notice(self, sequence: int) -> dict | None:
        """The `.invalid` DLQ notice naming this stream sequence, if any."""
        self.loop.run(self._read_dlq())
        return self.invalid.get(sequence)

    async def _read_dlq(self) -> None:
        try:
            info = await self.js.stream_info(DLQ_STREAM)
        except nats.js.errors.NotFoundError:
            return
        while self.dlq_next <= info.state.last_seq:
            seq, self.dlq_next = self.dlq_next, self.dlq_next + 1
            try:
                msg = await self.js.get_msg(DLQ_STREAM, seq)
            except nats.js.errors.NotFoundError:
                continue
            if not msg.subject.endswith(".invalid"):
                continue
            try:
                body = json.loads(msg.data)
            except ValueError:
                continue
            if body.get("stream") in (None, STREAM) and isinstance(body.get("stream_sequence"), int):
                self.invalid[body["stream_sequence"]] = body

    def reconnect_if_lost(self) -> None:
        """The server closes the test's own connection after a message over
        max_payload (nats-py checks the body, not the headers): a new one, so
        that later examples still reach the stream."""
        if self.nc.is_connected:
            return
        try:
            self.loop.run(self.nc.close(), 5)
        except Exception:
            pass
        self.nc = self.loop.run(nats.connect(self.nats.url, name="poison-test"))
        self.js = self.nc.jetstream(timeout=5)

    # -- one example ---
    def run_emit(self, case: EmitCase) -> list[str]:
        problems: list[str] = []
        sql, params = case.sql(ordering_suffix=f"~{uuid.uuid4().hex[:8]}")
        event_id = None
        try:
            with self.db.transaction():
                event_id = str(self.db.execute(sql, params).fetchone()[0])
        except psycopg.Error as exc:
            if why := refusal_problem(case, exc):
                problems.append(why)
        problems += self.await_ordinary(self.emit_ordinary())
        if event_id:
            problems += self.check_event(case, event_id)
        return problems + self.await_settled(SETTLE if not problems else 2) + self.died()

    def check_event(self, case: EmitCase, event_id: str) -> list[str]:
        row = self.poll(
            lambda: (r := self.outbox_row(event_id)) and r["status"] in ("COMPLETED", "DEAD_LETTER") and r, TERMINAL
        ) or self.outbox_row(event_id)
        if not row or row["status"] not in ("COMPLETED", "DEAD_LETTER"):
            return [
                f"accepted event {event_id} is {row and row['status']} after {TERMINAL}s, not COMPLETED or"
                f" DEAD_LETTER (last_error {row and (row['last_error'] or '')[:300]!r})"
            ]
        if row["status"] == "DEAD_LETTER":
            if not CODED.match(row["last_error"] or ""):
                return [f"event {event_id} is DEAD_LETTER without a code: {(row['last_error'] or '')[:300]!r}"]
            return []
        if row["subject"] not in SUBJECTS:
            return []
        problems = self.await_inbox(event_id, f"event {event_id}")
        for call in self.handler.calls_for(event_id):
            problems += envelope_problems(call, event_id, row["subject"])
            problems += value_problems(call, case)
        return problems

    def await_inbox(self, message_id: str, what: str) -> list[str]:
        done = self.poll(
            lambda: (r := self.inbox_row(message_id)) and r["status"] in ("PROCESSED", "DEAD_LETTER"), TERMINAL
        )
        if not done:
            row = self.inbox_row(message_id)
            return [
                f"{what} is {row and row['status']} in inbox.messages after {TERMINAL}s, not PROCESSED or"
                f" DEAD_LETTER (last_error {row and (row['last_error'] or '')[:300]!r})"
            ]
        return []

    def run_foreign(self, case: ForeignCase) -> list[str]:
        problems: list[str] = []
        msg_id, headers = case.materialise()
        ack = None
        for attempt in range(3):
            self.reconnect_if_lost()
            try:
                ack = self.loop.run(self.js.publish(case.subject, case.body, headers=headers, timeout=5))
                break
            except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError) as exc:
                # On a connection still up, a loaded machine, not the message: tried again, and
                # a problem the third time. The server closes it after a message over max_payload.
                if self.nc.is_connected:
                    if attempt == 2:
                        problems.append(f"foreign message ({case.short()}) not published: {exc!r}")
                    continue
                name = type(exc).__name__
                self.foreign_refused[name] = self.foreign_refused.get(name, 0) + 1
                break
            except Exception as exc:  # refused by the client or the server: it never reached the stream
                name = type(exc).__name__
                self.foreign_refused[name] = self.foreign_refused.get(name, 0) + 1
                break
        problems += self.await_ordinary(self.emit_ordinary())
        if ack is not None and not ack.duplicate:
            self.foreign_checked += 1
            problems += self.check_foreign(case, msg_id, ack.seq)
        return problems + self.await_settled(SETTLE if not problems else 2) + self.died()

    def check_foreign(self, case: ForeignCase, msg_id: str | None, seq: int) -> list[str]:
        mid = canonical(as_sent(msg_id))

        def ended():
            if mid and (r := self.inbox_row(mid)) and r["status"] in ("PROCESSED", "DEAD_LETTER"):
                return "inbox"
            return "invalid" if self.invalid_notice(seq) else None

        where = self.poll(ended, TERMINAL)
        if not where:
            row = self.inbox_row(mid) if mid else None
            return [
                f"foreign message #{seq} (Nats-Msg-Id {msg_id!r}) has no inbox outcome (row:"
                f" {row}) and no .invalid notice after {TERMINAL}s"
            ]
        if where == "invalid":
            return []
        problems = []
        for call in self.handler.calls_for(mid):
            problems += envelope_problems(call, mid, case.subject)
        return problems


def envelope_problems(call: Call, message_id: str, subject: str) -> list[str]:
    env = call.envelope
    if not isinstance(env, dict):
        return [f"handler got a body that is not a JSON object for {message_id}"]
    context, _, event_type, version = subject.split(".")
    expected = {
        "message_id": message_id,
        "subject": subject,
        "context": context,
        "event_type": event_type,
        "event_version": int(version[1:]),
    }
    bad = [f"{k}={env.get(k)!r} (expected {v!r})" for k, v in expected.items() if env.get(k) != v]
    if call.headers.get("Idempotency-Key") != message_id:
        bad.append(f"Idempotency-Key={call.headers.get('Idempotency-Key')!r}")
    if not isinstance(env.get("payload"), dict):
        bad.append(f"payload is {type(env.get('payload')).__name__}: {str(env.get('payload'))[:80]!r}")
    return [f"malformed envelope for {message_id}: {', '.join(bad)}"] if bad else []


def value_problems(call: Call, case: EmitCase) -> list[str]:
    """An accepted event's values reach the handler unaltered."""
    env = call.envelope if isinstance(call.envelope, dict) else {}
    want = {
        "aggregate_type": case.aggregate_type,
        "aggregate_id": case.aggregate_id,
        "tenant_id": case.tenant_id,
        "payload": case.payload,
    }
    bad = [k for k, v in want.items() if env.get(k) != v]
    return (
        [f"values altered on the way to the handler: {', '.join(bad)} (got {[str(env.get(k))[:60] for k in bad]})"]
        if bad
        else []
    )


class PipelineProblem(AssertionError):
    """One kind per class below, so that Hypothesis reports (and shrinks)
    each kind of failure separately instead of the first one only."""


class WorkerExited(PipelineProblem): ...


class OrdinaryEventDelayed(PipelineProblem): ...


class NoOutcome(PipelineProblem): ...


class UncodedRefusal(PipelineProblem): ...


class UncodedDeadLetter(PipelineProblem): ...


class MalformedEnvelope(PipelineProblem): ...


class ValuesAltered(PipelineProblem): ...


# In order of precedence: the first kind found names the failure.
KINDS = (
    (WorkerExited, "process exited with code"),
    (OrdinaryEventDelayed, "the ordinary event"),
    (NoOutcome, " after "),
    (UncodedRefusal, "emit refused with SQLSTATE"),
    (UncodedDeadLetter, "DEAD_LETTER without a code"),
    (MalformedEnvelope, "envelope"),
    (MalformedEnvelope, "handler got a body"),
    (ValuesAltered, "values altered"),
)


def raise_problems(case, problems: list[str]) -> None:
    if not problems:
        return
    kind = next((k for k, marker in KINDS if any(marker in p for p in problems)), PipelineProblem)
    raise kind(f"{case.short()}:\n  - " + "\n  - ".join(problems))


@pytest.fixture(scope="module")
def world(pg_server):
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-poison-"))
    w = World(pg_server, root)
    w.build()
    yield w
    print(
        f"poison world rebuilt {w.rebuilds} time(s); foreign messages checked: {w.foreign_checked},"
        f" refused before the stream: {w.foreign_refused}; logs under {root}"
    )
    w.close()
    # Examples that never reached the stream prove nothing: some must have been checked.
    if w.foreign_refused:
        assert w.foreign_checked > 0, w.foreign_refused


@pytest.mark.slow
@pytest.mark.parametrize("klass", list(CLASSES))
@settings(PROFILE)
@given(data=st.data())
def test_poison_never_stops_the_pipeline(world: World, klass: str, data):
    case = data.draw(CLASSES[klass](), label="case")
    world.ensure_healthy()
    problems = world.run_emit(case) if isinstance(case, EmitCase) else world.run_foreign(case)
    world.dirty = bool(problems)
    raise_problems(case, problems)
