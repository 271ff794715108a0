"""Every setting whose value a SQL function bounds is refused at start-up, with
the database's own bound (pgoutbox.core.bounds).

  * each bound is the database's: the SQL functions that take the value
    accept it just at the bound and refuse it, with their code, just past;
  * each bounded setting of each command, set just past its bound, ends the
    command before it connects anywhere (the database URL points at a closed
    port, NATS at nothing): one line on stderr naming the variable, exit 2;
    just at the bound the configuration is built;
  * which settings carry which bound is spelled out below, so that a setting
    that loses its bound fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from pgoutbox.cli import main as cli
from pgoutbox.core import bounds, settings
from pgoutbox.core.bounds import Bound
from pgoutbox.core.errors import ConfigError, ExitCode
from pgoutbox.dev.embedded import free_port
from support.inbox import write_registry

# -- the bounds are the database's --------------------------------------------

MICROSECOND = timedelta(microseconds=1)
ACCEPTED = None  # the call succeeds


@dataclass(frozen=True)
class Probe:
    """A call that takes a bounded value (%s), and what it may end with when
    the value is accepted (ACCEPTED, or the code of a check of another
    argument that comes after this one's)."""

    statement: str | Callable[[psycopg.Connection, object], None]
    refused: str  # the SQLSTATE of a value out of bounds
    accepted: frozenset = field(default=frozenset({ACCEPTED}))
    low: bool = True  # also probe the low end (when the bound has one)
    refused_low: str | None = None  # a different code at the low end


def _retry_at(conn: psycopg.Connection, ahead: object) -> None:
    conn.execute("SELECT outbox.emit('order', '1', 'created', '{\"schema_version\": 1}', context => 'sea')")
    token, event_id = conn.execute("SELECT claim_token, event_id FROM outbox.claim('probe', 1, '30s')").fetchone()
    conn.execute(
        "SELECT outbox.mark_failed(%s, ARRAY[%s]::uuid[], ARRAY['probe'], ARRAY[now() + %s])", (token, event_id, ahead)
    )


def _replay_after(conn: psycopg.Connection, after: object) -> None:
    message_id = uuid.uuid4()
    conn.execute("SELECT inbox.receive(%s, 'probe', 'sea.event.created.v1')", (message_id,))
    conn.execute("SELECT inbox.record_error(%s, 'probe', 'failed', TRUE, %s)", (message_id, after))


def _ids(n: str = "%s") -> str:
    return f"ARRAY(SELECT gen_random_uuid() FROM generate_series(1, {n}))"


PROBES: dict[str, list[Probe]] = {
    "CLAIM_BATCH": [Probe("SELECT count(*) FROM outbox.claim('probe', %s, interval '30 seconds')", "OB006")],
    "LEASE": [Probe("SELECT count(*) FROM outbox.claim('probe', 1, %s)", "OB006")],
    "RETRY_AHEAD": [Probe(_retry_at, "OB008")],
    "WORKER": [
        Probe("SELECT count(*) FROM outbox.claim(%s, 1, interval '30 seconds')", "OB009", refused_low="OB006"),
        Probe("SELECT count(*) FROM inbox.claim_replays(%s, 1)", "OB009", refused_low="OB006"),
    ],
    "DAYS_AHEAD": [
        # From the last day a partition can have: days_ahead passes its own check, then from_day's fails.
        Probe(
            "SELECT count(*) FROM outbox.create_partitions(%s, date '9999-12-30')",
            "OB006",
            frozenset({ACCEPTED, "OB008"}),
        )
    ],
    "MAX_ROWS": [
        Probe("SELECT count(*) FROM outbox.dead_letters(NULL, %s)", "OB006"),
        Probe("SELECT count(*) FROM inbox.dead_letters(NULL, %s)", "OB006"),
    ],
    "CONTEXT": [
        Probe("SELECT count(*) FROM outbox.backlog(%s)", "OB006"),
        Probe("SELECT count(*) FROM inbox.backlog(%s)", "OB006"),
        Probe("SELECT count(*) FROM outbox.dead_letters(%s, 10)", "OB006"),
    ],
    "REASON": [
        Probe("SELECT inbox.set_replay('probe', TRUE, %s)", "OB009", refused_low="OB014"),
        Probe("SELECT inbox.redrive('probe', NULL, %s)", "OB009", refused_low="OB014"),
        Probe(
            "SELECT outbox.requeue(ARRAY[gen_random_uuid()], %s)",
            "OB009",
            frozenset({"OB015"}),  # not a dead letter: the reason passed
            refused_low="OB014",
        ),
        Probe(
            "SELECT outbox.requeue_completed(ARRAY[gen_random_uuid()], %s, now() - interval '1 hour')",
            "OB009",
            frozenset({"OB040"}),  # not COMPLETED: the reason passed
            refused_low="OB014",
        ),
    ],
    "INBOX_BATCH": [
        Probe(
            "SELECT count(*) FROM inbox.receive_batch('probe', "
            + _ids()
            + ", ARRAY(SELECT 'sea.event.created.v1' FROM generate_series(1, %s)),"
            " ARRAY(SELECT NULL::jsonb FROM generate_series(1, %s)))",
            "OB006",
        ),
        Probe("SELECT count(*) FROM inbox.settle('probe', " + _ids() + ", NULL, NULL)", "OB006"),
    ],
    "REPLAY_BATCH": [Probe("SELECT count(*) FROM inbox.claim_replays('probe', %s)", "OB006")],
    "REPLAY_AFTER": [Probe(_replay_after, "OB006")],
    "RETENTION": [
        Probe("SELECT count(*) FROM outbox.archivable_partitions(%s, interval '30 days')", "OB006"),
        Probe("SELECT count(*) FROM outbox.archivable_partitions(interval '7 days', %s)", "OB006"),
        Probe("SELECT count(*) FROM inbox.archivable_days(%s, interval '30 days')", "OB006", low=False),
        Probe("SELECT count(*) FROM inbox.archivable_command_days(%s)", "OB006", low=False),
    ],
    "LOCK_TIMEOUT": [
        # No such partition: the lock_timeout passed.
        Probe("SELECT outbox.drop_archived('events_p19000101', %s)", "OB006", frozenset({"OB050"})),
        Probe(
            "SELECT * FROM outbox.seal_partition('events_p19000101', '7 days', '30 days', %s)",
            "OB006",
            frozenset({"OB050"}),
        ),
    ],
}


def edges(bound: Bound) -> Iterator[tuple[str, object, object]]:
    """(end, a value just inside, a value just outside) for each end of the bound."""
    if bound.pattern:
        yield "high", "a" * 64, "a" * 65
        yield "pattern", "sea_2-b", "sea.b"
        return
    if bound.unit == "characters":
        assert bound.high is not None
        yield "high", "x" * int(bound.high), "x" * (int(bound.high) + 1)
        if bound.low is not None:
            yield "low", "x" * int(bound.low), " "
        return
    if bound.unit == "s":
        assert bound.high is not None
        high = timedelta(seconds=bound.high)
        yield "high", high, high + MICROSECOND
        if bound.low is not None:
            low = timedelta(seconds=bound.low)
            yield ("low", low + MICROSECOND, low) if bound.low_open else ("low", low, low - MICROSECOND)
        return
    assert bound.high is not None
    yield "high", int(bound.high), int(bound.high) + 1
    if bound.low is not None:
        yield "low", int(bound.low), int(bound.low) - 1


def outcome(conn: psycopg.Connection, probe: Probe, value: object) -> str | None:
    """None when the call succeeds, else its SQLSTATE (rolled back either way)."""
    params = (value,) * probe.statement.count("%s") if isinstance(probe.statement, str) else ()
    try:
        with conn.transaction(force_rollback=True):
            if isinstance(probe.statement, str):
                conn.execute(probe.statement, params)
            else:
                probe.statement(conn, value)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def test_every_bound_the_database_sets_is_probed():
    assert set(PROBES) == set(bounds.SQL_BOUNDS)


@pytest.mark.parametrize("name", sorted(bounds.SQL_BOUNDS))
def test_the_sql_functions_take_the_value_at_the_bound_and_refuse_it_just_past(conn, name):
    bound = bounds.SQL_BOUNDS[name]
    checked = 0
    for probe in PROBES[name]:
        for end, inside, outside in edges(bound):
            if end == "low" and not probe.low:
                continue
            where = f"{probe.statement if isinstance(probe.statement, str) else probe.statement.__name__} ({end})"
            assert outcome(conn, probe, inside) in probe.accepted, f"{where} refuses {inside!r:.60}"
            expected = probe.refused_low if end == "low" and probe.refused_low else probe.refused
            assert outcome(conn, probe, outside) == expected, f"{where} does not refuse {outside!r:.60}"
            # Python draws the line at the same place.
            bound.check(inside)
            with pytest.raises(ValueError):
                bound.check(outside)
            checked += 1
    assert checked


# -- the settings that carry them ------------------------------------------------

# Which setting of which command carries which bound; a setting dropped from
# here, or a bound dropped from a setting, fails the test below.
# not default: the setting each bound is read from (the file tests every bound), not values
BOUNDED = {
    "relay": {
        "OUTBOX_RELAY_NAME": "WORKER",
        "OUTBOX_RELAY_BATCH_SIZE": "CLAIM_BATCH",
        "OUTBOX_RELAY_LEASE": "LEASE",
        "OUTBOX_RELAY_RETRY_CAP": "RETRY_AHEAD",
        "OUTBOX_RELAY_HTTP_PORT": "PORT",
        "OUTBOX_PARTITION_DAYS_AHEAD": "DAYS_AHEAD",
    },
    "streams": {"OUTBOX_RELAY_LEASE": "LEASE"},
    "status": {"OUTBOX_STATUS_CONTEXT": "CONTEXT", "OUTBOX_STATUS_DEAD_LETTERS": "MAX_ROWS"},
    "flow": {"OUTBOX_FLOW_MAX_ROWS": "MAX_ROWS"},
    "requeue": {"OUTBOX_REQUEUE_REASON": "REASON"},
    "audit": {"OUTBOX_AUDIT_REASON": "REASON"},
    "partitions": {"OUTBOX_PARTITION_DAYS_AHEAD": "DAYS_AHEAD"},
    "consume": {
        "OUTBOX_CONSUMER_BATCH_SIZE": "INBOX_BATCH",
        "OUTBOX_REPLAY_MAX_DELAY": "REPLAY_AFTER",
        "OUTBOX_REPLAY_BATCH_SIZE": "REPLAY_BATCH",
        "OUTBOX_REPLAY_WORKER": "WORKER",
        "OUTBOX_CONSUMER_HTTP_PORT": "PORT",
    },
    "replay": {"OUTBOX_REPLAY_BATCH_SIZE": "REPLAY_BATCH", "OUTBOX_REPLAY_WORKER": "WORKER"},
    "redrive": {"OUTBOX_REDRIVE_REASON": "REASON", "OUTBOX_REDRIVE_BATCH": "MAX_ROWS"},
    "dead-letters": {
        "OUTBOX_DEAD_LETTERS_MAX_ROWS": "MAX_ROWS",
        "OUTBOX_DEAD_LETTERS_REASON": "REASON",
        "OUTBOX_DEAD_LETTERS_BATCH": "MAX_ROWS",
    },
    "replay-switch": {"OUTBOX_REPLAY_SWITCH_REASON": "REASON"},
    "console": {"OUTBOX_CONSOLE_PORT": "PORT", "OUTBOX_CONSOLE_ACTION_BATCH": "MAX_ROWS"},
    "archive": {
        "OUTBOX_ARCHIVE_RETENTION": "RETENTION",
        "OUTBOX_ARCHIVE_DEAD_LETTER_RETENTION": "RETENTION",
        "OUTBOX_INBOX_RETENTION": "RETENTION",
        "OUTBOX_COMMAND_RETENTION": "RETENTION",
        "OUTBOX_ARCHIVE_LOCK_TIMEOUT": "LOCK_TIMEOUT",
    },
}
ALL_BOUNDS = {**bounds.SQL_BOUNDS, "PORT": bounds.PORT}
COMMANDS = {mod.COMMAND: mod for mod in cli.COMMANDS}
# What each command needs besides the setting under test to get as far as its configuration.
ARGUMENTS = {
    "streams": ["--streams-file", "streams.toml"],
    "requeue": [str(uuid.uuid4())],
    "audit": ["SEA_EVENTS"],
    "redrive": ["billing", "--list"],
    "replay-switch": ["billing", "off"],
    "dead-letters": ["groups"],
    "flow": [str(uuid.uuid4())],
}
REQUIRED = {"OUTBOX_REQUEUE_REASON": "test", "OUTBOX_REPLAY_SWITCH_REASON": "test"}


def test_each_bounded_setting_carries_its_bound():
    found = {
        mod.COMMAND: {s.env: name for s in mod.SETTINGS if s.bound for name, b in ALL_BOUNDS.items() if b is s.bound}
        for mod in cli.COMMANDS
    }
    assert {c: v for c, v in found.items() if v} == BOUNDED


def as_setting(bound: Bound, value: object) -> str:
    """A value as one writes it in the variable."""
    if isinstance(value, timedelta):
        return f"{value.total_seconds():.6f}s"
    return str(value)


def cases() -> Iterator:
    for command, envs in BOUNDED.items():
        for env, name in envs.items():
            bound = ALL_BOUNDS[name]
            for end, inside, outside in edges(bound):
                if end == "low" and isinstance(outside, timedelta) and outside < timedelta(0):
                    continue  # a duration cannot be written negative
                yield pytest.param(
                    command,
                    env,
                    bound,
                    as_setting(bound, inside),
                    as_setting(bound, outside),
                    id=f"{command}-{env}-{end}",
                )


def pgoutbox(tmp_path: Path, command: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    nowhere = f"127.0.0.1:{free_port()}"
    return subprocess.run(
        [sys.executable, "-m", "pgoutbox.cli.main", command, *ARGUMENTS.get(command, [])],
        env={
            **base,
            "OUTBOX_DATABASE_URL": f"postgresql://postgres@{nowhere}/app",
            "OUTBOX_NATS_URL": f"nats://{nowhere}",
            **REQUIRED,
            **env,
        },
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(("command", "env", "bound", "inside", "outside"), list(cases()))
def test_a_setting_past_its_bound_is_refused_at_start_up(tmp_path, command, env, bound, inside, outside):
    done = pgoutbox(tmp_path, command, **{env: outside})
    assert done.returncode == ExitCode.USAGE, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"pgoutbox {command}: ConfigError: {env}={outside!r}: must "), line
    assert f"({bound.sql})" in line, line
    # Just at the bound the bound lets the value through (another setting's
    # cross-check, e.g. a lease shorter than the publish timeout, may still refuse it).
    config = COMMANDS[command].CONFIG
    needed = {"streams_file": "streams.toml", "reason": "test"}
    given = {s.name: needed[s.name] for s in settings.of(config) if s.name in needed and s.env != env}
    try:
        settings.build(config, environ={env: inside}, overrides=given)
    except ConfigError as exc:
        assert not str(exc).startswith(f"{env}="), exc


def test_a_manifest_batch_size_past_the_bound_is_refused_at_start_up(tmp_path):
    # not default: the test is about the bound
    registry_file = write_registry(
        tmp_path,
        [
            {
                "name": "billing",
                "url": "http://127.0.0.1:1/events",
                "subjects": ["sea.event.order_created.v1"],
                "batch_size": 10001,
            }
        ],
    )
    done = pgoutbox(tmp_path, "consume", OUTBOX_REGISTRY_FILE=str(registry_file))
    assert done.returncode == ExitCode.USAGE, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("pgoutbox consume: ConfigError: handler billing: batch_size=10001: must be at most 10000"), (
        line
    )
