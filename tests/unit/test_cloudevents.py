"""CloudEvents without a server: the binding's percent-encoding, the ce-*
headers of an event, emitter ce-* headers, admission of binary and
structured CloudEvents, the handler's request lines, the registry's format
(tests/cloudevents/ runs relay, consumer and the official SDK for real)."""

from __future__ import annotations

import json

import pytest
from cloudevents.core.bindings.http import HTTPMessage, from_binary
from cloudevents.core.formats.json import JSONFormat
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pgoutbox.core import cloudevents, wire
from pgoutbox.core.errors import ConfigError
from pgoutbox.inbox import dlq, registry
from pgoutbox.inbox.handler_client import cloudevent_lines, payload_body, request_body
from pgoutbox.outbox import settings as relay_settings
from pgoutbox.outbox.publisher import PublishError, encode_outcome

EVENT_ID = "5b0c4bd5-bd35-4ef4-8a8c-1a1d0d1f1f00"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def row(**overrides):
    base = {
        "event_id": EVENT_ID,
        "subject": "sea.event.order_placed.v2",
        "context": "sea",
        "event_type": "order_placed",
        "event_version": 2,
        "aggregate_type": "order",
        "aggregate_id": "42",
        "occurred_at": "2025-01-02T03:04:05.123456Z",
        "payload": '{"n": 1.10}',
        "headers": {"traceparent": TRACEPARENT, "tracestate": "vendor=x"},
    }
    return {**base, **overrides}


# -- the encoding ----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, encoded",
    [
        ("Euro \u20ac \U0001f600", "Euro%20%E2%82%AC%20%F0%9F%98%80"),  # the binding's own example
        ('say "100%"', "say%20%22100%25%22"),
        ("/pgoutbox/sea", "/pgoutbox/sea"),
        ("tab\there", "tab%09here"),
        ("\x7f\u0085", "%7F%C2%85"),
        ("", ""),
    ],
)
def test_values_are_percent_encoded_as_the_binding_says_and_decode_back(text, encoded):
    assert cloudevents.encode(text) == encoded
    assert cloudevents.decode(encoded) == text


def test_decoding_takes_lower_case_hex_quoted_strings_and_refuses_what_is_not_utf8():
    assert cloudevents.decode("caf%c3%a9") == "caf\u00e9"
    assert cloudevents.decode('"a \\"b\\" c"') == 'a "b" c'  # older producers quoted instead of encoding
    assert cloudevents.decode("%41") == "A"  # needlessly encoded: accepted
    for bad in ("%C0%A0", "%FF", "%E2%82"):  # overlong, never UTF-8, cut short
        with pytest.raises(cloudevents.NotACloudEvent, match="not UTF-8"):
            cloudevents.decode(bad)


@pytest.mark.parametrize(
    "template", ["/pgoutbox/{context}", "https://orders.example.com/{context}?x=1", "urn:example:{context}", "sea"]
)
def test_a_uri_reference_is_a_source(template):
    assert cloudevents.source_template(template) == template


@pytest.mark.parametrize("template", ["has space", "/{ctx}", "/a#b#c", "1x:y", "caf\u00e9", "/%zz"])
def test_what_is_no_uri_reference_is_refused_at_start_up_in_one_line(template):
    with pytest.raises(ConfigError) as caught:
        relay_settings.load(environ={"OUTBOX_CLOUDEVENTS_SOURCE": template})
    assert "OUTBOX_CLOUDEVENTS_SOURCE" in str(caught.value) and "\n" not in str(caught.value)


# -- what the relay publishes ----------------------------------------------------


def test_every_message_carries_the_cloudevents_attributes_in_binary_mode():
    subject, body, headers = wire.to_nats(row())
    ce = {k: v for k, v in headers.items() if k.startswith("ce-")}
    assert ce == {
        "ce-specversion": "1.0",
        "ce-id": EVENT_ID,
        "ce-source": "/pgoutbox/sea",
        "ce-type": "sea.order_placed.v2",
        "ce-datacontenttype": "application/json",
        "ce-time": "2025-01-02T03:04:05.123456Z",
        "ce-subject": "order/42",
        "ce-traceparent": TRACEPARENT,
        "ce-tracestate": "vendor=x",
    }
    assert headers["ce-id"] == headers["Nats-Msg-Id"] and headers["traceparent"] == TRACEPARENT
    assert body == b'{"n": 1.10}'  # the payload, unchanged


