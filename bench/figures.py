"""The figures a benchmark hands to bench/guard.py: when PGOUTBOX_BENCH_FIGURES
names a file, record() appends one JSON line per figure to it (a bench run
by hand, without the variable, records nothing and prints as before)."""

from __future__ import annotations

import json
import os

VARIABLE = "PGOUTBOX_BENCH_FIGURES"


def record(figure: str, code: str, value: float, unit: str, better: str) -> None:
    """figure: what was measured; code: "before" or "this"; better: "higher"
    or "lower" (which way is an improvement)."""
    path = os.environ.get(VARIABLE)
    if not path:
        return
    line = {"figure": figure, "code": code, "value": value, "unit": unit, "better": better}
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
