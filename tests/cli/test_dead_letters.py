"""`pgoutbox dead-letters` and `pgoutbox redrive --match`, as the roles the
docs give them: pgoutbox_viewer reads (no payload, no action), pgoutbox_admin
acts; against the suite's PostgreSQL, and NATS where the replayer matters."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import timedelta

import psycopg
from psycopg.types.json import Jsonb

from pgoutbox.cli import main as cli
from pgoutbox.core import wire
from pgoutbox.core.errors import ExitCode
from support import archival
from support.commands import assert_one_line
from support.inbox import dlq_messages, event, jetstream
from support.roles import login

H = "billing"
SUBJECT = "sea.event.order_created.v1"


def dead_letter(url: str, error: str, *, handler: str = H, due: bool = False) -> str:
    """An inbox dead letter with its envelope (payload {"secret": 42}), as the consumer leaves one."""
    ev = event({"secret": 42})
    envelope = wire.from_nats(*wire.to_nats(ev))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT inbox.receive(%s, %s, %s, %s)", (ev["event_id"], handler, SUBJECT, Jsonb(envelope)))
        conn.execute(
            "SELECT inbox.record_error(%s, %s, %s, TRUE, %s)",
            (ev["event_id"], handler, error, timedelta(0) if due else None),
        )
    return ev["event_id"]


def seed(url: str) -> None:
    """Three causes on the inbox side (3, 2 and 1 rows) and one on the outbox side (2 rows)."""
    for _ in range(3):
        dead_letter(url, f"HTTP 500: order {uuid.uuid4()} failed")
    for n in range(2):
        dead_letter(url, f'BAD_PAYLOAD: field "amount" is {n}.5')
    dead_letter(url, "HTTP 404: no route", handler="shipping")
    with psycopg.connect(url, autocommit=True) as conn:
        archival.events(conn, archival.today(), 2, dead=2)


def pgoutbox(capsys, url: str, *argv: str) -> list[str]:
    """`pgoutbox argv` as the login of url, exit code 0; its stdout lines."""
    code = cli.main([*argv, "--database-url", url])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out.splitlines()


def role_of(url: str) -> str:
    """The login name in a URL from support.roles.login."""
    return url.split("//", 1)[1].split("@", 1)[0]


def json_lines(lines: list[str]) -> list[dict]:
    return [json.loads(line) for line in lines]


def test_a_viewer_reads_groups_lists_and_details_without_payloads(capsys, database_url):
    seed(database_url)
    viewer = login(database_url, "pgoutbox_viewer")
    groups = json_lines(pgoutbox(capsys, viewer, "dead-letters", "groups", "--format", "json"))
    assert sorted((g["side"], g["owner"], g["error_class"], g["dead_letters"]) for g in groups) == [
        ("inbox", "billing", "5xx", 3),
        ("inbox", "billing", "BAD_PAYLOAD", 2),
        ("inbox", "shipping", "4xx", 1),
        ("outbox", "sea", "OTHER", 2),
    ]
    table = pgoutbox(capsys, viewer, "dead-letters", "groups", "--owner", "billing")
    assert table[0].split()[:3] == ["group_id", "side", "owner"] and len(table) == 3

    page1 = json_lines(pgoutbox(capsys, viewer, "dead-letters", "list", "--format", "json", "--max-rows", "5"))
    page2 = json_lines(
        pgoutbox(capsys, viewer, "dead-letters", "list", "--format", "json", "--after", page1[-1]["cursor"])
    )
    assert len(page1) == 5 and len(page2) == 3
    assert not {r["id"] for r in page1} & {r["id"] for r in page2}

    [five_hundred] = [g for g in groups if g["error_class"] == "5xx"]
    listed = json_lines(
        pgoutbox(capsys, viewer, "dead-letters", "list", "--format", "json", "--group", five_hundred["group_id"])
    )
    assert len(listed) == 3
    doc = json.loads("".join(pgoutbox(capsys, viewer, "dead-letters", "show", listed[0]["id"])))
    assert (doc["side"], doc["handler"], doc["payload"], doc["payload_visible"]) == ("inbox", H, None, False)
    assert doc["envelope"]["message_id"] == listed[0]["id"] and "payload" not in doc["envelope"]

    admin = login(database_url, "pgoutbox_admin")
    doc = json.loads("".join(pgoutbox(capsys, admin, "dead-letters", "show", listed[0]["id"])))
    assert doc["payload"]["secret"] == 42, "the admin may read the payload"


def test_a_viewer_cannot_act_and_bad_input_gets_one_line(capsys, database_url):
    seed(database_url)
    viewer = login(database_url, "pgoutbox_viewer")
    db = ["--database-url", viewer]
    assert_one_line(capsys, ["dead-letters", "discard", "--reason", "x", *db], ExitCode.DATABASE, "[42501]")
    assert_one_line(capsys, ["redrive", "--match", "--reason", "x", *db], ExitCode.DATABASE, "[42501]")
    assert_one_line(capsys, ["dead-letters", "list", "--group", "zz", *db], ExitCode.USAGE, "[OB100]")
    assert_one_line(capsys, ["dead-letters", "list", "--after", "nope", *db], ExitCode.USAGE, "[OB107]")
    assert_one_line(capsys, ["dead-letters", "list", "--since", "yesterday", *db], ExitCode.USAGE, "ISO 8601")
    assert_one_line(capsys, ["dead-letters", "show", str(uuid.uuid4()), *db], ExitCode.USAGE, "no dead letter")
    admin = ["--database-url", login(database_url, "pgoutbox_admin")]
    assert_one_line(capsys, ["dead-letters", "discard", *admin], ExitCode.USAGE, "--reason")
    assert_one_line(capsys, ["redrive", "--match", "--owner", H, *admin], ExitCode.USAGE, "--reason")
    assert_one_line(capsys, ["redrive", H, "--owner", H, *admin], ExitCode.USAGE, "--match")
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT count(*) FROM inbox.discard_log").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM inbox.redrive_log").fetchone() == (0,)


def test_discard_and_restore_round_trip_in_batches(capsys, database_url):
    seed(database_url)
    admin = login(database_url, "pgoutbox_admin")
    args = ["--owner", H, "--batch", "2", "--pause", "0"]
    assert pgoutbox(capsys, admin, "dead-letters", "discard", *args, "--dry-run") == [
        "discard: 5 dead letter(s) match; nothing done (--dry-run)"
    ]
    assert pgoutbox(capsys, admin, "dead-letters", "discard", *args, "--reason", "obsolete") == [
        "discard: 2 of 5",
        "discard: 4 of 5",
        "discard: 5 of 5",
        "discarded 5 dead letter(s)",
    ]
    live = json_lines(pgoutbox(capsys, admin, "dead-letters", "groups", "--format", "json"))
    assert sorted(g["owner"] for g in live) == ["sea", "shipping"], "discarded ones are not live dead letters"
    gone = json_lines(pgoutbox(capsys, admin, "dead-letters", "groups", "--discarded", "--format", "json"))
    assert sorted((g["error_class"], g["discarded"]) for g in gone) == [("5xx", 3), ("BAD_PAYLOAD", 2)]
    # A redrive --match passes them by: nothing of billing is replayed.
    assert pgoutbox(capsys, admin, "redrive", "--match", "--owner", H, "--dry-run") == [
        "replay: 0 dead letter(s) match; nothing done (--dry-run)"
    ]
    assert pgoutbox(capsys, admin, "dead-letters", "restore", *args, "--reason", "needed after all")[-1] == (
        "restored 5 dead letter(s)"
    )
    with psycopg.connect(database_url) as conn:
        audit = conn.execute(
            "SELECT action, acted_by, count(*) FROM inbox.discard_log GROUP BY 1, 2 ORDER BY 1"
        ).fetchall()
        assert audit == [
            ("discard", role_of(admin), 5),
            ("restore", role_of(admin), 5),
        ]
        assert conn.execute(
            "SELECT count(*) FROM inbox.messages WHERE status = 'DEAD_LETTER' AND NOT dlq_metadata ? 'discarded'"
        ).fetchone() == (6,)


def test_redrive_match_replays_one_group_through_the_replayer(capsys, database_url, nats_server):
    seed(database_url)
    admin = login(database_url, "pgoutbox_admin")
    groups = json_lines(pgoutbox(capsys, admin, "dead-letters", "groups", "--side", "inbox", "--format", "json"))
    [five_hundred] = [g for g in groups if g["error_class"] == "5xx"]
    match = ["redrive", "--match", "--group", five_hundred["group_id"], "--batch", "2", "--pause", "0"]
    assert pgoutbox(capsys, admin, *match, "--dry-run") == ["replay: 3 dead letter(s) match; nothing done (--dry-run)"]
    out = pgoutbox(capsys, admin, *match, "--reason", "handler fixed in 2.1")
    assert out[:2] == ["replay: 2 of 3", "replay: 3 of 3"]
    assert pgoutbox(capsys, admin, *match, "--reason", "again") == [
        "replayed 0 dead letter(s): outbox events requeued, inbox messages marked for the replayer"
    ], "a second run finds nothing left to ask for"

    consumer = login(database_url, "pgoutbox_consumer")
    assert pgoutbox(capsys, consumer, "replay", "--once", "--nats-url", nats_server.url) == [
        "re-published 3 dead letter(s)"
    ]

    async def replayed() -> list:
        async with jetstream(nats_server.url) as js:
            return await dlq_messages(js, subject=f"sea.dlq.replay.{H}")

    assert len(asyncio.run(replayed())) == 3
    with psycopg.connect(database_url) as conn:
        assert conn.execute(
            "SELECT count(*), min(reason) FROM inbox.redrive_log WHERE redriven_by = %s",
            (role_of(admin),),
        ).fetchone() == (3, "handler fixed in 2.1")
        assert conn.execute(
            "SELECT count(*) FROM inbox.messages WHERE status = 'DEAD_LETTER' AND last_error LIKE 'BAD_PAYLOAD%'"
        ).fetchone() == (2,), "the other groups are untouched"
