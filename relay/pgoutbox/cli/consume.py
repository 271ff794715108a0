"""pgoutbox consume: run the inbox consumer (and, by default, the replayer)."""

from __future__ import annotations

import argparse

from pgoutbox.cli import event_loop
from pgoutbox.core import logs as json_logs
from pgoutbox.core import settings
from pgoutbox.core.stopping import stop_on_signals
from pgoutbox.inbox import settings as cs
from pgoutbox.inbox.consumer import Consumer

COMMAND = "consume"
HELP = (
    "Run the inbox consumer for the handlers of the generated registry: JetStream pull -> "
    "inbox -> HTTP handler -> ack / DLQ; the replayer runs alongside unless switched off."
)
CONFIG = cs.ConsumerConfig
SETTINGS = settings.of(CONFIG)


async def serve(consumer: Consumer) -> None:
    """Runs until SIGTERM or SIGINT, then drains (see consumer.py)."""
    await consumer.run(stop_on_signals())


def run(cfg: cs.ConsumerConfig, args: argparse.Namespace) -> int:
    json_logs.setup(cfg.log_level)
    handlers = cs.load_handlers(cfg)
    event_loop.run(serve(Consumer(handlers, cfg)))
    return 0
