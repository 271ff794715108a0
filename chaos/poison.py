"""Hypothesis strategies for hostile input, shared by the poison pipeline test
(tests/chaos/test_poison_pipeline.py) and the chaos harness's poison writer
(chaos/poison_writer.py).

Two kinds of candidate:
  * EmitCase: the arguments of one outbox.emit call, as a careless or hostile
    producer would pass them (extreme and non-finite times, empty and huge
    values, NULLs, control characters and NUL, NATS control headers, sizes
    around max_payload, non-object payloads, bad schema_version values);
  * ForeignCase: one message another system publishes straight to the event
    stream (non-canonical or missing Nats-Msg-Id, bodies that are not JSON
    objects, invalid JSON and UTF-8, headers that contradict the subject,
    sizes around max_payload).

Each class of the issue has its own strategy (CLASSES), so that a run can
tell which class a failure belongs to; `any_emit()` and `any_foreign()` mix
them. Nothing here talks to PostgreSQL or NATS: `EmitCase.sql()` gives the
statement and its parameters, `ForeignCase` the subject, body and headers.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg
from hypothesis import strategies as st

CONTEXT = "sea"
EVENT_TYPE = "order_created"
# The subjects the test's handler subscribes to (foreign messages use them too).
SUBJECTS = (f"{CONTEXT}.event.{EVENT_TYPE}.v1", f"{CONTEXT}.event.{EVENT_TYPE}.v2")
MAX_PAYLOAD = 1024 * 1024  # nats-server's default max_payload
ANSWERS = (200, 422)  # what the test's handler answers (payload "answer")


@dataclass(frozen=True)
class EmitCase:
    """One outbox.emit call. Text values are passed as text parameters and
    cast in SQL (payload and headers as JSON text, occurred_at as text), so
    that a value PostgreSQL rejects reaches PostgreSQL rather than being
    refused by Python first."""

    klass: str
    aggregate_type: str | None = "order"
    aggregate_id: str | None = "42"
    event_type: str | None = EVENT_TYPE
    payload: Any = field(default_factory=lambda: {"schema_version": 1})
    context: str | None = CONTEXT
    event_version: int | None = 1
    headers: Any = field(default_factory=dict)
    tenant_id: str | None = None
    ordering_key: str | None = None
    occurred_at: str | None = None
    correlation_id: str | None = None

    def payload_text(self) -> str | None:
        return None if self.payload is None else json.dumps(self.payload, ensure_ascii=False)

    def headers_text(self) -> str | None:
        return None if self.headers is None else json.dumps(self.headers, ensure_ascii=False)

    def sql(self, *, ordering_suffix: str = "", correlation_id: str | None = None) -> tuple[str, dict[str, Any]]:
        """The emit statement and its parameters. ordering_suffix is appended
        to a given ordering_key (a dead-lettered event holds back the later
        events of its key, by design: unrelated runs must not share keys)."""
        key = None if self.ordering_key is None else self.ordering_key + ordering_suffix
        return (
            "SELECT outbox.emit(%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, %(payload)s::jsonb,"
            " context => %(context)s, event_version => %(event_version)s::integer,"
            " headers => %(headers)s::jsonb, correlation_id => %(correlation_id)s::uuid,"
            " tenant_id => %(tenant_id)s, ordering_key => %(ordering_key)s,"
            " occurred_at => %(occurred_at)s::timestamptz)",
            {
                "aggregate_type": self.aggregate_type,
                "aggregate_id": self.aggregate_id,
                "event_type": self.event_type,
                "payload": self.payload_text(),
                "context": self.context,
                "event_version": self.event_version,
                "headers": self.headers_text(),
                "correlation_id": correlation_id or self.correlation_id,
                "tenant_id": self.tenant_id,
                "ordering_key": key,
                "occurred_at": self.occurred_at,
            },
        )

    def has_nul_text(self) -> bool:
        """A NUL in a text parameter: psycopg refuses to send it (PostgreSQL
        text cannot hold one), before anything reaches the database."""
        texts = (
            self.aggregate_type,
            self.aggregate_id,
            self.event_type,
            self.context,
            self.tenant_id,
            self.ordering_key,
            self.occurred_at,
        )
        return any(t is not None and "\x00" in t for t in texts)

    def has_nul_json(self) -> bool:
        """A NUL inside JSON (\\u0000): jsonb's own input function refuses it
        (22P05) while casting the caller's argument, before emit runs."""
        return any(t is not None and "\\u0000" in t for t in (self.payload_text(), self.headers_text()))

    def answer(self) -> int:
        return _answer_of(self.payload)

    def short(self) -> str:
        return _shorten(self)


