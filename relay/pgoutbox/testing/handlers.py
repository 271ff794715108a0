"""Runs a handler under the consumer's contract without NATS: an event in,
the handler's answer and what the consumer would make of it out.

    result = call_handler("http://127.0.0.1:8082/orders", emitted_event, handler="order_projection")
    assert result.status == 200 and result.action == "processed"

The event goes the consumer's own way, through the code the relay and the
consumer run: pgoutbox.core.wire.to_nats (the message the relay publishes),
wire.from_nats (the envelope the consumer builds from it), the request body
and headers of pgoutbox.inbox.handler_client (Idempotency-Key,
Pgoutbox-Message-Id, Pgoutbox-Handler, Pgoutbox-Delivery, the trace
context; the CloudEvents binary mode for a handler of format
"cloudevents"), and handler_contract.decide for the outcome: "processed"
(2xx, 409), "dead_letter" (422) or "retry" (anything else, no answer).
What the consumer does around the call (inbox dedup, upcasting for a
versioned handler, backoff) is not run: a test of that belongs with a real
consumer.

call_batch_handler does the same for a handler of format "batch": the
events in one request (pgoutbox.inbox.batch), and a result per event, read
from the answer as the consumer reads it (a malformed answer is each event's
BATCH_ANSWER_MALFORMED failure, an unreadable result its event's
BATCH_RESULT_INVALID).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pgoutbox.core import cloudevents, wire
from pgoutbox.inbox import batch, handler_contract
from pgoutbox.inbox.handler_client import (
    HandlerClient,
    cloudevent_lines,
    payload_body,
    request_body,
    request_headers,
)
from pgoutbox.testing.capture import EmittedEvent

DEFAULT_TIMEOUT = 10.0  # seconds: the consumer's default handler timeout (OUTBOX_HANDLER_TIMEOUT)


@dataclass(frozen=True)
class HandlerResult:
    status: int | None  # the HTTP status, None when the handler gave no answer
    action: str  # what the consumer would do: "processed", "dead_letter" or "retry"
    error: str | None  # why there was no answer (timeout, connection error)
    text: str  # the start of the answer's body, for a status of 300 or more
    envelope: dict[str, Any]  # the envelope the consumer built from the message
    request_headers: dict[str, str]  # the headers the consumer sent
    request_body: bytes  # the body the consumer sent


def event(
    event_type: str,
    payload: Mapping[str, Any],
    *,
    context: str = "app",
    aggregate_type: str = "test",
    aggregate_id: str = "1",
    event_version: int = 1,
    **more: Any,
) -> dict[str, Any]:
    """An outbox row for call_handler, without a database: the defaults of
    outbox.emit, a fresh event_id, and any other column given in `more`
    (ordering_key, headers, correlation_id, occurred_at, ...)."""
    return {
        "event_id": str(uuid.uuid4()),
        "subject": f"{context}.event.{event_type}.v{event_version}",
        "context": context,
        "aggregate_type": aggregate_type,
        "aggregate_id": aggregate_id,
        "event_type": event_type,
        "event_version": event_version,
        "payload": dict(payload),
        "headers": {},
        **more,
    }


def _headers_of(lines: bytes) -> dict[str, str]:
    pairs = (line.split(": ", 1) for line in lines.decode().split("\r\n") if line)
    return {name: value for name, value in pairs}


async def acall_handler(
    url: str,
    outbox_event: EmittedEvent | Mapping[str, Any],
    *,
    handler: str = "test_handler",
    delivery: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
    format: str = "json",
    cloudevents_source: str = cloudevents.DEFAULT_SOURCE,
) -> HandlerResult:
    """call_handler() for async tests."""
    row = outbox_event.as_row() if isinstance(outbox_event, EmittedEvent) else dict(outbox_event)
    subject, body, headers = wire.to_nats(row, cloudevents_source)
    envelope = wire.from_nats(subject, body, headers)
    payload = wire.payload_bytes(body, headers)
    attributes = None
    if format == "cloudevents":
        stored = envelope.get("cloudevents")
        attributes = (
            cloudevents.expand(stored, envelope) if stored else cloudevents.derived(envelope, cloudevents_source)
        )
        sent_body = payload_body(envelope, payload)
        sent_headers = _headers_of(cloudevent_lines(attributes, envelope, handler, delivery))
    elif format == "json":
        sent_body = request_body(envelope, payload)
        sent_headers = request_headers(envelope, handler, delivery)
    else:
        raise ValueError(f"format must be 'json' or 'cloudevents', got {format!r}")
    client = HandlerClient(per_origin=1)
    try:
        answer = await client.call(
            url, sent_body, envelope, handler=handler, delivery=delivery, timeout=timeout, cloudevent=attributes
        )
    finally:
        await client.aclose()
    action = handler_contract.decide(answer)
    return HandlerResult(answer.status, action.value, answer.error, answer.text, envelope, sent_headers, sent_body)


def call_handler(
    url: str,
    outbox_event: EmittedEvent | Mapping[str, Any],
    *,
    handler: str = "test_handler",
    delivery: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
    format: str = "json",
    cloudevents_source: str = cloudevents.DEFAULT_SOURCE,
) -> HandlerResult:
    """POSTs the event to the handler at `url` as the consumer would (delivery
    `delivery` of handler `handler`) and reports the answer and its action."""
    return asyncio.run(
        acall_handler(
            url,
            outbox_event,
            handler=handler,
            delivery=delivery,
            timeout=timeout,
            format=format,
            cloudevents_source=cloudevents_source,
        )
    )


@dataclass(frozen=True)
class _Item:
    """A message of a batch request, as pgoutbox.inbox.batch.request_body reads one."""

    envelope: dict[str, Any]
    delivery: int
    body: bytes
    received: int | None = None


async def acall_batch_handler(
    url: str,
    outbox_events: list[EmittedEvent] | list[Mapping[str, Any]],
    *,
    handler: str = "test_handler",
    delivery: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[HandlerResult]:
    """call_batch_handler() for async tests."""
    items = []
    for outbox_event in outbox_events:
        row = outbox_event.as_row() if isinstance(outbox_event, EmittedEvent) else dict(outbox_event)
        subject, body, headers = wire.to_nats(row)
        envelope = wire.from_nats(subject, body, headers)
        items.append(_Item(envelope, delivery, request_body(envelope, wire.payload_bytes(body, headers))))
    sent_body = batch.request_body(items)
    client = HandlerClient(per_origin=1)
    try:
        answer, kept = await client.call_batch(
            url, sent_body, handler=handler, count=len(items), timeout=timeout, keep=batch.ANSWER_KEPT
        )
    finally:
        await client.aclose()
    sent_headers = {
        "Content-Type": "application/json",
        "Pgoutbox-Handler": handler,
        "Pgoutbox-Batch-Size": str(len(items)),
    }
    return [
        HandlerResult(
            each.status,
            handler_contract.decide(each).value,
            each.error,
            each.text,
            item.envelope,
            sent_headers,
            sent_body,
        )
        for item, each in zip(
            items, batch.answers(answer, kept, [i.envelope["message_id"] for i in items]), strict=True
        )
    ]


def call_batch_handler(
    url: str,
    outbox_events: list[EmittedEvent] | list[Mapping[str, Any]],
    *,
    handler: str = "test_handler",
    delivery: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[HandlerResult]:
    """POSTs the events to the batch handler at `url` in one request, as the
    consumer would, and reports each event's answer and action, in order."""
    return asyncio.run(acall_batch_handler(url, outbox_events, handler=handler, delivery=delivery, timeout=timeout))
