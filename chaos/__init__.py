"""Chaos harness for pgoutbox (`make chaos`); see harness.py.

The hostile inputs come from the tests' strategies (tests/support/poison.py),
imported as `support.poison`: the name the tests use (pytest puts tests/ on
sys.path), so that a test process importing this package loads that module
once. Run on its own (`python -m chaos`), tests/ is added here.
"""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parents[1] / "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
