"""pgoutbox relay: run the outbox relay until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import signal
from collections.abc import Callable

from pgoutbox.cli import event_loop
from pgoutbox.core import logs as json_logs
from pgoutbox.core.settings import Setting
from pgoutbox.core.stopping import stop_on_signals
from pgoutbox.outbox import settings as relay_settings
from pgoutbox.outbox.relay import OutboxRelay

log = logging.getLogger(__name__)

COMMAND = "relay"
HELP = (
    "Run the relay: wake on NOTIFY (or poll), claim, publish to JetStream with Nats-Msg-Id, "
    "mark; SIGTERM finishes the in-flight batches and exits 0."
)
CONFIG = relay_settings.RelayConfig
SETTINGS = relay_settings.RELAY


def run(cfg: relay_settings.RelayConfig, args: argparse.Namespace) -> int:
    # A signal before the event loop takes them over stops the relay too
    # (exit 0 at once), rather than killing it or printing a traceback.
    early: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: early.append(signum)) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        json_logs.setup(cfg.log_level)
        _warn_unknown_variables(args.settings_groups)
        return event_loop.run(_main(cfg, early))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _warn_unknown_variables(all_settings: Callable[[], dict[str, tuple[Setting, ...]]]) -> None:
    """An OUTBOX_* variable no command knows is a typo or a stale name: it
    would otherwise be ignored without a word. (The other commands' settings,
    which import every command, are read only when the relay's own do not
    account for a variable.)"""
    own = {s.env for s in SETTINGS}
    if all(k in own for k in os.environ if k.startswith("OUTBOX_")):
        return
    known = {s.env for group in all_settings().values() for s in group}
    for name in sorted(k for k in os.environ if k.startswith("OUTBOX_") and k not in known):
        close = difflib.get_close_matches(name, known, n=1)
        log.warning(
            "unknown setting %s ignored%s",
            name,
            f" (did you mean {close[0]}?)" if close else "",
            extra={"action": "unknown_setting", "variable": name},
        )


async def _main(cfg: relay_settings.RelayConfig, early: list[int]) -> int:
    stop = stop_on_signals()
    if early:
        stop.set()
    await OutboxRelay(cfg).run(stop)
    return 0
