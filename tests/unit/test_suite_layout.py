"""How the suite is laid out: rules that keep its files from meeting."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_the_suite_has_one_conftest():
    """Test folders are not packages, so pytest imports every conftest.py as
    the module `conftest`: a second one replaces tests/conftest.py for the
    tests that import helpers from it (`from conftest import ...`), and which
    one they get depends on the collection order."""
    assert sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("conftest.py")) == ["conftest.py"]
