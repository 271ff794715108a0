"""What happens to delivered messages (recorded in the inbox before the
handler is called, acked only after the outcome is recorded). A fetch goes
through together as far as the database is concerned, and each message on
its own otherwise:

  1. build the envelope from the NATS message alone (message_id = the
     canonical text of Nats-Msg-Id; context, type, version from the subject);
     unreadable, or refused by the inbox as data PostgreSQL cannot store ->
     `.invalid` notice naming the header or body at fault, ack;
  2. record the whole fetch in the inbox with one call (inbox.receive_batch;
     inbox.receive per message on schema 7, or when the batch is refused, to
     learn which message is at fault), committed before anything else:
     PROCESSED -> ack, handler not called (duplicate);
     DEAD_LETTER -> ack (parked; its notice is already in the DLQ);
     a handler that declares a version records it with
     inbox.receive_batch_as, which upcasts each older payload to process in
     the same call; one that cannot be upcast (UPCAST_MISSING,
     UPCAST_FAILED) is dead-lettered on its own, as in 4;
  3. POST each envelope to the handler, concurrently; a call that outlives a
     third of ack_wait gets in-progress acks from the consumer's one
     heartbeat (Heartbeat), so that a long handler does not outlive ack_wait;
  4. act on the answer (handler_contract):
     processed   -> inbox.settle (with the other outcomes that are ready:
                    store.Settler), then ack;
     dead letter -> DLQ notice, then inbox.record_error(dead, replay_after),
                    then ack (dlq.DeadLetters). The notice comes first: a DEAD_LETTER row has
                    its notice, and a crash in between only repeats the
                    notice, which JetStream deduplicates. A notice always fits
                    under max_payload (it references the original by stream
                    sequence when copying it would not); one JetStream refuses
                    for good is not retried: last_error says why instead;
     retry       -> inbox.settle (FAILED), then nak with a backoff delay; on
                    the delivery that reaches max_deliver, dead letter instead.

Failures are counted by the inbox (dlq_metadata.failures), not by
JetStream: the durables redeliver without a limit, and a message is
dead-lettered on the handler failure that reaches max_deliver, while the
consumer holds it. A delivery cut short by an outage or a crash records no
failure and costs the message nothing.

PostgreSQL away (database_gate.DatabaseGate): every inbox call of a message in hand waits
for it to come back and runs again, the message kept alive by in-progress
acks, while the consumer stops fetching; an outage of any length only
delays. NATS away: nats-py reconnects; a message whose ack or nak was lost is
redelivered after ack_wait, and the inbox tells what was already done. A
handler is called again for a message it already answered only when its
outcome did not commit after its answer: docs/handlers.md lists the cases.

Every other error while a message is admitted, recorded, handled, settled
or dead-lettered is that message's outcome: `.invalid` before the inbox,
a dead letter (CONSUMER_ERROR) after it. Every message of a fetch is
reported exactly once to the consumer, which gives back its slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.errors
import psycopg

from pgoutbox.core import cloudevents, db, tracing
from pgoutbox.core.backoff import Backoff
from pgoutbox.core.errors import DatabaseUnavailable, PgOutboxError, PolicyViolation, SqlState, one_line
from pgoutbox.core.stopping import wait_set
from pgoutbox.core.wire import InvalidMessage, envelope_from, payload_bytes
from pgoutbox.inbox import batch as batches
from pgoutbox.inbox import dlq
from pgoutbox.inbox.database_gate import DatabaseGate, Stopping
from pgoutbox.inbox.gates import HandlerGate
from pgoutbox.inbox.handler_client import HandlerAnswer, HandlerClient, payload_body, request_body
from pgoutbox.inbox.handler_contract import Action, decide
from pgoutbox.inbox.metrics import ConsumerMetrics, Outcome, answer_of
from pgoutbox.inbox.settings import HandlerRuntime
from pgoutbox.inbox.store import Inbox
from pgoutbox.inbox.tenants import Share

log = logging.getLogger(__name__)
T = TypeVar("T")


def transient(exc: BaseException) -> bool:
    """A server away or slow (PostgreSQL, NATS), not the message's fault:
    it is left for redelivery, never counted as a failure."""
    return isinstance(exc, (DatabaseUnavailable, nats.errors.Error, TimeoutError, OSError))


class Heartbeat:
    """In-progress acks for the messages that need them, from one task for
    the whole consumer: a message is tracked from its fetch until it is
    settled (a dict entry, nothing more), and gets a +WPI each `interval`
    (a third of ack_wait) only once it has been in flight that long. Most
    messages finish long before: they never cost a beat or a task."""

    def __init__(self) -> None:
        # id(msg) -> (msg, next beat, interval): nats-py's Msg is not hashable.
        self._due: dict[int, tuple[Any, float, float]] = {}
        self._tick = 1.0
        self._shorter = asyncio.Event()  # the tick shrank: the sleep under way is too long

    def track(self, msgs: list[Any], interval: float) -> None:
        due = time.monotonic() + interval
        for msg in msgs:
            self._due[id(msg)] = (msg, due, interval)
        # Beats are at most a quarter of an interval late.
        if interval / 4 < self._tick:
            self._tick = interval / 4
            self._shorter.set()

    def done(self, msg: Any) -> None:
        self._due.pop(id(msg), None)

    async def run(self) -> None:
        """Until cancelled: also while the consumer drains its in-flight messages."""
        while True:
            await wait_set(self._shorter, self._tick)
            self._shorter.clear()
            now = time.monotonic()
            late = [(key, msg, interval) for key, (msg, due, interval) in self._due.items() if due <= now]
            for key, msg, interval in late:
                if key not in self._due:
                    continue  # settled while an earlier beat was sent
                self._due[key] = (msg, now + interval, interval)
                try:
                    await msg.in_progress()
                except Exception as exc:
                    log.warning("in-progress ack failed", extra={"error": repr(exc)})


# One encoder, built once (json.dumps with separators builds one per call).
_compact = json.JSONEncoder(separators=(",", ":")).encode

# What the consumer is told as each message of a fetch finishes.
Done = Callable[[Any, "Outcome | Exception | None"], None]


@dataclass(slots=True)
class Admitted:
    """A readable delivery: its envelope, and the request body, serialised once."""

    msg: Any
    envelope: dict[str, Any]
    delivery: int
    body: bytes
    # The version the payload came in at, for a handler that declares one.
    received: int | None = None
    # The payload as it came (None: the body was not the payload, a
    # structured CloudEvent), for a handler of format "cloudevents".
    payload: bytes | None = None

    def stored(self) -> str:
        """The envelope as the inbox stores it (JSON text): the body plus the
        trace context and the CloudEvents attributes a message carried.
        Before given_as(): the inbox keeps what came."""
        trace = json.dumps(self.envelope.get("trace") or {}, separators=(",", ":"))
        ce = self.envelope.get("cloudevents")
        kept = f',"cloudevents":{_compact(ce)}' if ce else ""
        return f'{self.body[:-1].decode()},"trace":{trace}{kept}}}'

    def given_as(self, version: int, upcast_payload: str | None) -> Admitted:
        """The delivery as a handler declaring `version` gets it: the upcast
        payload (JSON text from inbox.receive_batch_as) when it came older."""
        body, payload = self.body, self.payload
        if upcast_payload is not None:
            payload = upcast_payload.encode()
            body = request_body({**self.envelope, "event_version": version}, payload)
        return Admitted(self.msg, self.envelope, self.delivery, body, self.envelope["event_version"], payload)


async def _acked(msg: Any, outcome: Outcome) -> Outcome:
    await msg.ack()
    return outcome


# Prefix of last_error of a message the consumer itself failed on (a defect,
# or an input nobody foresaw): its own dead letter, never the fetch's.
CONSUMER_ERROR = "CONSUMER_ERROR"


def _own_failure(exc: BaseException) -> bool:
    """An inbox call failed for the message it was for, not because
    PostgreSQL is away (db.failure_of: whatever the SQLSTATE, an ASSERT, a
    statement_timeout; DatabaseUnavailable, PostgreSQL away, is raised by the
    pool before this is asked; a clash with a concurrent transaction runs
    again, MessageFlow.database): that message's own outcome, never the fetch's."""
    if isinstance(exc, PgOutboxError):  # an inbox function's refusal, by its code; not a schema mismatch
        return isinstance(exc.code, SqlState) and not isinstance(exc, DatabaseUnavailable)
    return isinstance(exc, psycopg.Error) and db.failure_of(exc) is db.Failure.STATEMENT


def _described(exc: BaseException) -> str:
    """An error's code and text, one line, for last_error."""
    if isinstance(exc, PgOutboxError):
        return f"[{exc.code}] {one_line(exc)}"
    if isinstance(exc, psycopg.Error):
        return f"[{exc.sqlstate}] {one_line(exc.diag.message_primary or exc)}"
    return f"{type(exc).__name__}: {one_line(exc)}"


