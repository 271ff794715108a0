"""pgoutbox relay: run the outbox relay until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import signal

from .. import json_logs, relay_settings
from ..outbox_relay import OutboxRelay

COMMAND = "relay"
HELP = ("Run the relay: wake on NOTIFY (or poll), claim, publish to JetStream with Nats-Msg-Id, "
        "mark; SIGTERM finishes the in-flight batches and exits 0.")
SETTINGS = relay_settings.RELAY


def run(cfg, args) -> int:
    relay_settings.validate(cfg)
    json_logs.setup(cfg.log_level)
    return asyncio.run(_main(cfg))


async def _main(cfg) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await OutboxRelay(cfg).run(stop)
    return 0
