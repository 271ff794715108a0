"""pgoutbox replay-switch: automated replay of a handler's dead letters on or off."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pgoutbox.core import bounds, db, settings
from pgoutbox.core.errors import wrap_exceptions
from pgoutbox.core.settings import option

COMMAND = "replay-switch"
HELP = "Switch automated replay of a handler's dead letters on or off, with a reason (redrives still work)."


@dataclass(frozen=True)
class ReplaySwitchConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    reason: str = option(
        settings.Setting(
            "reason", "OUTBOX_REPLAY_SWITCH_REASON", None, "Why (recorded)", required=True, bound=bounds.REASON
        )
    )


CONFIG = ReplaySwitchConfig
SETTINGS = settings.of(CONFIG)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("handler", metavar="HANDLER")
    parser.add_argument("state", choices=("on", "off"))


def run(cfg: ReplaySwitchConfig, args: argparse.Namespace) -> int:
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        [(enabled,)] = conn.execute(
            "SELECT enabled FROM inbox.set_replay(%s, %s, %s)", (args.handler, args.state == "on", cfg.reason)
        ).fetchall()
    print(f"automated replay for {args.handler}: {'on' if enabled else 'off'}")
    return 0
