"""A JetStream that does not answer, without a server: which publish outcomes
are the broker's (away) and which the message's own (refused), the episode's
pacing, and the relay loop on the fakes of tests/unit/fakes.py handing events
back with no attempt counted, pausing its claims, probing, and ending the
episode. tests/outbox/test_jetstream_away.py runs the same story with real
processes on the defaults."""

from __future__ import annotations

import logging

import nats.errors
from fakes import FakeOutboxStore, FakePublisher
from test_relay_cycle import relay_on_fakes

from pgoutbox.outbox import publisher as publishing
from pgoutbox.outbox.away import JetStreamAway
from pgoutbox.outbox.publisher import Outcome, Publisher, PublishError
from support.waiting import until

# -- the classification ---------------------------------------------------------


def test_jetstream_api_errors_that_say_jetstream_cannot_serve_are_away():
    for code in (10008, 10009, 10023, 10076, 10118):
        outcome = publishing.rejected("e", code, "JetStream system temporarily unavailable")
        assert outcome.away and not outcome.permanent, code
        assert outcome.code == PublishError.JETSTREAM_ERROR


def test_jetstream_api_errors_about_the_message_are_refusals():
    too_large = publishing.rejected("e", 10054, "message size exceeds maximum allowed")
    assert too_large.code == PublishError.MAX_PAYLOAD and too_large.permanent and not too_large.away
    for code in (10071, 10070, 10097, None):  # wrong last sequence / msg id, header too large, unreadable
        outcome = publishing.rejected("e", code, "refused")
        assert outcome.code == PublishError.JETSTREAM_ERROR and not outcome.away and not outcome.permanent, code


def test_a_send_that_fails_on_the_connection_is_away_and_one_that_fails_on_the_message_is_not():
    assert publishing._classify_send_error("e", nats.errors.ConnectionClosedError()).away
    assert publishing._classify_send_error("e", nats.errors.FlushTimeoutError()).away
    header = publishing._classify_send_error("e", nats.errors.BadHeaderError())
    assert header.code == PublishError.BAD_HEADER and not header.away
    payload = publishing._classify_send_error("e", nats.errors.MaxPayloadError())
    assert payload.code == PublishError.MAX_PAYLOAD and not payload.away


async def test_a_publish_while_disconnected_is_away_for_every_row():
    outcomes = await Publisher("nats://127.0.0.1:1", timeout=1).publish_batch([{"event_id": "a"}, {"event_id": "b"}])
    assert [(o.code, o.away) for o in outcomes] == [(PublishError.NATS_UNAVAILABLE, True)] * 2


# -- the episode -----------------------------------------------------------------


def test_the_probe_pauses_double_from_half_a_second_to_a_cap_of_thirty():
    away = JetStreamAway()
    assert away.begin("PUBLISH_TIMEOUT: no JetStream ack within 10s")
    assert [away.next_pause() for _ in range(9)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]


def test_an_episode_starts_once_counts_what_is_handed_back_and_ends_with_its_duration():
    now = [100.0]
    away = JetStreamAway(clock=lambda: now[0], wall=lambda: 0.0)
    away.counted(5)  # no episode: not counted
    assert away.begin("PUBLISH_TIMEOUT: first") and not away.begin("NATS_UNAVAILABLE: later")
    assert away.describe() == "JetStream not answering since 1970-01-01T00:00:00+00:00: NATS_UNAVAILABLE: later"
    away.counted(3)
    away.counted(2)
    away.next_pause()
    away.next_pause()
    now[0] = 400.0
    episode = away.end()
    assert episode is not None and (episode.seconds, episode.handed_back) == (300.0, 5)
    assert not away.active and away.end() is None
    assert away.begin("again") and away.next_pause() == 0.5  # a new episode starts its pauses over


# -- the relay loop ---------------------------------------------------------------


