"""The house's linters as part of the suite: sqlfluff (postgres dialect, see
.sqlfluff) over every SQL file we ship or test with, ruff (lint and format)
and mypy over the Python, and import-linter's contracts (imports point down,
no import circles; all configured in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize(
    "argv",
    [
        [str(BIN / "sqlfluff"), "lint", "sql/", "migrations/", "pgtap/"],
        [str(BIN / "ruff"), "check", "."],
        [str(BIN / "ruff"), "format", "--check", "."],
        [str(BIN / "mypy"), "-p", "pgoutbox", "-p", "pgoutbox_spark"],
        [str(BIN / "lint-imports"), "--no-logo"],
    ],
    ids=["sqlfluff", "ruff-check", "ruff-format", "mypy", "import-linter"],
)
def test_lint_clean(argv):
    result = run(*argv)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