def test_the_official_sdk_reads_the_headers_as_the_event():
    _, body, headers = wire.to_nats(row(aggregate_id="caf\u00e9 42"), "urn:shop:{context}")
    event = from_binary(HTTPMessage(headers, body), JSONFormat())
    assert (event.get_id(), event.get_source(), event.get_type()) == (EVENT_ID, "urn:shop:sea", "sea.order_placed.v2")
    assert event.get_subject() == "order/caf\u00e9 42" and headers["ce-subject"] == "order/caf%C3%A9%2042"
    assert event.get_time().isoformat() == "2025-01-02T03:04:05.123456+00:00"
    assert event.get_extension("traceparent") == TRACEPARENT
    assert event.get_data() == {"n": 1.1}


def test_emitter_ce_headers_set_attributes_and_may_not_contradict_the_fixed_ones():
    emitted = {"traceparent": TRACEPARENT, "CE-Source": "https://shop.example/a b", "ce-partitionkey": "k1"}
    _, _, headers = wire.to_nats(row(headers=emitted))
    assert headers["ce-source"] == "https://shop.example/a%20b" and "CE-Source" not in headers
    assert headers["ce-partitionkey"] == "k1"
    assert wire.to_nats(row(headers={"ce-id": EVENT_ID}))[2]["ce-id"] == EVENT_ID  # repeating is fine
    for headers_, match in (
        ({"ce-id": "other"}, "ce-id 'other' differs"),
        ({"ce-specversion": "0.3"}, "ce-specversion"),
        ({"ce-datacontenttype": "text/plain"}, "ce-datacontenttype"),
        ({"ce-Foo_Bar": "x"}, "does not name a CloudEvents attribute"),
        ({"ce-a": "1", "CE-A": "2"}, "twice"),
        ({"content-type": "application/cloudevents+json"}, "says structured mode"),
        ({"ce-time": "yesterday"}, "not an RFC 3339 timestamp"),
        ({"ce-subject": ""}, "ce-subject is empty"),
    ):
        outcome = encode_outcome(row(headers=headers_))
        assert outcome.code == PublishError.BAD_HEADER and outcome.permanent, headers_
        assert match in outcome.detail


def test_a_replay_carries_the_attributes_the_original_carried_and_none_when_it_had_none():
    envelope = wire.from_nats(*wire.to_nats(row(), "urn:a:{context}"))
    replay_row = {
        "envelope": envelope,
        "dlq_metadata": {},
        "message_id": EVENT_ID,
        "handler": "h",
        "subject": envelope["subject"],
        "context": "sea",
    }
    _, _, headers = dlq.replay_message(replay_row)
    assert headers["ce-id"] == EVENT_ID and headers["ce-source"] == "urn:a:sea"
    assert headers["Nats-Msg-Id"].startswith(f"{EVENT_ID}:replay:h:")
    assert (
        wire.envelope_from(dlq.replay_subject("sea", "h"), b'{"n": 1.10}', headers)["cloudevents"]
        == (envelope["cloudevents"])
    )
    old = {k: v for k, v in envelope.items() if k != "cloudevents"}  # stored by a consumer before CloudEvents
    _, _, headers = dlq.replay_message({**replay_row, "envelope": old})
    assert not [k for k in headers if k.startswith("ce-")]


# -- what the consumer admits ----------------------------------------------------


FOREIGN_ID = "0B9E8C8A-7A4C-4F8E-9E3A-2B1C0D9E8F7A"


def binary(**extra):
    headers = {
        "ce-specversion": "1.0",
        "ce-id": FOREIGN_ID,
        "ce-source": "https://shop.example/orders",
        "ce-type": "com.example.order.placed",
        "ce-time": "2025-01-02T03:04:05Z",
        "ce-traceparent": TRACEPARENT,
        "ce-comment": "caf%C3%A9%20%22ok%22",
    }
    return {**headers, **extra}


