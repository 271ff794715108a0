"""pgoutbox as a PostgreSQL extension (docs/extension.md), built by PGXS from
migrations/ (extension/Makefile runs scripts/gen_extension.py) and installed
into the suite's server: a clean checkout and the sdist install the same
files, which are what the migrations generate; CREATE EXTENSION at any version
and ALTER EXTENSION UPDATE to the latest (and back down as far as the down
scripts go) build the catalog the plain migrations build, apart from extension
membership; the pgTAP suite passes on it; `pgoutbox migrate` drives it; and
pg_dump/pg_restore keeps every row."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import psycopg
import pytest
from pgxs import install_extension

from conftest import create_database, drop_database
from pgoutbox import SCHEMA_VERSION
from pgoutbox.core import db
from pgoutbox.core import migrate as m
from pgoutbox.core.errors import MigrationError
from pgoutbox.dev.embedded import PG_BIN
from schema.test_migrations import catalog, columns_in_any_order
from schema.test_pgtap import FILES as PGTAP_FILES
from schema.test_pgtap import test_pgtap_file as run_pgtap_file

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_extension", ROOT / "scripts" / "gen_extension.py")
assert _spec and _spec.loader
gen_extension = importlib.util.module_from_spec(_spec)
sys.modules["gen_extension"] = gen_extension  # dataclasses look their module up
_spec.loader.exec_module(gen_extension)


LATEST = m.discover()[-1].version
OLDEST_DOWN = gen_extension.OLDEST_DOWN
SEEDED = set(gen_extension.seeded_tables(gen_extension.migrations(ROOT / "migrations")))


@pytest.fixture(scope="module")
def installed():
    install_extension()


@pytest.fixture
def new_database(pg_server):
    made: list[str] = []

    def make(template: str = "template0") -> str:
        made.append(create_database(pg_server, template))
        return pg_server.dsn(made[-1])

    yield make
    for name in made:
        drop_database(pg_server, name)


def plain(url: str, target: int | None = None) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        m.migrate(conn, target)
    return url


def members(conn: psycopg.Connection) -> list[tuple[str, str]]:
    return conn.execute(
        "SELECT i.type, i.identity FROM pg_depend AS d, pg_identify_object(d.classid, d.objid, 0) AS i"
        " WHERE d.refclassid = 'pg_extension'::regclass AND d.deptype = 'e'"
        " AND d.refobjid = (SELECT oid FROM pg_extension WHERE extname = 'pgoutbox') ORDER BY 1, 2"
    ).fetchall()


def without_membership(url: str) -> str:
    """Every member object released from the extension, then the extension
    dropped (nothing else goes with it): what is left is the catalog alone."""
    with psycopg.connect(url, autocommit=True) as conn:
        found = members(conn)
        assert ("schema", "outbox") in found and ("table", "outbox.events") in found, found
        for kind, identity in found:
            conn.execute(f"ALTER EXTENSION pgoutbox DROP {kind} {identity}")
        conn.execute("DROP EXTENSION pgoutbox RESTRICT")
    return catalog(url)


def staged_install(tree: Path, stage: Path) -> dict[str, str]:
    """`make install/extension` in tree (a checkout or an unpacked sdist) into
    stage (DESTDIR), for the suite's server; the pgoutbox files it installed,
    name -> text."""
    pg_config = str(PG_BIN / "pg_config")
    result = subprocess.run(
        ["make", "-s", "-C", str(tree), "install/extension", f"DESTDIR={stage}", f"PG_CONFIG={pg_config}"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    share = subprocess.run([pg_config, "--sharedir"], check=True, capture_output=True, text=True).stdout.strip()
    folder = stage / share.lstrip("/") / "extension"
    return {p.name: p.read_text() for p in folder.iterdir() if p.name.startswith("pgoutbox")}


def test_the_extension_files_are_what_the_migrations_generate(installed):
    files = gen_extension.generate()
    # install_extension() built extension/ (PGXS `all`) from migrations/.
    assert gen_extension.drift(ROOT / "extension") == []
    assert f"default_version = '{LATEST}'" in files["pgoutbox.control"]
    ups = {"pgoutbox--1.sql"} | {f"pgoutbox--{v}--{v + 1}.sql" for v in range(1, LATEST)}
    downs = {f"pgoutbox--{v + 1}--{v}.sql" for v in range(OLDEST_DOWN, LATEST)}
    tap = {"pgoutbox_tap.control", f"pgoutbox_tap--{gen_extension.TAP_VERSION}.sql"} | {
        f"pgoutbox_tap--{v}--{gen_extension.TAP_VERSION}.sql" for v in range(1, gen_extension.TAP_VERSION)
    }
    assert set(files) == ups | downs | {"pgoutbox.control"} | tap
    for name, text in files.items():
        if name.endswith(".sql") and not name.startswith("pgoutbox_tap"):
            assert "\nBEGIN;\n" not in text and "\nCOMMIT;\n" not in text, name
            assert "pg_extension_config_dump" in text, name


def test_a_clean_checkout_and_its_sdist_install_the_generated_files(tmp_path):
    """The files git knows (tracked or not ignored) build the scripts with
    PGXS and the system python3 (no virtualenv); the sdist made from them by
    `make sdist` (what `make wheel` builds from) carries the scripts, and
    installs the same files without the generator."""
    checkout = tmp_path / "checkout"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    tracked = [n for n in listed.split("\0") if n]
    assert not [n for n in tracked if n.startswith("extension/pgoutbox")], "generated files are in git or not ignored"
    for name in tracked:
        source = ROOT / name
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            (checkout / name).symlink_to(source.readlink())
        elif source.is_file():
            shutil.copyfile(source, checkout / name)
    want = gen_extension.generate()
    assert staged_install(checkout, tmp_path / "from-checkout") == want

    subprocess.run(["make", "sdist", f"PY={sys.executable}"], cwd=checkout, check=True, capture_output=True)
    (sdist,) = (checkout / "dist").glob("pgoutbox-*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path / "sdist", filter="data")
    (unpacked,) = (tmp_path / "sdist").iterdir()
    assert not (unpacked / "scripts").exists() and not (unpacked / "migrations").exists()
    assert staged_install(unpacked, tmp_path / "from-sdist") == want


def test_the_generator_follows_a_migration_added_later(tmp_path):
    """Generic: a new migration gets its update scripts and moves default_version."""
    (tmp_path / "migrations").mkdir()
    for path in (ROOT / "migrations").glob("*.sql"):
        (tmp_path / "migrations" / path.name).write_text(path.read_text())
    (tmp_path / "pgtap" / "helpers").mkdir(parents=True)  # the testing kit's extension is built beside it
    for path in (ROOT / "pgtap" / "helpers").glob("*.sql"):
        (tmp_path / "pgtap" / "helpers" / path.name).write_text(path.read_text())
    nxt = f"{LATEST + 1:04d}_later"
    (tmp_path / "migrations" / f"{nxt}.up.sql").write_text(
        "BEGIN;\nCREATE TABLE IF NOT EXISTS outbox.later (x int);\n"
        "INSERT INTO outbox.schema_migrations (version, name) VALUES (99, 'x');\nCOMMIT;\n"
    )
    (tmp_path / "migrations" / f"{nxt}.down.sql").write_text("BEGIN;\nDROP TABLE outbox.later;\nCOMMIT;\n")
    out = tmp_path / "built"
    out.mkdir()
    (out / f"pgoutbox--{OLDEST_DOWN}--{OLDEST_DOWN - 1}.sql").write_text("-- no longer made\n")
    assert gen_extension.main(["--root", str(tmp_path), "--out", str(out)]) == 0
    files = {p.name: p.read_text() for p in out.iterdir()}
    assert f"pgoutbox--{OLDEST_DOWN}--{OLDEST_DOWN - 1}.sql" not in files, "a stale script is left"
    assert f"default_version = '{LATEST + 1}'" in files["pgoutbox.control"]
    up = files[f"pgoutbox--{LATEST}--{LATEST + 1}.sql"]
    assert "CREATE TABLE IF NOT EXISTS outbox.later" in up and "\nBEGIN;" not in up
    assert f"pgoutbox--{LATEST + 1}--{LATEST}.sql" in files
    assert gen_extension.main(["--root", str(tmp_path), "--out", str(out), "--check"]) == 0
    (tmp_path / "migrations" / f"{nxt}.up.sql").write_text("BEGIN;\nSELECT 1;\nCOMMIT;\n")
    assert gen_extension.main(["--root", str(tmp_path), "--out", str(out), "--check"]) == 1, "drift goes unnoticed"


@pytest.mark.parametrize("start", range(1, LATEST + 1))
def test_create_at_any_version_then_update_builds_the_plain_catalog(installed, new_database, start):
    expected = catalog(plain(new_database()))
    url = new_database()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE EXTENSION pgoutbox VERSION '{start}'")
        assert m.extension_version(conn) == start == m.applied_version(conn)
        # As in service: day partitions (not members) and an event before the update.
        conn.execute("SELECT outbox.create_partitions()")
        conn.execute("SELECT outbox.emit('order', '1', 'order_created', '{\"schema_version\": 1}', context => 'sea')")
        ran = m.migrate(conn)  # ALTER EXTENSION pgoutbox UPDATE, then today's partitions
        assert ran == ([] if start == LATEST else [f"ALTER EXTENSION pgoutbox UPDATE TO '{LATEST}' (from '{start}')"])
        assert m.extension_version(conn) == LATEST == m.applied_version(conn) == SCHEMA_VERSION
        db.check_schema_version(m.applied_version(conn))
    assert without_membership(url) == expected


def test_update_down_to_every_version_the_down_scripts_reach_builds_the_plain_catalog(installed, new_database):
    url = new_database()
    with psycopg.connect(url, autocommit=True) as conn:
        assert m.migrate(conn, extension=True) == [f"CREATE EXTENSION pgoutbox VERSION '{LATEST}'"]
        for target in range(LATEST - 1, OLDEST_DOWN - 1, -1):
            m.migrate(conn, target)
            assert m.extension_version(conn) == target == m.applied_version(conn)
    got = without_membership(url)
    assert columns_in_any_order(got) == columns_in_any_order(catalog(plain(new_database(), OLDEST_DOWN)))


def test_migrate_keeps_the_modes_apart(installed, new_database):
    url = plain(new_database())
    with psycopg.connect(url, autocommit=True) as conn, pytest.raises(MigrationError):
        m.migrate(conn, extension=True)
    with psycopg.connect(new_database(), autocommit=True) as conn:
        m.migrate(conn, extension=True)
        with pytest.raises(MigrationError):
            m.migrate(conn, 0)
        with pytest.raises(MigrationError):
            m.migrate(conn, LATEST + 1)
        assert m.extension_version(conn) == LATEST


def test_the_migrate_command_creates_the_extension_when_asked(installed, new_database, capsys):
    from pgoutbox.cli import main as cli

    url = new_database()
    assert cli.main(["migrate", "--database-url", url, "--extension"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"schema at version {LATEST}"
    with psycopg.connect(url, autocommit=True) as conn:
        assert m.extension_version(conn) == LATEST == m.applied_version(conn)
    # Without the flag, a database that has the extension is still moved by ALTER EXTENSION.
    assert cli.main(["migrate", "--database-url", url, "--target", str(OLDEST_DOWN)]) == 0
    with psycopg.connect(url, autocommit=True) as conn:
        assert m.extension_version(conn) == OLDEST_DOWN


@pytest.mark.parametrize("mode", ["extension", "migrate"])
def test_the_testing_kit_extension_installs_beside_either_mode_and_drops_whole(installed, new_database, mode):
    """CREATE EXTENSION pgoutbox_tap needs no pgoutbox extension (pgoutbox
    made by `pgoutbox migrate` will do); its assertions run in a test's
    transaction, which rolls their events back; DROP EXTENSION takes the
    schema with it."""
    url = new_database()
    with psycopg.connect(url, autocommit=True) as conn:
        m.migrate(conn, extension=mode == "extension")
        conn.execute("CREATE EXTENSION pgtap")
        conn.execute("CREATE EXTENSION pgoutbox_tap")
        assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = 'pgoutbox_tap'").fetchone() == (
            str(gen_extension.TAP_VERSION),
        )
        with conn.transaction(force_rollback=True):
            conn.execute("SELECT plan(2)")
            emit = "SELECT outbox.emit('order', '1', 'order_created', '{\"schema_version\": 1}', context => 'sea')"
            passed = conn.execute("SELECT pgoutbox_tap.emits(%s, 'order_created')", (emit,)).fetchone()
            failed = conn.execute("SELECT pgoutbox_tap.emits_nothing(%s)", (emit,)).fetchone()
        assert passed == ("ok 1 - emits order_created",)
        assert failed == (
            'not ok 2 - emits nothing\n# Failed test 2: "emits nothing"\n'
            '# expected: no event\n# emitted:  1 event(s)\n#     order_created {"schema_version": 1}',
        )
        assert conn.execute("SELECT count(*) FROM outbox.events").fetchone() == (0,), "rolled back with the test"
        conn.execute("DROP EXTENSION pgoutbox_tap")
        assert conn.execute("SELECT to_regnamespace('pgoutbox_tap')").fetchone() == (None,)


def test_a_down_path_that_fails_at_its_last_step_changes_nothing(installed, new_database):
    """ALTER EXTENSION runs the whole path in one transaction: the steps down
    to the failing one are undone with it. Here the last shipped step (back to
    OLDEST_DOWN, migration 0011's down) fails validating its CHECK constraints
    on a row written past the triggers (as only a superuser in replica mode can)."""
    with psycopg.connect(new_database(), autocommit=True) as conn:
        m.migrate(conn, extension=True)
        conn.execute("SET session_replication_role = replica")
        conn.execute(
            "INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload, attempts)"
            " VALUES ('sea', 'order', 'bad', 'order_created', '{\"schema_version\": 1}', -1)"
        )
        conn.execute("RESET session_replication_role")
        with pytest.raises(psycopg.errors.CheckViolation):
            m.migrate(conn, OLDEST_DOWN)
        assert m.extension_version(conn) == LATEST == m.applied_version(conn)
        # 0013's grant, which a step down revokes, is still there.
        assert conn.execute(
            "SELECT has_function_privilege('pgoutbox_archiver', 'outbox.schema_version()', 'EXECUTE')"
        ).fetchone() == (True,)


def test_migrate_says_when_the_server_lacks_the_files_for_a_version(installed, new_database):
    with psycopg.connect(new_database(), autocommit=True) as conn:
        m.migrate(conn, extension=True)
        with pytest.raises(MigrationError) as info:
            # A version no checkout makes (the server's extension folder is shared by all).
            m._extension_command(conn, "ALTER EXTENSION {} UPDATE TO {}", LATEST + 1000)
        assert "make -C extension install" in str(info.value)
        assert m.extension_version(conn) == LATEST
        with pytest.raises(MigrationError) as info:
            # Back to a version no down script leads to (0: DROP EXTENSION's job).
            m._extension_command(conn, "ALTER EXTENSION {} UPDATE TO {}", 0, down=True)
        assert "does not go back to version 0" in str(info.value)
        assert "make -C extension install" not in str(info.value)
        assert m.extension_version(conn) == LATEST


@pytest.fixture(scope="module")
def updated_from_first_version(installed, pg_server):
    """CREATE EXTENSION at version 1, today's partitions, ALTER EXTENSION
    UPDATE to the latest, and pgTAP."""
    name = create_database(pg_server, "template0")
    with psycopg.connect(pg_server.dsn(name), autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pgoutbox VERSION '1'")
        conn.execute("SELECT outbox.create_partitions()")  # partitions the updates must carry along
        conn.execute("ALTER EXTENSION pgoutbox UPDATE")
        assert m.extension_version(conn) == LATEST
        conn.execute("CREATE EXTENSION pgtap")
    yield name
    drop_database(pg_server, name)


@pytest.mark.parametrize("path", PGTAP_FILES, ids=[p.stem for p in PGTAP_FILES])
def test_the_pgtap_suite_passes_on_the_updated_extension(pg_server, updated_from_first_version, path):
    name = create_database(pg_server, updated_from_first_version)
    try:
        run_pgtap_file(pg_server.dsn(name), path)
    finally:
        drop_database(pg_server, name)


def fill_every_table(url: str) -> None:
    """Rows in every table and partition: events in each status and in each
    partition, a requeue, inbox rows in each status, a replay switch, a
    redrive, discards and a restore, archival audits, command keys, a
    tenant's weight."""
    with psycopg.connect(url, autocommit=True) as conn:
        emit = (
            "SELECT outbox.emit('order', i::text, 'order_created', jsonb_build_object('schema_version', 1, 'n', i),"
            " context => 'sea')::text FROM generate_series(1, %s) AS i"
        )
        conn.execute(emit, (7,))
        claimed = conn.execute(
            "SELECT event_id::text, claim_token::text FROM outbox.claim('w1', 5, '1 hour')"
        ).fetchall()
        token = claimed[0][1]
        ids = [r[0] for r in claimed]
        conn.execute("SELECT outbox.mark_published(%s, %s::uuid[])", (token, ids[:1]))
        conn.execute(
            "SELECT outbox.mark_failed(%s, %s::uuid[], %s, ARRAY[now() + interval '1 day', NULL, NULL])",
            (token, ids[1:4], ["boom", "dead", "dead"]),
        )
        conn.execute("SELECT outbox.requeue(%s::uuid[], 'fixed upstream')", (ids[3:4],))
        # A caller's id (outbox.event_keys), two scheduled events (outbox.schedules), one cancelled
        # (outbox.cancel_log).
        conn.execute(
            "SELECT outbox.emit('order', 'k', 'order_created', '{\"schema_version\": 1}', context => 'sea',"
            " event_id => '6fa459ea-ee8a-5ca4-894e-db77e160355e')"
        )
        later = (
            "SELECT outbox.emit('order', %s, 'order_reminder', '{\"schema_version\": 1}', context => 'sea',"
            " deliver_after => interval '1 day')::text"
        )
        conn.execute(later, ("s1",))
        cancelled = conn.execute(later, ("s2",)).fetchone()[0]
        conn.execute("SELECT outbox.cancel(%s, 'order withdrawn')", (cancelled,))
        # A tenant's weight in fair claims (outbox.tenant_weights, its log outbox.tenant_weight_log).
        conn.execute("SELECT outbox.set_tenant_weight('acme', 5, 'a larger plan')")
        # One event in every other partition, routed there by created_at (as the owner).
        for (part,) in conn.execute(
            "SELECT c.oid::regclass::text FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = 'outbox.events'::regclass"
            " AND NOT EXISTS (SELECT 1 FROM outbox.events AS e WHERE e.tableoid = c.oid)"
        ).fetchall():
            day = "2999-01-01" if part == "outbox.events_default" else f"{part[-8:-4]}-{part[-4:-2]}-{part[-2:]} 12:00"
            conn.execute(
                "INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload, created_at)"
                " VALUES ('sea', 'order', 'p', 'order_created', '{\"schema_version\": 1}', %s)",
                (day,),
            )
        messages = [
            r[0]
            for r in conn.execute(
                "SELECT (inbox.receive(gen_random_uuid(), 'billing', 'sea.event.order_created.v1',"
                ' \'{"payload": {"schema_version": 1}}\')).message_id::text'
                " FROM generate_series(1, 3)"
            )
        ]
        conn.execute("SELECT inbox.mark_processed(%s, 'billing')", (messages[0],))
        conn.execute("SELECT inbox.record_error(%s, 'billing', 'poison', true)", (messages[1],))
        conn.execute("SELECT inbox.set_replay('billing', false, 'incident 7')")
        conn.execute("SELECT inbox.redrive('billing', %s::uuid[], 'fixed')", ([messages[1]],))
        # Discards (an outbox event stays DEAD_LETTER, marked in outbox.discarded_events) and a restore, in both discard logs.
        conn.execute(
            "SELECT outbox.dlq_discard(jsonb_build_object('side', 'outbox', 'ids', jsonb_build_array(%s::uuid)), 'dup')",
            (ids[2],),
        )
        conn.execute("""SELECT outbox.dlq_discard('{"side": "inbox", "owner": "billing"}', 'obsolete')""")
        conn.execute("""SELECT outbox.dlq_restore('{"side": "inbox", "owner": "billing"}', 'needed after all')""")
        # A console bulk action prepared on its fixed set of targets (outbox.dlq_actions, dlq_action_targets).
        conn.execute("""SELECT action_id FROM outbox.dlq_prepare('{"side": "inbox", "owner": "billing"}', 'replay')""")
        conn.execute(
            "INSERT INTO inbox.messages (message_id, handler, subject, status, received_at, processed_at)"
            " VALUES (gen_random_uuid(), 'h', 'sea.event.x.v1', 'PROCESSED',"
            " '2001-01-01 12:00+00', '2001-01-01 12:00:01+00')"
        )
        conn.execute(
            "SELECT outbox.record_archive('inbox.messages', '2001-01-01', f.row_count, f.checksum, 'file:/a')"
            " FROM outbox.archive_figures('inbox.messages', '2001-01-01') AS f"
        )
        # A command key answered, and an audited day of keys (the third archival source).
        conn.execute("SELECT claimed FROM inbox.claim_command('start_run', 'k1')")
        conn.execute("SELECT status FROM inbox.complete_command('start_run', 'k1', '{\"run\": 1}')")
        conn.execute(
            "INSERT INTO inbox.commands (handler, command_key, status, result, first_claimed_at, claimed_at,"
            " settled_at) VALUES ('start_run', 'k0', 'DONE', '{}', '2001-01-01 12:00+00', '2001-01-01 12:00+00',"
            " '2001-01-01 12:00:01+00')"
        )
        conn.execute(
            "SELECT outbox.record_archive('inbox.commands', '2001-01-01', f.row_count, f.checksum, 'file:/c')"
            " FROM outbox.archive_figures('inbox.commands', '2001-01-01') AS f"
        )
        conn.execute("CREATE FUNCTION public.v1_to_v2(p jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$ SELECT p $$")
        conn.execute("SELECT inbox.register_upcaster('order_created', 1, 'public.v1_to_v2(jsonb)')")
        # Seal figures as seal_figures() records them (no outbox day here is old enough to seal).
        conn.execute(
            "INSERT INTO outbox.archive_seal (day, relation, row_count, checksum)"
            " VALUES ('2001-01-01', 'outbox.events_20010101', 0, 0)"
        )


def tables(conn: psycopg.Connection) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            "SELECT c.oid::regclass::text FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace"
            " WHERE n.nspname IN ('outbox', 'inbox') AND c.relkind = 'r' ORDER BY 1"
        )
    ]


