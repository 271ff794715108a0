"""Every `pgoutbox` command answers an unreachable or misconfigured PostgreSQL
or NATS, and a bad setting, with one line on stderr that names what is wrong
and which setting, and the documented exit code (errors.ExitCode): the cases
that need no server (a closed port, a host that does not resolve, unparsable
URLs, bad flags). The ones against real servers are in
tests/cli/test_command_errors.py."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import nats
import pytest

from pgoutbox.cli import archive
from pgoutbox.cli import main as cli
from pgoutbox.core import settings
from pgoutbox.core.errors import ExitCode
from pgoutbox.dev.embedded import free_port
from support.commands import DATABASE_COMMANDS, assert_one_line

WORKERS = ("relay", "consume", "replay")


# -- PostgreSQL --------------------------------------------------------------


@pytest.mark.parametrize("command", DATABASE_COMMANDS)
def test_a_closed_port_is_one_line_with_exit_3(command, capsys):
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/shop"
    assert_one_line(
        capsys,
        [command, *DATABASE_COMMANDS[command], "--database-url", url],
        ExitCode.DATABASE,
        "DatabaseUnavailable",
        "OUTBOX_DATABASE_URL or --database-url",
        "database shop",
        "Connection refused",
    )


@pytest.mark.parametrize("command", DATABASE_COMMANDS)
def test_an_unknown_host_is_one_line_with_exit_3(command, capsys):
    url = "postgresql://postgres@no-such-host.invalid:5432/shop"
    assert_one_line(
        capsys,
        [command, *DATABASE_COMMANDS[command], "--database-url", url],
        ExitCode.DATABASE,
        "DatabaseUnavailable",
        "no-such-host.invalid:5432 database shop",
        "OUTBOX_DATABASE_URL or --database-url",
        "failed to resolve host",
    )


@pytest.mark.parametrize("command", [*DATABASE_COMMANDS, *WORKERS])
@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:s3cret@127.0.0.1:notaport/shop",
        "postgresql://app:s3%zzcret@127.0.0.1/shop",
        "host=127.0.0.1 dbname=shop password=s3cret colour=blue",
    ],
)
def test_an_unparsable_database_url_is_a_bad_setting(command, url, capsys):
    args = DATABASE_COMMANDS.get(command, [])
    line = assert_one_line(
        capsys,
        [command, *args, "--database-url", url],
        ExitCode.USAGE,
        "ConfigError",
        "OUTBOX_DATABASE_URL=",
        "--database-url",
    )
    assert "s3cret" not in line and "zzc" not in line


# -- NATS --------------------------------------------------------------------


@pytest.fixture
def streams_file(tmp_path):
    path = tmp_path / "streams.toml"
    path.write_text("[streams.sea]\n")
    return str(path)


def test_streams_with_nats_on_a_closed_port_is_one_line_with_exit_4(streams_file, capsys):
    url = f"nats://app:s3cret@127.0.0.1:{free_port()}"
    line = assert_one_line(
        capsys,
        ["streams", "--streams-file", streams_file, "--nats-url", url],
        ExitCode.BROKER,
        "BrokerUnavailable",
        "OUTBOX_NATS_URL or --nats-url",
        "Connect call failed",
    )
    assert "s3cret" not in line


@pytest.mark.parametrize("command", ["streams", *WORKERS])
@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("nats://127.0.0.1:notaport", "not a host:port"),
        ("nats://127.0.0.1:70000", "not a host:port"),
        ("http://127.0.0.1:4222", "the scheme must be one of"),
        ("nats://127.0.0.1:4222,", "no host"),
    ],
)
def test_an_unparsable_nats_url_is_a_bad_setting(command, url, reason, streams_file, capsys):
    assert_one_line(
        capsys,
        [command, "--nats-url", url, "--streams-file", streams_file]
        if command == "streams"
        else [command, "--nats-url", url],
        ExitCode.USAGE,
        "ConfigError",
        "OUTBOX_NATS_URL=",
        "--nats-url",
        reason,
    )


# -- bad settings ------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["migrate", "--target", "-1"], ("OUTBOX_MIGRATE_TARGET='-1'", "--target", "must be >= 0")),
        (["status", "--dead-letters", "ten"], ("OUTBOX_STATUS_DEAD_LETTERS='ten'", "--dead-letters", "not an integer")),
        (["requeue", str(uuid.uuid4())], ("OUTBOX_REQUEUE_REASON", "--reason", "is required")),
        (
            ["partitions", "--days-ahead", "1.5"],
            ("OUTBOX_PARTITION_DAYS_AHEAD='1.5'", "--days-ahead", "not an integer"),
        ),
        (["replay-switch", "billing", "on"], ("OUTBOX_REPLAY_SWITCH_REASON", "--reason", "is required")),
        (
            ["registry", "check", "--manifest-dir", "/nonexistent/handlers"],
            ("OUTBOX_MANIFEST_DIR", "--manifest-dir", "does not exist"),
        ),
        (
            ["registry", "generate", "--manifest-dir", "/nonexistent/handlers"],
            ("OUTBOX_MANIFEST_DIR", "--manifest-dir", "does not exist"),
        ),
        (["archive", "--retention", "a week"], ("OUTBOX_ARCHIVE_RETENTION='a week'", "--retention", "not a duration")),
        (
            ["report", "--read-partitions", "0"],
            ("OUTBOX_SPARK_READ_PARTITIONS='0'", "--read-partitions", "must be >= 1"),
        ),
        (["streams"], ("OUTBOX_STREAMS_FILE", "--streams-file", "is required")),
        (
            ["streams", "--streams-file", "/nonexistent/streams.toml"],
            ("OUTBOX_STREAMS_FILE", "--streams-file", "cannot be read"),
        ),
        (["streams", "--streams-file", "x.toml", "--lease", "soon"], ("OUTBOX_RELAY_LEASE='soon'", "--lease")),
        (["relay", "--batch-size", "20000"], ("OUTBOX_RELAY_BATCH_SIZE='20000'", "--batch-size", "from 1 to 10000")),
        (["relay", "--poll-interval", "often"], ("OUTBOX_RELAY_POLL_INTERVAL='often'", "--poll-interval")),
        (
            ["consume", "--max-deliver", "many"],
            ("OUTBOX_CONSUMER_MAX_DELIVER='many'", "--max-deliver", "not an integer"),
        ),
        (["consume", "--handler-timeout=-1s"], ("OUTBOX_HANDLER_TIMEOUT='-1s'", "--handler-timeout")),
        (
            ["replay", "--replay-batch-size", "0"],
            ("OUTBOX_REPLAY_BATCH_SIZE='0'", "--replay-batch-size", "must be from 1 to 10000"),
        ),
        (
            ["replay", "--replay-poll-interval", "5 parsecs"],
            ("OUTBOX_REPLAY_POLL_INTERVAL='5 parsecs'", "--replay-poll-interval"),
        ),
    ],
)
def test_a_bad_setting_is_one_line_naming_variable_and_flag_with_exit_2(argv, named, capsys):
    assert_one_line(capsys, argv, ExitCode.USAGE, *named)


def test_a_boolean_is_a_bare_flag_and_its_variable_takes_true_or_false(monkeypatch, capsys):
    """--drop / --no-drop on the command line; OUTBOX_ARCHIVE_DROP=true|false."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["archive", "--drop", "perhaps"])
    assert exit_.value.code == ExitCode.USAGE
    assert capsys.readouterr().err.splitlines() == [
        "pgoutbox: error: unrecognized arguments: perhaps (see pgoutbox --help)"
    ]
    monkeypatch.setenv("OUTBOX_ARCHIVE_DROP", "perhaps")
    assert_one_line(capsys, ["archive"], ExitCode.USAGE, "OUTBOX_ARCHIVE_DROP='perhaps'", "--drop", "not a boolean")
    # The flag wins over the variable, both ways.
    monkeypatch.setenv("OUTBOX_ARCHIVE_DROP", "false")
    parsed = cli.build_parser().parse_args(["archive", "--drop"])
    assert settings.build(archive.ArchiveConfig, overrides=vars(parsed)).drop is True
    parsed = cli.build_parser().parse_args(["archive"])
    assert settings.build(archive.ArchiveConfig, overrides=vars(parsed)).drop is False
    monkeypatch.setenv("OUTBOX_ARCHIVE_DROP", "true")
    parsed = cli.build_parser().parse_args(["archive", "--no-drop"])
    assert settings.build(archive.ArchiveConfig, overrides=vars(parsed)).drop is False


