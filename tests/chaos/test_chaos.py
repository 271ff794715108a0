"""The chaos harness, short profile: the whole pipeline (2 relays, 2
consumers, an in-database ledger app) under load with every fault kind, then
the ledger check. And proof that the check has teeth: the same run against a
deliberately broken consumer (acks each message before anything is recorded)
must fail."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from support.chaos_run import run_chaos

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_short_chaos_run_keeps_the_ledger():
    result = run_chaos("--profile", "short")
    assert result.returncode == 0
    assert "ledger OK" in result.stdout


@pytest.mark.slow
def test_the_ledger_check_catches_a_consumer_that_acks_first(tmp_path):
    broken = tmp_path / "pgoutbox"
    shutil.copytree(ROOT / "relay", broken)
    (tmp_path / "migrations").symlink_to(ROOT / "migrations")
    flow = broken / "inbox" / "flow.py"
    text = flow.read_text()
    anchor = "        delivery = msg.metadata.num_delivered\n"
    assert anchor in text, "inbox/flow.py MessageFlow.handle changed: update the sabotage"
    flow.write_text(text.replace(anchor, anchor + "        await msg.ack()  # SABOTAGE: ack before the inbox\n", 1))
    result = run_chaos("--profile", "short", "--seconds", "25", "--faults", "5", pythonpath=tmp_path)
    assert result.returncode == 1
    assert "VIOLATIONS" in result.stdout
    assert "without its side effect" in result.stdout
