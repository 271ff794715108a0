"""What happens to one delivered message (recorded in the inbox before the
handler is called, acked only after the outcome is recorded):

  1. build the envelope from the NATS message alone (message_id = the
     canonical text of Nats-Msg-Id; context, type, version from the subject);
     unreadable, or refused by the inbox as data PostgreSQL cannot store ->
     `.invalid` notice naming the header or body at fault, ack;
  2. inbox.receive() first, committed before anything else happens:
     PROCESSED -> ack, handler not called (duplicate);
     DEAD_LETTER -> ack (parked; its notice is already in the DLQ);
  3. POST the envelope to the handler, sending in-progress acks meanwhile
     so that a long handler does not outlive ack_wait;
  4. act on the answer (handler_contract):
     processed   -> inbox.mark_processed, then ack;
     dead letter -> DLQ notice, then inbox.record_error(dead, replay_after),
                    then ack. The notice comes first: a DEAD_LETTER row has
                    its notice, and a crash in between only repeats the
                    notice, which JetStream deduplicates. A notice always fits
                    under max_payload (it references the original by stream
                    sequence when copying it would not); one JetStream refuses
                    for good is not retried: last_error says why instead;
     retry       -> inbox.record_error, then nak with a backoff delay; on the
                    delivery that reaches max_deliver, dead letter instead.

A failure of PostgreSQL or NATS in the middle raises: the message is left
unacknowledged and JetStream redelivers it after ack_wait, where the inbox
tells what was already done. A handler is called again for a message it
already answered when mark_processed (or record_error) did not commit after
its answer: docs/consumer.md lists the cases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import psycopg
from nats.aio.msg import Msg

from pgoutbox.core.backoff import Backoff
from pgoutbox.core.errors import IllegalTransition, PolicyViolation, SqlState
from pgoutbox.core.wire import InvalidMessage, PublishError
from pgoutbox.inbox import dlq
from pgoutbox.inbox.handler_client import HandlerAnswer, HandlerClient
from pgoutbox.inbox.handler_contract import Action, decide
from pgoutbox.inbox.metrics import ConsumerMetrics
from pgoutbox.inbox.settings import HandlerRuntime
from pgoutbox.inbox.store import Inbox

log = logging.getLogger("pgoutbox.inbox.consumer")


@contextlib.asynccontextmanager
async def kept_in_progress(msg, every: float):
    """Sends +WPI every `every` seconds until the block exits."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await msg.in_progress()
            except Exception as exc:
                log.warning("in-progress ack failed", extra={"error": repr(exc)})

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# Prefix of last_error when no DLQ notice could be published for a dead letter.
UNPUBLISHABLE = "DLQ_UNPUBLISHABLE"


def _origin(msg) -> tuple[str | None, int | None]:
    """Stream and stream sequence of a delivery, or of a stream's copy (advisory)."""
    if isinstance(msg, Msg):
        return msg.metadata.stream, msg.metadata.sequence.stream
    return msg.stream, msg.seq


def _refuses_data(exc: psycopg.Error) -> bool:
    """PostgreSQL refused the values themselves (data exception, program limit):
    every redelivery would be refused the same way."""
    return (exc.sqlstate or "")[:2] in ("22", "54")


def _consumed_by(envelope: dict[str, Any], h: HandlerRuntime) -> None:
    """A replay names its original subject in a header: only this handler's
    subjects are taken (the event durable's filter guarantees it for the rest)."""
    if envelope["subject"] not in h.spec.subjects:
        raise InvalidMessage(f"subject {envelope['subject']!r} is not one handler {h.name} consumes")


async def _settles(call) -> bool:
    """Awaits an inbox move; False when the row was no longer RECEIVED/FAILED
    (ILLEGAL_TRANSITION): another delivery of the same message settled it."""
    try:
        await call
    except IllegalTransition as exc:
        if exc.code is not SqlState.ILLEGAL_TRANSITION:
            raise
        return False
    return True


