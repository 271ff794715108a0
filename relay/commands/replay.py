"""pgoutbox replay: run the replayer on its own (the consumer also runs it)."""

from __future__ import annotations

import asyncio
import signal

import nats

from .. import consumer_settings as cs
from .. import db, json_logs, settings
from ..consumer_metrics import ConsumerMetrics
from ..inbox_store import ConnectionPool, Inbox
from ..replayer import Replayer

COMMAND = "replay"
HELP = ("Re-publish due dead letters to their handler's replay subject (automated replay and "
        "operator redrives); runs until SIGTERM, or one pass with --once.")
SETTINGS = settings.DATABASE + settings.NATS + cs.DLQ + cs.REPLAYER + (
    next(s for s in cs.CONSUMER if s.name == "log_level"),
)


def add_arguments(parser) -> None:
    parser.add_argument("--once", action="store_true", help="one pass, print how many were re-published, exit")


async def _main(cfg, once: bool) -> int:
    nc = await nats.connect(servers=[u.strip() for u in cfg.nats_url.split(",")], name="pgoutbox-replayer")
    pool = ConnectionPool(cfg.database_url, 1)
    try:
        inbox = Inbox(pool)
        db.check_schema_version(await inbox.schema_version())
        replayer = Replayer(
            inbox=inbox, js=nc.jetstream(), metrics=ConsumerMetrics(), worker=cs.worker_name(cfg),
            batch_size=cfg.replay_batch_size, poll_interval=cfg.replay_poll_interval,
            dlq_max_age=cfg.dlq_max_age, dlq_duplicate_window=cfg.dlq_duplicate_window,
        )
        if once:
            total = 0
            while (done := await replayer.run_once()) > 0:
                total += done
            print(f"re-published {total} dead letter(s)")
            return 0
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await replayer.run(stop)
        return 0
    finally:
        await nc.close()
        await pool.close()


def run(cfg, args) -> int:
    json_logs.setup(cfg.log_level)
    return asyncio.run(_main(cfg, args.once))
