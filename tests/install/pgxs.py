"""The extension files of extension/, installed by PGXS (`make -C extension
install`) into the PostgreSQL the suite runs, once per test run."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

from pgoutbox.dev.embedded import PG_BIN

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def install_extension() -> None:
    result = subprocess.run(
        ["make", "-s", "-C", str(ROOT / "extension"), "install", f"PG_CONFIG={PG_BIN / 'pg_config'}"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
