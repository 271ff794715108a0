"""sql/ (the canonical definition) and migrations/ (what DBAs apply) must build
the same catalog; migrations must be well named, re-runnable, safe to run
concurrently, and reversible (up -> down -> up)."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import psycopg
import pytest

from pgoutbox import SCHEMA_VERSION
from pgoutbox.core import migrate as m
from pgoutbox.core.errors import MigrationError, PolicyViolation, SqlState, wrap_exceptions
from pgoutbox.dev.embedded import PG_BIN

ROOT = Path(__file__).resolve().parents[2]


def apply_canonical(url: str) -> None:
    with psycopg.connect(url) as conn:  # one transaction
        for path in sorted((ROOT / "sql").glob("*.sql")):
            conn.execute(path.read_text())


def catalog(url: str) -> str:
    dump = subprocess.run(
        [str(PG_BIN / "pg_dump"), "--schema-only", "--no-owner", "-d", url],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # \restrict carries a random key per dump; it is not part of the catalog.
    return "\n".join(line for line in dump.splitlines() if not line.startswith(("\\restrict", "\\unrestrict")))


# Downs that, as their header says, cannot restore a column's position:
# their step down is compared with each table's columns in any order.
COLUMN_POSITION_NOT_RESTORED = {5}


def columns_in_any_order(dump: str) -> str:
    """The dump with the column lines of every CREATE TABLE sorted."""
    out, columns = [], None
    for line in dump.splitlines():
        if columns is None:
            out.append(line)
            if line.startswith("CREATE TABLE ") and line.endswith("("):
                columns = []
        elif line.startswith(")"):
            out.extend(sorted(c.rstrip(",") for c in columns))
            out.append(line)
            columns = None
        else:
            columns.append(line)
    return "\n".join(out)


def versions(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT version, name FROM outbox.schema_migrations ORDER BY 1").fetchall()


def test_canonical_schema_and_migrations_build_the_same_catalog(pg_server):
    from conftest import create_database, drop_database

    a, b = create_database(pg_server, "template0"), create_database(pg_server, "template0")
    try:
        apply_canonical(pg_server.dsn(a))
        with psycopg.connect(pg_server.dsn(b), autocommit=True) as conn:
            m.migrate(conn)
        dump_a, dump_b = catalog(pg_server.dsn(a)), catalog(pg_server.dsn(b))
        assert "CREATE TABLE outbox.events" in dump_a
        assert dump_a == dump_b
        assert versions(pg_server.dsn(a)) == versions(pg_server.dsn(b))
        assert versions(pg_server.dsn(a))[-1][0] == SCHEMA_VERSION
    finally:
        drop_database(pg_server, a)
        drop_database(pg_server, b)


def test_up_down_up_round_trip(empty_database_url):
    """Every step down restores the catalog of the version below, and every
    step up after that rebuilds the same catalog again."""
    found = m.discover()
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        catalogs, moved_columns = {}, False
        for x in found:
            assert m.migrate(conn, target=x.version) == [f"up {x.name}"]
            catalogs[x.version] = catalog(empty_database_url)
        for x in reversed(found):
            assert m.migrate(conn, target=x.version - 1) == [f"down {x.name}"]
            if x.version in COLUMN_POSITION_NOT_RESTORED:
                assert catalog(empty_database_url) != catalogs[x.version - 1], "the exception is not needed"
                moved_columns = True
            if x.version > 1 and moved_columns:
                assert columns_in_any_order(catalog(empty_database_url)) == columns_in_any_order(
                    catalogs[x.version - 1]
                ), f"down {x.name}"
            elif x.version > 1:
                assert catalog(empty_database_url) == catalogs[x.version - 1], f"down {x.name}"
        assert conn.execute("SELECT to_regnamespace('outbox')").fetchone()[0] is None
        assert m.migrate(conn) == [f"up {x.name}" for x in found]
    assert catalog(empty_database_url) == catalogs[found[-1].version]


def test_rerunning_a_migration_file_changes_nothing(empty_database_url):
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        for x in m.discover():
            m.migrate(conn, target=x.version)
            before = catalog(empty_database_url)
            for _ in range(3):
                subprocess.run(
                    [
                        str(PG_BIN / "psql"),
                        "-X",
                        "-q",
                        "-v",
                        "ON_ERROR_STOP=1",
                        "-d",
                        empty_database_url,
                        "-f",
                        str(x.up),
                    ],
                    check=True,
                    capture_output=True,
                )
            assert catalog(empty_database_url) == before, x.name
            assert versions(empty_database_url)[-1] == (x.version, x.name)


def test_a_migration_refuses_a_schema_it_does_not_follow(empty_database_url):
    """0001 refuses to run over a newer schema; a later migration refuses to
    run without its predecessor."""
    found = m.discover()
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        for x in found[1:]:
            with pytest.raises(MigrationError) as info:
                m._run_file(conn, x.up)
            assert info.value.code == SqlState.MIGRATION_OUT_OF_ORDER, x.name
        m.migrate(conn)
        with pytest.raises(MigrationError) as info:
            m._run_file(conn, found[0].up)
        assert info.value.code == SqlState.MIGRATION_OUT_OF_ORDER


def test_two_migrations_at_once_are_serialised(empty_database_url):
    errors: list[BaseException] = []

    def run():
        try:
            with psycopg.connect(empty_database_url, autocommit=True) as conn:
                m.migrate(conn)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert versions(empty_database_url) == [(x.version, x.name) for x in m.discover()]


def test_down_refuses_to_lose_data(database_url):
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT outbox.emit('order', '1', 'created', '{\"schema_version\": 1}', context => 'sea')")
        with pytest.raises(MigrationError) as info:
            m.migrate(conn, target=0)
        assert info.value.code == SqlState.DATA_WOULD_BE_LOST
        assert m.applied_version(conn) == 1


def test_0002_down_refuses_to_lose_the_redrive_audit(database_url):
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SELECT inbox.set_replay('billing', false, 'incident 7')")
        with pytest.raises(MigrationError) as info:
            m.migrate(conn, target=1)
        assert info.value.code == SqlState.DATA_WOULD_BE_LOST
        assert m.applied_version(conn) == 2


def test_archival_down_refuses_to_lose_the_audit_trail(database_url):
    """The archival migration's down keeps outbox.archive_audit once it records anything."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO inbox.messages (message_id, handler, subject, status, received_at, processed_at)"
            " VALUES (gen_random_uuid(), 'h', 'sea.event.x.v1', 'PROCESSED',"
            " '2001-01-01 12:00+00', '2001-01-01 12:00:01+00')"
        )
        conn.execute(
            "SELECT outbox.record_archive('inbox.messages', '2001-01-01', f.row_count, f.checksum, 'file:/a')"
            " FROM outbox.archive_figures('inbox.messages', '2001-01-01') AS f"
        )
        archival = next(x for x in m.discover() if x.name.endswith("_archival"))
        with pytest.raises(MigrationError) as info:
            m.migrate(conn, target=archival.version - 1)
        assert info.value.code == SqlState.DATA_WOULD_BE_LOST
        assert m.applied_version(conn) == archival.version, "the newer migrations went down, archival stayed"


