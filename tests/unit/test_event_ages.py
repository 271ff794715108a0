"""The live latency metrics without a server: the Pgoutbox-Created-At header
(written by the relay, optional and never fatal for the consumer), the relay's
age-at-publish observation (also through the relay loop on the fakes of
tests/unit/fakes.py) and the consumer's age-at-outcome and handler-answer
counts. tests/cli/test_metrics.py runs both workers with traffic."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from fakes import FakeHandlerClient, FakeOutboxStore, FakePublisher, delivery, event_row
from test_consumer_flow import Flow
from test_relay_cycle import relay_on_fakes

from pgoutbox.core import wire
from pgoutbox.core.wire import CREATED_AT, Unrepresentable, created_epoch
from pgoutbox.inbox.metrics import Answer, ConsumerMetrics, Outcome, answer_of
from pgoutbox.outbox.metrics import RelayMetrics
from pgoutbox.outbox.publisher import Outcome as Published
from pgoutbox.outbox.publisher import PublishError
from support.waiting import until

CREATED = "2025-01-02T03:04:05.250000Z"
EPOCH = datetime(2025, 1, 2, 3, 4, 5, 250000, tzinfo=UTC).timestamp()
AGE = "pgoutbox_relay_event_age_at_publish_seconds"
OUTCOME_AGE = "pgoutbox_consumer_event_age_at_outcome_seconds"


def sample(metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


# -- the header -------------------------------------------------------------------


def test_the_relay_sends_created_at_as_rfc_3339_utc_beside_the_envelope_headers():
    _, _, headers = wire.to_nats(event_row(created_at=CREATED))
    assert headers[CREATED_AT] == CREATED
    as_datetime = datetime(2025, 1, 2, 8, 34, 5, 250000, tzinfo=UTC) - timedelta(hours=5, minutes=30)
    assert wire.to_nats(event_row(created_at=as_datetime))[2][CREATED_AT] == "2025-01-02T03:04:05.250000Z"


@pytest.mark.parametrize("created", [None, Unrepresentable("infinity")])
def test_an_event_without_a_representable_created_at_goes_out_without_the_header(created):
    """created_at feeds a metric only: nothing about it may fail an event."""
    _, _, headers = wire.to_nats(event_row(created_at=created))
    assert CREATED_AT not in headers
    assert headers[wire.MSG_ID]


def test_the_handler_envelope_is_the_same_with_or_without_the_header():
    row = event_row(event_id="5b0c4bd5-bd35-4ef4-8a8c-1a1d0d1f1f00")
    plain = wire.from_nats(*wire.to_nats(row))
    stamped = wire.from_nats(*wire.to_nats({**row, "created_at": CREATED}))
    assert stamped == plain
    assert "created_at" not in stamped


def test_the_header_counts_against_the_message_size():
    subject, body, headers = wire.to_nats(event_row(created_at=CREATED))
    without = {k: v for k, v in headers.items() if k != CREATED_AT}
    assert wire.message_size(body, headers) - wire.message_size(body, without) == len(CREATED_AT) + len(CREATED) + 4


@pytest.mark.parametrize(
    "headers, expected",
    [
        ({CREATED_AT: CREATED}, EPOCH),
        ({CREATED_AT: "2025-01-02T03:04:05Z"}, EPOCH - 0.25),
        (None, None),
        ({}, None),
        ({CREATED_AT: ""}, None),
        ({CREATED_AT: "yesterday"}, None),
        ({CREATED_AT: "2025-13-02T03:04:05Z"}, None),
        ({CREATED_AT: "2025-01-02T03:04:05+01:00"}, None),  # not the relay's form
        ({CREATED_AT: "2025-01-02T03:04:05"}, None),  # no zone: no instant
        ({CREATED_AT: "9" * 4300 + "Z"}, None),
        ({"pgoutbox-created-at": CREATED}, None),  # exactly the name the relay sends
    ],
)
def test_the_consumer_reads_created_at_or_nothing(headers, expected):
    assert created_epoch(headers) == expected


# -- the relay: age at publish ----------------------------------------------------------


def test_the_relay_observes_each_published_event_by_context_and_nothing_else():
    m = RelayMetrics()
    later = "2025-01-02T03:04:06.250000Z"
    rows = [
        event_row(created_at=CREATED),
        event_row(created_at=CREATED),
        event_row(created_at=later, context="land"),
        event_row(created_at=CREATED),  # back to the first text: not the cached one
        event_row(created_at=None),  # a row written around emit: skipped
        event_row(created_at=Unrepresentable("infinity")),
        event_row(created_at=CREATED),  # failed: not published, not observed
    ]
    outcomes = [Published(r["event_id"]) for r in rows[:-1]]
    outcomes.append(Published(rows[-1]["event_id"], code=PublishError.PUBLISH_TIMEOUT, detail="x"))
    outcomes[1] = Published(rows[1]["event_id"], duplicate=True)  # published before: still its age now
    m.ages(rows, outcomes, EPOCH + 2)
    assert sample(m, AGE + "_count", context="sea") == 3
    assert sample(m, AGE + "_sum", context="sea") == pytest.approx(6)
    assert sample(m, AGE + "_count", context="land") == 1
    assert sample(m, AGE + "_sum", context="land") == pytest.approx(1)
    assert sample(m, AGE + "_bucket", context="land", le="1.0") == 1
    assert sample(m, AGE + "_bucket", context="land", le="0.5") == 0


def test_a_clock_behind_postgresql_counts_zero_not_a_negative_age():
    m = RelayMetrics()
    row = event_row(created_at=CREATED)
    m.ages([row], [Published(row["event_id"])], EPOCH - 3)
    assert sample(m, AGE + "_count", context="sea") == 1
    assert sample(m, AGE + "_sum", context="sea") == 0


async def test_the_relay_loop_observes_the_age_of_what_it_published():
    store, publisher = FakeOutboxStore(), FakePublisher()
    started = time.time()  # before `created`: the bound holds however long the rows take to add
    created = datetime.now(UTC) - timedelta(seconds=2)
    ids = store.add(3, created_at=wire.wire_time(created.strftime("%Y-%m-%d %H:%M:%S.%f+00")))
    async with relay_on_fakes(store, publisher) as relay:
        await until(lambda: all(store.status(i) == "COMPLETED" for i in ids), 5, "three events completed")
    waited = time.time() - started
    assert sample(relay.metrics, AGE + "_count", context="sea") == 3
    # not a race: the upper bound is the time measured around the run, not a fixed one
    assert 3 * 2 <= sample(relay.metrics, AGE + "_sum", context="sea") <= 3 * (2 + waited)


# -- the consumer: age at outcome, handler answers ----------------------------------------


def test_the_consumer_observes_the_age_by_handler_and_outcome_when_the_message_has_it():
    m = ConsumerMetrics()
    m.observe_age("billing", Outcome.PROCESSED, {CREATED_AT: CREATED}, EPOCH + 0.125)
    m.observe_age("billing", Outcome.DUPLICATE, {CREATED_AT: CREATED}, EPOCH + 10)
    m.observe_age("billing", Outcome.PROCESSED, {CREATED_AT: "garbage"}, EPOCH)  # foreign: not observed
    m.observe_age("billing", Outcome.PROCESSED, None, EPOCH)
    m.observe_age("billing", Outcome.PROCESSED, {CREATED_AT: CREATED}, EPOCH - 1)  # clocks apart: 0
    assert sample(m, OUTCOME_AGE + "_count", handler="billing", outcome="processed") == 2
    assert sample(m, OUTCOME_AGE + "_sum", handler="billing", outcome="processed") == pytest.approx(0.125)
    assert sample(m, OUTCOME_AGE + "_bucket", handler="billing", outcome="processed", le="0.1") == 1
    assert sample(m, OUTCOME_AGE + "_count", handler="billing", outcome="duplicate") == 1


@pytest.mark.parametrize(
    "status, answer",
    [
        (200, Answer.OK),
        (204, Answer.OK),
        (409, Answer.ALREADY_DONE),
        (422, Answer.POISON),
        (500, Answer.FAILED),
        (404, Answer.FAILED),
        (301, Answer.FAILED),
        (None, Answer.FAILED),
    ],
)
def test_each_handler_answer_has_its_label(status, answer):
    assert answer_of(status) is answer


@pytest.mark.parametrize("created", [CREATED, "garbage", None])
async def test_a_message_is_processed_whatever_its_created_at(created):
    f = Flow(FakeHandlerClient(200))
    msg = delivery(f.nc)
    if created is not None:
        msg.headers[CREATED_AT] = created
    await f.fetch(msg)
    assert f.outcomes[msg.reply] == "processed"
    m = f.flow.metrics
    assert sample(m, "pgoutbox_consumer_handler_calls_total", handler="billing", answer="ok") == 1


@pytest.mark.parametrize("status, answer", [(200, "ok"), (409, "already_done"), (422, "poison"), (503, "failed")])
async def test_the_flow_counts_each_handler_call_by_its_answer(status, answer):
    f = Flow(FakeHandlerClient(status))
    await f.fetch(delivery(f.nc), delivery(f.nc))
    calls = {
        k: sample(f.flow.metrics, "pgoutbox_consumer_handler_calls_total", handler="billing", answer=k) for k in Answer
    }
    assert calls == {k: (2 if k == answer else None) for k in Answer}


async def test_a_failing_age_observation_holds_no_batch_back():
    """A defect in the metric must not leave the batch unmarked (its events
    would wait for the lease, then fail the same way again)."""
    store, publisher = FakeOutboxStore(), FakePublisher()
    calls = []

    def broken(*args: object) -> None:
        calls.append(args)
        raise RuntimeError("defect")

    async with relay_on_fakes(store, publisher) as relay:
        relay.metrics.ages = broken  # type: ignore[method-assign]
        ids = store.add(2, created_at=CREATED)  # claimed by the next poll, after the defect is in place
        await until(lambda: all(store.status(i) == "COMPLETED" for i in ids), 5, "both events completed")
    assert calls