@pytest.mark.parametrize("module", [mod for mod in cli.COMMANDS if any(s.is_flag for s in mod.SETTINGS)])
def test_every_boolean_setting_is_a_bare_flag_with_a_no_twin(module):
    parser = cli.build_parser()
    for s in module.SETTINGS:
        if s.is_flag:
            assert getattr(parser.parse_args([module.COMMAND, s.flag]), s.name) is True
            no = "--no-" + s.flag[2:]
            assert getattr(parser.parse_args([module.COMMAND, no]), s.name) is False
            assert getattr(parser.parse_args([module.COMMAND]), s.name) is None


def test_registry_names_the_registry_file_it_cannot_write(tmp_path, capsys):
    manifests = tmp_path / "handlers"
    manifests.mkdir()
    (manifests / "h.toml").write_text(
        '[[handler]]\nname = "h"\nurl = "http://127.0.0.1:1/"\nsubjects = ["sea.event.x.v1"]\n'
    )
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_one_line(
        capsys,
        ["registry", "generate", "--manifest-dir", str(manifests), "--registry-file", str(blocker / "registry.json")],
        ExitCode.USAGE,
        "OUTBOX_REGISTRY_FILE or --registry-file",
        "cannot write",
    )


def test_settings_lists_every_variable_and_a_wrong_flag_is_one_line(capsys):
    assert cli.main(["settings"]) == 0
    assert "OUTBOX_DATABASE_URL=" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        cli.main(["settings", "--markdwon"])
    err = capsys.readouterr().err
    assert exit_.value.code == ExitCode.USAGE
    assert err.splitlines() == ["pgoutbox: error: unrecognized arguments: --markdwon (see pgoutbox --help)"]


