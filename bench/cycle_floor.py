"""What a relay's claim cycle costs its process at the least, on this stack
(psycopg 3 + nats-py, one asyncio process): figures, not a test.

A relay pays per claim cycle (claim, publish, acks, mark, the pause) and per
event. At a moderate rate the claim interval fixes how many events share a
cycle (500/s with a claim every 10 ms: 5); at saturation a cycle carries a
full batch (500). This bench runs a hand-written relay cycle with nothing of
the product but its two SQL calls (OutboxCalls.claim and mark_published, as
a login in pgoutbox_relay only, over a backlog of emitted events) and raw
nats-py `publish_async` of each claimed event's payload with its Nats-Msg-Id
into a JetStream stream, waiting for the acks, and prints its client CPU
(time.process_time) per event:

  * paced: cycles of 5 with a pause of --interval between them, as the
    relay's claim interval paces them at 500/s (the wait cools the process's
    caches, as in production);
  * saturated: cycles of 500 back to back.

Their ratio is the least a relay built on these parts reaches at that rate
against saturation. Beside it, for scale: a prepared `SELECT 1` and the
pause alone, paced the same way.

    .venv/bin/python bench/cycle_floor.py [--cycles 400] [--interval 10ms] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import nats
import psycopg
from nats.js.api import StreamConfig

from claim_mark_bench import RELAY, build
from machine import cpu_ticks, load, steal_since
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres
from pgoutbox.outbox.calls import OutboxCalls

ROOT = Path(__file__).resolve().parents[1]
SMALL, LARGE = 5, 500


async def timed(cycles: int, n: int, pause: float, one) -> float:
    """Client CPU in µs per cycle of `one(n)`, with `pause` seconds of sleep between cycles."""
    await one(n)  # warm: prepared statements, the reply subscription
    cpu = time.process_time()
    for _ in range(cycles):
        await one(n)
        if pause:
            await asyncio.sleep(pause)
    return (time.process_time() - cpu) / cycles * 1e6


async def measure(db_url: str, nats_url: str, cycles: int, interval: float) -> dict[str, float]:
    """Client CPU in µs per event of the cycle, paced and saturated; per call of the bare parts."""
    calls = OutboxCalls(db_url, "claim", wire_times=True)
    bare = await psycopg.AsyncConnection.connect(db_url, autocommit=True)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="FLOOR", subjects=["floor.>"]))

    async def cycle(n: int) -> None:
        rows = await calls.claim("floor", n, 30.0)
        futures = [
            await js.publish_async(
                "floor." + r["context"], r["payload"].encode(), headers={"Nats-Msg-Id": r["event_id"]}
            )
            for r in rows
        ]
        await asyncio.gather(*futures)
        await calls.mark_published(rows[0]["claim_token"], [r["event_id"] for r in rows])

    async def select_one(n: int) -> None:
        await (await bare.execute("SELECT 1", prepare=True)).fetchone()

    async def nothing(n: int) -> None:
        return None

    try:
        return {
            "paced": await timed(cycles, SMALL, interval, cycle) / SMALL,
            "saturated": await timed(max(4, cycles // 25), LARGE, 0.0, cycle) / LARGE,
            "select_1": await timed(cycles, 1, interval, select_one),
            "pause": await timed(cycles, 1, interval, nothing),
        }
    finally:
        await js.delete_stream("FLOOR")
        await nc.close()
        await bare.close()
        await calls.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=400, help="paced cycles of 5 a round (of 500: a 25th)")
    ap.add_argument("--interval", default="10ms", help="the pause between paced cycles (the relay's claim interval)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    interval = float(args.interval.removesuffix("ms")) / 1000 if args.interval.endswith("ms") else float(args.interval)
    if args.cycles < 25 or args.rounds < 1 or not 0 <= interval < 1:
        ap.error("--cycles must be at least 25, --rounds at least 1, --interval from 0 to 1s")
    start = cpu_ticks()
    print(
        f"cycle floor: {args.cycles} cycles of {SMALL} events {args.interval} apart, and cycles of {LARGE}"
        f" back to back, {args.rounds} round(s); client CPU (µs); {load()}"
    )
    per_round = args.cycles * SMALL + (max(4, args.cycles // 25) + 1) * LARGE + SMALL
    with tempfile.TemporaryDirectory(prefix="pgoutbox-cycle-floor-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # the postgres user runs the server in it
        pg, ns = EmbeddedPostgres(root / "pg"), EmbeddedNats(root / "nats")
        pg.start()
        ns.start()
        try:
            build(pg, "floor", ROOT / "migrations", per_round * args.rounds, 0, 0)
            url = pg.dsn("floor").replace("postgres@", f"{RELAY}@")
            for r in range(args.rounds):
                f = asyncio.run(measure(url, ns.url, args.cycles, interval))
                print(
                    f"round {r + 1}: per event, paced {f['paced']:6.1f}, saturated {f['saturated']:5.1f}:"
                    f" {f['paced'] / f['saturated']:4.2f} x;  paced SELECT 1 {f['select_1']:5.0f}, pause alone"
                    f" {f['pause']:4.0f} a call"
                )
        finally:
            ns.stop()
            pg.stop()
    print(f"done: {load()}; {steal_since(start)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
