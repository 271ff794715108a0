"""What the command-line tests share: the database commands with the
arguments each needs, and the check that a command answered in one line."""

from __future__ import annotations

import uuid

from pgoutbox.cli import main as cli
from pgoutbox.core.errors import ExitCode

# The database commands, each with the arguments it needs to reach the database.
DATABASE_COMMANDS = {
    "migrate": [],
    "status": [],
    "requeue": [str(uuid.uuid4()), "--reason", "test"],
    "partitions": [],
    "redrive": ["billing", "--list"],
    "replay-switch": ["billing", "off", "--reason", "test"],
    "dead-letters": ["groups"],
    "archive": ["--dry-run"],
    "report": [],
}


def assert_one_line(capsys, argv: list[str], exit_code: ExitCode, *expected: str) -> str:
    """Runs `pgoutbox argv`; the one stderr line it prints, checked."""
    code = cli.main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if not ln.startswith('{"ts": ')]  # a worker's JSON log lines aside
    assert code == exit_code, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"pgoutbox {argv[0]}: "), lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]
