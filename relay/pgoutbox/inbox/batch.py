"""Handlers of format "batch": one POST carries the messages of a fetch that
are to be handled (up to the handler's batch_size), and the handler answers
one result per message, each meaning what the same status means for one
message (handler_contract). Everything else stays per message and as for
any handler (flow.py): the fetch is recorded in the inbox (one
inbox.receive_batch) before the call, each outcome is settled (the batch's
processed and failed ones together, through store.Settler's one
inbox.settle), dead-lettered (its own notice) or sent back, and acked only
after its outcome commits.

Request (Content-Type application/json; headers Pgoutbox-Handler and
Pgoutbox-Batch-Size), messages in stream order:

    {"messages": [{"delivery": 1, "received_version": 1, "trace": {...},
                   "envelope": {<the envelope a single-message handler gets>}}, ...]}

`received_version` only for a handler that declares a version, `trace`
(traceparent, tracestate) only when the message carried one.

Answer: a 2xx with one result per message, in the order of the request:

    {"results": [{"message_id": "...", "status": 200}, {"message_id": "...",
                  "status": 500, "error": "why", "retry_after": 5}, ...]}

An answer about the batch as a whole that is not a 2xx (429, 502, 503, 504,
no connection: the handler is away; a timeout, 500, 422, ...) is every
message's answer. A 2xx whose body cannot be read as that (not JSON, no
results array, a count or message id that does not match the request) is
BATCH_ANSWER_MALFORMED for every message of the batch; one result that
cannot be read (no integer status from 100 to 599, a retry_after that is no
number of seconds) is BATCH_RESULT_INVALID for its message only. Both are
that message's failure, as a broken answer of a single-message handler is:
retried, counted toward max_deliver.

Order per ordering key: a batch lists its messages in stream order, and a
batch that holds a key an earlier batch of the same handler (in this
process) still holds waits for it to finish before it is sent (Lanes), so
a handler never has two messages of one key in flight at once in one
consumer process.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pgoutbox.core.errors import SqlState
from pgoutbox.inbox.handler_client import HandlerAnswer
from pgoutbox.inbox.http1 import TEXT_KEPT


class Admitted(Protocol):
    """A message to send (flow.Admitted): what the request needs of it."""

    @property
    def envelope(self) -> dict[str, Any]: ...
    @property
    def delivery(self) -> int: ...
    @property
    def body(self) -> bytes: ...
    @property
    def received(self) -> int | None: ...


# Bytes of a batch handler's answer read at most: a result is about 100 bytes,
# so 1 MiB holds the results of the largest batch (registry.BATCH_MAX) ten times over.
ANSWER_KEPT = 1 << 20

MALFORMED = f"{SqlState.BATCH_ANSWER_MALFORMED.name} [{SqlState.BATCH_ANSWER_MALFORMED.value}]"
INVALID = f"{SqlState.BATCH_RESULT_INVALID.name} [{SqlState.BATCH_RESULT_INVALID.value}]"

_compact = json.JSONEncoder(separators=(",", ":")).encode


def request_body(items: Sequence[Admitted]) -> bytes:
    """The batch request: each message's envelope as a single-message handler
    gets it (its body, serialised once already), with its delivery count,
    received version and trace context, which travel as headers there."""
    parts = []
    for a in items:
        head = f'{{"delivery":{a.delivery}'
        if a.received is not None:
            head += f',"received_version":{a.received}'
        trace = a.envelope.get("trace")
        if trace:
            head += f',"trace":{_compact({k: v for k, v in trace.items() if isinstance(v, str)})}'
        parts.append(b"".join((head.encode(), b',"envelope":', a.body, b"}")))
    return b'{"messages":[' + b",".join(parts) + b"]}"


def _failure(why: str, answer: HandlerAnswer) -> HandlerAnswer:
    """A message's answer that could not be read: its failure (no status: retried, counted)."""
    return HandlerAnswer(None, why[: TEXT_KEPT + len(MALFORMED) + 2], None, answer.elapsed)


