"""`pgoutbox requeue --broker-outage`, as a login granted only pgoutbox_admin:
the one command that brings back what older releases dead-lettered because
JetStream did not answer (NATS_UNAVAILABLE, PUBLISH_TIMEOUT, the "NATS_TIMEOUT"
of reports, a JETSTREAM_ERROR whose code says JetStream was unavailable or a
stream had no leader), and nothing else, audited in outbox.requeue_log."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import psycopg
from psycopg.types.json import Jsonb

from pgoutbox.cli.requeue import broker_outage
from support.roles import login

PGOUTBOX = Path(sys.executable).parent / "pgoutbox"

# last_error as older releases wrote it when they gave up.
OUTAGE = [
    "NATS_UNAVAILABLE: JetStream did not answer for 'sea.event.order_created.v1': ServiceUnavailableError"
    " (gave up after 10 attempts)",
    "PUBLISH_TIMEOUT: no JetStream ack within 5s (gave up after 10 attempts)",
    "NATS_TIMEOUT: nats: timeout (gave up after 10 attempts)",
    "JETSTREAM_ERROR: [10008] JetStream system temporarily unavailable (gave up after 10 attempts)",
    "JETSTREAM_ERROR: stream SEA_EVENTS did not respond for 'sea.event.order_created.v1' (gave up after 10 attempts)",
]
OWN = [
    "MAX_PAYLOAD: [10054] message size exceeds maximum allowed",
    "JETSTREAM_ERROR: [10071] wrong last sequence: 41 (gave up after 10 attempts)",
    "BAD_HEADER: header 'x' value 'NATS_UNAVAILABLE: PUBLISH_TIMEOUT: ' is not allowed",
]


def dead_letters(url: str, errors: list[str]) -> list[str]:
    """Events walked to DEAD_LETTER through the relay's own calls, with these errors."""
    ids = []
    with psycopg.connect(url, autocommit=True) as conn:
        for n, error in enumerate(errors):
            event_id = conn.execute(
                "SELECT outbox.emit('order', %s, 'order_created', %s, context => 'sea')::text",
                (str(n), Jsonb({"schema_version": 1})),
            ).fetchone()[0]
            (token,) = conn.execute(
                "SELECT claim_token FROM outbox.claim('old-relay', 1, %s)", (timedelta(minutes=1),)
            ).fetchone()
            conn.execute(
                "SELECT outbox.mark_failed(%s, ARRAY[%s]::uuid[], ARRAY[%s], ARRAY[NULL]::timestamptz[])",
                (token, event_id, error),
            )
            ids.append(event_id)
    return ids


def requeue(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PGOUTBOX), "requeue", *args, "--database-url", url],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )


def statuses(url: str) -> dict[str, str]:
    with psycopg.connect(url, autocommit=True) as conn:
        return dict(conn.execute("SELECT event_id::text, status FROM outbox.events").fetchall())


def test_broker_outage_requeues_exactly_what_the_broker_caused_and_audits_it(database_url):
    outage = dead_letters(database_url, OUTAGE)
    own = dead_letters(database_url, OWN)
    admin = login(database_url, "pgoutbox_admin")

    dry = requeue(admin, "--broker-outage", "--dry-run", "--reason", "JetStream outage of 28 Nov")
    assert dry.returncode == 0, dry.stderr
    assert (
        dry.stdout
        == f"{len(OUTAGE)} event(s) dead-lettered because the broker did not answer; nothing done (--dry-run)\n"
    )
    assert set(statuses(database_url).values()) == {"DEAD_LETTER"}

    done = requeue(admin, "--broker-outage", "--reason", "JetStream outage of 28 Nov")
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(f"requeued {len(OUTAGE)} event(s) dead-lettered because the broker did not answer\n")
    now = statuses(database_url)
    assert {i: now[i] for i in outage} == dict.fromkeys(outage, "PENDING")
    assert {i: now[i] for i in own} == dict.fromkeys(own, "DEAD_LETTER")
    with psycopg.connect(database_url, autocommit=True) as conn:
        logged = conn.execute("SELECT event_id::text, reason, requeued_by FROM outbox.requeue_log").fetchall()
    role = admin.split("://", 1)[1].split("@", 1)[0]
    assert sorted(logged) == sorted((i, "JetStream outage of 28 Nov", role) for i in outage)

    again = requeue(admin, "--broker-outage", "--reason", "JetStream outage of 28 Nov")
    assert again.stdout == "0 event(s) dead-lettered because the broker did not answer\n"  # nothing left


def test_broker_outage_takes_no_ids_and_needs_a_reason(database_url):
    admin = login(database_url, "pgoutbox_admin")
    with_ids = requeue(admin, "--broker-outage", "00000000-0000-0000-0000-000000000001", "--reason", "x")
    assert with_ids.returncode == 2 and len(with_ids.stderr.strip().splitlines()) == 1, with_ids.stderr
    no_reason = requeue(admin, "--broker-outage")
    assert no_reason.returncode == 2 and len(no_reason.stderr.strip().splitlines()) == 1, no_reason.stderr


def test_what_counts_as_a_broker_outage():
    assert all(broker_outage(e) for e in OUTAGE)
    assert not any(broker_outage(e) for e in [*OWN, None, "", "JETSTREAM_ERROR: [10054] too large"])
