"""docs/relay.md documents every setting of `pgoutbox relay` and `pgoutbox
streams` with its default and every publish error code (the metrics are in
docs/reference.md, generated: tests/cli/test_docs.py)."""

from __future__ import annotations

from pathlib import Path

from pgoutbox.cli import streams as streams_command
from pgoutbox.outbox import settings as relay_settings
from pgoutbox.outbox.publisher import PublishError

DOC = (Path(__file__).resolve().parents[2] / "docs" / "relay.md").read_text()


def test_every_relay_setting_is_documented_with_its_default():
    for s in relay_settings.RELAY + streams_command.SETTINGS:
        rows = [line for line in DOC.splitlines() if line.startswith(f"| `{s.env}` | `{s.flag}` |")]
        assert rows, f"{s.env} missing from docs/relay.md"
        if s.env == "OUTBOX_STREAMS_FILE":
            continue  # optional for the relay, required by `pgoutbox streams`: the row says so
        default = "*(none)*" if s.default is None else f"`{s.default}`"
        assert f"| {default} |" in rows[0], f"{s.env}: default {default} not documented"


def test_every_publish_error_code_is_documented():
    for code in PublishError:
        assert f"| `{code.value}` |" in DOC, code
