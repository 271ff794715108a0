"""Waiting that a stop interrupts: the workers' loops and their retries end
as soon as the process is asked to stop, whatever they were waiting for."""

from __future__ import annotations

import asyncio
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


async def sleep(seconds: float, stopping: asyncio.Event) -> bool:
    """Sleeps unless `stopping` is set first; True when the whole sleep passed."""
    if stopping.is_set():
        return False
    try:
        await asyncio.wait_for(stopping.wait(), seconds)
    except TimeoutError:
        return True
    return False
