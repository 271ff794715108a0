"""The relay loop in-process, against a real PostgreSQL and nats-server:
publishing and the wire envelope, wake-ups, duplicates, permanent and
transient failures, per-key order under injected publish failures."""

from __future__ import annotations

import asyncio

from pgoutbox.outbox.wakeups import Wakeups


async def test_a_pause_ends_early_only_for_an_urgent_wake_up_or_stop():
    wakeups = Wakeups(poll_interval=60)
    pause = asyncio.create_task(wakeups.pause(60))
    await asyncio.sleep(0.05)
    wakeups.wake()  # counted for the next wait, not ending the pause
    await asyncio.sleep(0.05)
    assert not pause.done()
    wakeups.wake(urgent=True)
    await asyncio.wait_for(pause, 5)
    await asyncio.wait_for(wakeups.wait(), 5)  # the wake-ups came: no wait
    wakeups.arm()
    waiting = asyncio.create_task(wakeups.wait())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    wakeups.stop()
    await asyncio.wait_for(waiting, 5)
    await asyncio.wait_for(wakeups.pause(60), 5)  # stopped: no pause any more
