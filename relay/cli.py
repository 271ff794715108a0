"""The `pgoutbox` command. Each subcommand lives in a module exposing
COMMAND (name), HELP, SETTINGS (tuple of Setting) and run(cfg, args) -> int;
every flag is the twin of an environment variable (shown in --help)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from . import __version__, settings
from .errors import PgOutboxError

# Modules providing subcommands, in --help order.
COMMAND_MODULES = (
    "pgoutbox.commands.migrate",
    "pgoutbox.commands.relay",
    "pgoutbox.commands.streams",
    "pgoutbox.commands.status",
    "pgoutbox.commands.requeue",
    "pgoutbox.commands.partitions",
    "pgoutbox.commands.consume",
    "pgoutbox.commands.replay",
    "pgoutbox.commands.redrive",
    "pgoutbox.commands.replay_switch",
    "pgoutbox.commands.registry",
    "pgoutbox.commands.archive",
    "pgoutbox.commands.report",
    "pgoutbox.commands.settings",
)


def _commands():
    return [importlib.import_module(name) for name in COMMAND_MODULES]


def all_settings() -> dict[str, tuple[settings.Setting, ...]]:
    """Every command's settings, for the README table (deduplicated by env)."""
    seen: set[str] = set()
    groups: dict[str, tuple[settings.Setting, ...]] = {}
    for mod in _commands():
        fresh = tuple(s for s in mod.SETTINGS if s.env not in seen)
        seen.update(s.env for s in fresh)
        if fresh:
            groups[mod.COMMAND] = fresh
    return groups


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgoutbox",
        description="PostgreSQL transactional outbox + inbox, relayed to NATS JetStream.",
        epilog="Every flag has an environment twin; libpq PG* variables apply when "
        "OUTBOX_DATABASE_URL is unset.",
    )
    parser.add_argument("--version", action="version", version=f"pgoutbox {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in _commands():
        p = sub.add_parser(mod.COMMAND, help=mod.HELP, description=mod.HELP)
        settings.add_arguments(p, mod.SETTINGS)
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mod = args._module
    try:
        cfg = settings.load(mod.SETTINGS, overrides=vars(args))
        return int(mod.run(cfg, args) or 0)
    except PgOutboxError as exc:
        code = f" [{exc.code}]" if exc.code else ""
        print(f"pgoutbox {mod.COMMAND}: {type(exc).__name__}{code}: {exc}", file=sys.stderr)
        return int(exc.exit_code)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
