"""The in-database handler example's settings without a server (split from
tests/inbox/test_in_database_handler.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_idle_exit_refuses_a_value_that_is_not_a_positive_number():
    for value in ("0", "-2", "soon"):
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "in_database_handler.py"), "--idle-exit", value],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2 and "--idle-exit" in out.stderr and "Traceback" not in out.stderr, out.stderr
