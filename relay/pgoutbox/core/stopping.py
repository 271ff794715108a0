"""Waiting that a stop interrupts: the workers' loops and their retries end
as soon as the process is asked to stop, whatever they were waiting for."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable
from typing import Any


async def until_stopped(aw: Awaitable[Any], stopping: asyncio.Event) -> bool:
    """Awaits aw unless `stopping` is set first (aw is then cancelled); True when aw finished."""
    task = asyncio.ensure_future(aw)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        # Cancelled again until it ends: nats-py's connect swallows a cancellation
        # that lands while it closes a failed attempt, and would go on retrying.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
    if task.done() and not task.cancelled():
        task.result()  # raises what aw raised
        return True
    return False


async def wait_set(event: asyncio.Event, seconds: float | None) -> bool:
    """Waits up to `seconds` for `event`; True when it is set.

    Not asyncio.wait_for: on Python 3.11 it returns the result of an event
    set in the same loop iteration as a cancellation, and the cancellation is
    lost; a loop that waits that way then runs on after its task was
    cancelled, and whoever awaits the task waits forever. asyncio.timeout
    waits in the task itself, so the cancellation is raised."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def sleep(seconds: float, stopping: asyncio.Event) -> bool:
    """Sleeps unless `stopping` is set first; True when the whole sleep passed."""
    return not await wait_set(stopping, seconds)


def stop_on_signals() -> asyncio.Event:
    """An event SIGTERM and SIGINT set, from now on (start-up included)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
