"""pgoutbox restore-list: the `pg_restore -L` list for a dump of an extension-mode database."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pgoutbox.core import migrate

COMMAND = "restore-list"
HELP = (
    "Read `pg_restore -l DUMP` on stdin, print the list `pg_restore -L` needs to restore an"
    " extension-mode database (docs/extension.md)."
)
CONFIG = None  # nothing to configure: a filter from stdin to stdout
SETTINGS = ()


def run(cfg: Any, args: argparse.Namespace) -> int:
    toc, skipped = migrate.restore_list(sys.stdin.read())
    sys.stdout.write(toc)
    print(f"pgoutbox restore-list: {skipped} entries commented out (ATTACH PARTITION builds them)", file=sys.stderr)
    return 0
