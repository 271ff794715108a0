"""Foreign messages: what another system publishes straight to the event
stream, outside the outbox (so outside the ledger of committed events).

Two kinds, both published by fault kinds (chaos/faults.py):
  * hostile ones, drawn once per run from the poison strategies of
    chaos/poison.py (any_foreign(), and foreign_header_values():
    header values with Unicode white space, invisible characters, invalid
    UTF-8, event versions of thousands of digits). Each that reached the
    stream must end as a `.invalid` DLQ notice naming its stream sequence,
    or in the handler's inbox PROCESSED, or DEAD_LETTER with a notice;
  * well-formed ones, published while PostgreSQL is down (postgres_outage):
    each must end PROCESSED with exactly one side effect, never
    dead-lettered for the outage.
A message that ends nowhere vanished: the check counts it.

They are sent with a small raw NATS client (HPUB), not nats-py: nats-py
strips every Unicode white space from a header value and refuses invalid
UTF-8, so it cannot send what another client can. The PubAck gives the
stream sequence each message got.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import secrets
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from chaos import poison

# One UUID inside a Nats-Msg-Id, however it is wrapped (the strategies put at
# most the one fresh UUID of ForeignCase.materialise in an id).
_UUID = re.compile(r"[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header name NATS carries
PUBLISH_TIMEOUT = 5.0


@dataclass(frozen=True)
class Sent:
    klass: str
    expect: str  # "outcome" (hostile: .invalid, PROCESSED or DEAD_LETTER) or "processed" (well-formed)
    seq: int | None  # stream sequence (None: the PubAck was lost, stored or not)
    uid: uuid.UUID | None  # the UUID in its Nats-Msg-Id, if any
    case: str  # ForeignCase.short(), for the report


@dataclass
class ForeignLedger:
    sent: list[Sent] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)  # why NATS did not store one -> count
    lock: threading.Lock = field(default_factory=threading.Lock)


def draw_cases(seed: int, count: int, subject: str) -> list[poison.ForeignCase]:
    """`count` hostile messages for `subject`, half of them with odd header values."""
    context, _, event_type, _ = subject.split(".")
    strategy = st.one_of(poison.any_foreign(), poison.foreign_header_values(context, event_type, subject))
    drawn: list[poison.ForeignCase] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(case: poison.ForeignCase) -> None:
        drawn.append(case)

    collect()
    # Every class on the handler's subject (the test's subjects are another context's).
    return [dataclasses.replace(c, subject=subject) for c in drawn]


def well_formed(subject: str) -> poison.ForeignCase:
    """A message the handler processes: relay headers, a canonical id, a JSON object."""
    return poison.ForeignCase(klass="well_formed", subject=subject, body=b'{"schema_version":1}')


def _header_block(headers: dict[str, str]) -> bytes:
    """NATS/1.0 headers as raw bytes: values sent as they are (surrogate
    escapes become the invalid bytes they stand for), CR/LF as spaces (the
    framing cannot carry them). ValueError for a name NATS cannot carry."""
    out = bytearray(b"NATS/1.0\r\n")
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name):
            raise ValueError(f"header name {name[:40]!r} is not a token")
        out += name.encode() + b": "
        out += str(value).replace("\r", " ").replace("\n", " ").encode("utf-8", "surrogateescape") + b"\r\n"
    return bytes(out + b"\r\n")


class RawClient:
    """Just enough of the NATS client protocol to publish with headers and
    read JetStream's PubAck: CONNECT, SUB to a reply inbox, HPUB, PING/PONG."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, info: dict):
        self.reader, self.writer, self.info = reader, writer, info
        self.inbox = f"_INBOX.chaos{secrets.token_hex(6)}"
        self.max_payload = int(info.get("max_payload") or 1024 * 1024)
        self.count = 0

    @classmethod
    async def connect(cls, nats_url: str) -> RawClient:
        errors = []
        for server in (s.strip() for s in nats_url.split(",") if s.strip()):
            hostport = server.partition("://")[2] or server
            host, _, port = hostport.rpartition("@")[2].rpartition(":")
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 3)
                line = await asyncio.wait_for(reader.readline(), 3)
            except (OSError, TimeoutError) as exc:
                errors.append(f"{hostport}: {exc!r}")
                continue
            if not line.startswith(b"INFO "):
                writer.close()
                errors.append(f"{hostport}: no INFO")
                continue
            client = cls(reader, writer, json.loads(line[5:]))
            connect = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True, "protocol": 1}
            writer.write(
                b"CONNECT " + json.dumps(connect).encode() + b"\r\n" + f"SUB {client.inbox}.* 1\r\nPING\r\n".encode()
            )
            await writer.drain()
            await client._until_pong()
            return client
        raise ConnectionError("; ".join(errors) or "no server in the NATS URL")

    async def _line(self) -> bytes:
        while True:
            line = await self.reader.readline()
            if not line:
                raise ConnectionError("the server closed the connection")
            if line.startswith(b"PING"):
                self.writer.write(b"PONG\r\n")
                await self.writer.drain()
                continue
            if line.startswith(b"-ERR"):
                raise ConnectionError(line.decode(errors="replace").strip())
            return line

    async def _until_pong(self) -> None:
        while not (await asyncio.wait_for(self._line(), 5)).startswith(b"PONG"):
            pass

    async def publish(self, subject: str, headers: dict[str, str], body: bytes) -> dict[str, Any]:
        """JetStream's answer (PubAck or error) as a dict; {"refused": why}
        when it is not sent (too large, a name NATS cannot carry)."""
        try:
            block = _header_block(headers)
        except ValueError as exc:
            return {"refused": str(exc)}
        if len(block) + len(body) > self.max_payload:
            return {"refused": "max_payload"}
        self.count += 1
        reply = f"{self.inbox}.{self.count}"
        self.writer.write(
            f"HPUB {subject} {reply} {len(block)} {len(block) + len(body)}\r\n".encode() + block + body + b"\r\n"
        )
        await self.writer.drain()
        while True:
            line = await asyncio.wait_for(self._line(), PUBLISH_TIMEOUT)
            parts = line.split()
            if parts[0] not in (b"MSG", b"HMSG"):
                continue
            size = int(parts[-1])
            data = await self.reader.readexactly(size + 2)
            if parts[1].decode() != reply:
                continue  # the late answer of an earlier publish
            if parts[0] == b"HMSG":  # a status message: no responders (503)
                return {"refused": data[: int(parts[-2])].decode(errors="replace").split("\r\n")[0]}
            return json.loads(data[:size])

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass


