"""Cost of the live latency metrics (not a test): CPU time per event, on this
machine, of what each worker does for them, side by side with what it did
already for every event:

  relay     RelayMetrics.ages (parse created_at once per transaction, one
            histogram observation per event) beside RelayMetrics.count (the
            counters every batch already updated), batches of --batch events,
            --per-transaction events sharing one created_at;
  wire      wire.to_nats of a claimed row with created_at (the extra header)
            and without it;
  consumer  ConsumerMetrics.observe_age (parse Pgoutbox-Created-At, one
            observation) beside ConsumerMetrics.count (the counter every
            message already increments).

The relay and consumer benchmarks (bench/relay_bench.py --parts e --before,
bench/consumer_bench.py --only g --before) measure the whole processes; on a
shared machine their noise is larger than these figures.

    .venv/bin/python bench/metrics_bench.py [--events 200000] [--batch 100] [--per-transaction 1]
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from pgoutbox.core import wire
from pgoutbox.inbox.metrics import ConsumerMetrics, Outcome
from pgoutbox.outbox.metrics import RelayMetrics
from pgoutbox.outbox.publisher import Outcome as Published


def per_event(run: Callable[[], None], events: int, repeat: int = 5) -> float:
    """Best of `repeat` runs: CPU microseconds per event."""
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        run()
        best = min(best, time.process_time() - started)
    return best / events * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=100, help="events per claimed batch")
    ap.add_argument("--per-transaction", type=int, default=1, help="events per emitting transaction")
    args = ap.parse_args()
    n, size = args.events, args.batch

    now = time.time()
    rows = []
    for i in range(size):
        # Wire text as calls.WireTimeLoader hands it out; one text per transaction.
        created = datetime.fromtimestamp(now - 0.01 - i // args.per_transaction * 0.001, UTC)
        rows.append(
            {
                "event_id": str(uuid.uuid4()),
                "subject": "bench.event.tick.v1",
                "context": "bench",
                "event_type": "tick",
                "event_version": 1,
                "aggregate_type": "counter",
                "aggregate_id": str(i),
                "ordering_key": None,
                "occurred_at": wire.wire_time(created.strftime("%Y-%m-%d %H:%M:%S.%f+00")),
                "created_at": wire.wire_time(created.strftime("%Y-%m-%d %H:%M:%S.%f+00")),
                "payload": '{"schema_version": 1, "n": 1, "pad": "' + "x" * 200 + '"}',
                "headers": '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}',
            }
        )
    outcomes = [Published(r["event_id"]) for r in rows]
    contexts = {r["event_id"]: r["context"] for r in rows}
    batches = n // size
    relay = RelayMetrics()

    def ages() -> None:
        for _ in range(batches):
            relay.ages(rows, outcomes, now)

    def count() -> None:
        for _ in range(batches):
            relay.count(contexts, outcomes, set())

    bare = [{k: v for k, v in r.items() if k != "created_at"} for r in rows]

    def encode(these: list[dict]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(batches):
                for row in these:
                    wire.to_nats(row)

        return run

    consumer = ConsumerMetrics()
    headers = wire.to_nats(rows[0])[2]

    def observe() -> None:
        for _ in range(n):
            consumer.observe_age("billing", Outcome.PROCESSED, headers, now)

    def counted() -> None:
        for _ in range(n):
            consumer.count("billing", Outcome.PROCESSED)

    print(f"metrics bench: {n:,} events, batches of {size}, {args.per_transaction} event(s) per transaction")
    new, old = per_event(ages, n), per_event(count, n)
    print(f"  relay     ages (new) {new:6.2f} us/event   count (before) {old:6.2f} us/event")
    with_header, without = per_event(encode(rows), n), per_event(encode(bare), n)
    print(
        f"  wire      to_nats with Pgoutbox-Created-At {with_header:6.2f} us/event, without {without:6.2f} us/event "
        f"(+{with_header - without:.2f})"
    )
    print(
        f"  consumer  observe_age (new) {per_event(observe, n):6.2f} us/message   "
        f"count (before) {per_event(counted, n):6.2f} us/message"
    )


if __name__ == "__main__":
    main()
