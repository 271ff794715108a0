"""pgoutbox replay: run the replayer on its own (the consumer also runs it).

Like `consume`, it waits for NATS and PostgreSQL when they are unreachable
and stops on SIGTERM/SIGINT at any moment; with --once (a cron job) an
unreachable server is one line and exit code 3 (PostgreSQL) or 4 (NATS)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pgoutbox.cli import event_loop
from pgoutbox.core import broker, db, settings
from pgoutbox.core import logs as json_logs
from pgoutbox.core.stopping import stop_on_signals, until_stopped
from pgoutbox.inbox import settings as cs
from pgoutbox.inbox import store as inbox_store
from pgoutbox.inbox.consumer import check_schema
from pgoutbox.inbox.metrics import ConsumerMetrics
from pgoutbox.inbox.replayer import Replayer
from pgoutbox.inbox.store import Inbox

COMMAND = "replay"
HELP = (
    "Re-publish due dead letters to their handler's replay subject (automated replay and "
    "operator redrives); runs until SIGTERM, or one pass with --once."
)
CONFIG = cs.ReplayConfig
SETTINGS = settings.of(CONFIG)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", help="one pass, print how many were re-published, exit")


async def _replay(cfg: cs.ReplayConfig, once: bool, stop: asyncio.Event, pool: db.Pool, opened: list[Any]) -> int:
    nc = await broker.connect(cfg.nats_url, "pgoutbox-replayer", retry=not once)
    opened.append(nc)
    inbox = Inbox(pool)
    await check_schema(inbox, cfg.database_url, retry=not once)
    replayer = Replayer(
        inbox=inbox,
        js=nc.jetstream(),
        nc=nc,
        metrics=ConsumerMetrics(),
        worker=cs.worker_name(cfg),
        batch_size=cfg.replay_batch_size,
        poll_interval=cfg.replay_poll_interval,
        dlq_max_age=cfg.dlq_max_age,
        dlq_duplicate_window=cfg.dlq_duplicate_window,
    )
    if once:
        total = 0
        while (done := await replayer.run_once()) > 0:
            total += done
        print(f"re-published {total} dead letter(s)")
        return 0
    await replayer.run(stop)
    return 0


async def _main(cfg: cs.ReplayConfig, once: bool) -> int:
    stop = stop_on_signals()
    pool = inbox_store.pool(cfg.database_url, 1)
    opened: list[Any] = []
    try:
        work = asyncio.ensure_future(_replay(cfg, once, stop, pool, opened))
        if not await until_stopped(work, stop):
            return 0  # stopped before or during start-up
        return work.result()
    finally:
        for nc in opened:
            if not nc.is_closed:
                await nc.close()
        await pool.close()


def run(cfg: cs.ReplayConfig, args: argparse.Namespace) -> int:
    json_logs.setup(cfg.log_level)
    return event_loop.run(_main(cfg, args.once))
