"""Replayer (REQ-059): re-publishes due dead letters to their handler.

The policy (exponential delays with jitter, the cap) was applied when the
consumer dead-lettered the row: dlq_metadata.next_replay_at is set, or null
when the row is parked. This loop only takes what is due (inbox.claim_replays,
which also honours the per-handler switch and operator redrives) and
publishes each to `{context}.dlq.replay.{handler}`, which only that handler's
replay durable reads; other handlers never see it.

Each pass is one transaction around claim and publish, committed after every
publish was acknowledged by JetStream (see inbox.claim_replays for why).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from . import dlq
from .consumer_metrics import ConsumerMetrics
from .inbox_store import Inbox

log = logging.getLogger("pgoutbox.replayer")


class Replayer:
    def __init__(
        self, *, inbox: Inbox, js, metrics: ConsumerMetrics, worker: str, batch_size: int,
        poll_interval: float, dlq_max_age: float, dlq_duplicate_window: float,
    ):
        self.inbox = inbox
        self.js = js
        self.metrics = metrics
        self.worker = worker
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self._dlq_options = {"max_age": dlq_max_age, "duplicate_window": dlq_duplicate_window}
        self._streams: set[str] = set()

    async def _ensure_stream(self, context: str) -> None:
        if context not in self._streams:
            await dlq.ensure_stream(self.js, context, **self._dlq_options)
            self._streams.add(context)

    async def run_once(self) -> int:
        """One pass: returns how many dead letters were re-published."""
        async with self.inbox.claimed_replays(self.worker, self.batch_size) as rows:
            for context in {row["context"] for row in rows}:
                await self._ensure_stream(context)
            # Pipelined: every publish in flight at once, all acked before commit.
            messages = [dlq.replay_message(row) for row in rows]
            await asyncio.gather(*(self.js.publish(s, b, headers=h) for s, b, h in messages))
        for row in rows:
            self.metrics.replays.labels(row["handler"]).inc()
            log.info("replayed", extra={
                "handler": row["handler"], "message_id": str(row["message_id"]),
                "replay_attempts": row["dlq_metadata"].get("replay_attempts"),
                "redrives": row["dlq_metadata"].get("redrives"),
            })
        return len(rows)

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                done = await self.run_once()
            except Exception:  # noqa: BLE001 - logged; the rows stay due and are retried
                log.exception("replay pass failed")
                done = 0
            if done < self.batch_size:  # a full batch means more may be due: go on at once
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopping.wait(), self.poll_interval)