def _consumed_by(envelope: dict[str, Any], h: HandlerRuntime) -> None:
    """A replay names its original subject in a header: only this handler's
    subjects are taken (the event durable's filter guarantees it for the rest)."""
    if not h.spec.takes(envelope["subject"]):
        raise InvalidMessage(f"subject {envelope['subject']!r} is not one handler {h.name} consumes")


class MessageFlow:
    def __init__(
        self,
        *,
        inbox: Inbox,
        client: HandlerClient,
        nc: Any,
        js: Any,
        metrics: ConsumerMetrics,
        retry_backoff: Backoff,
        replay_backoff: Backoff,
        stopping: asyncio.Event,
        gate: DatabaseGate,
        tracer: tracing.Tracer = tracing.OFF,
        cloudevents_source: str = cloudevents.DEFAULT_SOURCE,
        handler_gates: Mapping[str, HandlerGate] | None = None,
        tenants: Mapping[str, Share] | None = None,
    ) -> None:
        self.inbox = inbox
        # For a handler of format "cloudevents" and a message that came without attributes.
        self.cloudevents_source = cloudevents_source
        self.client = client
        self.metrics = metrics
        self.retry_backoff = retry_backoff
        self.stopping = stopping
        self.gate = gate
        self.dead_letters = dlq.DeadLetters(
            inbox=inbox,
            nc=nc,
            js=js,
            gate=gate,
            stopping=stopping,
            retry_backoff=retry_backoff,
            replay_backoff=replay_backoff,
        )
        # Per handler: closed while it is away (inbox/gates.py); none: every answer is the message's.
        self.handler_gates = handler_gates or {}
        # Per handler: its calls in flight per tenant (inbox/tenants.py); none: no limit.
        self.tenants = tenants or {}
        self.tracing = tracer
        self.heartbeat = Heartbeat()
        # Handlers of format "batch": which batch in flight holds each ordering key.
        self.lanes = batches.Lanes()

    def use(self, nc: Any, js: Any) -> None:
        """The connection to publish on, after the consumer re-established it."""
        self.dead_letters.use(nc, js)

    async def handle_fetch(self, msgs: list[Any], h: HandlerRuntime, done: Done) -> None:
        """Processes the messages of one fetch, and calls done(msg, outcome)
        exactly once for each, as it finishes: a metrics label, the exception
        that left it unacknowledged, or None when it was cancelled or the
        consumer stopped. Never raises but CancelledError."""
        reported: set[int] = set()

        def once(msg: Any, outcome: Outcome | Exception | None) -> None:
            if id(msg) not in reported:
                reported.add(id(msg))
                self.heartbeat.done(msg)
                done(msg, outcome)

        self.heartbeat.track(msgs, h.progress_interval)
        try:
            await self._handle_fetch(msgs, h, once)
        except asyncio.CancelledError:
            for msg in msgs:
                once(msg, None)
            raise
        except Exception as exc:  # a defect: each message not yet answered is left for redelivery
            log.exception("a fetch failed", extra={"handler": h.name})
            for msg in msgs:
                once(msg, exc)
        finally:
            for msg in msgs:
                self.heartbeat.done(msg)

    async def database(self, call: Callable[[], Awaitable[T]]) -> T:
        """Runs an inbox call through the database gate (DatabaseGate.run):
        while PostgreSQL is away, the message waits in hand."""
        return await self.gate.run(call, self.stopping)

    async def _handle_fetch(self, msgs: list[Any], h: HandlerRuntime, done: Done) -> None:
        admitted: list[Admitted] = []
        work: list[Awaitable[None]] = []
        # Tracing is decided once per fetch: off, no message pays for it.
        fetched_ns = time.time_ns() if self.tracing.on else 0
        for msg in msgs:
            got = await self._admit(msg, h)
            if isinstance(got, str):
                work.append(self._run(msg, self.dead_letters.unreadable(msg, h, got), done))
            else:
                admitted.append(got)
        # A handler of format "batch" gets one call for the fetch; it takes its
        # ordering keys now, before the first wait, so batches go in fetch order.
        batch = self.lanes.enter(h.name, admitted) if h.spec.format == "batch" else None
        try:
            await self._handle_admitted(admitted, h, done, work, fetched_ns, batch)
        finally:
            if batch is not None:
                batch.leave()

    async def _handle_admitted(
        self,
        admitted: list[Admitted],
        h: HandlerRuntime,
        done: Done,
        work: list[Awaitable[None]],
        fetched_ns: int,
        batch: batches.Batch | None,
    ) -> None:
        try:
            rows = await self.database(lambda: self._receive_all(h, admitted))
        except Exception as exc:
            for a in admitted:
                done(a.msg, None if isinstance(exc, Stopping) else exc)
            admitted, rows = [], []
        called: list[tuple[Admitted, dict[str, Any]]] = []  # format "batch": the messages of its one call
        for a, row in zip(admitted, rows, strict=True):
            if isinstance(row, str):
                work.append(self._run(a.msg, self.dead_letters.unreadable(a.msg, h, row), done))
            elif row["status"] == "PROCESSED":
                work.append(self._run(a.msg, _acked(a.msg, Outcome.DUPLICATE), done))
            elif row["status"] == "DEAD_LETTER":
                work.append(self._run(a.msg, _acked(a.msg, Outcome.PARKED), done))
            elif row.get("upcast_error"):
                work.append(self._run(a.msg, self._not_upcast(a, h, row), done))
            else:
                if h.spec.version is not None:
                    a = a.given_as(h.spec.version, row.get("upcast_payload"))
                if batch is not None:
                    called.append((a, row))
                    continue
                process = self._traced(a, h, row, fetched_ns) if fetched_ns else self._process(a, h, row)
                work.append(self._run(a.msg, process, done))
        if batch is not None and called:
            batch.start([a for a, _ in called], lambda body, ids: self._ask_batch(h, body, ids))
            for index, (a, row) in enumerate(called):
                work.append(self._run(a.msg, self._process(a, h, row, answer=batch.answer_of(index)), done))
        if len(work) == 1:
            await work[0]
        elif work:
            await asyncio.gather(*work)

    async def _run(self, msg: Any, work: Awaitable[Outcome], done: Done) -> None:
        try:
            outcome: Outcome | Exception | None = await work
        except asyncio.CancelledError:
            done(msg, None)
            raise
        except Stopping:
            outcome = None
        except Exception as exc:
            outcome = exc
        done(msg, outcome)

    # -- admit: a delivery read, or why it is unreadable (dlq.DeadLetters.unreadable) --
    async def _admit(self, msg: Any, h: HandlerRuntime) -> Admitted | str:
        """A delivery read: its envelope and request body, or why it is unreadable."""
        delivery = msg.metadata.num_delivered
        if delivery > 1:
            self.metrics.redeliveries.labels(h.name).inc()
        try:
            envelope = envelope_from(msg.subject, msg.data, msg.headers)
            _consumed_by(envelope, h)
            payload = payload_bytes(msg.data, msg.headers)
            return Admitted(msg, envelope, delivery, request_body(envelope, payload), payload=payload)
        except InvalidMessage as exc:
            return str(exc)
        except Exception as exc:  # an input nobody foresaw: still that message's own outcome
            log.exception("unreadable message", extra={"handler": h.name})
            return f"unreadable ({type(exc).__name__}: {str(exc)[:200]})"

    # -- record: the fetch in the inbox, before anything else --
    async def _receive_all(self, h: HandlerRuntime, admitted: list[Admitted]) -> list[dict[str, Any] | str]:
        """The inbox rows of a fetch, recorded with one call (receive_batch);
        one by one on a schema without it (the store says so), or when the
        batch is refused (to learn which message is at fault and refuse only
        that one)."""
        if not admitted:
            return []
        rows: list[dict[str, Any]] | None = None
        try:
            rows = await self.inbox.receive_batch(
                h.name,
                [a.envelope["message_id"] for a in admitted],
                [a.envelope["subject"] for a in admitted],
                [a.stored() for a in admitted],
                h.spec.version,
            )
        except Exception as exc:
            # Whatever one message's values or upcast raised (any SQLSTATE):
            # each message again on its own, so that only its own call fails.
            if not _own_failure(exc):
                raise
        if rows is not None:
            if [row["ordinal"] for row in rows] != list(range(1, len(admitted) + 1)):
                raise RuntimeError("inbox.receive_batch() did not return one row per message")
            return list(rows)
        if len(admitted) == 1:
            return [await self._receive(h, admitted[0])]
        return list(await asyncio.gather(*(self._receive(h, a) for a in admitted)))

    async def _receive(self, h: HandlerRuntime, a: Admitted) -> dict[str, Any] | str:
        """inbox.receive() (a batch of one for a handler that declares a
        version: it upcasts too), or why the inbox refused the message's values
        (then it cannot enter the inbox: `.invalid`). A versioned call that
        fails where the plain one does not failed on the upcast (a schema
        before 18 lets an upcaster's ASSERT or statement_timeout escape, and
        any schema a timeout of one message's upcasts): the row as received,
        with that failure as its upcast_error, the message's own dead letter."""
        envelope = a.envelope
        version = h.spec.version
        try:
            if version is not None:
                try:
                    return await self._receive_one(h, a, version)
                except Exception as exc:
                    if not _own_failure(exc):
                        raise
                    row = await self._receive_one(h, a, None)  # schema 15 or later: batches
                    if row["status"] in ("RECEIVED", "FAILED"):
                        row["upcast_error"] = (
                            f"{SqlState.UPCAST_FAILED.name} [{SqlState.UPCAST_FAILED.value}]: "
                            f"{envelope['event_type']} v{envelope['event_version']} -> v{version}: {_described(exc)}"
                        )
                    return row
            return await self.inbox.receive(envelope["message_id"], h.name, envelope["subject"], envelope)
        except Exception as exc:
            if not _own_failure(exc):
                raise
            if isinstance(exc, PolicyViolation):
                return f"the inbox refused it: [{exc.code}] {exc}"
            return f"PostgreSQL cannot store it: {_described(exc)}"

    async def _receive_one(self, h: HandlerRuntime, a: Admitted, version: int | None) -> dict[str, Any]:
        """One message's inbox row (receive_batch of one), upcast to `version`
        when it is not None."""
        envelope = a.envelope
        rows = await self.inbox.receive_batch(
            h.name, [envelope["message_id"]], [envelope["subject"]], [a.stored()], version
        )
        assert rows is not None and len(rows) == 1
        return dict(rows[0])

    # -- call: the handler, and what its answer means --
    async def _traced(self, a: Admitted, h: HandlerRuntime, row: dict[str, Any], fetched_ns: int) -> Outcome:
        """_process inside a "process {subject}" span (tracing on)."""
        try:  # JetStream's time of the message, as its reply subject gives it
            wait: float | None = round(fetched_ns / 1e6 - a.msg.metadata.timestamp.timestamp() * 1e3, 3)
        except Exception:
            wait = None
        span = self.tracing.process(a.envelope, h.name, a.delivery, wait)  # never raises
        try:
            outcome = await self._process(a, h, row, span)
        except BaseException as exc:
            # Left for redelivery (stopping, cancelled, a server away): not the message's failure.
            span.end(None, None if isinstance(exc, (asyncio.CancelledError, Stopping)) else exc)
            raise
        span.end(outcome)
        return outcome

    async def _process(
        self,
        a: Admitted,
        h: HandlerRuntime,
        row: dict[str, Any],
        span: tracing.ProcessSpan | None = None,
        answer: Awaitable[tuple[HandlerAnswer, int]] | None = None,
    ) -> Outcome:
        try:
            return await self._call(a, h, row, span, answer)
        except Stopping:
            raise
        except Exception as exc:
            if transient(exc):
                raise
            # A defect, or an input nobody foresaw: this message's own dead
            # letter, whatever the rest of the fetch does.
            log.exception("consumer error on a message", extra={"handler": h.name})
            return await self._dead_lettered(a, h, row, f"{CONSUMER_ERROR}: {type(exc).__name__}: {str(exc)[:500]}")

    async def _call(
        self,
        a: Admitted,
        h: HandlerRuntime,
        row: dict[str, Any],
        span: tracing.ProcessSpan | None = None,
        given: Awaitable[tuple[HandlerAnswer, int]] | None = None,
    ) -> Outcome:
        """Calls the handler and acts on its answer; with a span (tracing on),
        the call is its child CLIENT span (whose traceparent the handler
        receives) and the action its child settle span. `given`: the
        message's answer from its batch's call instead (format "batch"),
        and that call's number."""
        if given is not None:
            answer, call = await given
            return await self._act(a, h, row, decide(answer), answer, call)
        gate = self.handler_gates.get(h.name)
        call = gate.calling() if gate is not None else 0
        if span is None:
            answer = await self._ask(a, h)
            return await self._act(a, h, row, decide(answer), answer, call)
        http = span.http("POST", h.spec.url)
        answer = await self._ask(a, h, http.headers() or None)  # untraced: the envelope's own
        http.end(answer.status, answer.error)
        action = decide(answer)
        if action is Action.PROCESSED:
            operation = "ack"
        elif answer.away and h.name in self.handler_gates:
            operation = "nak"
        elif action is Action.RETRY and self.inbox.failures(row) + 1 < h.max_deliver:
            operation = "nak"
        else:
            operation = "dead_letter"
        settle = span.settle(operation)
        try:
            outcome = await self._act(a, h, row, action, answer, call)
        except BaseException as exc:
            settle.end(exc)
            raise
        settle.end()
        return outcome

    async def _ask(self, a: Admitted, h: HandlerRuntime, trace: dict[str, str] | None = None) -> HandlerAnswer:
        body, attributes = a.body, None
        if h.spec.format == "cloudevents":
            # A versioned handler gets the payload at its version: a derived
            # ce-type names that version, not the one the message came in at.
            as_given = a.envelope if a.received is None else {**a.envelope, "event_version": h.spec.version}
            stored = a.envelope.get("cloudevents")
            attributes = (
                cloudevents.expand(stored, as_given)
                if stored
                else cloudevents.derived(as_given, self.cloudevents_source)
            )
            body = payload_body(a.envelope, a.payload)
        share = self.tenants.get(h.name)
        if share is not None and not await share.acquire(a.envelope, self.stopping):
            raise Stopping()  # held back for its tenant's turn until the consumer stopped
        try:
            answer = await self.client.call(
                h.spec.url,
                body,
                a.envelope,
                handler=h.name,
                delivery=a.delivery,
                timeout=h.timeout,
                received=a.received,
                trace=trace,
                cloudevent=attributes,
            )
        finally:
            if share is not None:
                share.release(a.envelope)
        self.metrics.handler_latency.labels(h.name).observe(answer.elapsed)
        self.metrics.handler_calls.labels(h.name, answer_of(answer.status)).inc()
        return answer

    async def _ask_batch(self, h: HandlerRuntime, body: bytes, ids: list[str]) -> tuple[list[HandlerAnswer], int]:
        """One call of a handler of format "batch" (inbox/batch.py), counted as
        one call: each message's answer, and the call's number for its gate.
        A batch with any message answered tells the gate so before any of its
        messages' away answers is judged: the handler answered a call made
        after their previous away answers (HandlerGate.own_failure)."""
        gate = self.handler_gates.get(h.name)
        call = gate.calling() if gate is not None else 0
        answer, kept = await self.client.call_batch(
            h.spec.url, body, handler=h.name, count=len(ids), timeout=h.timeout, keep=batches.ANSWER_KEPT
        )
        self.metrics.handler_latency.labels(h.name).observe(answer.elapsed)
        self.metrics.handler_calls.labels(h.name, answer_of(answer.status)).inc()
        each = batches.answers(answer, kept, ids)
        if gate is not None and not all(e.away for e in each):
            gate.answered(call)
        return each, call

    # -- settle: the outcome recorded, then the ack or nak --
    async def _act(
        self, a: Admitted, h: HandlerRuntime, row: dict[str, Any], action: Action, answer: HandlerAnswer, call: int = 0
    ) -> Outcome:
        msg, envelope, delivery = a.msg, a.envelope, a.delivery
        message_id = envelope["message_id"]
        gate = self.handler_gates.get(h.name)
        if gate is not None:
            if not answer.away:
                gate.answered(call)
            elif not gate.own_failure(message_id):
                return await self._went_back(a, h, gate, answer)
            else:
                log.warning(
                    "handler away for this message only (it answered others since): counted as its failure",
                    extra={"handler": h.name, "message_id": message_id, "answer": answer.summary},
                )
        failures = self.inbox.failures(row)
        if action is Action.PROCESSED:
            if not await self.database(lambda: self.inbox.settle_one(h.name, message_id)):
                return await self._settled_elsewhere(msg, h, message_id)
            await msg.ack()
            return Outcome.PROCESSED
        # This failure is the handler's (failures + 1)th: the one that reaches
        # max_deliver dead-letters, here, while the message is in hand.
        last = failures + 1 >= h.max_deliver
        if action is Action.RETRY and not last:
            if not await self.database(lambda: self.inbox.settle_one(h.name, message_id, answer.summary)):
                return await self._settled_elsewhere(msg, h, message_id)
            delay = self._retry_delay(answer, failures + 1)
            await msg.nak(delay=delay)
            log.info(
                "handler failed; redelivery scheduled",
                extra={
                    "handler": h.name,
                    "message_id": message_id,
                    "delivery": delivery,
                    "failures": failures + 1,
                    "answer": answer.summary,
                    "nak_delay": round(delay, 3),
                },
            )
            return Outcome.RETRIED
        reason = (
            answer.summary
            if action is Action.DEAD_LETTER
            else (f"max_deliver ({h.max_deliver}) reached; last answer: {answer.summary}")
        )
        return await self._dead_lettered(a, h, row, reason)

    async def _dead_lettered(self, a: Admitted, h: HandlerRuntime, row: dict[str, Any], reason: str) -> Outcome:
        """The message dead-lettered in hand (dlq.DeadLetters), unless
        another delivery settled it first."""
        if not await self.dead_letters.dead_letter(a.msg, h, a.envelope, row, reason):
            return await self._settled_elsewhere(a.msg, h, a.envelope["message_id"])
        return Outcome.DEAD_LETTERED

    async def _not_upcast(self, a: Admitted, h: HandlerRuntime, row: dict[str, Any]) -> Outcome:
        """A payload the upcasters cannot bring to the handler's version: this
        message's own dead letter (replayed like any other: an upcaster
        registered or fixed since is used then)."""
        return await self._dead_lettered(a, h, row, row["upcast_error"])

    async def _went_back(self, a: Admitted, h: HandlerRuntime, gate: HandlerGate, answer: HandlerAnswer) -> Outcome:
        """The handler is away: its gate closes (or stays closed) and the
        message goes back, its row left as it was (no failure counted, not
        FAILED), with the first retry delay: the gate, not this delay, keeps
        it from coming back while the handler is away."""
        gate.away(answer.summary, answer.retry_after)
        await a.msg.nak(delay=self.retry_backoff.delay(1))
        return Outcome.DEFERRED

    async def _settled_elsewhere(self, msg: Any, h: HandlerRuntime, message_id: str) -> Outcome:
        """Another delivery of the same message id (a redelivery while this one
        ran, or the same id published twice) settled the row first: its outcome stands."""
        await msg.ack()
        log.warning(
            "another delivery settled this message first; its outcome stands",
            extra={
                "handler": h.name,
                "message_id": message_id,
            },
        )
        return Outcome.DUPLICATE

    def _retry_delay(self, answer: HandlerAnswer, failure: int) -> float:
        """The nak delay after the handler's failure number `failure` (1, 2, ...)."""
        if answer.retry_after is not None:
            return min(answer.retry_after, self.retry_backoff.max_delay)
        return self.retry_backoff.delay(failure)