def uid_of(msg_id: str | None) -> uuid.UUID | None:
    found = _UUID.search(msg_id or "")
    return uuid.UUID(found[0]) if found else None


async def _publish_all(nats_url: str, cases: list[poison.ForeignCase], expect: str, ledger: ForeignLedger) -> str:
    client: RawClient | None = None
    stored = 0
    try:
        for case in cases:
            msg_id, headers = case.materialise()
            uid = uid_of(msg_id)
            try:
                client = client or await RawClient.connect(nats_url)
                answer = await client.publish(case.subject, headers, case.body)
            except (OSError, ConnectionError, TimeoutError, asyncio.IncompleteReadError) as exc:
                # No PubAck: stored or not. Kept, with its id, so that an outcome it has is still its own.
                if client is not None:
                    await client.close()
                client = None
                with ledger.lock:
                    ledger.sent.append(Sent(case.klass, expect, None, uid, case.short()))
                    ledger.refused[f"no answer: {type(exc).__name__}"] += 1
                continue
            if "refused" in answer or "error" in answer or not answer.get("seq"):
                why = answer.get("refused") or json.dumps(answer.get("error") or answer)[:120]
                with ledger.lock:
                    ledger.refused[why] += 1
                continue
            if answer.get("duplicate"):
                with ledger.lock:
                    ledger.refused["duplicate (JetStream deduplicated it)"] += 1
                continue
            stored += 1
            with ledger.lock:
                ledger.sent.append(Sent(case.klass, expect, int(answer["seq"]), uid, case.short()))
    finally:
        if client is not None:
            await client.close()
    return f"{stored}/{len(cases)} stored"