# Columns that record when a row was written: the scripts write the seeded
# rows again when a restore runs CREATE EXTENSION.
WRITTEN_AT = ("applied_at", "changed_at")


def contents(url: str) -> dict[str, object]:
    with psycopg.connect(url, autocommit=True) as conn:
        out: dict[str, object] = {}
        for table in tables(conn):
            rows = [r[0] for r in conn.execute(f"SELECT to_jsonb(t) FROM {table} AS t")]
            if table in SEEDED:
                rows = [{k: v for k, v in r.items() if k not in WRITTEN_AT} for r in rows]
            out[table] = sorted(json.dumps(r, sort_keys=True) for r in rows)
        for (seq,) in conn.execute(
            "SELECT c.oid::regclass::text FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace"
            " WHERE n.nspname IN ('outbox', 'inbox') AND c.relkind = 'S' AND c.relpersistence = 'p'"
        ).fetchall():
            out[seq] = conn.execute(f"SELECT last_value, is_called FROM {seq}").fetchone()
        out["version"] = conn.execute(
            "SELECT outbox.schema_version(), (SELECT extversion FROM pg_extension WHERE extname = 'pgoutbox')"
        ).fetchone()
        return out


def test_an_extension_database_survives_dump_and_restore_with_every_row(installed, new_database, tmp_path):
    source = new_database()
    with psycopg.connect(source, autocommit=True) as conn:
        m.migrate(conn, extension=True)
    fill_every_table(source)
    before = contents(source)
    empty = [t for t, rows in before.items() if rows == []]
    assert not empty, f"tables without rows: {empty}"

    dump = tmp_path / "pgoutbox.dump"
    subprocess.run([str(PG_BIN / "pg_dump"), "-Fc", "-f", str(dump), "-d", source], check=True, capture_output=True)
    toc = subprocess.run([str(PG_BIN / "pg_restore"), "-l", str(dump)], check=True, capture_output=True, text=True)
    listed = subprocess.run(
        [sys.executable, "-m", "pgoutbox.cli.main", "restore-list"],
        input=toc.stdout,
        check=True,
        capture_output=True,
        text=True,
    )
    assert listed.stdout != toc.stdout
    (tmp_path / "pgoutbox.list").write_text(listed.stdout)

    target = new_database()
    env = {**os.environ, "PGOPTIONS": "-c session_replication_role=replica"}
    restored = subprocess.run(
        [str(PG_BIN / "pg_restore"), "--exit-on-error", "-L", str(tmp_path / "pgoutbox.list"), "-d", target, str(dump)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert restored.returncode == 0, restored.stderr
    after = contents(target)
    assert after == before

    with psycopg.connect(target, autocommit=True) as conn:
        # The restored database is as usable as the original: the identity
        # continues, the guards are back, workers accept its schema.
        conn.execute("SELECT outbox.emit('order', 'new', 'order_created', '{\"schema_version\": 1}', context => 'sea')")
        top = conn.execute("SELECT max(id) FROM outbox.events").fetchone()[0]
        assert top == before["outbox.events_id_seq"][0] + 1
        assert (
            conn.execute(
                "SELECT count(*) FROM pg_event_trigger WHERE evtname = 'pgoutbox_guard_partitions'"
            ).fetchone()[0]
            == 1
        )
        db.check_schema_version(m.applied_version(conn))
