"""An earlier commit's pgoutbox, taken from the checkout's git history and
made importable on a PYTHONPATH of its own: the rolling-upgrade test and the
benchmarks' --before runs start workers from it, side by side with this one."""

from __future__ import annotations

import subprocess
from pathlib import Path


def export(repo: Path, commit: str, into: Path) -> Path:
    """Extracts `commit`'s package (with its sql/ and migrations/) under `into`
    and returns the folder to put on PYTHONPATH. Commits before release 0.4.0
    kept the package's modules directly in relay/ and found migrations/ two
    folders above core/migrate.py; later ones keep them in relay/pgoutbox/."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", commit, "relay", "sql", "migrations"], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    if (into / "relay" / "pgoutbox").is_dir():
        return into / "relay"
    (into / "relay").rename(into / "pgoutbox")
    return into
