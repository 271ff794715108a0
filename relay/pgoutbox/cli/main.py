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
import importlib
import os
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn

from pgoutbox import __version__
from pgoutbox.core import settings
from pgoutbox.core.errors import PgOutboxError, from_database, one_line

if TYPE_CHECKING:
    from pgoutbox.core.settings import Setting

# The subcommands, in --help order: each is the module pgoutbox.cli.<name>
# (a dash in the name is an underscore in the module's). Only the chosen one
# is imported (all of them for the command list of --help, or a name no
# command has): a command starts with what it needs, and `pgoutbox status`
# does not import nats-py and httpx (0.14 against 0.36 s of CPU to start).
COMMAND_NAMES = (
    "migrate",
    "relay",
    "streams",
    "status",
    "requeue",
    "flow",
    "audit",
    "partitions",
    "consume",
    "replay",
    "redrive",
    "backfill",
    "replay-switch",
    "dead-letters",
    "registry",
    "archive",
    "report",
    "restore-list",
    "console",
    "testing",
    "settings",
)


def command_module(name: str) -> ModuleType:
    return importlib.import_module(f"pgoutbox.cli.{name.replace('-', '_')}")


def _commands() -> tuple[ModuleType, ...]:
    return tuple(command_module(name) for name in COMMAND_NAMES)


def __getattr__(name: str) -> object:
    """COMMANDS: every subcommand's module, in --help order (imports them all)."""
    if name == "COMMANDS":
        return _commands()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def all_settings() -> dict[str, tuple[Setting, ...]]:
    """Every command's settings, for the reference table (deduplicated by env)."""
    seen: set[str] = set()
    groups: dict[str, tuple[Setting, ...]] = {}
    for mod in _commands():
        fresh = tuple(s for s in mod.SETTINGS if s.env not in seen)
        seen.update(s.env for s in fresh)
        if fresh:
            groups[mod.COMMAND] = fresh
    return groups


def all_metrics() -> dict[str, object]:
    """Each worker's metrics, for the reference table (`pgoutbox replay` serves none:
    the consumer runs the replayer and serves its metric)."""
    from pgoutbox.inbox.metrics import ConsumerMetrics
    from pgoutbox.outbox.metrics import RelayMetrics

    return {"`pgoutbox relay`": RelayMetrics(), "`pgoutbox consume`": ConsumerMetrics()}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line (argparse would print the whole usage block first)."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only that of the command `chosen`."""
    parser = _Parser(
        prog="pgoutbox",
        description="PostgreSQL transactional outbox + inbox, relayed to NATS JetStream.",
        epilog="Every flag has an environment twin; libpq PG* variables apply when OUTBOX_DATABASE_URL is unset.",
    )
    parser.add_argument("--version", action="version", version=f"pgoutbox {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in (command_module(chosen),) if chosen else _commands():
        p = sub.add_parser(mod.COMMAND, help=mod.HELP, description=mod.HELP)
        settings.add_arguments(p, mod.SETTINGS)
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def _broker_errors() -> tuple[type[Exception], ...]:
    """What nats-py raises when the server cannot be reached or drops us (none
    when the command never imported nats-py)."""
    if "nats" not in sys.modules:
        return ()
    import nats.errors
    import nats.js.errors

    return (
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
    if "psycopg" in sys.modules:  # else the command never spoke to PostgreSQL
        import psycopg.errors

        from pgoutbox.core import db

        if isinstance(exc, psycopg.Error) and db.is_connection_error(exc):
            return db.unavailable(exc, database_url, lost=True)
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            return db.refused(exc, database_url)
        if isinstance(exc, psycopg.Error):
            return from_database(exc)
    nats_url = getattr(cfg, "nats_url", None)
    if isinstance(exc, _broker_errors()) and nats_url:
        from pgoutbox.core import broker

        return broker.unavailable(nats_url, f"{type(exc).__name__}: {exc}")
    return None


def _chosen(argv: Sequence[str]) -> str | None:
    """The command named on the line (the first word that is not an option:
    `pgoutbox` itself has no option that takes a value), if there is one."""
    first = next((word for word in argv if not word.startswith("-")), None)
    return first if first in COMMAND_NAMES else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_chosen(argv)).parse_args(argv)
    # Handed down rather than imported back (`settings` prints them, the relay
    # warns about OUTBOX_* variables no command knows), as a call: it imports
    # every command.
    args.settings_groups = all_settings
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
    first. A reader of the output that stops early (`pgoutbox settings |
    head`) ends the command quietly, as it ends `cat`: exit 141, no
    traceback."""
    try:
        code = main()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the final flush writes nowhere
        code = 141  # 128 + SIGPIPE, what a shell reports for a command its pipe's reader left
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