def _result(raw: Any, answer: HandlerAnswer) -> HandlerAnswer:
    status = raw.get("status")
    if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
        return _failure(f"{INVALID}: status {json.dumps(status)[:40]} is not an HTTP status", answer)
    retry_after = raw.get("retry_after")
    if retry_after is not None and (
        isinstance(retry_after, bool)
        or not isinstance(retry_after, (int, float))
        or not math.isfinite(retry_after)
        or retry_after < 0
    ):
        return _failure(f"{INVALID}: retry_after {json.dumps(retry_after)[:40]} is not a number of seconds", answer)
    error = raw.get("error")
    text = error if isinstance(error, str) else "" if error is None else json.dumps(error)
    return HandlerAnswer(status, None, retry_after, answer.elapsed, text[:TEXT_KEPT] if status >= 300 else "")


def answers(answer: HandlerAnswer, body: bytes, message_ids: Sequence[str]) -> list[HandlerAnswer]:
    """Each message's answer, in the order of the request, from the batch's."""
    n = len(message_ids)
    if answer.status is None or not 200 <= answer.status < 300:
        return [answer] * n  # about the batch: every message's, away included
    try:
        document = json.loads(body)
    except ValueError as exc:
        return [_failure(f"{MALFORMED}: not JSON ({exc})", answer)] * n
    results = document.get("results") if isinstance(document, dict) else None
    if not isinstance(results, list):
        return [_failure(f'{MALFORMED}: no "results" array', answer)] * n
    if len(results) != n:
        return [_failure(f"{MALFORMED}: {len(results)} result(s) for {n} message(s)", answer)] * n
    for i, (raw, message_id) in enumerate(zip(results, message_ids, strict=True)):
        if not isinstance(raw, dict) or raw.get("message_id") != message_id:
            got = raw.get("message_id") if isinstance(raw, dict) else raw
            return [
                _failure(f"{MALFORMED}: result {i + 1} is about {json.dumps(got)[:60]}, not {message_id}", answer)
            ] * n
    return [_result(raw, answer) for raw in results]


class Lanes:
    """Per handler, which batch in flight holds each ordering key: a batch
    waits for the earlier ones that hold any of its keys. A batch enters when
    its fetch starts (flow, before its first wait), so in fetch order."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], asyncio.Future[None]] = {}

    def enter(self, handler: str, items: Sequence[Admitted]) -> Batch:
        batch = Batch(self, handler, asyncio.get_running_loop().create_future())
        for a in items:
            key = a.envelope.get("ordering_key")
            if key is None:
                continue
            held = self._held.get((handler, key))
            if held is not None and held is not batch.done:
                batch.waits.add(held)
            self._held[(handler, key)] = batch.done
            batch.keys.add(key)
        return batch

    def leave(self, batch: Batch) -> None:
        for key in batch.keys:
            if self._held.get((batch.handler, key)) is batch.done:
                del self._held[(batch.handler, key)]
        if not batch.done.done():
            batch.done.set_result(None)


# Asks the handler: (request body, message ids) -> (each message's answer, the call's number).
Post = Callable[[bytes, list[str]], Awaitable[tuple[list[HandlerAnswer], int]]]


@dataclass(eq=False)
class Batch:
    """One fetch of a handler of format "batch": one POST for the messages
    to call it with (start), each message's answer (answer_of)."""

    lanes: Lanes
    handler: str
    done: asyncio.Future[None]
    keys: set[str] = field(default_factory=set)
    waits: set[asyncio.Future[None]] = field(default_factory=set)
    _call: asyncio.Task[tuple[list[HandlerAnswer], int]] | None = None

    def start(self, items: Sequence[Admitted], post: Post) -> None:
        """The one POST of `items`, once the earlier batches holding its keys finished."""
        self._call = asyncio.ensure_future(self._post(list(items), post))

    async def _post(self, items: list[Admitted], post: Post) -> tuple[list[HandlerAnswer], int]:
        for earlier in self.waits:
            await earlier
        return await post(request_body(items), [a.envelope["message_id"] for a in items])

    async def answer_of(self, index: int) -> tuple[HandlerAnswer, int]:
        """Message `index`'s answer and the call's number (an exception of the call is each message's)."""
        assert self._call is not None
        each, call = await asyncio.shield(self._call)
        return each[index], call

    def leave(self) -> None:
        if self._call is not None and not self._call.done():
            self._call.cancel()
        self.lanes.leave(self)