def publish(nats_url: str, cases: list[poison.ForeignCase], expect: str, ledger: ForeignLedger) -> str:
    """Publishes `cases` in turn, each with a fresh id; returns a line for the fault log."""
    return asyncio.run(_publish_all(nats_url, cases, expect, ledger))


@dataclass(frozen=True)
class Outcomes:
    """What the run left, as the check reads it."""

    invalid: set[tuple[str | None, int | None]]  # (stream, stream_sequence) named by .invalid notices
    notices: Counter  # message id -> dead-letter notices
    inbox: dict[uuid.UUID, str]  # the handler's inbox: message id -> status
    effects: dict[uuid.UUID, int]  # side effects per message id
    failures: dict[uuid.UUID, int]  # the handler's failure answers (503) per message id
    max_deliver: int


def check(ledger: ForeignLedger, stream: str, seen: Outcomes) -> tuple[dict, list[str], list[dict]]:
    """The foreign messages' part of the ledger check: figures, problems, and
    each message's outcome (for the run's logs)."""
    ended: Counter = Counter()
    found: dict[str, list[str]] = {}
    outcomes = []
    for sent in ledger.sent:
        status = seen.inbox.get(sent.uid) if sent.uid else None
        effects = seen.effects.get(sent.uid, 0) if sent.uid else 0
        if sent.seq is not None and (stream, sent.seq) in seen.invalid:
            outcome = "invalid"
        elif status == "PROCESSED":
            outcome = "processed"
        elif status == "DEAD_LETTER" and seen.notices.get(str(sent.uid)):
            outcome = "dead_letter"
        elif status in ("RECEIVED", "FAILED", "DEAD_LETTER"):
            outcome = "stuck"  # not settled, or a dead letter without its notice
        elif sent.seq is None:
            outcome = "unknown"  # no PubAck and no trace: never stored, as far as anyone can tell
        else:
            outcome = "vanished"
        ended[f"{sent.klass}:{outcome}"] += 1
        outcomes.append(
            {
                "class": sent.klass,
                "seq": sent.seq,
                "uid": str(sent.uid),
                "outcome": outcome,
                "inbox": status,
                "side_effects": effects,
                "case": sent.case,
            }
        )
        problem = None
        if outcome == "vanished":
            problem = "vanished (no .invalid notice, no inbox outcome)"
        elif outcome == "stuck":
            problem = "not PROCESSED nor DEAD_LETTER with a notice (stuck)"
        elif effects > 1:
            problem = "with duplicated side effects"
        elif outcome == "processed" and effects == 0:
            problem = "PROCESSED without their side effect"
        elif sent.expect == "processed" and outcome == "invalid":
            problem = "well-formed but refused as unreadable (.invalid)"
        elif sent.expect == "processed" and outcome == "dead_letter":
            if seen.failures.get(sent.uid, 0) < seen.max_deliver:  # type: ignore[arg-type]
                problem = f"well-formed, dead-lettered without max_deliver ({seen.max_deliver}) handler failures"
        if problem:
            found.setdefault(problem, []).append(f"#{sent.seq} {sent.uid} {sent.case[:160]}")
    problems = [f"{len(items)} foreign messages {name}: {'; '.join(items[:3])}" for name, items in found.items()]
    total: Counter = Counter()
    for key, n in ended.items():
        total[key.split(":", 1)[1]] += n
    figures = {
        "foreign_stored": sum(1 for s in ledger.sent if s.seq is not None),
        "foreign_unacknowledged": sum(1 for s in ledger.sent if s.seq is None),
        "foreign_refused_by_nats": sum(ledger.refused.values()),
        "foreign_refused_reasons": {why[:80]: n for why, n in ledger.refused.most_common(8)},
        "foreign_outcomes": dict(sorted(total.items())),
        "foreign_by_class": dict(sorted(ended.items())),
        "foreign_vanished": total["vanished"],
    }
    return figures, problems, outcomes
