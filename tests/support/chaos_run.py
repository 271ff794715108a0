"""Runs `python -m chaos` in a subprocess with a clean environment, for the chaos tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_chaos(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "PYTHON"))}
    env["PYTHONPATH"] = f"{pythonpath}:{ROOT}" if pythonpath else str(ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "chaos", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,  # the short profiles take about five minutes alone; more under load
    )
    print(result.stdout[-3000:])
    print(result.stderr[-3000:], file=sys.stderr)
    return result