def test_a_wrong_subcommand_argument_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["replay-switch", "billing", "maybe", "--reason", "x"])
    err = capsys.readouterr().err
    assert exit_.value.code == ExitCode.USAGE
    assert len(err.splitlines()) == 1 and "argument state: invalid choice: 'maybe'" in err, err


# -- the safety net in cli.main ---------------------------------------------


def test_a_nats_failure_escaping_a_command_becomes_one_line(capsys, monkeypatch):
    import asyncio

    from pgoutbox.cli import streams

    url = f"nats://127.0.0.1:{free_port()}"

    def connect_directly(cfg, args):  # nats-py's own error: NoServersError
        async def main():
            async def quiet(exc):
                pass

            await nats.connect(
                cfg.nats_url,
                allow_reconnect=False,
                connect_timeout=2,
                error_cb=quiet,
                max_reconnect_attempts=1,
                reconnect_time_wait=0.1,
            )

        asyncio.run(main())

    monkeypatch.setattr(streams, "run", connect_directly)
    assert_one_line(
        capsys,
        ["streams", "--streams-file", "x.toml", "--nats-url", url],
        ExitCode.BROKER,
        "BrokerUnavailable",
        "NoServersError",
        "OUTBOX_NATS_URL or --nats-url",
    )


def test_an_unexpected_exception_keeps_its_traceback(monkeypatch):
    """A bug is not an operator mistake: it is not folded into one line."""
    from pgoutbox.cli import status

    def broken(cfg, args):
        raise KeyError("a bug")

    monkeypatch.setattr(status, "run", broken)
    with pytest.raises(KeyError):
        cli.main(["status"])


def test_each_command_name_is_its_module_and_a_command_imports_only_itself():
    assert [mod.COMMAND for mod in cli.COMMANDS] == list(cli.COMMAND_NAMES)
    # In a fresh interpreter: `pgoutbox status` parses its line without nats-py
    # or httpx, and `pgoutbox --help` lists every command.
    probe = (
        "import sys; from pgoutbox.cli import main as cli; "
        "cli.build_parser(cli._chosen(['status', '--json'])).parse_args(['status']); "
        "print(sorted(m for m in ('nats', 'httpx', 'pgoutbox.cli.relay') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    assert cli._chosen(["--version"]) is None and cli._chosen(["nosuch"]) is None
    assert cli._chosen(["dead-letters", "list"]) == "dead-letters"
    helped = subprocess.run([sys.executable, "-m", "pgoutbox.cli.main", "--help"], capture_output=True, text=True)
    assert all(name in helped.stdout for name in cli.COMMAND_NAMES), helped.stdout


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`pgoutbox settings | head -1`: exit 141 and nothing on stderr, not a
    BrokenPipeError traceback. The reader is gone before the command writes
    (its end of the pipe closed first), so every write meets the closed pipe."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from pgoutbox.cli.main import entry; entry()", "settings"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, b"")
