"""The consumer's and replayer's configuration and JSON logs without a
server: bad settings refused with the variable named, configs built whole,
every flag's environment twin (split from tests/inbox/test_consumer_operations.py)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from pgoutbox.cli import main as cli
from pgoutbox.core import settings
from pgoutbox.core.errors import ConfigError
from pgoutbox.core.logs import JsonFormatter
from pgoutbox.inbox import settings as cs
from support.inbox import (
    consumer_config,
)

H = "billing"


def test_bad_settings_are_refused_with_the_variable_named(tmp_path, capsys):
    assert cli.main(["consume", "--max-deliver", "0", "--registry-file", str(tmp_path / "r.json")]) == 2
    assert "OUTBOX_CONSUMER_MAX_DELIVER='0'" in capsys.readouterr().err
    assert cli.main(["consume", "--registry-file", str(tmp_path / "missing.json")]) == 2
    assert "run `pgoutbox registry generate`" in capsys.readouterr().err
    assert cli.main(["consume", "--replay-jitter", "2", "--registry-file", str(tmp_path / "r.json")]) == 2
    assert "OUTBOX_REPLAY_JITTER" in capsys.readouterr().err


def test_the_consumer_and_replayer_configs_are_built_whole(tmp_path):
    cfg = consumer_config(None, "nats://unused", tmp_path / "r.json", replay_worker="")
    assert cfg.http_port is None and cfg.replay_worker == cs.worker_name(cfg)  # host:pid, from the loader
    with pytest.raises(ConfigError, match="OUTBOX_CONSUMER_RETRY_DELAY/_MAX_DELAY"):
        dataclasses.replace(cfg, retry_delay=5.0, retry_max_delay=1.0)
    replay = settings.build(cs.ReplayConfig, environ={"OUTBOX_REPLAY_WORKER": "r1"}, overrides={"nats_url": "n:4222"})
    assert (replay.replay_worker, replay.nats_url, replay.replay_batch_size) == ("r1", "n:4222", 100)
    assert [s.env for s in settings.of(cs.ReplayConfig)] == [
        s.env for s in settings.of(cs.ConsumerConfig) if s.name in {f.name for f in dataclasses.fields(replay)}
    ]


def test_every_consumer_flag_shows_its_environment_twin(capsys):
    with pytest.raises(SystemExit):
        cli.main(["consume", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for s in settings.of(cs.ConsumerConfig):
        assert f"env: {s.env};" in text, s.env


def test_logs_are_json_lines_with_their_fields():
    record = logging.makeLogRecord(
        {
            "name": "pgoutbox.inbox.consumer",
            "levelname": "WARNING",
            "msg": "dead-lettered",
            "handler": H,
            "message_id": "m1",
        }
    )
    document = json.loads(JsonFormatter().format(record))
    assert {k: document[k] for k in ("level", "logger", "event", "handler", "message_id")} == {
        "level": "warning",
        "logger": "pgoutbox.inbox.consumer",
        "event": "dead-lettered",
        "handler": H,
        "message_id": "m1",
    }
