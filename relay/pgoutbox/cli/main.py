"""The `pgoutbox` command. Each subcommand lives in a module exposing
COMMAND (name), HELP, CONFIG (its frozen config dataclass, or None),
SETTINGS (settings.of(CONFIG)) and run(cfg, args) -> int; every flag is the
twin of an environment variable (shown in --help).

An operator mistake gets one line on stderr and an exit code (errors.ExitCode),
never a traceback: domain errors print as `pgoutbox CMD: Class [code]: message`,
and main() also catches what a command let escape from a lost PostgreSQL or NATS
connection. Anything else still shows its traceback: that is a bug to fix."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

import nats.errors
import nats.js.errors
import psycopg
import psycopg.errors

from pgoutbox import __version__
from pgoutbox.cli import (
    archive,
    audit,
    backfill,
    console,
    consume,
    dead_letters,
    flow,
    migrate,
    partitions,
    redrive,
    registry,
    relay,
    replay,
    replay_switch,
    report,
    requeue,
    restore_list,
    status,
    streams,
    testing,
)
from pgoutbox.cli import settings as settings_command
from pgoutbox.core import broker, db, settings
from pgoutbox.core.errors import PgOutboxError, from_database, one_line
from pgoutbox.inbox.metrics import ConsumerMetrics
from pgoutbox.outbox.metrics import RelayMetrics

# The subcommands, in --help order.
COMMANDS = (
    migrate,
    relay,
    streams,
    status,
    requeue,
    flow,
    audit,
    partitions,
    consume,
    replay,
    redrive,
    backfill,
    replay_switch,
    dead_letters,
    registry,
    archive,
    report,
    restore_list,
    console,
    testing,
    settings_command,
)


def _commands() -> tuple[ModuleType, ...]:
    return COMMANDS


def all_settings() -> dict[str, tuple[settings.Setting, ...]]:
    """Every command's settings, for the reference table (deduplicated by env)."""
    seen: set[str] = set()
    groups: dict[str, tuple[settings.Setting, ...]] = {}
    for mod in _commands():
        fresh = tuple(s for s in mod.SETTINGS if s.env not in seen)
        seen.update(s.env for s in fresh)
        if fresh:
            groups[mod.COMMAND] = fresh
    return groups


def all_metrics() -> dict[str, object]:
    """Each worker's metrics, for the reference table (`pgoutbox replay` serves none:
    the consumer runs the replayer and serves its metric)."""
    return {"`pgoutbox relay`": RelayMetrics(), "`pgoutbox consume`": ConsumerMetrics()}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line (argparse would print the whole usage block first)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pgoutbox",
        description="PostgreSQL transactional outbox + inbox, relayed to NATS JetStream.",
        epilog="Every flag has an environment twin; libpq PG* variables apply when OUTBOX_DATABASE_URL is unset.",
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


# What nats-py raises when the server cannot be reached or drops us.
_BROKER_ERRORS = (
    nats.errors.NoServersError,
    nats.errors.ConnectionClosedError,
    nats.errors.StaleConnectionError,
    nats.errors.UnexpectedEOF,
    nats.errors.ConnectionReconnectingError,
    nats.errors.AuthorizationError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
)


def as_domain_error(exc: Exception, cfg: object | None) -> PgOutboxError | None:
    """The one-line error for a failure that escaped a command, or None (a bug: traceback)."""
    if isinstance(exc, PgOutboxError):
        return exc
    database_url = getattr(cfg, "database_url", None)
    if isinstance(exc, psycopg.Error) and db.is_connection_error(exc):
        return db.unavailable(exc, database_url, lost=True)
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return db.refused(exc, database_url)
    if isinstance(exc, psycopg.Error):
        return from_database(exc)
    nats_url = getattr(cfg, "nats_url", None)
    if isinstance(exc, _BROKER_ERRORS) and nats_url:
        return broker.unavailable(nats_url, f"{type(exc).__name__}: {exc}")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Handed down rather than imported back: `settings` prints them, the relay
    # warns about OUTBOX_* variables no command knows.
    args.settings_groups = all_settings()
    mod = args._module
    cfg = None
    try:
        cfg = settings.build(mod.CONFIG, overrides=vars(args)) if mod.CONFIG else None
        return int(mod.run(cfg, args) or 0)
    except Exception as exc:
        error = as_domain_error(exc, cfg)
        if error is None:
            raise
        code = f" [{error.code}]" if error.code else ""
        message = one_line(str(error))
        print(f"pgoutbox {mod.COMMAND}: {type(error).__name__}{code}: {message}", file=sys.stderr)
        return int(error.exit_code)


def entry() -> NoReturn:  # pragma: no cover - the process itself ends here
    """The `pgoutbox` command: main(), then the process ends at once.

    By the time main() returns, a command has closed what it holds (a
    worker's stop: its pools, NATS connection, health server, spans). What
    Python would still do is tear down every module and object of the
    interpreter, which the operator's stop waits for and which does nothing
    for them: 0.05 s on an idle machine, 0.6-1.9 s measured with load average
    16 on 2 cores, and more under `make test` next to other work (a relay
    waiting for PostgreSQL took 6 s from SIGTERM to its exit, its "stopped"
    line logged within 30 ms of the signal). So the exit does what Python's
    own does first (wait for the non-daemon threads, run the atexit handlers,
    flush the logs and the console) and skips the teardown. An exception
    main() lets escape (a bug) ends the process the usual way, traceback
    first."""
    code = main()
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # logging.shutdown() among them: every handler flushed
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    entry()
