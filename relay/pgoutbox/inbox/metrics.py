"""Prometheus metrics of the consumer and replayer (served by
core/health.py::HealthServer; /readyz fails unless NATS and PostgreSQL are
reachable and every durable is bound).

Each Consumer owns its own CollectorRegistry, so several can share a process
(tests, the benchmark) without clashing on metric names.

Names: pgoutbox_consumer_* and pgoutbox_replayer_* for what this process did,
pgoutbox_inbox_* for what inbox.backlog() reports of the table; a base unit or
the thing counted ends the name, `_total` a counter. The help texts are the
metrics table of docs/reference.md (`make docs/reference`).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pgoutbox.core.health import AGE_BUCKETS
from pgoutbox.core.wire import created_epoch


class Outcome(StrEnum):
    """What became of a delivery: the `outcome` label of the messages counter
    (a str: labels and logs read the same as plain strings)."""

    PROCESSED = "processed"
    DUPLICATE = "duplicate"  # already processed: acked, handler not called
    PARKED = "parked"  # already dead-lettered: acked
    DEAD_LETTERED = "dead_lettered"
    RETRIED = "retried"
    INVALID = "invalid"  # unreadable: sent to .invalid
    ERROR = "error"  # an infrastructure failure: not acked
    DEFERRED = "deferred"  # the handler was away: nak'ed, no failure counted (inbox/gates.py)


class Answer(StrEnum):
    """The handler's answer, as the `answer` label of the handler calls counter
    (handler_contract.py says what each one does)."""

    OK = "ok"  # 2xx: processed
    ALREADY_DONE = "already_done"  # 409: the handler had it already (a duplicate it caught)
    POISON = "poison"  # 422: dead-lettered
    FAILED = "failed"  # any other status, a timeout or a connection failure: retried


def answer_of(status: int | None) -> Answer:
    if status is None:
        return Answer.FAILED
    if 200 <= status < 300:
        return Answer.OK
    return {409: Answer.ALREADY_DONE, 422: Answer.POISON}.get(status, Answer.FAILED)


class ConsumerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.messages = Counter(
            "pgoutbox_consumer_messages",
            "Deliveries handled, by outcome: processed; duplicate (already processed, skipped, or settled "
            "first by another delivery of the same id); parked (already dead-lettered); dead_lettered; retried; "
            "invalid (unreadable, refused to .invalid); error (PostgreSQL or NATS failure: not acked, redelivered); "
            "deferred (the handler was away: nak'ed, no failure counted)",
            ["handler", "outcome"],
            registry=r,
        )
        self.redeliveries = Counter(
            "pgoutbox_consumer_redeliveries",
            "Deliveries JetStream had made before (delivery count > 1)",
            ["handler"],
            registry=r,
        )
        self.handler_latency = Histogram(
            "pgoutbox_consumer_handler_duration_seconds",
            "Duration of the HTTP call to the handler",
            ["handler"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.handler_calls = Counter(
            "pgoutbox_consumer_handler_calls",
            "Calls to the handler (each delivery it was given, retries included), by answer: ok (2xx); "
            "already_done (409: a duplicate the handler caught); poison (422); failed (any other status, "
            "timeout, connection failure)",
            ["handler", "answer"],
            registry=r,
        )
        self.age_at_outcome = Histogram(
            "pgoutbox_consumer_event_age_at_outcome_seconds",
            "Age of each message when its outcome was recorded (the outcomes of the messages counter but error): "
            "from its Pgoutbox-Created-At (the emitting transaction's time, PostgreSQL's clock) to then "
            "(this host's clock); messages without that header are not observed",
            ["handler", "outcome"],
            buckets=AGE_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "pgoutbox_consumer_in_flight_messages",
            "Messages being processed",
            ["handler"],
            registry=r,
        )
        self.tenant_held = Gauge(
            "pgoutbox_consumer_tenant_held_messages",
            "Messages held back now because their tenant has tenant_concurrency handler calls in flight: "
            "recorded in the inbox, kept alive by in-progress acks, neither nak'ed nor failed",
            ["handler"],
            registry=r,
        )
        self.tenant_holds = Counter(
            "pgoutbox_consumer_tenant_holds",
            "Messages that waited for their tenant's turn (tenant_concurrency) before their handler call",
            ["handler"],
            registry=r,
        )
        self.handler_up = Gauge(
            "pgoutbox_consumer_handler_up",
            "1 while the handler answers, 0 while it is away (no connection, 429, 502, 503, 504): its gate is "
            "closed, nothing is fetched for it but one probe with growing pauses",
            ["handler"],
            registry=r,
        )
        self.backlog = Gauge(
            "pgoutbox_inbox_backlog_messages",
            "Inbox rows by kind (unprocessed, failed, dead_letter), per inbox.backlog()",
            ["context", "handler", "kind"],
            registry=r,
        )
        self.oldest_unprocessed_age = Gauge(
            "pgoutbox_inbox_oldest_unprocessed_age_seconds",
            "Age of the oldest unprocessed inbox row (0: none)",
            ["context", "handler"],
            registry=r,
        )
        self.replays = Counter(
            "pgoutbox_replayer_published_messages",
            "Dead letters re-published to their handler's replay subject",
            ["handler"],
            registry=r,
        )

    def count(self, handler: str, outcome: Outcome) -> None:
        self.messages.labels(handler, outcome).inc()

    def observe_age(self, handler: str, outcome: Outcome, headers: Mapping[str, str] | None, now: float) -> None:
        """The message's age at its outcome, when it says when it was created;
        a missing or unreadable Pgoutbox-Created-At is no fault of the message."""
        created = created_epoch(headers)
        if created is not None:
            # Clocks apart (PostgreSQL's and this host's) can make it negative: 0, not a negative sum.
            self.age_at_outcome.labels(handler, outcome).observe(max(0.0, now - created))

    def value(self, handler: str, outcome: Outcome | str) -> float:
        """The current count (for tests and the benchmark)."""
        return (
            self.registry.get_sample_value("pgoutbox_consumer_messages_total", {"handler": handler, "outcome": outcome})
            or 0.0
        )

    def set_backlog(self, rows: list[dict[str, Any]], now: float) -> None:
        self.backlog.clear()
        self.oldest_unprocessed_age.clear()
        for row in rows:
            labels = (row["context"], row["handler"])
            self.backlog.labels(*labels, "unprocessed").set(row["unprocessed"])
            self.backlog.labels(*labels, "failed").set(row["failed"])
            self.backlog.labels(*labels, "dead_letter").set(row["dead_letter"])
            oldest = row["oldest_unprocessed_at"]
            self.oldest_unprocessed_age.labels(*labels).set(now - oldest.timestamp() if oldest else 0)