def test_0005_keeps_every_subject_across_up_and_down(empty_database_url):
    """0005 turns the generated subject into a plain column written at INSERT
    (no rewrite), and its down makes it generated again: rows emitted under
    either version keep the subject they were emitted with."""
    emit = "SELECT outbox.emit('order', %s, 'order_created', '{\"schema_version\": 1}', context => 'sea', event_version => %s)"
    subjects = "SELECT aggregate_id, subject FROM outbox.events ORDER BY id"
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        m.migrate(conn, target=4)
        conn.execute(emit, ("before", 1))
        claimed = conn.execute("SELECT event_id, claim_token FROM outbox.claim('w', 1, '1 minute')").fetchone()
        m.migrate(conn, target=5)
        conn.execute(emit, ("after", 2))
        conn.execute("SELECT outbox.mark_published(%s, %s)", (claimed[1], [claimed[0]]))
        expected = [("before", "sea.event.order_created.v1"), ("after", "sea.event.order_created.v2")]
        assert conn.execute(subjects).fetchall() == expected
        m.migrate(conn, target=4)
        assert conn.execute(subjects).fetchall() == expected
        assert conn.execute("SELECT count(*) FROM outbox.events WHERE status = 'COMPLETED'").fetchone()[0] == 1


def test_0006_migrates_a_database_holding_what_it_now_refuses(empty_database_url):
    """The new limits live in emit's trigger, not in CHECK constraints: rows
    accepted by version 5 stay, the migration succeeds over them (up, down,
    up), and they can still be claimed and dead-lettered."""
    poison = [
        "occurred_at => '-infinity'",
        'headers => \'{"Nats-Msg-Id": "forged", "x-a": "1", "X-A": "2"}\'',
        "ordering_key => repeat('k', 2000)",
        "tenant_id => E'line\\nbreak'",
    ]
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        m.migrate(conn, target=5)
        for extra in poison:
            conn.execute(
                f"SELECT outbox.emit('order', '1', 'created', '{{\"schema_version\": 1.0}}', context => 'sea', {extra})"
            )
        conn.execute(
            "SELECT outbox.emit('order', '1', 'created',"
            " jsonb_build_object('schema_version', 1, 'x', repeat('a', 600000)), context => 'sea')"
        )
        assert m.migrate(conn, target=6) == ["up 0006_poison_proof"]
        assert m.migrate(conn, target=5) == ["down 0006_poison_proof"]
        assert m.migrate(conn, target=6) == ["up 0006_poison_proof"]
        for extra in poison:
            with pytest.raises(PolicyViolation):
                with wrap_exceptions():
                    conn.execute(
                        "SELECT outbox.emit('order', '1', 'created', '{\"schema_version\": 1}',"
                        f" context => 'sea', {extra})"
                    )
        claimed = conn.execute("SELECT event_id, claim_token FROM outbox.claim('w', 100, '1 minute')").fetchall()
        assert len(claimed) == 5, "ordering keys are distinct or absent: every stored row is claimable"
        ids = [r[0] for r in claimed]
        marked = conn.execute(
            "SELECT outbox.mark_failed(%s, %s, %s, %s)", (claimed[0][1], ids, ["poison"] * len(ids), [None] * len(ids))
        ).fetchone()[0]
        assert marked == 5
        assert conn.execute("SELECT count(*) FROM outbox.events WHERE status = 'DEAD_LETTER'").fetchone()[0] == 5


