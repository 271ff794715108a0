"""Relay configuration without a server: settings, the streams file, the
retry policy and the envelope. Bad input gets a clear error (and exit code 2
from the CLI) before anything is claimed. Start-up refusals against real
servers are in tests/outbox/test_relay_config.py."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import socket
import statistics

import pytest

from pgoutbox.cli import main as cli
from pgoutbox.core import settings, wire
from pgoutbox.core.backoff import RetryPolicy
from pgoutbox.core.errors import ConfigError
from pgoutbox.outbox import settings as relay_settings
from pgoutbox.outbox import streams
from pgoutbox.outbox.publisher import message_size
from support.outbox import GOOD


@pytest.fixture(autouse=True)
def _restore_logging():
    """`pgoutbox relay` replaces the root log handlers; put pytest's back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


# -- retry policy --------------------------------------------------------------


def test_backoff_ceiling_doubles_up_to_the_cap_and_gives_up_at_max_attempts():
    policy = RetryPolicy(base=1.0, cap=30.0, max_attempts=8, rng=random.Random(1))
    assert [policy.ceiling(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert policy.delay(8) is None and policy.delay(9) is None
    assert policy.ceiling(10_000) == 30.0  # no overflow on absurd attempt counts


def test_backoff_full_jitter_is_uniform_between_zero_and_the_ceiling():
    policy = RetryPolicy(base=0.5, cap=60.0, max_attempts=100, rng=random.Random(42))
    samples = [policy.delay(4) for _ in range(4000)]  # ceiling 4 s
    assert all(0.0 <= s <= 4.0 for s in samples)
    assert statistics.mean(samples) == pytest.approx(2.0, abs=0.1)
    assert min(samples) < 0.05 and max(samples) > 3.95  # full jitter, not "equal jitter"


# -- settings ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"batch_size": "0"}, "OUTBOX_RELAY_BATCH_SIZE='0': must be from 1 to 10000 (outbox.claim(batch_size))"),
        ({"batch_size": "20000"}, "must be from 1 to 10000"),
        ({"lease": "0s"}, "OUTBOX_RELAY_LEASE='0s': must be more than 0 and at most 1d (outbox.claim(lease))"),
        ({"lease": "25h"}, "OUTBOX_RELAY_LEASE='25h': must be more than 0 and at most 1d"),
        ({"retry_cap": "31d"}, "OUTBOX_RELAY_RETRY_CAP='31d': must be at most 30d"),
        ({"lease": "soon"}, "OUTBOX_RELAY_LEASE='soon': not a duration"),
        ({"publish_timeout": "30s", "lease": "30s"}, "must be positive and shorter than OUTBOX_RELAY_LEASE"),
        ({"retry_base": "2m", "retry_cap": "1m"}, "must be positive and at most OUTBOX_RELAY_RETRY_CAP"),
        ({"wakeups": "maybe"}, "not a boolean"),
        ({"claim_interval": "-5ms"}, "OUTBOX_RELAY_CLAIM_INTERVAL='-5ms': not a duration"),
        ({"claim_interval": "1s"}, "must be at least 0 and shorter than OUTBOX_RELAY_POLL_INTERVAL (1s)"),
        ({"http_port": "-1"}, "OUTBOX_RELAY_HTTP_PORT='-1': must be from 0 to 65535"),
        ({"http_port": "99999"}, "OUTBOX_RELAY_HTTP_PORT='99999': must be from 0 to 65535"),
        ({"log_level": "LOUD"}, "not a log level: 'LOUD'"),
    ],
)
def test_bad_settings_are_refused_with_the_variable_named(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        relay_settings.load(environ={}, overrides=overrides)


def test_environment_variables_configure_the_relay_and_flags_win():
    cfg = relay_settings.load(
        environ={"OUTBOX_RELAY_LEASE": "45s", "OUTBOX_RELAY_BATCH_SIZE": "100"}, overrides={"batch_size": "250"}
    )
    assert (cfg.lease, cfg.batch_size, cfg.http_host, cfg.http_port) == (45.0, 250, "127.0.0.1", 9464)
    assert cfg.relay_name  # host:pid by default


def test_the_relay_config_is_frozen_and_checks_itself_whatever_builds_it():
    cfg = relay_settings.load(environ={"OUTBOX_RELAY_NAME": ""})
    assert cfg.relay_name == f"{socket.gethostname()}:{os.getpid()}"  # derived by the loader
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lease = 1.0  # type: ignore[misc]
    assert dataclasses.replace(cfg, lease=60.0, publish_timeout=50.0).publish_timeout == 50.0
    with pytest.raises(ConfigError, match="must be positive and shorter than OUTBOX_RELAY_LEASE"):
        dataclasses.replace(cfg, publish_timeout=cfg.lease)
    with pytest.raises(ConfigError, match=re.escape("OUTBOX_RELAY_BATCH_SIZE=20000: must be from 1 to 10000")):
        dataclasses.replace(cfg, batch_size=20000)


def test_every_config_field_is_a_setting_in_declaration_order():
    names = [f.name for f in dataclasses.fields(relay_settings.RelayConfig)]
    assert [s.name for s in relay_settings.RELAY] == names
    assert names[:3] == ["database_url", "nats_url", "relay_name"] and names[-1] == "log_level"
    for mod in cli.COMMANDS:
        assert mod.SETTINGS == (settings.of(mod.CONFIG) if mod.CONFIG else ()), mod.COMMAND

    @dataclasses.dataclass(frozen=True)
    class Loose:
        lease: float

    with pytest.raises(TypeError, match="Loose.lease is not declared with settings.option"):
        settings.of(Loose)


def test_cli_reports_bad_settings_with_exit_code_2(capsys):
    assert cli.main(["relay", "--batch-size", "0"]) == 2
    assert (
        "pgoutbox relay: ConfigError: OUTBOX_RELAY_BATCH_SIZE='0': must be from 1 to 10000" in capsys.readouterr().err
    )


def test_help_lists_relay_and_streams_with_environment_twins(capsys):
    with pytest.raises(SystemExit):
        cli.main(["relay", "--help"])
    out = capsys.readouterr().out
    for env in ("OUTBOX_RELAY_LEASE", "OUTBOX_RELAY_BATCH_SIZE", "OUTBOX_RELAY_HTTP_PORT", "OUTBOX_STREAMS_FILE"):
        assert env in out
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "relay" in out and "streams" in out


# -- streams file --------------------------------------------------------------


def test_streams_file_defaults_and_overrides():
    sea, vibes = streams.loads(GOOD)
    assert (
        sea.name,
        sea.subjects,
        sea.max_age,
        sea.duplicate_window,
        sea.replicas,
        sea.storage,
        sea.retention,
        sea.max_bytes,
    ) == ("SEA_EVENTS", ("sea.event.>",), 14 * 86400.0, 300.0, 1, "file", "limits", -1)
    assert (vibes.name, vibes.subjects, vibes.max_bytes, vibes.storage) == (
        "VIBES",
        ("vibespro.event.>", "vibespro.dlq.>"),
        512 << 20,
        "memory",
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[streams.sea\n", "is not valid TOML"),
        ("[defaults]\nmax_age = '1d'\n", "no \\[streams.<context>\\] table"),
        ("[stream.sea]\n", "unknown table\\(s\\) \\['stream'\\]"),
        ("[streams.sea]\nmax_agee = '1d'\n", "unknown key\\(s\\) \\['max_agee'\\]"),
        ("[streams.sea]\nretention = 'forever'\n", "retention must be limits, interest or workqueue"),
        ("[streams.sea]\nstorage = 'tape'\n", "storage must be file or memory"),
        ("[streams.sea]\nreplicas = 0\n", "replicas must be an integer from 1 to 5"),
        ("[streams.sea]\nmax_bytes = '1 lot'\n", "max_bytes must be -1, a byte count"),
        ("[streams.sea]\nduplicate_window = 'never'\n", "duplicate_window: not a duration"),
        ("[streams.sea]\nduplicate_window = 0\n", "duplicate_window must be positive"),
        ("[streams.'sea.x']\n", "is not a subject token"),
        ("[streams.sea]\nname = 'A B'\n", "may only hold letters"),
        ("[streams.sea]\nname = 'X'\n[streams.sky]\nname = 'X'\n", "two contexts share a stream name"),
        ("[defaults]\nname = 'X'\n[streams.sea]\n", "\\[defaults\\] may only set"),
    ],
)
def test_bad_streams_files_are_refused_with_a_clear_error(text, message):
    with pytest.raises(ConfigError, match=message):
        streams.loads(text, "streams.toml")


def test_lease_must_be_shorter_than_every_duplicate_window():
    specs = streams.loads("[streams.sea]\nduplicate_window = '30s'\n")
    streams.check_lease(specs, 29.0)
    with pytest.raises(ConfigError, match="duplicate_window 30s is not longer than the relay lease 30s"):
        streams.check_lease(specs, 30.0)


@pytest.mark.parametrize(
    ("subject", "captures"),
    [
        ("sea.event.>", True),
        (">", True),
        ("*.event.*.*", True),
        ("sea.>", True),
        ("sea.event.order_created.v1", True),
        ("sea.dlq.>", False),
        ("sea.event.*", False),
        ("sea.event.a.v1.extra", False),
        ("orders", False),
    ],
)
def test_which_stream_subjects_capture_outbox_subjects(subject, captures):
    assert streams.captures_outbox_subjects(subject) is captures


# -- wire format ----------------------------------------------------


def test_envelope_passes_jsonb_text_through_and_still_compacts_objects():
    row = {
        "event_id": "5b0c4bd5-bd35-4ef4-8a8c-1a1d0d1f1f00",
        "subject": "sea.event.x.v1",
        "payload": '{"n": 1.10, "big": 123456789012345678901234567890.5}',
        "headers": '{"traceparent": "00-abc-def-01"}',
        "context": "sea",
        "event_type": "x",
        "event_version": 1,
    }
    subject, body, headers = wire.to_nats(row)
    assert body == b'{"n": 1.10, "big": 123456789012345678901234567890.5}'
    assert headers["Nats-Msg-Id"] == row["event_id"] and headers["traceparent"] == "00-abc-def-01"
    # A forged reserved header is refused (the event's BAD_HEADER), never sent or silently dropped.
    with pytest.raises(wire.WireError, match="BAD_HEADER: header name 'Nats-Msg-Id' is reserved"):
        wire.to_nats({**row, "headers": '{"Nats-Msg-Id": "forged"}'})
    assert wire.to_nats({**row, "payload": {"a": [1, 2]}, "headers": {}})[1] == b'{"a":[1,2]}'
    assert message_size(b"12345", {"A": "bc"}) == 5 + len(b"NATS/1.0\r\nA: bc\r\n\r\n")


@pytest.mark.parametrize(
    ("given", "shown"),
    [
        ("postgresql://u:p@localhost/x", "postgresql://u:***@localhost/x"),
        ("postgresql://u:s3cret-pw@h/x says s3cret-pw", "postgresql://u:***@h/x says ***"),
        ("host=h password=p user=u", "host=h password=*** user=u"),
        ("nats://a:b@h1:4222,nats://c:dd@h2:4222", "nats://a:***@h1:4222,nats://c:***@h2:4222"),
        ("postgresql://u@h/x", "postgresql://u@h/x"),
    ],
)
def test_redact_masks_the_password_where_it_stands_and_long_ones_everywhere(given, shown):
    assert settings.redact(given) == shown


def test_redact_masks_a_short_password_quoted_in_a_message_about_its_url():
    message = 'invalid value "pw" in postgresql://u:pw@h/x (pwd)'
    assert settings.redact(message, "postgresql://u:pw@h/x") == 'invalid value "***" in postgresql://u:***@h/x (pwd)'