@dataclass(frozen=True)
class ForeignCase:
    """One message published straight to the event stream. msg_id None: no
    Nats-Msg-Id header; "{uuid}" in it is replaced by a fresh UUID per run
    (JetStream would deduplicate a repeated id). relay_headers: also send
    the Pgoutbox-Context/-Event-Type/-Event-Version headers the relay would
    (agreeing with the subject), so that a class other than foreign_headers
    is not judged on their absence; `headers` come after them."""

    klass: str
    subject: str = SUBJECTS[0]
    msg_id: str | None = "{uuid}"
    body: bytes = b'{"schema_version":1}'
    headers: dict[str, str] = field(default_factory=dict)
    relay_headers: bool = True

    def materialise(self) -> tuple[str | None, dict[str, str]]:
        """(the Nats-Msg-Id sent, all headers), with a fresh UUID."""
        fresh = uuid.uuid4()
        msg_id = (
            None
            if self.msg_id is None
            else self.msg_id.format(uuid=str(fresh), UUID=str(fresh).upper(), hex=fresh.hex, HEX=fresh.hex.upper())
        )
        headers: dict[str, str] = {}
        if self.relay_headers:
            context, _, event_type, version = self.subject.split(".")
            headers.update(
                {"Pgoutbox-Context": context, "Pgoutbox-Event-Type": event_type, "Pgoutbox-Event-Version": version[1:]}
            )
        headers.update(self.headers)
        if msg_id is not None:
            headers["Nats-Msg-Id"] = msg_id
        return msg_id, headers

    def answer(self) -> int:
        try:
            return _answer_of(json.loads(self.body))
        except ValueError:
            return 200

    def short(self) -> str:
        return _shorten(self)


def refusal_problem(case: EmitCase, exc: psycopg.Error) -> str | None:
    """None when an emit's refusal is a coded one; else what is wrong with it.
    Coded: an OB SQLSTATE, or one of the two refusals that happen before
    emit runs (EmitCase.has_nul_text, EmitCase.has_nul_json)."""
    state = exc.sqlstate
    if state and state.startswith("OB"):
        return None
    if state is None and isinstance(exc, psycopg.DataError) and case.has_nul_text():
        return None  # psycopg refused the NUL; nothing reached the database
    if state == "22P05" and case.has_nul_json():
        return None  # jsonb's input refused \u0000 before emit ran
    first = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    return f"emit refused with SQLSTATE {state} ({type(exc).__name__}), not an OB code: {first}"


def _answer_of(payload: Any) -> int:
    answer = payload.get("answer") if isinstance(payload, dict) else None
    return answer if answer in ANSWERS else 200


def _shorten(case: Any, limit: int = 160) -> str:
    """repr with long values cut (a failing example of 1 MiB is unreadable)."""
    parts = []
    for name, value in vars(case).items():
        text = repr(value)
        if len(text) > limit:
            text = f"{text[:60]}...<{len(text)} chars>...{text[-40:]}"
        parts.append(f"{name}={text}")
    return f"{type(case).__name__}({', '.join(parts)})"


# -- building blocks ---------------------------------------------------------

CONTROL = "".join(chr(c) for c in range(0x20)) + "\x7f\u2028\u2029\ufeff"

