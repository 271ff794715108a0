"""The relay's Prometheus metrics, in a registry of its own (one per relay, so
several relays in one process, as in the tests, do not collide).

Names: pgoutbox_relay_* for what this relay did, pgoutbox_outbox_* for what
outbox.backlog() reports of the table (the same for every relay); a base unit
or the thing counted ends the name, `_total` a counter. The help texts are the
metrics table of docs/reference.md (`make docs/reference`)."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pgoutbox.core.health import AGE_BUCKETS
from pgoutbox.core.wire import PublishError
from pgoutbox.outbox.publisher import Outcome

_BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_NONE = object()


class RelayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.published = Counter(
            "pgoutbox_relay_published_events", "Events acked by JetStream and marked COMPLETED", ["context"], registry=r
        )
        self.duplicates = Counter(
            "pgoutbox_relay_duplicate_events",
            "Published events JetStream reported as duplicates (a re-publish)",
            ["context"],
            registry=r,
        )
        self.failed = Counter(
            "pgoutbox_relay_failed_events",
            "Events whose publish failed, marked FAILED for a retry",
            ["context", "code"],
            registry=r,
        )
        self.dead_lettered = Counter(
            "pgoutbox_relay_dead_lettered_events",
            "Events whose publish failed for the last time, marked DEAD_LETTER",
            ["context", "code"],
            registry=r,
        )
        self.handed_back = Counter(
            "pgoutbox_relay_handed_back_events",
            "Events JetStream did not answer for, handed back as due with no attempt counted",
            ["context", "code"],
            registry=r,
        )
        self.age_at_publish = Histogram(
            "pgoutbox_relay_event_age_at_publish_seconds",
            "Age of each published event when JetStream acked it: from created_at (the emitting "
            "transaction's time, PostgreSQL's clock) to the ack of its batch (this host's clock)",
            ["context"],
            buckets=AGE_BUCKETS,
            registry=r,
        )
        self.stale_claims = Counter(
            "pgoutbox_relay_stale_claims", "Marks refused because another relay had taken the lease over", registry=r
        )
        self.batch_size = Histogram(
            "pgoutbox_relay_batch_events", "Events per claimed batch", buckets=_BATCH_BUCKETS, registry=r
        )
        self.publish_seconds = Histogram(
            "pgoutbox_relay_publish_duration_seconds",
            "Time from a batch's first publish to its last ack",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.claim_seconds = Histogram(
            "pgoutbox_relay_claim_duration_seconds", "Duration of outbox.claim()", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.unpublished = Gauge(
            "pgoutbox_outbox_unpublished_events",
            "Events not yet published, per outbox.backlog()",
            ["context"],
            registry=r,
        )
        self.due = Gauge("pgoutbox_outbox_due_events", "Events a relay could claim now", ["context"], registry=r)
        self.oldest_due_age = Gauge(
            "pgoutbox_outbox_oldest_due_age_seconds", "Age of the oldest due event (0: none)", ["context"], registry=r
        )
        self.dead_letter = Gauge("pgoutbox_outbox_dead_letter_events", "Events in DEAD_LETTER", ["context"], registry=r)
        self.oldest_snapshot_age = Gauge(
            "pgoutbox_outbox_oldest_snapshot_age_seconds",
            "Age of the oldest snapshot that keeps vacuum from pgoutbox's dead rows, per "
            "outbox.oldest_snapshots(): a session's transaction or a prepared transaction (0: none)",
            registry=r,
        )
        self.oldest_snapshot_xids = Gauge(
            "pgoutbox_outbox_oldest_snapshot_age_xids",
            "Transactions since the oldest snapshot that keeps vacuum from pgoutbox's dead rows "
            "(sessions, prepared transactions, replication slots; 0: none)",
            registry=r,
        )
        self.database_up = Gauge(
            "pgoutbox_relay_database_up", "1 when the claim connection to PostgreSQL works", registry=r
        )
        self.nats_up = Gauge("pgoutbox_relay_nats_up", "1 when connected to NATS", registry=r)
        self.jetstream_up = Gauge(
            "pgoutbox_relay_jetstream_up",
            "0 while JetStream does not answer publishes (claiming paused, events handed back), else 1",
            registry=r,
        )
        self.jetstream_up.set(1)
        self.ready = Gauge("pgoutbox_relay_ready", "1 when /readyz answers 200", registry=r)

    def count(
        self,
        contexts: dict[Any, str],
        outcomes: list[Outcome],
        dead: set[Any],
        handed_back: AbstractSet[Any] = frozenset(),
    ) -> None:
        """Counts one batch's outcomes; contexts maps event_id -> context."""
        published: Tally[str] = Tally()
        duplicates: Tally[str] = Tally()
        failed: Tally[tuple[str, PublishError | None]] = Tally()
        dead_lettered: Tally[tuple[str, PublishError | None]] = Tally()
        back: Tally[tuple[str, PublishError | None]] = Tally()
        for o in outcomes:
            ctx = contexts[o.event_id]
            if o.ok:
                published[ctx] += 1
                duplicates[ctx] += o.duplicate
            elif o.event_id in dead:
                dead_lettered[(ctx, o.code)] += 1
            elif o.event_id in handed_back:
                back[(ctx, o.code)] += 1
            else:
                failed[(ctx, o.code)] += 1
        for ctx, n in published.items():
            self.published.labels(ctx).inc(n)
            if duplicates[ctx]:
                self.duplicates.labels(ctx).inc(duplicates[ctx])
        for (ctx, code), n in failed.items():
            self.failed.labels(ctx, code).inc(n)
        for (ctx, code), n in dead_lettered.items():
            self.dead_lettered.labels(ctx, code).inc(n)
        for (ctx, code), n in back.items():
            self.handed_back.labels(ctx, code).inc(n)

    def ages(self, rows: Sequence[dict[str, Any]], outcomes: Sequence[Outcome], acked: float) -> None:
        """Observes the age of each published event of a batch at `acked`
        (POSIX time), once per batch and context (observe_many). created_at
        arrives as wire text (calls.WireTimeLoader); a value that is no time
        (wire.Unrepresentable, None) is skipped. The events of one
        transaction share created_at: parsed once."""
        last_text: Any = _NONE
        last_age: float | None = None
        by_context: dict[str, list[float]] = {}
        for row, outcome in zip(rows, outcomes):
            if not outcome.ok:
                continue
            text = row.get("created_at")
            if text != last_text:
                last_text, epoch = text, _epoch(text)
                # Clocks apart (PostgreSQL's and this host's) can make it negative: 0, not a negative sum.
                last_age = None if epoch is None else max(0.0, acked - epoch)
            if last_age is None:
                continue
            ctx = row["context"]
            ages = by_context.get(ctx)
            if ages is None:
                ages = by_context[ctx] = []
            ages.append(last_age)
        for ctx, ages in by_context.items():
            observe_many(self.age_at_publish.labels(ctx), ages)

    def backlog(self, rows: list[dict[str, Any]]) -> None:
        seen = set()
        for row in rows:
            ctx = row["context"]
            seen.add(ctx)
            self.unpublished.labels(ctx).set(row["unpublished"])
            self.due.labels(ctx).set(row["due"])
            age = row["oldest_due_age"]
            self.oldest_due_age.labels(ctx).set(age.total_seconds() if age else 0)
            self.dead_letter.labels(ctx).set(row["dead_letter"])
        for gauge in (self.unpublished, self.due, self.oldest_due_age, self.dead_letter):
            for (ctx,) in list(gauge._metrics):  # contexts that have emptied out
                if ctx not in seen:
                    gauge.labels(ctx).set(0)


def _epoch(value: Any) -> float | None:
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    if isinstance(value, datetime):
        return value.timestamp()
    return None  # None, or wire.Unrepresentable


def observe_many(child: Any, amounts: Sequence[float]) -> None:
    """Histogram.observe for each amount, with one increment per bucket hit
    and one of the sum: a batch's events cost one update each, not one
    locked update of two values per event. prometheus_client keeps a
    histogram's buckets uncounted (each counts only its own range) and adds
    them up when scraped; a client without these internals is observed one
    amount at a time."""
    bounds, buckets, total = (
        getattr(child, "_upper_bounds", None),
        getattr(child, "_buckets", None),
        getattr(child, "_sum", None),
    )
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for amount in amounts:
            child.observe(amount)
        return
    hits = Tally(bisect_left(bounds, amount) for amount in amounts)  # the first bound >= amount, as observe() finds it
    for index, count in hits.items():
        buckets[index].inc(count)
    total.inc(math.fsum(amounts))