def test_a_foreign_binary_cloudevent_is_admitted_with_ce_id_as_message_id():
    envelope = wire.from_nats("sea.event.order_placed.v1", b'{"n": 1}', binary())
    assert envelope["message_id"] == FOREIGN_ID.lower()
    assert (envelope["context"], envelope["event_type"], envelope["event_version"]) == ("sea", "order_placed", 1)
    assert envelope["payload"] == {"n": 1} and envelope["occurred_at"] == "2025-01-02T03:04:05Z"
    assert envelope["trace"] == {"traceparent": TRACEPARENT}
    assert envelope["cloudevents"]["comment"] == 'caf\u00e9 "ok"'
    assert b"cloudevents" not in request_body(envelope)  # the pgoutbox envelope is as before
    assert wire.payload_bytes(b'{"n": 1}', binary()) == b'{"n": 1}'


def test_a_foreign_structured_cloudevent_is_admitted_with_data_as_payload():
    document = {
        "specversion": "1.0",
        "id": FOREIGN_ID,
        "source": "/shop",
        "type": "com.example.order.placed",
        "datacontenttype": "application/json",
        "sequence": 7,
        "data": {"n": 1},
    }
    headers = {"Content-Type": "Application/CloudEvents+JSON; charset=utf-8"}
    body = json.dumps(document).encode()
    envelope = wire.from_nats("sea.event.order_placed.v1", body, headers)
    assert envelope["message_id"] == FOREIGN_ID.lower() and envelope["payload"] == {"n": 1}
    assert envelope["cloudevents"]["sequence"] == "7" and "data" not in envelope["cloudevents"]
    assert wire.payload_bytes(body, headers) is None  # the body is not the payload


@pytest.mark.parametrize(
    "headers, body, reason",
    [
        (binary(**{"ce-id": "order-17"}), b"{}", "ce-id (the CloudEvents id) 'order-17' is not a UUID"),
        (binary(**{"ce-specversion": "0.3"}), b"{}", "specversion '0.3' is not 1.0"),
        ({"ce-id": FOREIGN_ID}, b"{}", "required attribute(s) specversion, source, type missing"),
        (binary(**{"ce-Bad_Name": "x"}), b"{}", "does not name a CloudEvents attribute"),
        (binary(**{"ce-source": "%C0%A0"}), b"{}", "not UTF-8"),
        (binary(**{"ce-comment": "a%00b"}), b"{}", "CloudEvents attribute comment contains a NUL"),
        (binary(**{"ce-time": "yesterday"}), b"{}", "not an RFC 3339 timestamp"),
        (binary(**{"ce-datacontenttype": "text/plain"}), b"{}", "is not JSON"),
        (binary(**{"Nats-Msg-Id": EVENT_ID}), b"{}", "disagree"),
        (binary(), b"[1]", "body is an array"),
        (
            {"content-type": "application/cloudevents+json"},
            b'{"specversion": "1.0", "id": "x", "source": "/s", "type": "t", "data": {}}',
            "ce-id (the CloudEvents id) 'x' is not a UUID",
        ),
        (
            {"content-type": "application/cloudevents+json"},
            json.dumps({"specversion": "1.0", "id": FOREIGN_ID, "source": "/s", "type": "t", "data": [1]}).encode(),
            "data of the structured CloudEvent is an array",
        ),
        (
            {"content-type": "application/cloudevents+json"},
            json.dumps(
                {"specversion": "1.0", "id": FOREIGN_ID, "source": "/s", "type": "t", "data_base64": "AA=="}
            ).encode(),
            "data_base64",
        ),
        ({"content-type": "application/cloudevents+json"}, b"not json", "body is not JSON"),
    ],
)
def test_what_is_no_admissible_cloudevent_is_invalid_with_the_reason(headers, body, reason):
    with pytest.raises(wire.InvalidMessage) as caught:
        wire.from_nats("sea.event.order_placed.v1", body, headers)
    assert reason in str(caught.value)


