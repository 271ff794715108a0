"""CloudEvents benchmark (not a test): what the ce-* headers cost per event,
this build against --before COMMIT (default: the parent of the first
CloudEvents commit), on the same row and the same machine:

  - core.wire.to_nats, the relay's encoding of one claimed row (~200 bytes of
    payload and a traceparent, as bench/relay_bench.py emits);
  - core.wire.from_nats, the consumer's reading of the message it gives, and
    the consumer's whole Python work on it before the inbox call (envelope,
    request body, the envelope text the inbox stores);
  - the header bytes of the message (what counts against max_payload) and
    the bytes of the envelope the inbox stores.

Each figure is the best of --repeat runs of --number calls (CPU microseconds
per call), each build in its own subprocess with its package first on PYTHONPATH
(harness.releases.export), alternating builds --rounds times. The relay
and consumer benchmarks give the figures per event of the whole processes
(relay_bench.py --parts e --before, consumer_bench.py --only g --before).

    .venv/bin/python bench/cloudevents_bench.py [--before 8ff7cc8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import checkout  # noqa: F401  (the checkout's root on sys.path, for harness/)
import machine
from harness import releases

ROOT = Path(__file__).resolve().parents[1]
ROW = {
    "event_id": "5b0c4bd5-bd35-4ef4-8a8c-1a1d0d1f1f00",
    "subject": "bench.event.order_created.v1",
    "context": "bench",
    "event_type": "order_created",
    "event_version": 1,
    "aggregate_type": "order",
    "aggregate_id": "12345",
    "occurred_at": "2025-01-02T03:04:05.123456Z",
    "correlation_id": None,
    "causation_id": None,
    "tenant_id": None,
    "ordering_key": None,
    "payload": json.dumps({"schema_version": 1, "order_id": 12345, "pad": "x" * 160}),
    "headers": '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}',
}


def measure(number: int, repeat: int) -> dict[str, float]:
    """In the subprocess: the figures of the pgoutbox first on sys.path."""
    from pgoutbox.core import wire

    subject, body, headers = wire.to_nats(ROW)

    def best(call: object) -> float:
        # CPU time of this process: the machine is shared, and wall time counts the others' turns too.
        runs = timeit.repeat(call, number=number, repeat=repeat, timer=time.process_time)  # type: ignore[arg-type]
        return min(runs) / number * 1e6

    from pgoutbox.inbox import dlq, flow, handler_client

    # A build older than core.wire.envelope_from has it in inbox/dlq.py.
    envelope_from = wire.envelope_from if hasattr(wire, "envelope_from") else dlq.envelope_from

    def admit() -> str:
        """The consumer's Python work on one message before the inbox call (MessageFlow._admit, stored())."""
        envelope = envelope_from(subject, body, headers)
        raw = wire.payload_bytes(body, headers) if hasattr(wire, "payload_bytes") else body
        admitted = flow.Admitted(None, envelope, 1, handler_client.request_body(envelope, raw))
        return admitted.stored()

    return {
        "to_nats_us": best(lambda: wire.to_nats(ROW)),
        "from_nats_us": best(lambda: wire.from_nats(subject, body, headers)),
        "admit_us": best(admit),
        "stored_bytes": len(admit().encode()),
        "header_bytes": wire.message_size(body, headers) - len(body),
    }


def main() -> int:
    if sys.argv[1:2] == ["--measure"]:
        print(json.dumps(measure(int(sys.argv[2]), int(sys.argv[3]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="8ff7cc8", help="the commit to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--number", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"cloudevents bench: {machine.load()}")
    with tempfile.TemporaryDirectory(prefix="pgoutbox-ce-bench-") as tmp:
        builds = {
            f"before ({args.before})": str(releases.export(ROOT, args.before, Path(tmp) / "before")),
            "this build": str(ROOT / "relay"),
        }
        got: dict[str, list[dict[str, float]]] = {label: [] for label in builds}
        for _ in range(args.rounds):
            for label, path in builds.items():
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([path, str(ROOT / "bench")])}
                out = subprocess.run(
                    [sys.executable, __file__, "--measure", str(args.number), str(args.repeat)],
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                )
                got[label].append(json.loads(out.stdout))
    print(f"  median of {args.rounds} round(s), best of {args.repeat} x {args.number:,} calls each:")
    for label, runs in got.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"    {label:22s} to_nats {med['to_nats_us']:5.2f} us  from_nats {med['from_nats_us']:5.2f} us"
            f"  admit {med['admit_us']:5.2f} us;  headers {med['header_bytes']:.0f} bytes,"
            f" inbox envelope {med['stored_bytes']:.0f} bytes"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