class MessageFlow:
    def __init__(
        self,
        *,
        inbox: Inbox,
        client: HandlerClient,
        nc,
        js,
        metrics: ConsumerMetrics,
        retry_backoff: Backoff,
        replay_backoff: Backoff,
        stopping: asyncio.Event,
    ):
        self.inbox = inbox
        self.client = client
        self.nc = nc
        self.js = js
        self.metrics = metrics
        self.retry_backoff = retry_backoff
        self.replay_backoff = replay_backoff
        self.stopping = stopping

    async def handle(self, msg, h: HandlerRuntime) -> str:
        """Processes one delivery; returns its outcome (a metrics label)."""
        delivery = msg.metadata.num_delivered
        if delivery > 1:
            self.metrics.redeliveries.labels(h.name).inc()
        try:
            envelope = dlq.envelope_from(msg.subject, msg.data, msg.headers)
            _consumed_by(envelope, h)
        except InvalidMessage as exc:
            return await self._unreadable(msg, h, str(exc))
        async with kept_in_progress(msg, h.progress_interval):
            return await self._process(msg, h, envelope, delivery)

    def use(self, nc, js) -> None:
        """The connection to publish on, after the consumer re-established it."""
        self.nc, self.js = nc, js

    async def _receive(self, h: HandlerRuntime, envelope: dict[str, Any]) -> dict[str, Any] | str:
        """inbox.receive(), or why the inbox refused the message's values."""
        try:
            return await self.inbox.receive(envelope["message_id"], h.name, envelope["subject"], envelope)
        except PolicyViolation as exc:
            return f"the inbox refused it: [{exc.code}] {exc}"
        except psycopg.Error as exc:
            if not _refuses_data(exc):
                raise
            return f"PostgreSQL cannot store it: [{exc.sqlstate}] {exc.diag.message_primary or exc}"

    async def exhausted(self, h: HandlerRuntime, raw, deliveries: int) -> str:
        """A message JetStream stopped redelivering (its MAX_DELIVERIES
        advisory) without an outcome from us: the consumer stopped, or lost
        PostgreSQL or NATS, during the last delivery. Dead-lettered unless the
        inbox says it was handled after all. `raw` is the stream's copy."""
        try:
            envelope = dlq.envelope_from(raw.subject, raw.data or b"", raw.headers)
            _consumed_by(envelope, h)
        except InvalidMessage as exc:
            return await self._unreadable(raw, h, str(exc))
        row = await self._receive(h, envelope)
        if isinstance(row, str):
            return await self._unreadable(raw, h, row)
        if row["status"] in ("PROCESSED", "DEAD_LETTER"):
            return "duplicate" if row["status"] == "PROCESSED" else "parked"
        reason = f"max_deliver ({deliveries}) reached without an outcome (consumer stopped or lost PostgreSQL/NATS)"
        if row["last_error"]:
            reason += f"; last error: {row['last_error']}"
        return (
            "dead_lettered"
            if await self._dead_letter(None, h, envelope, row, reason, True, _origin(raw))
            else "duplicate"
        )

    async def _process(self, msg, h: HandlerRuntime, envelope: dict[str, Any], delivery: int) -> str:
        message_id = envelope["message_id"]
        row = await self._receive(h, envelope)
        if isinstance(row, str):
            return await self._unreadable(msg, h, row)
        if row["status"] == "PROCESSED":
            await msg.ack()
            return "duplicate"
        if row["status"] == "DEAD_LETTER":
            await msg.ack()
            return "parked"

        answer = await self.client.call(h.spec.url, envelope, handler=h.name, delivery=delivery, timeout=h.timeout)
        self.metrics.handler_latency.labels(h.name).observe(answer.elapsed)
        action = decide(answer)
        if action is Action.PROCESSED:
            if not await _settles(self.inbox.mark_processed(message_id, h.name)):
                return await self._settled_elsewhere(msg, h, message_id)
            await msg.ack()
            return "processed"
        last = delivery >= h.max_deliver
        if action is Action.RETRY and not last:
            if not await _settles(self.inbox.record_error(message_id, h.name, answer.summary)):
                return await self._settled_elsewhere(msg, h, message_id)
            delay = self._retry_delay(answer, delivery)
            await msg.nak(delay=delay)
            log.info(
                "handler failed; redelivery scheduled",
                extra={
                    "handler": h.name,
                    "message_id": message_id,
                    "delivery": delivery,
                    "answer": answer.summary,
                    "nak_delay": round(delay, 3),
                },
            )
            return "retried"
        reason = (
            answer.summary
            if action is Action.DEAD_LETTER
            else (f"max_deliver ({h.max_deliver}) reached; last answer: {answer.summary}")
        )
        if not await self._dead_letter(msg, h, envelope, row, reason, last, _origin(msg)):
            return await self._settled_elsewhere(msg, h, message_id)
        return "dead_lettered"

    async def _settled_elsewhere(self, msg, h: HandlerRuntime, message_id: str) -> str:
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
        return "duplicate"

    def _retry_delay(self, answer: HandlerAnswer, delivery: int) -> float:
        if answer.retry_after is not None:
            return min(answer.retry_after, self.retry_backoff.max_delay)
        return self.retry_backoff.delay(delivery)

    async def _dead_letter(
        self,
        msg,
        h: HandlerRuntime,
        envelope: dict[str, Any],
        row: dict[str, Any],
        reason: str,
        last: bool,
        origin: tuple[str | None, int | None],
    ) -> bool:
        """Publishes the notice, records the dead letter, acks; False when
        another delivery settled the row first (nothing recorded or acked)."""
        meta = row["dlq_metadata"] or {}
        replays = int(meta.get("replay_attempts") or 0)
        replay_after = self.replay_backoff.delay(replays + 1) if replays < h.replay_max_attempts else None
        message_id = envelope["message_id"]
        stream, sequence = origin

        def build(copy: bool) -> tuple[str, bytes, dict[str, str]]:
            return dlq.notice(
                context=h.spec.context,
                handler=h.name,
                message_id=message_id,
                original_subject=envelope["subject"],
                reason=reason,
                attempts=row["attempts"],
                dead_letters=int(meta.get("dead_letters") or 0) + 1,
                replay_attempts=replays,
                next_replay_in=replay_after,
                envelope=envelope,
                stream=stream,
                stream_sequence=sequence,
                max_payload=self.nc.max_payload,
                copy=copy,
            )

        subject, problem = await self._publish_notice(build, persist=last)
        recorded = reason if problem is None else f"{UNPUBLISHABLE}: {problem}; {reason}"
        if not await _settles(
            self.inbox.record_error(message_id, h.name, recorded, dead=True, replay_after=replay_after)
        ):
            return False
        if msg is not None:
            await msg.ack()
        log.warning(
            "dead-lettered",
            extra={
                "handler": h.name,
                "message_id": message_id,
                "reason": recorded,
                "dlq_subject": subject,
                "replay_in": None if replay_after is None else round(replay_after, 3),
            },
        )
        return True

    async def _publish_notice(self, build, *, persist: bool) -> tuple[str | None, str | None]:
        """Publishes the notice build(copy) makes: the original copied when it
        fits, else referenced; referenced again when JetStream refuses the
        copy as too large (a stream's max_msg_size). Returns (subject, None),
        or (None, why) when no notice can ever be published."""
        problem = None
        for copy in (True, False):
            try:
                subject, body, headers = build(copy)
            except dlq.NoticeTooLarge as exc:
                return None, f"{PublishError.MAX_PAYLOAD}: {exc}"
            try:
                await self._publish(subject, body, headers, persist=persist)
                return subject, None
            except dlq.DlqRefused as exc:
                problem = str(exc)
                if exc.code is not PublishError.MAX_PAYLOAD:
                    break
        log.error("no DLQ notice can be published", extra={"error": problem})
        return None, problem

    async def _publish(self, subject: str, body: bytes, headers: dict[str, str], *, persist: bool) -> None:
        """Publishes to the DLQ. On the last allowed delivery JetStream will
        not redeliver, so a failed publish is retried here (the message kept
        alive by in-progress acks) until it succeeds or the consumer stops;
        a permanent refusal (dlq.DlqRefused) is never retried."""
        attempt = 0
        while True:
            attempt += 1
            try:
                await dlq.publish(self.js, subject, body, headers)
                return
            except dlq.DlqRefused:
                raise
            except Exception as exc:
                if not persist or self.stopping.is_set():
                    raise
                delay = self.retry_backoff.delay(attempt)
                log.error(
                    "DLQ publish failed on the last delivery; retrying",
                    extra={
                        "dlq_subject": subject,
                        "error": repr(exc),
                        "retry_in": round(delay, 3),
                    },
                )
                await asyncio.sleep(delay)

    async def _unreadable(self, msg, h: HandlerRuntime, why: str) -> str:
        """Publishes a message that cannot enter the inbox to `.invalid`, raw
        when that fits; acks it when it was delivered (a stream's copy, from an
        advisory, has nothing to ack). When no notice can be published, the
        error log line (stream and sequence) is what is left to find."""
        stream, sequence = _origin(msg)
        reason = f"{SqlState.INVALID_MESSAGE.name} [{SqlState.INVALID_MESSAGE.value}]: {why}"

        def build(copy: bool) -> tuple[str, bytes, dict[str, str]]:
            return dlq.unreadable_notice(
                context=h.spec.context,
                handler=h.name,
                stream=stream,
                sequence=sequence,
                subject=msg.subject,
                body=msg.data or b"",
                headers=msg.headers,
                reason=reason,
                max_payload=self.nc.max_payload,
                copy=copy,
            )

        subject, problem = await self._publish_notice(build, persist=False)
        if isinstance(msg, Msg):
            await msg.ack()
        log.error(
            "unreadable message sent to the DLQ"
            if problem is None
            else f"unreadable message acknowledged without a DLQ notice ({UNPUBLISHABLE})",
            extra={
                "handler": h.name,
                "stream": stream,
                "stream_sequence": sequence,
                "subject": msg.subject,
                "reason": why,
                "dlq_subject": subject,
                "error": problem,
            },
        )
        return "invalid"
