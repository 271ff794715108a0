"""Runs each pgtap/*.sql file with pg_prove against a fresh database, so the
suite has one runner and each file gets its own pass/fail line."""

from __future__ import annotations

import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest

PGTAP = Path(__file__).resolve().parents[2] / "pgtap"
FILES = sorted(PGTAP.glob("*.sql"))


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_pgtap_file(database_url, path):
    url = urlparse(database_url)
    result = subprocess.run(
        [
            "pg_prove",
            "-h",
            url.hostname,
            "-p",
            str(url.port),
            "-U",
            "postgres",
            "-d",
            url.path.lstrip("/"),
            "--failures",
            str(path),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and "Result: PASS" in result.stdout, result.stdout + result.stderr