def test_the_inbox_keeps_only_what_the_envelope_does_not_give_back():
    _, body, headers = wire.to_nats(row(), "urn:shop:{context}")
    envelope = wire.from_nats("sea.event.order_placed.v2", body, headers)
    assert envelope["cloudevents"] == {"source": "urn:shop:sea"}  # a relay's message: its source alone
    assert cloudevents.expand(envelope["cloudevents"], envelope) == cloudevents.from_binary(headers)
    foreign = wire.from_nats("sea.event.order_placed.v1", b'{"n": 1}', binary())
    assert foreign["cloudevents"]["id"] == FOREIGN_ID  # as sent; message_id is its lower case
    assert (
        foreign["cloudevents"]["datacontenttype"] is None
        and "subject" not in foreign["cloudevents"]
        and foreign["cloudevents"]["type"] == "com.example.order.placed"
    )
    assert cloudevents.expand(foreign["cloudevents"], foreign) == cloudevents.from_binary(binary())


def test_a_message_without_ce_headers_is_read_as_before():
    envelope = wire.from_nats("sea.event.x.v1", b"{}", {"Nats-Msg-Id": EVENT_ID})
    assert "cloudevents" not in envelope


# -- what a handler of format "cloudevents" gets --------------------------------


def test_the_handler_request_is_the_http_binary_mode():
    envelope = wire.from_nats(*wire.to_nats(row(aggregate_id="a b")))
    lines = cloudevent_lines(cloudevents.expand(envelope["cloudevents"], envelope), envelope, "billing", 2).decode()
    parsed = dict(line.split(": ", 1) for line in lines.split("\r\n") if line)
    assert parsed["Content-Type"] == "application/json" and "ce-datacontenttype" not in parsed
    assert parsed["ce-id"] == EVENT_ID and parsed["ce-subject"] == "order/a%20b"
    assert parsed["Idempotency-Key"] == EVENT_ID and parsed["Pgoutbox-Delivery"] == "2"
    assert parsed["traceparent"] == TRACEPARENT and parsed["ce-traceparent"] == TRACEPARENT
    assert lines.count("Content-Type") == 1
    assert payload_body(envelope, b' {"n": 1.10} ') == b'{"n": 1.10}'
    assert payload_body({"payload": {"n": 1}}) == b'{"n":1}'


def test_a_message_without_attributes_gets_them_derived_for_the_handler():
    envelope = wire.from_nats("sea.event.x.v3", b"{}", {"Nats-Msg-Id": EVENT_ID, "Pgoutbox-Aggregate-Type": "o"})
    attributes = cloudevents.derived(envelope, "urn:x:{context}")
    assert attributes == {
        "specversion": "1.0",
        "id": EVENT_ID,
        "source": "urn:x:sea",
        "type": "sea.x.v3",
        "datacontenttype": "application/json",
    }


def test_the_registry_takes_format_and_refuses_an_unknown_one(tmp_path):
    (tmp_path / "a.toml").write_text(
        '[[handler]]\nname = "a"\nurl = "http://h/e"\nsubjects = ["sea.event.x.v1"]\nformat = "cloudevents"\n'
        '[[handler]]\nname = "b"\nurl = "http://h/e"\nsubjects = ["sea.event.x.v1"]\n'
    )
    out = tmp_path / "registry.json"
    registry.generate(tmp_path, out)
    a, b = registry.load(out)
    assert (a.format, b.format) == ("cloudevents", "pgoutbox")
    assert '"format"' in out.read_text() and out.read_text().count('"format": "cloudevents"') == 1
    (tmp_path / "a.toml").write_text(
        '[[handler]]\nname = "a"\nurl = "http://h/e"\nsubjects = ["sea.event.x.v1"]\nformat = "xml"\n'
    )
    with pytest.raises(registry.RegistryError, match="BAD_FORMAT: format must be one of pgoutbox, cloudevents"):
        registry.read_manifests(tmp_path)


# -- hostile input: refused with a reason, never an exception of another kind ---


_names = st.sampled_from(
    ["ce-id", "ce-source", "ce-type", "ce-specversion", "ce-time", "ce-x", "CE-Y", "ce-", "ce-A_b"]
)
_values = st.one_of(st.text(max_size=20), st.sampled_from(["%C0%A0", "%", "%zz", '"a\\"', '"', "1.0", FOREIGN_ID]))
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


