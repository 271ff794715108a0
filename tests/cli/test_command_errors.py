"""Every `pgoutbox` command answers an unreachable or misconfigured PostgreSQL
or NATS, and a bad setting, with one line on stderr that names what is wrong
and which setting, and the documented exit code (errors.ExitCode). Real
servers here: a database that does not exist, a role that does not exist, a
server that wants a password, nats-server without JetStream (the cases that
need no server are in tests/unit/test_command_lines.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from pgoutbox.core.errors import ExitCode
from pgoutbox.dev.embedded import EmbeddedPostgres, free_port, nats_server_binary
from support.commands import DATABASE_COMMANDS, assert_one_line
from support.roles import login


@pytest.fixture(scope="module")
def password_server():
    """A PostgreSQL that asks TCP clients for a password (the suite's own trusts everyone)."""
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-pw-"))
    server = EmbeddedPostgres(root)
    server.start()
    try:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("CREATE ROLE app LOGIN PASSWORD 'right-pw'")
        (server.datadir / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
        server._pg_ctl("reload")
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def role_without_grants(pg_server, database_url):
    """A login role that may connect but holds none of the pgoutbox roles."""
    name = f"nogrant_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {name} LOGIN")
    yield database_url.replace("postgresql://postgres@", f"postgresql://{name}@")
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP ROLE {name}")


# -- PostgreSQL --------------------------------------------------------------


@pytest.mark.parametrize("command", DATABASE_COMMANDS)
def test_a_missing_database_is_one_line_with_exit_3(command, pg_server, capsys):
    url = pg_server.dsn("no_such_db")
    assert_one_line(
        capsys,
        [command, *DATABASE_COMMANDS[command], "--database-url", url],
        ExitCode.DATABASE,
        "DatabaseUnavailable",
        "OUTBOX_DATABASE_URL or --database-url",
        'database "no_such_db" does not exist',
    )


@pytest.mark.parametrize("command", DATABASE_COMMANDS)
def test_an_unknown_user_is_one_line_with_exit_3(command, pg_server, capsys):
    url = pg_server.dsn().replace("postgres@", "nobody_here@")
    assert_one_line(
        capsys,
        [command, *DATABASE_COMMANDS[command], "--database-url", url],
        ExitCode.DATABASE,
        "DatabaseUnavailable",
        "OUTBOX_DATABASE_URL or --database-url",
        'role "nobody_here" does not exist',
    )


@pytest.mark.parametrize("command", DATABASE_COMMANDS)
def test_a_wrong_password_is_one_line_with_exit_3_and_never_shown(command, password_server, capsys):
    url = f"postgresql://app:wrong-pw@127.0.0.1:{password_server.port}/postgres"
    line = assert_one_line(
        capsys,
        [command, *DATABASE_COMMANDS[command], "--database-url", url],
        ExitCode.DATABASE,
        "DatabaseUnavailable",
        "OUTBOX_DATABASE_URL or --database-url",
        'password authentication failed for user "app"',
    )
    assert "wrong-pw" not in line


@pytest.mark.parametrize("command", [c for c in DATABASE_COMMANDS if c != "migrate"])
def test_a_database_without_the_schema_says_run_migrate(command, empty_database_url, capsys):
    assert_one_line(
        capsys,
        [command, *DATABASE_COMMANDS[command], "--database-url", empty_database_url],
        ExitCode.DATABASE,
        "SchemaMismatch",
        "schema is at version 0",
        "run `pgoutbox migrate`",
    )


@pytest.mark.parametrize("command", ["status", "requeue", "partitions", "redrive", "replay-switch"])
def test_a_role_without_grants_is_refused_in_one_line(command, role_without_grants, capsys):
    assert_one_line(
        capsys,
        [command, *DATABASE_COMMANDS[command], "--database-url", role_without_grants],
        ExitCode.DATABASE,
        "DatabaseUnavailable",
        "refused [42501]",
        "permission denied",
        "OUTBOX_DATABASE_URL or --database-url",
    )


def test_the_installed_command_prints_one_line_and_no_traceback():
    """The console script as an operator runs it: nothing but the line on stderr."""
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/shop"
    script = Path(sys.executable).parent / "pgoutbox"
    out = subprocess.run(
        [str(script), "status", "--database-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == ExitCode.DATABASE
    assert out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("pgoutbox status: DatabaseUnavailable: cannot connect to PostgreSQL at 127.0.0.1:")


# -- NATS --------------------------------------------------------------------


@pytest.fixture
def streams_file(tmp_path):
    path = tmp_path / "streams.toml"
    path.write_text("[streams.sea]\n")
    return str(path)


def test_streams_against_nats_without_jetstream_is_one_line_with_exit_4(streams_file, tmp_path, capsys):
    port = free_port()
    log = tmp_path / "nats.log"
    server = subprocess.Popen(
        [str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(port), "-l", str(log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            if log.exists() and "Server is ready" in log.read_text():
                break
            time.sleep(0.05)
        assert_one_line(
            capsys,
            ["streams", "--streams-file", streams_file, "--nats-url", f"nats://127.0.0.1:{port}"],
            ExitCode.BROKER,
            "JetStream is not enabled",
            "OUTBOX_NATS_URL or --nats-url",
        )
    finally:
        server.terminate()
        server.wait(10)


# -- bad settings ------------------------------------------------------------


@pytest.mark.parametrize("argv", [["redrive", "billing", str(uuid.uuid4())], ["redrive", "billing", "--all"]])
def test_a_redrive_without_a_reason_is_refused_in_one_line(argv, database_url, capsys):
    assert_one_line(
        capsys,
        [*argv, "--database-url", login(database_url, "pgoutbox_admin")],
        ExitCode.USAGE,
        "OUTBOX_REDRIVE_REASON",
        "--reason",
    )


# -- the safety net in cli.main ---------------------------------------------


def test_a_connection_dropped_mid_command_becomes_one_line(database_url, capsys, monkeypatch):
    """What escapes a command from a lost session is still one line, exit 3."""
    from pgoutbox.cli import status

    def drop_own_session(cfg, args):
        with psycopg.connect(cfg.database_url, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    monkeypatch.setattr(status, "run", drop_own_session)
    assert_one_line(
        capsys,
        ["status", "--database-url", login(database_url, "pgoutbox_admin")],
        ExitCode.DATABASE,
        "DatabaseUnavailable",
        "lost the connection to PostgreSQL",
        "OUTBOX_DATABASE_URL",
    )


@pytest.mark.parametrize("command", ["relay", "consume"])
def test_a_metrics_port_in_use_is_one_line_naming_the_setting(command, database_url, nats_server, capsys):
    """Two workers on one host with the same OUTBOX_*_HTTP_PORT: the second says which setting to change."""
    import asyncio
    import socket

    from support.outbox import apply_streams

    asyncio.run(apply_streams(nats_server.url))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        role = "pgoutbox_relay" if command == "relay" else "pgoutbox_consumer"
        argv = [
            command,
            "--database-url",
            login(database_url, role),
            "--nats-url",
            nats_server.url,
            "--http-port",
            port,
        ]
        if command == "consume":
            argv += ["--registry-file", str(Path(__file__).resolve().parents[2] / "examples/handlers.registry.json")]
        assert_one_line(capsys, argv, ExitCode.USAGE, f"cannot serve /metrics on 127.0.0.1:{port}", "--http-port")
