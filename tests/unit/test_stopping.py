"""core.stopping: a stop ends what is awaited, even an awaitable that swallows
a cancellation (nats-py's connect does, when it lands while it closes a
failed attempt)."""

from __future__ import annotations

import asyncio
import os
import signal

from pgoutbox.core.backoff import Retrier
from pgoutbox.core.stopping import sleep, stop_on_signals, until_stopped, wait_set


async def test_a_stop_ends_an_awaitable_that_swallows_the_first_cancellation():
    swallowed = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)  # carries on, as nats-py's connect loop does

    stopping = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stopping.set)
    assert await asyncio.wait_for(until_stopped(stubborn(), stopping), 5) is False
    assert swallowed == [True]


async def test_what_ends_before_the_stop_is_returned_with_its_errors():
    stopping = asyncio.Event()

    async def fails() -> None:
        raise ValueError("bad")

    try:
        await until_stopped(fails(), stopping)
    except ValueError:
        pass
    else:
        raise AssertionError("the awaitable's error must come through")
    assert await until_stopped(asyncio.sleep(0), stopping) is True


async def test_a_sleep_ends_at_the_stop():
    stopping = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stopping.set)
    assert await asyncio.wait_for(sleep(30, stopping), 5) is False
    assert await sleep(0.01, asyncio.Event()) is True


async def test_wait_set_answers_whether_the_event_was_set_in_time():
    event = asyncio.Event()
    assert await wait_set(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, 5) is True
    assert await wait_set(event, 0) is True  # already set: no wait at all


async def test_a_cancellation_that_lands_as_the_event_is_set_is_raised_not_lost():
    # asyncio.wait_for on Python 3.11 returns True here and the task runs on:
    # a fetch loop cancelled that way never ended and its awaiter hung.
    event = asyncio.Event()
    waiting = asyncio.create_task(wait_set(event, 10))
    await asyncio.sleep(0)  # not a race: one loop turn runs the ready task to its wait on the event
    event.set()
    waiting.cancel()  # in the same loop iteration
    done, _ = await asyncio.wait({waiting}, timeout=5)
    assert done and waiting.cancelled()


async def test_a_retriers_pause_ends_at_the_stop_and_its_lines_start_again_after_a_success():
    stopping = asyncio.Event()
    retry = Retrier(stopping, every=60.0)
    assert retry.failed() and not retry.failed() and retry.attempts == 2  # one line per minute
    stopping.set()
    assert await asyncio.wait_for(retry.pause(), 1) is False
    retry.succeeded()
    assert retry.failed() and retry.attempts == 1  # a new outage gets its line at once


async def test_a_retrier_without_a_stop_pauses_to_the_end_and_every_0_gives_each_failure_its_line():
    retry = Retrier(every=0.0)
    assert all(retry.failed() for _ in range(3)) and retry.attempts == 3
    assert await retry.pause() is True  # the first pause: at most 0.1 s


async def test_stop_on_signals_sets_its_event_on_sigterm():
    stop = stop_on_signals()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert await wait_set(stop, 5)
    finally:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
