"""pgoutbox backfill's pure logic (no server): the throttle spaces lanes
that wait at once, the event types narrow the handler's subjects (an unknown
one is refused), and a state file resumes only the run of the same
arguments, with the range that run resolved."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest

from pgoutbox.core.errors import ConfigError
from pgoutbox.inbox import backfill
from pgoutbox.inbox.registry import HandlerSpec

SPEC = HandlerSpec(
    name="late",
    url="http://127.0.0.1:1/x",
    context="shop",
    stream="SHOP_EVENTS",
    subjects=("shop.event.order_created.v1", "shop.event.order_paid.v1"),
)


def test_the_throttle_gives_lanes_waiting_at_once_successive_slots(monkeypatch):
    now = [100.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(round(seconds, 6))

    monkeypatch.setattr(backfill.asyncio, "sleep", sleep)
    throttle = backfill.Throttle(10.0, clock=lambda: now[0])

    async def lanes() -> None:
        await asyncio.gather(*(throttle.wait() for _ in range(4)))

    asyncio.run(lanes())
    assert slept == [0.1, 0.2, 0.3]  # the first goes at once; 10/s is one every 0.1 s
    now[0] = 200.0  # long idle: no burst is saved up
    asyncio.run(lanes())
    assert slept[3:] == [0.1, 0.2, 0.3]


def test_event_types_narrow_the_subjects_and_an_unknown_one_is_refused():
    assert backfill.subjects_of(SPEC, ()) == SPEC.subjects
    assert backfill.subjects_of(SPEC, ("order_paid",)) == ("shop.event.order_paid.v1",)
    with pytest.raises(ConfigError, match="no event type order_shipped"):
        backfill.subjects_of(SPEC, ("order_paid", "order_shipped"))


def test_a_state_file_resumes_only_the_same_arguments(tmp_path):
    path = tmp_path / "state.json"
    asked = {"handler": "late", "subjects": list(SPEC.subjects), "since": "all", "until": "now"}
    since, until = datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 11, 28, 12, tzinfo=UTC)
    plan = backfill.Plan("late", SPEC.subjects, since, until, 10, since, asked)
    assert backfill.read_state(path, asked) is None
    backfill.write_state(path, plan, backfill.Progress(done=5, phase="outbox", after_id=42))
    assert backfill.read_state(path, asked) == backfill.Resume(
        since, until, backfill.Progress(phase="outbox", after_id=42), None
    )
    # In an archived day, with the stream's boundary: both come back.
    start = datetime(2026, 11, 26, tzinfo=UTC)
    side = backfill.StreamSide("SHOP_EVENTS", start, 18)
    streamed = backfill.Plan("late", SPEC.subjects, since, until, 10, since, asked, stream=side)
    backfill.write_state(path, streamed, backfill.Progress(done=5, phase="archive", day="2026-11-02", after_id=7))
    assert backfill.read_state(path, asked) == backfill.Resume(
        since, until, backfill.Progress(phase="archive", day="2026-11-02", after_id=7), start
    )
    # A state file of the first release (the outbox only, no phase) resumes in the outbox.
    path.write_text(
        json.dumps({"asked": asked, "since": since.isoformat(), "until": until.isoformat(), "after_id": 42})
    )
    assert backfill.read_state(path, asked) == backfill.Resume(
        since, until, backfill.Progress(phase="outbox", after_id=42), None
    )
    assert backfill.read_state(path, {**asked, "until": "2026-11-28T00:00:00Z"}) is None
    path.write_text("{not json")
    assert backfill.read_state(path, asked) is None
    assert backfill.read_state(None, asked) is None
