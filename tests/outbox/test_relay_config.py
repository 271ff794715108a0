"""Relay configuration: settings, the streams file and `pgoutbox streams`,
start-up refusals, the retry policy and the log format. Bad input gets a
clear error (and exit code 2 from the CLI) before anything is claimed."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest

from pgoutbox.cli import main as cli
from pgoutbox.core.errors import ConfigError
from pgoutbox.dev.embedded import EmbeddedNats, free_port
from pgoutbox.outbox import streams
from support.outbox import GOOD, apply_streams, emit, relay_config, running_relay, status_counts
from support.roles import login
from support.schema import newer_schema


@pytest.fixture(autouse=True)
def _restore_logging():
    """`pgoutbox relay` replaces the root log handlers; put pytest's back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


# -- streams file --------------------------------------------------------------


async def test_streams_apply_is_idempotent_and_reports_changes(nats_server):
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    try:
        specs = streams.loads(GOOD)
        assert await streams.apply(js, specs) == [("SEA_EVENTS", "created"), ("VIBES", "created")]
        assert await streams.apply(js, specs) == [("SEA_EVENTS", "unchanged"), ("VIBES", "unchanged")]
        changed = streams.loads(GOOD.replace('max_age = "14d"', 'max_age = "7d"'))
        report = dict(await streams.apply(js, changed))
        assert report["SEA_EVENTS"] == "updated (max_age: 1209600.0 -> 604800.0)"
        info = await js.stream_info("VIBES")
        assert (info.config.subjects, info.config.duplicate_window, info.config.max_bytes) == (
            ["vibespro.event.>", "vibespro.dlq.>"],
            300.0,
            512 << 20,
        )
        # JetStream refuses what it cannot do, and says so.
        with pytest.raises(ConfigError, match=r"stream SEA_EVENTS: JetStream refused it \[\d+\]"):
            await streams.apply(js, streams.loads("[streams.sea]\nstorage = 'memory'\n"))
    finally:
        await nc.close()


def test_streams_command_applies_the_file(nats_server, tmp_path, capsys):
    path = tmp_path / "streams.toml"
    path.write_text("[streams.sea]\n[streams.sky]\n")
    args = ["streams", "--streams-file", str(path), "--nats-url", nats_server.url]
    assert cli.main(args) == 0
    assert capsys.readouterr().out == "SEA_EVENTS: created\nSKY_EVENTS: created\n"
    assert cli.main(args) == 0
    assert capsys.readouterr().out == "SEA_EVENTS: unchanged\nSKY_EVENTS: unchanged\n"
    assert cli.main(args + ["--lease", "3m"]) == 2
    assert "duplicate_window 120s is not longer than the relay lease 180s" in capsys.readouterr().err
    assert cli.main(["streams", "--streams-file", str(tmp_path / "missing.toml")]) == 2
    assert "cannot be read" in capsys.readouterr().err
    assert cli.main(["streams", "--nats-url", nats_server.url]) == 2
    assert "OUTBOX_STREAMS_FILE (or --streams-file) is required" in capsys.readouterr().err
    port = free_port()
    assert (
        cli.main(["streams", "--streams-file", str(path), "--nats-url", f"nats://127.0.0.1:{port}"]) == 4
    )  # ExitCode.BROKER
    assert "BrokerUnavailable" in capsys.readouterr().err


# -- start-up refusals ---------------------------------------------------------


def test_relay_refuses_a_stream_whose_duplicate_window_is_not_longer_than_the_lease(database_url, nats_server, capsys):
    asyncio.run(apply_streams(nats_server.url, duplicate_window="20s"))
    emit(database_url, 3)
    code = cli.main(
        [
            "relay",
            "--database-url",
            login(database_url, "pgoutbox_relay"),
            "--nats-url",
            nats_server.url,
            "--lease",
            "30s",
            "--http-port",
            "0",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert (
        "ConfigError: refusing to start: stream SEA_EVENTS: duplicate_window 20s is not longer "
        "than the relay lease 30s" in err
    )
    assert status_counts(database_url) == {"PENDING": 3}  # nothing was claimed


def test_relay_refuses_an_unknown_schema_version(database_url, nats_server, capsys):
    newer_schema(database_url)  # a contract release that no longer serves this code
    code = cli.main(
        [
            "relay",
            "--database-url",
            login(database_url, "pgoutbox_relay"),
            "--nats-url",
            nats_server.url,
            "--http-port",
            "0",
        ]
    )
    assert code == 3  # ExitCode.DATABASE
    assert "SchemaMismatch: database schema is at version 99" in capsys.readouterr().err


def test_strict_durability_refuses_what_only_warns_otherwise(database_url, nats_server, caplog):
    asyncio.run(apply_streams(nats_server.url))
    with pytest.raises(ConfigError, match="NATS fsync policy not verified"):
        # not default: the test is about strict durability
        asyncio.run(_start_and_stop(relay_config(database_url, nats_server.url, durability_strict="true")))
    caplog.clear()
    asyncio.run(_start_and_stop(relay_config(database_url, nats_server.url)))
    assert any("NATS fsync policy not verified" in r.getMessage() for r in caplog.records)


async def _start_and_stop(cfg):
    async with running_relay(cfg):
        pass


async def test_startup_check_reads_the_fsync_policy_from_the_monitoring_endpoint(tmp_path):
    for sync, expect_warning in (("", True), ("sync_interval: always", False)):
        conf = tmp_path / f"js{bool(sync)}.conf"
        conf.write_text(f"jetstream {{ {sync} }}\n")  # the store dir comes from -sd
        monitor = free_port()
        server = EmbeddedNats(tmp_path / conf.stem, extra_args=["-c", str(conf), "-m", str(monitor)])
        server.start()
        try:
            await apply_streams(server.url)
            nc = await nats.connect(server.url)
            findings = await streams.check(nc.jetstream(), 30, None, f"http://127.0.0.1:{monitor}")
            await nc.close()
        finally:
            server.stop()
        assert findings.errors == [] and findings.notices == []
        assert any("does not fsync every write" in d for d in findings.durability) is expect_warning
