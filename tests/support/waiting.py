"""Waiting for a condition, the one way the suite does it: poll the predicate
until it returns something truthy (returned), or fail the test naming what
did not happen. `alive` is checked each round and raises when what the test
waits on died (a process exited); `detail` adds to the failure (a log)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def _timed_out(timeout: float, what: str, detail: Callable[[], str] | None) -> AssertionError:
    return AssertionError(f"timed out after {timeout}s waiting for {what}" + (f":\n{detail()}" if detail else ""))


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.1,
    *,
    alive: Callable[[], None] | None = None,
    detail: Callable[[], str] | None = None,
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None:
            alive()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what, detail)
        time.sleep(interval)


async def until(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    what: str = "condition",
    interval: float = 0.02,
    *,
    detail: Callable[[], str] | None = None,
) -> Any:
    """wait_for in a coroutine: the predicate may return an awaitable."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(timeout, what, detail)
        await asyncio.sleep(interval)
