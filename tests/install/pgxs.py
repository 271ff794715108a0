"""The extension's files, built from migrations/ and installed by PGXS (`make
-C extension install`, as `make install/extension` does) into the PostgreSQL
the suite runs, once per test run: the server's share folder (root's to write),
or a private copy of the installation's when OUTBOX_PG_BIN points at its bin/
(PostgreSQL finds its share folder relative to its binaries)."""

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
