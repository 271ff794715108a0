"""docs/consumer.md documents every setting of the consumer's commands and
every SQLSTATE in the consumer's range (OB030-OB049)."""

from __future__ import annotations

from pathlib import Path

from pgoutbox.cli import consume, redrive, registry, replay, replay_switch
from pgoutbox.core.errors import SqlState

DOC = (Path(__file__).resolve().parents[2] / "docs" / "consumer.md").read_text()


def test_every_consumer_setting_is_documented_with_its_default():
    for mod in (consume, replay, redrive, replay_switch, registry):
        for s in mod.SETTINGS:
            if s.env in ("OUTBOX_DATABASE_URL", "OUTBOX_NATS_URL"):
                continue  # shared connection settings, documented with the others
            rows = [line for line in DOC.splitlines() if line.startswith(f"| `{s.env}` |")]
            assert rows, f"{s.env} missing from docs/consumer.md"
            default = "*(required)*" if s.required else ("*(none)*" if s.default is None else f"`{s.default}`")
            assert f"| {default} |" in rows[0], f"{s.env}: default {default} not documented"


def test_every_consumer_sqlstate_is_documented():
    ours = [c for c in SqlState if "OB030" <= c.value <= "OB039"]  # the inbox operations (OB04x: the audit)
    assert ours
    for code in ours:
        assert f"| `{code.value}` | `{code.name}` |" in DOC, code