control_text = st.text(alphabet=st.sampled_from(CONTROL + "ab é漢"), min_size=1, max_size=12)
nul_text = st.builds(lambda a, b: a + "\x00" + b, st.text(max_size=4), st.text(max_size=4))


def huge_text(min_size: int = 2_000, max_size: int = 200_000) -> st.SearchStrategy[str]:
    """Thousands of characters without drawing each one (Hypothesis would
    refuse to generate that much data): one unit repeated (compresses to
    almost nothing in PostgreSQL), or characters from a seeded generator
    (does not compress: what an index entry or a TOAST-less limit sees)."""
    length = st.integers(min_size, max_size)
    repeated = st.builds(
        lambda unit, n: (unit * (n // len(unit) + 1))[:n],
        st.sampled_from(["x", "é", "漢", "ab\t", "\U0001f600"]),
        length,
    )
    scrambled = st.builds(
        lambda seed, n: "".join(random.Random(seed).choices(_SCRAMBLE, k=n)), st.integers(0, 2**32), length
    )
    return st.one_of(repeated, scrambled)


_SCRAMBLE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.éü漢字"


ordinary_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=20
)
texts = st.one_of(ordinary_text, st.just(""), st.just("   "), control_text, nul_text, huge_text(), st.none())
schema_version_values = st.sampled_from(
    [1, 2, 0, -1, 1.5, 1.0, "1", None, True, [], {}, 2**31, 2**63, 10**400, -(10**400), 1e308]
)


def payload_object(extra: st.SearchStrategy | None = None) -> st.SearchStrategy[dict]:
    base = st.fixed_dictionaries(
        {"schema_version": st.just(1)},
        optional={
            "answer": st.sampled_from(ANSWERS),
            "note": st.one_of(ordinary_text, control_text),
        },
    )
    return base if extra is None else st.builds(lambda p, e: {**p, **e}, base, extra)


def padded(size: int, answer: int) -> dict:
    """A payload whose JSON is about `size` bytes."""
    return {"schema_version": 1, "answer": answer, "pad": "x" * max(0, size - 60)}


# Landmarks, and the window just under the limit where the message fits but
# whatever wraps it (a DLQ notice, an envelope) may not.
sizes_around_max_payload = st.one_of(
    st.sampled_from(
        [
            MAX_PAYLOAD - 4096,
            MAX_PAYLOAD - 1024,
            MAX_PAYLOAD - 300,
            MAX_PAYLOAD - 1,
            MAX_PAYLOAD,
            MAX_PAYLOAD + 1,
            MAX_PAYLOAD + 10_000,
            3 * MAX_PAYLOAD // 4,
            MAX_PAYLOAD // 2,
        ]
    ),
    st.integers(MAX_PAYLOAD - 2048, MAX_PAYLOAD + 64),
)

# NATS and JetStream interpret these; pgoutbox writes its own Pgoutbox-* headers.
CONTROL_HEADERS = (
    "Nats-Msg-Id",
    "Nats-Expected-Stream",
    "Nats-Expected-Last-Sequence",
    "Nats-Expected-Last-Subject-Sequence",
    "Nats-Expected-Last-Msg-Id",
    "Nats-TTL",
    "Nats-Rollup",
    "Nats-Marker-Reason",
    "Pgoutbox-Context",
    "Pgoutbox-Event-Type",
    "Pgoutbox-Event-Version",
    "Pgoutbox-Aggregate-Id",
    "Pgoutbox-Original-Subject",
    "Pgoutbox-Handler",
    "Status",
)


@st.composite
def any_case(draw, name: str) -> str:
    """The name in a random letter case."""
    flips = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    return "".join(c.upper() if f else c.lower() for c, f in zip(name, flips))


control_header_name = st.sampled_from(CONTROL_HEADERS).flatmap(lambda n: st.one_of(st.just(n), any_case(n)))
control_header_value = st.sampled_from(
    ["1", "0", "all", "sub", "1s", "SEA_EVENTS", "OTHER", "x y", "", str(uuid.UUID(int=1))]
)
header_value = st.one_of(
    ordinary_text,
    control_text,
    huge_text(1_000, 20_000),
    st.integers(),
    st.none(),
    st.just({"nested": [1, 2]}),
    st.just(""),
)
bad_header_name = st.sampled_from(["", " ", "a b", "a:b", "a\r\nb", "ä", "x" * 5000, "\x00", "a\tb"])

# -- emit classes --------------------------------------------------------------

TIMES = [
    "-infinity",
    "infinity",
    "epoch",
    "0001-01-01 00:00:00+00",
    "0001-01-01 00:00:00+14",
    "9999-12-31 23:59:59.999999+00",
    "10000-01-01 00:00:00+00",
    "294276-12-31 23:59:59+00",
    "4713-01-01 00:00:00+00 BC",
    "0001-12-31 23:59:59+00 BC",
    "1969-12-31 23:59:59.999999+00",
    "1900-01-01 00:00:00+00",
    "2000-02-29 12:00:00+05:30",
    "now",
    "today",
    "yesterday",
]


def emit_times() -> st.SearchStrategy[EmitCase]:
    return st.builds(EmitCase, klass=st.just("times"), occurred_at=st.sampled_from(TIMES), payload=payload_object())


def emit_max_payload() -> st.SearchStrategy[EmitCase]:
    """Payloads around the server's max_payload, answered 200 or 422 (a DLQ
    notice then carries the payload too)."""
    big_payload = st.builds(padded, sizes_around_max_payload, st.sampled_from((422, 200)))
    return st.builds(EmitCase, klass=st.just("max_payload"), payload=big_payload)


def emit_sizes() -> st.SearchStrategy[EmitCase]:
    """Huge and empty text arguments, many headers."""
    many_headers = st.integers(50, 3000).map(lambda n: {f"x-h{i}": "v" * 10 for i in range(n)})
    return st.one_of(
        st.builds(EmitCase, klass=st.just("sizes"), payload=payload_object(), headers=many_headers),
        st.builds(
            EmitCase,
            klass=st.just("sizes"),
            payload=payload_object(),
            aggregate_id=huge_text(),
            aggregate_type=st.one_of(st.just("order"), huge_text()),
        ),
        st.builds(EmitCase, klass=st.just("sizes"), payload=payload_object(), tenant_id=huge_text()),
        st.builds(EmitCase, klass=st.just("sizes"), payload=payload_object(), ordering_key=huge_text()),
        st.builds(
            EmitCase,
            klass=st.just("sizes"),
            headers=st.builds(lambda v: {"x-big": v}, huge_text(10_000, 2 * MAX_PAYLOAD)),
            payload=st.builds(lambda a: {"schema_version": 1, "answer": a}, st.sampled_from(ANSWERS)),
        ),
        st.builds(
            EmitCase,
            klass=st.just("sizes"),
            payload=st.just({"schema_version": 1}),
            aggregate_id=st.just(""),
            aggregate_type=st.just(""),
            tenant_id=st.just(""),
        ),
    )


def emit_text() -> st.SearchStrategy[EmitCase]:
    """NULLs, control characters and NUL in the text arguments and the
    payload: mostly one field at a time (the others valid, so that what is
    accepted travels the whole pipeline), sometimes all at once."""
    payload = payload_object(st.fixed_dictionaries({"text": st.one_of(control_text, nul_text)}))
    headers = st.one_of(
        st.none(),
        st.dictionaries(
            st.sampled_from(["x-a", "traceparent"]), st.one_of(control_text, nul_text), min_size=1, max_size=2
        ),
    )
    subject_part = st.one_of(st.none(), st.just(""), control_text, nul_text)
    one = lambda **kw: st.builds(EmitCase, klass=st.just("text"), **kw)
    return st.one_of(
        one(aggregate_id=texts),
        one(aggregate_type=texts),
        one(tenant_id=texts),
        one(ordering_key=texts),
        one(payload=payload),
        one(headers=headers),
        one(event_type=subject_part),
        one(context=subject_part),
        one(aggregate_type=texts, aggregate_id=texts, tenant_id=texts, ordering_key=texts, payload=payload),
    )


def emit_headers() -> st.SearchStrategy[EmitCase]:
    """Header names NATS or JetStream interpret, pgoutbox's own in any case,
    names NATS cannot carry, values that are not strings."""
    name = st.one_of(control_header_name, bad_header_name, st.sampled_from(["traceparent", "x-ok"]))
    headers = st.one_of(
        st.dictionaries(name, st.one_of(control_header_value, header_value), min_size=1, max_size=4),
        st.sampled_from([[], "text", 1, None]),
    )
    return st.builds(EmitCase, klass=st.just("headers"), headers=headers, payload=payload_object())


def emit_schema() -> st.SearchStrategy[EmitCase]:
    """Non-object payloads, bad schema_version values, bad subject parts."""
    payload = st.one_of(
        st.builds(lambda v: {"schema_version": v}, schema_version_values),
        st.just({}),
        st.just([]),
        st.just([{"schema_version": 1}]),
        st.just(1),
        st.just("text"),
        st.just(None),
        st.just(True),
    )
    return st.builds(
        EmitCase,
        klass=st.just("schema"),
        payload=payload,
        event_version=st.sampled_from([1, 2, 0, -1, None, 2**31 - 1]),
        event_type=st.sampled_from([EVENT_TYPE, "order.created", "order created", "*", ">", "x" * 129, ""]),
        context=st.sampled_from([CONTEXT, "other_context", "sea.x", "SEA", "*", "x" * 65]),
    )


# -- foreign classes -------------------------------------------------------------

MSG_IDS = [
    "{uuid}",
    "{UUID}",
    "{{{uuid}}}",
    "urn:uuid:{uuid}",
    "{hex}",
    "{HEX}",
    " {uuid} ",
    "{uuid}\n",
    "{uuid}:x",
    "not-a-uuid-{hex}",
    "",
    "{uuid}-{hex}",
    "{{{UUID}}}",
]


def foreign_ids() -> st.SearchStrategy[ForeignCase]:
    return st.builds(
        ForeignCase,
        klass=st.just("foreign_ids"),
        msg_id=st.one_of(st.sampled_from(MSG_IDS), st.none()),
        body=st.builds(lambda p: json.dumps(p).encode(), payload_object()),
    )


def foreign_bodies() -> st.SearchStrategy[ForeignCase]:
    body = st.one_of(
        st.sampled_from(
            [
                b"",
                b"[]",
                b"[1,2]",
                b"1",
                b"-0.5",
                b'"text"',
                b"null",
                b"true",
                b"{",
                b"{'a':1}",
                b"\xff\xfe\x00",
                b'{"schema_version":1,"x":"\xc3\x28"}',
                b"\x00",
                b"   ",
                b'{"schema_version":1}{"schema_version":1}',
                b'{"a":1e999999}',
                b"NaN",
            ]
        ),
        st.builds(lambda p: json.dumps(p).encode(), payload_object()),
        st.builds(
            lambda p: json.dumps(p, ensure_ascii=False).encode(),
            payload_object(st.fixed_dictionaries({"text": control_text})),
        ),
    )
    return st.builds(ForeignCase, klass=st.just("foreign_bodies"), body=body)


def foreign_max_payload() -> st.SearchStrategy[ForeignCase]:
    body = st.builds(
        lambda size, answer: json.dumps(padded(size, answer)).encode(),
        sizes_around_max_payload,
        st.sampled_from((422, 200)),
    )
    return st.builds(ForeignCase, klass=st.just("foreign_max_payload"), body=body)


def foreign_headers() -> st.SearchStrategy[ForeignCase]:
    """Headers that contradict the subject or are missing, and control headers."""
    contradicting = st.fixed_dictionaries(
        {},
        optional={
            "Pgoutbox-Context": st.sampled_from([CONTEXT, "other", "", "sea.x"]),
            "Pgoutbox-Event-Type": st.sampled_from([EVENT_TYPE, "other_type", ""]),
            "Pgoutbox-Event-Version": st.sampled_from(["1", "2", "3", "abc", "", "-1", "99999999999999999999"]),
            "Pgoutbox-Occurred-At": st.sampled_from(["-infinity", "garbage", "2025-01-01T00:00:00Z"]),
            "Pgoutbox-Aggregate-Id": ordinary_text,
        },
    )
    controls = st.dictionaries(control_header_name, control_header_value, max_size=2)
    return st.builds(
        ForeignCase,
        klass=st.just("foreign_headers"),
        subject=st.sampled_from(SUBJECTS),
        headers=st.builds(lambda a, b: {**a, **b}, contradicting, controls),
        relay_headers=st.booleans(),
        body=st.builds(lambda p: json.dumps(p).encode(), payload_object()),
    )


CLASSES = {
    "times": emit_times,
    "sizes": emit_sizes,
    "max_payload": emit_max_payload,
    "text": emit_text,
    "headers": emit_headers,
    "schema": emit_schema,
    "foreign_ids": foreign_ids,
    "foreign_bodies": foreign_bodies,
    "foreign_max_payload": foreign_max_payload,
    "foreign_headers": foreign_headers,
}
EMIT_CLASSES = ("times", "sizes", "max_payload", "text", "headers", "schema")


def any_emit() -> st.SearchStrategy[EmitCase]:
    """A class first, then a case of it (one_of would flatten the classes'
    own branches and favour the classes that have most)."""
    return st.sampled_from(EMIT_CLASSES).flatmap(lambda k: CLASSES[k]())


def any_foreign() -> st.SearchStrategy[ForeignCase]:
    return st.sampled_from([k for k in CLASSES if k not in EMIT_CLASSES]).flatmap(lambda k: CLASSES[k]())


# -- header values another client can send ------------------------------------------
# nats-py strips every Unicode white space from a header value it sends
# (str.strip()) and encodes it strictly as UTF-8, but strips only ASCII white
# space from a value it receives and decodes invalid UTF-8 as U+FFFD: another
# client (or a raw HPUB, as chaos/foreign.py sends these) can send what nats-py
# cannot. Invalid UTF-8 bytes are written as surrogate escapes ("\udcff" is
# the byte 0xff): encode a value with value.encode("utf-8", "surrogateescape").
# CR and LF are left out: NATS's framing cannot carry them in any client.
# These cases are not in CLASSES: nats-py (the poison pipeline test's
# publisher) cannot send most of them.

UNICODE_SPACE = [
    "\u00a0",  # no-break space
    "\x1c",  # file separator .. unit separator: str.isspace(), not bytes.isspace()
    "\x1d",
    "\x1e",
    "\x1f",
    "\x0b",  # vertical tab and form feed: ASCII white space, stripped by nats-py on receipt
    "\x0c",
    "\x85",  # next line
    "\u1680",
    "\u2000",
    "\u2003",
    "\u2028",
    "\u2029",
    "\u202f",
    "\u205f",
    "\u3000",
]
# Invisible, but not white space for str.strip().
INVISIBLE = ["\u200b", "\u2060", "\ufeff", "\u00ad", "\u200e"]
BAD_UTF8 = [
    "\udcff",  # a byte UTF-8 never uses
    "\udcfe",
    "\udcc3(",  # a lead byte followed by a non-continuation byte (0xc3 0x28)
    "\udce2\udc82",  # truncated 3-byte sequence
    "\udcc0\udcaf",  # overlong "/"
    "\udced\udca0\udc80",  # an encoded surrogate (U+D800)
    "\udcf4\udc90\udc80\udc80",  # past U+10FFFF
]
# Pgoutbox-Event-Version values: digits Python's int() refuses (more than
# 4,300 of them, ValueError), digits str.isdigit() accepts but int() reads as
# another number or refuses, and near misses.
VERSION_VALUES = [
    "0" * 4399 + "1",
    "1" * 4301,
    "0" * 20_000 + "1",
    "9" * 4300,
    "0" * 50 + "1",
    "\u00b2",  # superscript two: isdigit(), int() refuses it
    "\u0661",  # Arabic-Indic one: int() reads 1
    "\uff11",  # fullwidth one: int() reads 1
    "1\u00a0",
    "\u00a01",
    "1\x1f",
    "+1",
    "1_0",
    " 1",
    "1.0",
]
VALUED_HEADERS = (
    "Pgoutbox-Tenant-Id",
    "Pgoutbox-Aggregate-Id",
    "Pgoutbox-Aggregate-Type",
    "Pgoutbox-Ordering-Key",
    "Pgoutbox-Correlation-Id",
    "Pgoutbox-Causation-Id",
    "Pgoutbox-Occurred-At",
    "Pgoutbox-Context",
    "Pgoutbox-Event-Type",
    "Pgoutbox-Event-Version",
    "traceparent",
    "tracestate",
    "x-app",
)


def _decorated(base: str) -> st.SearchStrategy[str]:
    """base with white space, invisible characters or invalid UTF-8 before,
    after or inside it."""
    odd = st.sampled_from(UNICODE_SPACE + INVISIBLE + BAD_UTF8)
    return st.one_of(
        st.builds(lambda s: base + s, odd),
        st.builds(lambda s: s + base, odd),
        st.builds(lambda s: base[:1] + s + base[1:], odd),
        st.builds(lambda a, b: a + base + b, odd, odd),
        st.just(base),
    )


def foreign_header_values(
    context: str = CONTEXT, event_type: str = EVENT_TYPE, subject: str = SUBJECTS[0]
) -> st.SearchStrategy[ForeignCase]:
    """A well-formed message (relay headers agreeing with the subject, a JSON
    object answered 200 or 422) with one or two header values nats-py would
    not send: Unicode white space at an end, invisible characters, invalid
    UTF-8, event versions of thousands of digits. context and event_type are
    those of `subject`, which the headers' plain values repeat."""
    uuid_text = str(uuid.UUID(int=0x1234))
    bases = {
        "Pgoutbox-Context": context,
        "Pgoutbox-Event-Type": event_type,
        "Pgoutbox-Event-Version": subject.rsplit(".v", 1)[1],
        "Pgoutbox-Occurred-At": "2025-01-01T00:00:00Z",
        "Pgoutbox-Correlation-Id": uuid_text,
        "Pgoutbox-Causation-Id": uuid_text,
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "k=v",
    }

    def value_for(name: str) -> st.SearchStrategy[str]:
        decorated = _decorated(bases.get(name, "t"))
        if name == "Pgoutbox-Event-Version":
            return st.one_of(st.sampled_from(VERSION_VALUES), decorated)
        return decorated

    # The version (int() of thousands of digits) and the tenant (a header the
    # replay re-sends) drawn more often than the rest.
    names = ("Pgoutbox-Event-Version",) * 3 + ("Pgoutbox-Tenant-Id",) * 2 + VALUED_HEADERS
    header = st.sampled_from(names).flatmap(lambda n: value_for(n).map(lambda v: (n, v)))
    # Half of them with a plain id: the tested header alone is odd.
    msg_ids = st.one_of(
        st.just("{uuid}"),
        st.just("{uuid}"),
        st.sampled_from(UNICODE_SPACE + INVISIBLE + BAD_UTF8).map(lambda s: "{uuid}" + s),
        st.sampled_from(UNICODE_SPACE + BAD_UTF8).map(lambda s: s + "{uuid}"),
    )
    return st.builds(
        ForeignCase,
        klass=st.just("foreign_header_values"),
        subject=st.just(subject),
        msg_id=msg_ids,
        headers=st.lists(header, min_size=1, max_size=2).map(dict),
        body=st.builds(
            lambda a: json.dumps({"schema_version": 1, "answer": a}).encode(), st.sampled_from((200, 422, 422))
        ),
    )
