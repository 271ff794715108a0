"""bench/guard.py's table: which figures it flags (unit tier: no server)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def guard():
    sys.path.insert(0, str(BENCH))  # the benches import their neighbours by name
    try:
        yield importlib.import_module("guard")
    finally:
        sys.path.remove(str(BENCH))


def line(figure: str, code: str, value: float, better: str) -> dict:
    return {"figure": figure, "code": code, "value": value, "unit": "x", "better": better}


@pytest.mark.parametrize(
    ("better", "before", "this", "flagged"),
    [
        ("higher", 100.0, 89.0, True),  # 11 % fewer events/s
        ("higher", 100.0, 91.0, False),
        ("higher", 100.0, 150.0, False),
        ("lower", 100.0, 111.0, True),  # 11 % more CPU per event
        ("lower", 100.0, 109.0, False),
        ("lower", 100.0, 50.0, False),
    ],
)
def test_a_figure_is_flagged_when_it_is_worse_by_more_than_the_bound(guard, better, before, this, flagged):
    rows = guard.table([line("f", "before", before, better), line("f", "this", this, better)], 0.10, "abc1234")
    assert len(rows) == 2, rows
    assert rows[1].endswith("FLAG") is flagged, rows[1]


def test_a_figure_one_side_did_not_record_is_flagged_as_missing(guard):
    rows = guard.table([line("drain", "this", 1.0, "higher")], 0.10, "abc1234")
    assert "missing: before" in rows[1] and rows[1].endswith("FLAG"), rows


def test_an_unknown_part_is_refused_in_one_line(guard, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["guard.py", "--before", "HEAD", "--parts", "relay,nope"])
    with pytest.raises(SystemExit) as exit_:
        guard.main()
    assert exit_.value.code == 2
    assert "unknown part(s) nope" in capsys.readouterr().err
