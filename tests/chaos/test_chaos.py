"""The chaos harness, short profile: the whole pipeline (2 relays, 2
consumers, an in-database ledger app) under load with every single-node fault
kind, every worker on the product's default settings, each as its
least-privileged login, then the ledger check. The fault kinds include a
PostgreSQL outage longer than max_deliver x the retry delay (with well-formed
messages published straight to the stream meanwhile), a kill -9 of every
consumer at once, hostile foreign messages drawn from the poison strategies
(header values included), JetStream away with the NATS connection up, the
handler down, and older-version events whose upcaster raises for some. The
long faults last tens of seconds here (minutes in `make chaos PROFILE=long`):
the mechanisms are the same. And proof that the check has teeth: the same run
against a deliberately broken consumer (acks each message before anything is
recorded) must fail."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from support.chaos_run import run_chaos

ROOT = Path(__file__).resolve().parents[2]
NEW_KINDS = (
    "postgres_outage",
    "kill_all_consumers",
    "foreign_messages",
    "jetstream_away",
    "postgres_outage_long",
    "handler_down",
    "upcaster_raises",
)


def figures_of(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("figures: ")]
    assert lines, "the run printed no figures"
    return json.loads(lines[-1].removeprefix("figures: "))


@pytest.mark.slow
def test_short_chaos_run_keeps_the_ledger():
    result = run_chaos("--profile", "short")
    figures = figures_of(result.stdout)
    # Every new fault kind ran (the harness also fails a run where one did
    # not), and both kinds of foreign message reached the stream: the
    # ledger judged them.
    assert all(figures["faults"].get(kind) for kind in NEW_KINDS), figures["faults"]
    classes = {key.split(":")[0] for key in figures["foreign_by_class"]}
    assert "well_formed" in classes and "foreign_header_values" in classes, classes
    assert result.returncode == 0, "the ledger check failed: see VIOLATIONS above"
    assert "ledger OK" in result.stdout
    assert figures["lost"] == figures["duplicated_side_effects"] == figures["stuck"] == 0
    assert figures["dead_letters_not_own"] == 0, figures["dead_letters_not_own_by_cause"]
    assert figures["foreign_vanished"] == 0
    # The upcaster raised for some older-version events: each is an UPCAST_FAILED dead letter, the others processed.
    assert (
        figures["upcast_failed_dead_lettered"] > 0 and figures["upcast_events"] > figures["upcast_failed_dead_lettered"]
    )
    assert figures["dead_letters_by_cause"].get("upcaster", 0) >= figures["upcast_failed_dead_lettered"]


@pytest.mark.slow
@pytest.mark.xdist_group("chaos-check")  # not behind the short soak: a chain of its own
def test_the_ledger_check_catches_a_consumer_that_acks_first(tmp_path):
    broken = tmp_path / "pgoutbox"
    shutil.copytree(ROOT / "relay" / "pgoutbox", broken)  # the links to sql/ and migrations/ copied as folders
    flow = broken / "inbox" / "flow.py"
    text = flow.read_text()
    anchor = "        delivery = msg.metadata.num_delivered\n"
    assert anchor in text, "inbox/flow.py MessageFlow.handle changed: update the sabotage"
    # Acks first, then takes its time to record: a kill lands in that window.
    # 50 ms a message: admission goes message by message, and at 0.5 s the
    # drain after the load (15 messages/s) outlasted the 5-minute wait for
    # quiescence; at 50 ms the run is over in about a minute, and each of its
    # four kills still finds messages in the window.
    sabotage = "        await msg.ack()  # SABOTAGE: ack before the inbox\n        await asyncio.sleep(0.05)\n"
    flow.write_text(text.replace(anchor, anchor + sabotage, 1))
    # Consumer kills only, at a rate that keeps messages in flight at each
    # one: what an acked message in flight becomes is the point. No poison
    # nor hostile input: no dead letter whose first replay the run would wait for.
    result = run_chaos(
        "--profile",
        "short",
        "--seconds",
        "30",
        "--rate",
        "200",
        "--faults",
        "4",
        "--kinds",
        "kill_consumer,kill_all_consumers",
        "--poison-fraction",
        "0",
        "--poison-share",
        "0",
        pythonpath=tmp_path,
    )
    assert result.returncode == 1
    assert "VIOLATIONS" in result.stdout
    # Acked before the inbox, then killed: no side effect and no inbox row
    # (lost), or a row never settled (stuck).
    figures = figures_of(result.stdout)
    assert figures["lost"] + figures["stuck"] > 0, figures
