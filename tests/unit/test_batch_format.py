"""Handlers of format "batch" without a server (inbox/batch.py): the request
carries each message's envelope in stream order; each message's answer is
read from the batch's, a malformed answer being every message's coded
failure (OB063) and an unreadable result its own message's (OB064); a batch
waits for the earlier ones that hold one of its ordering keys; the manifest's
format and batch_size are checked with their codes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

import pytest

from pgoutbox.core.errors import ConfigError
from pgoutbox.inbox import batch, registry
from pgoutbox.inbox import settings as cs
from pgoutbox.inbox.flow import Admitted
from pgoutbox.inbox.handler_client import HandlerAnswer
from pgoutbox.inbox.handler_contract import Action, decide
from support.inbox import consumer_config


def _admitted(key: str | None = None, received: int | None = None, trace: dict | None = None) -> Admitted:
    envelope = {"message_id": str(uuid.uuid4()), "ordering_key": key, "payload": {"schema_version": 1}}
    body = json.dumps(envelope).encode()
    return Admitted(None, {**envelope, "trace": trace or {}}, 2, body, received)


def _ok(body: dict | bytes) -> tuple[HandlerAnswer, bytes]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return HandlerAnswer(200, None, None, 0.01), raw


def test_the_request_lists_each_envelope_in_order_with_its_delivery_version_and_trace():
    items = [_admitted(), _admitted(received=1, trace={"traceparent": "00-a-b-01"})]
    sent = json.loads(batch.request_body(items))
    assert [m["envelope"] for m in sent["messages"]] == [json.loads(a.body) for a in items]
    assert [m["delivery"] for m in sent["messages"]] == [2, 2]
    assert "received_version" not in sent["messages"][0] and "trace" not in sent["messages"][0]
    assert sent["messages"][1]["received_version"] == 1
    assert sent["messages"][1]["trace"] == {"traceparent": "00-a-b-01"}


def test_each_result_means_what_its_status_means_for_one_message():
    ids = [str(uuid.uuid4()) for _ in range(6)]
    statuses = [200, 204, 409, 422, 500, 503]
    results = [{"message_id": m, "status": s, "error": f"e{s}"} for m, s in zip(ids, statuses, strict=True)]
    results[4]["retry_after"] = 7
    got = batch.answers(*_ok({"results": results}), ids)
    assert [decide(a) for a in got] == [
        Action.PROCESSED,
        Action.PROCESSED,
        Action.PROCESSED,
        Action.DEAD_LETTER,
        Action.RETRY,
        Action.RETRY,
    ]
    assert got[3].summary == "HTTP 422: e422" and got[4].summary == "HTTP 500: e500"
    assert got[4].retry_after == 7 and not got[4].away
    assert got[5].away and not any(a.away for a in got[:5])
    assert got[0].summary == "HTTP 200"  # a success keeps no text


@pytest.mark.parametrize(
    "answer",
    [
        HandlerAnswer(503, None, 2.0, 0.1),  # the handler away: every message's
        HandlerAnswer(None, "connection error: refused", None, 0.1, unreachable=True),
        HandlerAnswer(None, "timeout after 10s", None, 10.0),
        HandlerAnswer(500, None, None, 0.1, "boom"),
        HandlerAnswer(422, None, None, 0.1, "poison"),
    ],
)
def test_an_answer_about_the_whole_batch_is_every_messages(answer):
    ids = [str(uuid.uuid4()) for _ in range(3)]
    assert batch.answers(answer, b"", ids) == [answer] * 3


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"<html>", "not JSON"),
        (b"[]", 'no "results" array'),
        (b'{"results": {}}', 'no "results" array'),
        (b"", "not JSON"),  # a 204
        ("short", "1 result(s) for 2 message(s)"),
        ("swapped", "result 1 is about"),
        ("not-objects", "result 1 is about"),
    ],
)
def test_a_malformed_answer_is_every_messages_coded_failure(body, why):
    ids = [str(uuid.uuid4()) for _ in range(2)]
    if body == "short":
        body = json.dumps({"results": [{"message_id": ids[0], "status": 200}]}).encode()
    elif body == "swapped":
        body = json.dumps({"results": [{"message_id": m, "status": 200} for m in reversed(ids)]}).encode()
    elif body == "not-objects":
        body = json.dumps({"results": [200, 200]}).encode()
    got = batch.answers(*_ok(body), ids)
    assert len(got) == 2
    for a in got:
        assert decide(a) is Action.RETRY and not a.away
        assert a.summary.startswith("BATCH_ANSWER_MALFORMED [OB063]: ") and why in a.summary, a.summary


@pytest.mark.parametrize(
    ("result", "why"),
    [
        ({"status": "200"}, "status"),
        ({"status": True}, "status"),
        ({"status": 99}, "status"),
        ({"status": 600}, "status"),
        ({}, "status"),
        ({"status": 500, "retry_after": -1}, "retry_after"),
        ({"status": 500, "retry_after": "soon"}, "retry_after"),
    ],
)
def test_an_unreadable_result_is_only_its_messages_coded_failure(result, why):
    ids = [str(uuid.uuid4()) for _ in range(3)]
    results = [{"message_id": m, "status": 200} for m in ids]
    results[1] = {"message_id": ids[1], **result}
    got = batch.answers(*_ok({"results": results}), ids)
    assert [decide(a) for a in got] == [Action.PROCESSED, Action.RETRY, Action.PROCESSED]
    assert got[1].summary.startswith("BATCH_RESULT_INVALID [OB064]: ") and why in got[1].summary


async def test_a_batch_waits_for_the_earlier_batch_holding_one_of_its_keys():
    lanes = batch.Lanes()
    first = lanes.enter("h", [_admitted("k1"), _admitted(None)])
    second = lanes.enter("h", [_admitted("k2"), _admitted("k1")])
    apart = lanes.enter("h", [_admitted("k3")])
    other_handler = lanes.enter("g", [_admitted("k1")])
    posted: list[str] = []

    def post(name: str):
        async def go(body: bytes, ids: list[str]) -> tuple[list[HandlerAnswer], int]:
            posted.append(name)
            return [HandlerAnswer(503, None, None, 0.0)] * len(ids), 7

        return go

    for name, b in (("second", second), ("apart", apart), ("other", other_handler)):
        b.start([_admitted()], post(name))
    for _ in range(5):
        await asyncio.sleep(0)
    assert sorted(posted) == ["apart", "other"]  # the second waits for the first
    first.leave()
    answer, call = await second.answer_of(0)
    assert (answer.status, call) == (503, 7)
    assert posted[-1] == "second"
    for b in (second, apart, other_handler):
        b.leave()
    third = lanes.enter("h", [_admitted("k1")])
    assert third.waits == set()  # every holder left


def test_the_manifest_takes_format_batch_with_a_bounded_batch_size(tmp_path):
    head = '[[handler]]\nname = "a"\nurl = "http://h/e"\nsubjects = ["sea.event.x.v1"]\n'
    (tmp_path / "a.toml").write_text(head + f'format = "batch"\nbatch_size = {registry.BATCH_MAX}\n')
    (spec,) = registry.read_manifests(tmp_path)
    assert (spec.format, spec.batch_size) == ("batch", registry.BATCH_MAX)
    (tmp_path / "a.toml").write_text(head + f'format = "batch"\nbatch_size = {registry.BATCH_MAX + 1}\n')
    with pytest.raises(registry.RegistryError, match="BAD_BATCH_SIZE: batch_size of a handler of format batch"):
        registry.read_manifests(tmp_path)
    (tmp_path / "a.toml").write_text(head + f"batch_size = {registry.BATCH_MAX + 1}\n")  # other formats: as before
    assert registry.read_manifests(tmp_path)[0].batch_size == registry.BATCH_MAX + 1
    (tmp_path / "a.toml").write_text(head + 'format = "batches"\n')
    with pytest.raises(registry.RegistryError, match="BAD_FORMAT: format must be one of pgoutbox, cloudevents, batch"):
        registry.read_manifests(tmp_path)


def test_a_default_batch_size_above_the_batch_bound_is_refused_for_a_batch_handler(tmp_path):
    spec = registry.HandlerSpec("a", "http://h/e", "sea", "SEA_EVENTS", ("sea.event.x.v1",), format="batch")
    cfg = consumer_config(None, "nats://127.0.0.1:1", tmp_path / "r.json")
    assert cs.resolve(spec, cfg).batch_size == cfg.batch_size  # the default (32) fits
    big = dataclasses.replace(cfg, batch_size=registry.BATCH_MAX + 1)  # not default: the bound under test
    with pytest.raises(ConfigError, match="BAD_BATCH_SIZE"):
        cs.resolve(spec, big)
    assert cs.resolve(dataclasses.replace(spec, format="pgoutbox"), big).batch_size == registry.BATCH_MAX + 1
