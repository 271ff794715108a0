"""The handler gate's state without a server (inbox/gates.py): which answers
say the handler is away, and the probe's turns and pauses.
tests/inbox/test_handler_gate.py runs it against real servers."""

from __future__ import annotations

import asyncio
import logging

import pytest

from pgoutbox.inbox.gates import HandlerGate
from pgoutbox.inbox.handler_client import HandlerAnswer


@pytest.mark.parametrize(
    "answer, away",
    [
        (HandlerAnswer(503, None, None, 0.1), True),
        (HandlerAnswer(502, None, None, 0.1), True),
        (HandlerAnswer(504, None, None, 0.1), True),
        (HandlerAnswer(429, None, 3.0, 0.1), True),
        (HandlerAnswer(None, "connection error: ConnectionRefusedError", None, 0.1, unreachable=True), True),
        (HandlerAnswer(500, None, None, 0.1), False),
        (HandlerAnswer(422, None, None, 0.1), False),
        (HandlerAnswer(404, None, None, 0.1), False),
        (HandlerAnswer(200, None, None, 0.1), False),
        (HandlerAnswer(None, "timeout after 5s", None, 5.0), False),  # the message's own: docs/handlers.md
        (HandlerAnswer(None, "connection error: not an HTTP/1.x answer", None, 0.1), False),
    ],
)
def test_which_answers_say_the_handler_is_away(answer, away):
    assert answer.away is away


async def test_one_probe_at_a_time_with_growing_pauses_and_retry_after_honoured(caplog):
    caplog.set_level(logging.INFO, logger="pgoutbox.inbox.gates")
    stopping = asyncio.Event()
    gate = HandlerGate("billing", stopping=stopping)
    pauses: list[float] = []

    async def after(pause: float) -> None:  # the pause recorded, not slept
        pauses.append(pause)
        gate._turn.set()

    gate._after = after  # type: ignore[method-assign]
    assert gate.is_up and await gate.admit(stopping) is False
    gate.away("HTTP 503")
    gate.away("HTTP 503")  # another message in hand: the same episode, no second probe
    assert not gate.is_up
    assert await gate.admit(stopping) is True  # the probe: one message
    gate.probe_unused()  # its fetch found nothing: the next fetch probes, with no pause
    assert await gate.admit(stopping) is True
    gate.away("HTTP 429", retry_after=7)  # the probe's answer
    gate.probe_done()
    assert await gate.admit(stopping) is True
    gate.away("connection error: refused")
    gate.probe_done()
    assert await gate.admit(stopping) is True
    assert gate.describe().startswith("handler billing not answering since ")
    assert gate.describe().endswith(": connection error: refused")
    gate.answered()  # the probe's message answered about itself
    gate.probe_done()
    assert gate.is_up and await gate.admit(stopping) is False
    assert pauses == [0.5, 7.0, 2.0]
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions == ["handler_away", "handler_back"]
    assert caplog.records[-1].handed_back == 4
    gate.close()


async def test_a_stop_ends_the_wait_for_a_probe():
    stopping = asyncio.Event()
    gate = HandlerGate("billing", stopping=stopping)
    gate.away("HTTP 503")
    waiting = asyncio.create_task(gate.admit(stopping))
    stopping.set()
    assert await waiting is None
    gate.close()
