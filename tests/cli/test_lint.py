"""sqlfluff (postgres dialect, see .sqlfluff) over every SQL file we ship or test with."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sql_is_lint_clean():
    sqlfluff = Path(sys.executable).parent / "sqlfluff"
    result = subprocess.run(
        [str(sqlfluff), "lint", "sql/", "migrations/", "pgtap/"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
