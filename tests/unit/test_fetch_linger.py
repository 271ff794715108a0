"""The consumer's fetch linger without a server (OUTBOX_CONSUMER_FETCH_LINGER):
after a fetch that brought fewer messages than it asked for, the next one
comes no sooner than the linger after it; a full fetch is followed at once;
values outside the bounds are refused in one line (exit 2)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_consumer_flow import CONFIG, HANDLER

from pgoutbox.cli import main as cli
from pgoutbox.inbox.consumer import Consumer, Linger, Slots
from pgoutbox.inbox.database_gate import DatabaseGate
from pgoutbox.inbox.gates import HandlerGate

LINGER = 0.05


class Puller:
    """Answers each fetch with the next of `sizes` messages (then stops the
    consumer), and notes when each fetch was asked for."""

    def __init__(self, consumer: Consumer, sizes: list[int]):
        self.consumer, self.sizes, self.asked = consumer, sizes, []

    async def fetch(self, batch: int, timeout: float) -> list[object]:
        self.asked.append((asyncio.get_running_loop().time(), batch))
        size = self.sizes.pop(0)
        if not self.sizes:
            self.consumer.stopping.set()
        return [object()] * min(size, batch)


async def fetches(sizes: list[int], linger: float) -> list[tuple[float, int]]:
    consumer = Consumer([HANDLER], dataclasses.replace(CONFIG, fetch_linger=linger))

    async def up() -> None:
        return None

    consumer.gate = DatabaseGate(up)
    consumer.handler_gates = {HANDLER.name: HandlerGate(HANDLER.name, stopping=consumer.stopping)}
    consumer._process = lambda h, msgs, slots, probe=False: asyncio.sleep(0)  # type: ignore[method-assign,assignment,return-value]
    puller = Puller(consumer, sizes)
    await consumer._fetch_loop(HANDLER, puller, Slots(8), 8)  # type: ignore[arg-type]
    return puller.asked


def test_after_a_short_fetch_the_next_comes_no_sooner_than_the_linger():
    asked = asyncio.run(fetches([1, 0, 3, 2], LINGER))
    starts = [t for t, _ in asked]
    # A lower bound only: the loop may run later on a busy machine, never sooner.
    assert all(b - a >= LINGER - 0.002 for a, b in zip(starts, starts[1:], strict=False))


@pytest.mark.parametrize(
    ("got", "pause"),
    [(8, 0.0), (7, 0.04), (0, 0.04)],  # full: at once; short or empty: the linger after the start
)
def test_the_pause_after_a_fetch(got, pause):
    linger = Linger(0.05)
    assert linger.pause(100.0) == 0.0  # the first fetch: at once
    linger.fetched(100.0, got, 8)
    assert linger.pause(100.01) == pytest.approx(pause)
    assert linger.pause(100.2) == 0.0  # the linger is over by then


def test_no_linger_never_pauses():
    linger = Linger(0.0)
    linger.fetched(100.0, 1, 8)
    assert linger.pause(100.0) == 0.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fetch-linger=-1ms"], "OUTBOX_CONSUMER_FETCH_LINGER='-1ms': not a duration"),
        (["--fetch-linger", "2s", "--fetch-timeout", "5s"], "OUTBOX_CONSUMER_FETCH_LINGER (2s) must be from 0 to 1s"),
        (["--fetch-linger", "300ms", "--fetch-timeout", "250ms"], "shorter than OUTBOX_CONSUMER_FETCH_TIMEOUT (0.25s)"),
    ],
)
def test_a_linger_out_of_bounds_is_refused_in_one_line(tmp_path, capsys, flags, message):
    assert cli.main(["consume", *flags, "--registry-file", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
