"""Replayer: re-publishes due dead letters to their handler.

The policy (exponential delays with jitter, the cap) was applied when the
consumer dead-lettered the row: dlq_metadata.next_replay_at is set, or null
when the row is parked. This loop only takes what is due (inbox.claim_replays,
which also honours the per-handler switch and operator redrives) and
publishes each to `{context}.dlq.replay.{handler}`, which only that handler's
replay durable reads; other handlers never see it.

Each pass is one transaction around claim and publish, committed after every
publish was acknowledged by JetStream (see inbox.claim_replays for why). A
replay that can never be published (larger than the server's max_payload
with its replay headers, no stream, a permanent JetStream refusal) is not
retried pass after pass: it goes back to DEAD_LETTER without a next replay,
last_error starting with REPLAY_UNPUBLISHABLE, in the same transaction; so
does a row no replay can be built from (REPLAY_UNBUILDABLE), while the
pass's other rows are replayed.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import psycopg
from nats.js import JetStreamContext

from pgoutbox.core.backoff import Every
from pgoutbox.core.errors import DatabaseUnavailable, one_line
from pgoutbox.core.stopping import sleep
from pgoutbox.core.wire import PublishError, message_size
from pgoutbox.inbox import dlq
from pgoutbox.inbox.metrics import ConsumerMetrics
from pgoutbox.inbox.store import Inbox

log = logging.getLogger(__name__)

# Prefix of last_error of a dead letter whose replay can never be published.
UNPUBLISHABLE = "REPLAY_UNPUBLISHABLE"
# Prefix of last_error of a dead letter no replay can be built from (a stored
# envelope NATS cannot carry, e.g. admitted by an older release).
UNBUILDABLE = "REPLAY_UNBUILDABLE"


class Replayer:
    def __init__(
        self,
        *,
        inbox: Inbox,
        js: JetStreamContext,
        metrics: ConsumerMetrics,
        worker: str,
        batch_size: int,
        poll_interval: float,
        dlq_max_age: float,
        dlq_duplicate_window: float,
        nc: nats.NATS | None = None,
    ) -> None:
        self.inbox = inbox
        self.js = js
        self.nc = nc  # for its max_payload (None: not checked before publishing)
        self.metrics = metrics
        self.worker = worker
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self._dlq_options = {"max_age": dlq_max_age, "duplicate_window": dlq_duplicate_window}
        self._streams: set[str] = set()

    def use(self, nc: nats.NATS, js: JetStreamContext) -> None:
        """The connection to publish on, after the consumer re-established it."""
        self.nc, self.js = nc, js

    async def _publish(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        max_payload = self.nc.max_payload if self.nc is not None else None
        if max_payload is not None and message_size(body, headers) > max_payload:
            raise dlq.DlqRefused(
                PublishError.MAX_PAYLOAD,
                (
                    f"the replay takes {message_size(body, headers)} bytes with its headers, over the server's "
                    f"max_payload of {max_payload}"
                ),
            )
        await dlq.publish(self.js, subject, body, headers)

    async def _ensure_stream(self, context: str) -> None:
        if context not in self._streams:
            await dlq.ensure_stream(self.js, context, **self._dlq_options)
            self._streams.add(context)

    async def run_once(self) -> int:
        """One pass: returns how many dead letters were re-published."""
        async with self.inbox.claimed_replays(self.worker, self.batch_size) as rows:
            for context in {row["context"] for row in rows}:
                await self._ensure_stream(context)
            # A row no replay can be built from is that row's outcome, not the pass's.
            built: list[tuple[str, bytes, dict[str, str]] | Exception] = []
            for row in rows:
                try:
                    built.append(dlq.replay_message(row))
                except Exception as exc:
                    built.append(exc)

            async def publish(message: tuple[str, bytes, dict[str, str]] | Exception) -> None:
                if isinstance(message, Exception):
                    raise message
                await self._publish(*message)

            # Pipelined: every publish in flight at once, all acked before commit.
            results = await asyncio.gather(*(publish(m) for m in built), return_exceptions=True)
            transient = [
                r
                for r, m in zip(results, built)
                if isinstance(r, BaseException) and not isinstance(r, dlq.DlqRefused) and r is not m
            ]
            if transient:
                raise transient[0]  # all rolled back: the next pass tries again
            for row, result, message in zip(rows, results, built):
                if result is message:
                    error = f"{UNBUILDABLE}: {type(result).__name__}: {result}"
                elif isinstance(result, dlq.DlqRefused):
                    error = f"{UNPUBLISHABLE}: {result}"
                else:
                    continue
                await rows.park(row, error)
                log.error(
                    "no replay can be published; dead letter parked",
                    extra={"handler": row["handler"], "message_id": str(row["message_id"]), "error": error},
                )
        published = [row for row, r in zip(rows, results) if not isinstance(r, BaseException)]
        for row in published:
            self.metrics.replays.labels(row["handler"]).inc()
            log.info(
                "replayed",
                extra={
                    "handler": row["handler"],
                    "message_id": str(row["message_id"]),
                    "replay_attempts": row["dlq_metadata"].get("replay_attempts"),
                    "redrives": row["dlq_metadata"].get("redrives"),
                },
            )
        return len(published)

    async def run(self, stopping: asyncio.Event) -> None:
        every = Every()  # one line per outage, not per pass
        while not stopping.is_set():
            try:
                done = await self.run_once()
            except Exception as exc:
                done = 0
                if every():
                    if isinstance(
                        exc, (DatabaseUnavailable, psycopg.OperationalError, nats.errors.Error, asyncio.TimeoutError)
                    ):
                        log.warning("replay pass failed: %s", one_line(exc))
                    else:
                        log.exception("replay pass failed")
            if done < self.batch_size:  # a full batch means more may be due: go on at once
                await sleep(self.poll_interval, stopping)