_ADMISSIBLE = {
    "Nats-Msg-Id": FOREIGN_ID,
    "ce-id": FOREIGN_ID,
    "ce-source": "/s",
    "ce-type": "t",
    "ce-specversion": "1.0",
}
# Few hostile entries often enough that some examples are admitted: both sides are checked.
_hostile = st.one_of(st.dictionaries(_names, _values, max_size=6), st.dictionaries(_names, _values, max_size=1))


def _refused_with_a_reason(exc: wire.InvalidMessage, parts) -> None:
    """The reason is one line that names the part at fault: a header given (or
    its CloudEvents attribute), the body, its data, or the subject."""
    text = str(exc).lower()
    assert text.strip() and "\n" not in text, f"refused without a one-line reason: {exc!r}"
    named = (
        {"body", "data", "subject"}
        | {p.lower() for p in parts}
        | {p.lower()[3:] for p in parts if p[:3].lower() == "ce-"}
    )
    assert any(part and part in text for part in named), f"the reason names no header, body or subject: {exc}"


def test_any_binary_ce_headers_are_admitted_or_refused_with_a_reason():
    seen = {"admitted": 0, "refused": 0}

    # Both outcomes every run, whatever the draw (a draw of 300 refusals alone
    # failed a clean clone's run): the admissible headers as they are, and a
    # source that is no URI-reference.
    @settings(max_examples=300, deadline=None)
    @given(
        headers=_hostile,
        body=st.one_of(st.binary(max_size=40), st.sampled_from([b"{}", b'{"a": 1}', b"[]", b'"x"', b""])),
    )
    @example(headers={}, body=b"{}")
    @example(headers={"ce-source": "%C0%A0"}, body=b"{}")
    def check(headers, body):
        try:
            envelope = wire.from_nats("sea.event.x.v1", body, {**_ADMISSIBLE, **headers})
        except wire.InvalidMessage as exc:
            _refused_with_a_reason(exc, {**_ADMISSIBLE, **headers})
            seen["refused"] += 1
            return
        assert envelope["message_id"] == FOREIGN_ID.lower()
        expanded = cloudevents.expand(envelope.get("cloudevents") or {"source": "/s"}, envelope)
        assert {"specversion", "id", "source", "type"} <= set(expanded), expanded
        seen["admitted"] += 1

    check()
    assert seen["admitted"] + seen["refused"] >= 100 and seen["admitted"] and seen["refused"], seen


def test_any_structured_body_is_admitted_or_refused_with_a_reason():
    seen = {"admitted": 0, "refused": 0}
    keys = st.sampled_from(["specversion", "id", "source", "type", "data", "time", "Bad", "x"])

    # Both outcomes every run, whatever the draw (a draw of 300 refusals alone
    # failed two clean clones' runs): the admissible document as it is (a
    # structured event's data must be a JSON object: without one it is
    # refused), and one with another specversion.
    @settings(max_examples=300, deadline=None)
    @given(document=st.one_of(st.dictionaries(keys, _json), st.dictionaries(keys, _json, max_size=1)))
    @example(document={"data": {}})
    @example(document={"specversion": "0.3"})
    def check(document):
        document = {"specversion": "1.0", "id": FOREIGN_ID, "source": "/s", "type": "t", **document}
        try:
            envelope = wire.from_nats(
                "sea.event.x.v1", json.dumps(document).encode(), {"Content-Type": "application/cloudevents+json"}
            )
        except wire.InvalidMessage as exc:
            _refused_with_a_reason(exc, document)
            seen["refused"] += 1
            return
        assert envelope["message_id"] == FOREIGN_ID.lower()
        assert envelope["cloudevents"]["source"] == document["source"]
        seen["admitted"] += 1

    check()
    assert seen["admitted"] + seen["refused"] >= 100 and seen["admitted"] and seen["refused"], seen


def test_a_value_that_is_not_utf_8_once_decoded_is_refused_naming_its_header():
    with pytest.raises(wire.InvalidMessage) as refused:
        wire.from_nats("sea.event.x.v1", b"{}", {**_ADMISSIBLE, "ce-source": "%C0%A0"})
    _refused_with_a_reason(refused.value, {"ce-source"})
    assert "ce-source" in str(refused.value)
