"""pgoutbox settings: every environment variable, its flag and its default."""

from __future__ import annotations

import argparse
from typing import Any

from pgoutbox.core import settings

COMMAND = "settings"
HELP = "List every setting (environment variable, flag, default); --markdown for docs/reference.md."
CONFIG = None  # nothing to configure
SETTINGS = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--markdown", action="store_true", help="print the table of docs/reference.md")


def run(cfg: Any, args: argparse.Namespace) -> int:
    groups = args.settings_groups()
    if args.markdown:
        print(settings.markdown_table(groups))
    else:
        for group, items in groups.items():
            for s in items:
                print(f"{s.env}={'' if s.default is None else s.default}  # {group}: {s.help}")
    return 0