def test_0006_keeps_a_valid_throttle_set_for_the_database(empty_database_url):
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        m.migrate(conn, target=5)
        dbname = conn.info.dbname
        conn.execute(f"ALTER DATABASE {dbname} SET pgoutbox.notify_throttle = '50ms'")
    with psycopg.connect(empty_database_url, autocommit=True) as conn:  # a session that sees it
        m.migrate(conn)
        conn.execute("SET pgoutbox.notify_throttle = '1 min'")  # read no more
        assert conn.execute("SELECT outbox.notify_throttle()").fetchone()[0].total_seconds() == 0.05


def test_command_inbox_down_refuses_to_lose_the_audits_of_purged_keys(database_url):
    """Its keys purged by audited archival, inbox.commands is empty, but the
    audits that say where they went keep 0014 from going down."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO inbox.commands (handler, command_key, status, result, first_claimed_at, claimed_at,"
            " settled_at) VALUES ('h', 'k', 'DONE', '{}', '2001-01-01 12:00+00', '2001-01-01 12:00+00',"
            " '2001-01-01 12:00:01+00')"
        )
        conn.execute(
            "SELECT outbox.record_archive('inbox.commands', '2001-01-01', f.row_count, f.checksum, 'file:/c')"
            " FROM outbox.archive_figures('inbox.commands', '2001-01-01') AS f"
        )
        assert conn.execute("SELECT inbox.purge_archived_commands('2001-01-01')").fetchone() == (1,)
        commands = next(x for x in m.discover() if x.name.endswith("_command_inbox"))
        with pytest.raises(MigrationError) as info:
            m.migrate(conn, target=commands.version - 1)
        assert info.value.code == SqlState.DATA_WOULD_BE_LOST
        assert m.applied_version(conn) == commands.version