async def test_while_jetstream_is_away_events_are_handed_back_and_never_use_up_their_attempts(caplog):
    caplog.set_level(logging.INFO, logger="pgoutbox")
    store, publisher = FakeOutboxStore(), FakePublisher()
    ids = store.add(20, attempts=9)  # one counted attempt more would dead-letter them (max_attempts 10)
    publisher.away = "no JetStream ack within 10s"
    publisher.connected = False  # nothing claimed before the test sets its pacing
    async with relay_on_fakes(store, publisher) as relay:
        relay.away = JetStreamAway(first_pause=0.01, pause_cap=0.05)  # fast probes, for a test on fakes
        publisher.connected = True
        await until(lambda: publisher.probes >= 10, 10, "ten probes while JetStream is away")
        assert relay.metrics.jetstream_up._value.get() == 0
        (why,) = [p for p in relay.problems() if p.startswith("JetStream not answering since ")]
        assert why.endswith("no JetStream ack within 10s"), why  # the publish's or the latest probe's reason
        assert all(store.status(i) == "PENDING" and store.events[i]["attempts"] == 9 for i in ids)
        assert "mark_failed" not in store.calls and "hand_back" in store.calls
        claims, probes = store.calls.count("claim"), publisher.probes
        await until(lambda: publisher.probes >= probes + 3, 10, "three more probes while JetStream is away")
        assert store.calls.count("claim") == claims  # the probe fails at $JS.API.INFO: no claim
        publisher.away = None
        await until(lambda: all(store.status(i) == "COMPLETED" for i in ids), 10, "all published once back")
        assert relay.metrics.jetstream_up._value.get() == 1
        assert not any(p.startswith("JetStream") for p in relay.problems())
    assert sorted(publisher.published) == sorted(ids)
    assert all(store.events[i]["attempts"] == 10 for i in ids)  # the one attempt that succeeded
    starts = [r for r in caplog.records if getattr(r, "action", None) == "jetstream_away"]
    ends = [r for r in caplog.records if getattr(r, "action", None) == "jetstream_back"]
    assert len(starts) == 1 and len(ends) == 1 and ends[0].handed_back >= 20


async def test_when_jetstream_answers_info_but_not_publishes_each_probe_claims_one_event():
    store, publisher = FakeOutboxStore(), FakePublisher()
    ids = store.add(30)
    publisher.away = "stream without a leader"
    publisher.connected = False
    async with relay_on_fakes(store, publisher) as relay:
        relay.away = JetStreamAway(first_pause=0.01, pause_cap=0.02)
        publisher.connected = True
        await until(lambda: publisher.probes >= 1, 10, "a probe")
        publisher.info_answers = True
        batches = publisher.batches
        await until(lambda: publisher.batches >= batches + 5, 10, "five probe publishes")
        assert set(publisher.batch_sizes[batches:]) == {1}  # a probe risks one event, not a batch
        # A probe's event counts its claim until it is handed back: one may be in flight now.
        in_flight = [i for i in ids if store.status(i) == "PROCESSING"]
        assert len(in_flight) <= 1 and all(store.events[i]["attempts"] == 0 for i in ids if i not in in_flight)
        publisher.away = None
        await until(lambda: all(store.status(i) == "COMPLETED" for i in ids), 10, "all published")


async def test_a_refusal_counts_an_attempt_and_does_not_pause_claiming():
    store, publisher = FakeOutboxStore(), FakePublisher()
    refused, other = store.add(2)
    publisher.failing[refused] = PublishError.JETSTREAM_ERROR
    async with relay_on_fakes(store, publisher) as relay:
        await until(lambda: store.status(refused) == "FAILED", 5, "the refusal recorded")
        assert store.status(other) == "COMPLETED" and store.events[refused]["attempts"] == 1
        assert not relay.away.active and publisher.probes == 0


async def test_on_a_schema_without_hand_back_an_away_outcome_counts_an_attempt_as_before():
    store, publisher = FakeOutboxStore(), FakePublisher()
    (event,) = store.add(1)
    publisher.away = "no ack"
    publisher.connected = False
    async with relay_on_fakes(store, publisher) as relay:
        relay.can_hand_back = False
        publisher.connected = True
        await until(lambda: store.status(event) == "FAILED", 5, "recorded as a failure")
        assert "hand_back" not in store.calls


def test_an_outcome_is_refused_unless_said_away():
    assert not Outcome("e", code=PublishError.JETSTREAM_ERROR).away


async def test_a_stop_ends_a_probes_pause_at_once():
    store, publisher = FakeOutboxStore(), FakePublisher()
    store.add(1)
    publisher.away = "no ack"
    publisher.connected = False
    async with relay_on_fakes(store, publisher) as relay:  # its exit waits at most 10 s for the relay to end
        relay.away = JetStreamAway(first_pause=3600, pause_cap=3600)
        publisher.connected = True
        await until(lambda: relay.away.active and "hand_back" in store.calls, 5, "an episode, its event handed back")
    assert publisher.probes == 0  # stopped within the hour-long pause before the first probe
