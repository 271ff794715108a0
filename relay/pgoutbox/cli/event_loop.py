"""The event loop of the long-running commands (relay, consume, replay): uvloop
where it is installed (a dependency on every platform it supports), else
asyncio's own. Both workers spend much of their CPU in the loop itself
(selector, timers, task wake-ups) at moderate rates; uvloop runs that part in C
(docs/benchmarks.md has the figures)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), on uvloop when available."""
    try:
        import uvloop
    except ImportError:  # a platform uvloop does not support (Windows)
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
