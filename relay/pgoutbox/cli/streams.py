"""pgoutbox streams: create or update the JetStream streams of the streams
file, idempotently (created / updated (what changed) / unchanged)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from dataclasses import dataclass

import nats
import nats.errors
import nats.js.errors

from pgoutbox.core import broker, settings
from pgoutbox.core.settings import option
from pgoutbox.outbox import settings as relay_settings
from pgoutbox.outbox import streams

COMMAND = "streams"
HELP = (
    "Apply the streams file (one JetStream stream per bounded context): create or update, "
    "idempotently; --check only validates the file."
)


@dataclass(frozen=True)
class StreamsConfig:
    nats_url: str = option(settings.NATS_URL)
    streams_file: str = option(dataclasses.replace(relay_settings.STREAMS_FILE, required=True))
    lease: float = option(relay_settings.LEASE)


CONFIG = StreamsConfig
SETTINGS = settings.of(CONFIG)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--check", action="store_true", help="validate the file (and its duplicate windows against the lease) only"
    )


def run(cfg: StreamsConfig, args: argparse.Namespace) -> int:
    specs = streams.load(cfg.streams_file)
    streams.check_lease(specs, cfg.lease)
    if args.check:
        for s in specs:
            print(f"{s.name}: ok ({', '.join(s.subjects)})")
        return 0
    for name, what in asyncio.run(_apply(cfg.nats_url, specs)):
        print(f"{name}: {what}")
    return 0


async def _apply(url: str, specs: list[streams.StreamSpec]) -> list[tuple[str, str]]:
    nc = await connect(url)
    try:
        return await streams.apply(nc.jetstream(), specs)
    except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError) as exc:
        raise broker.unavailable(url, "start nats-server with -js", "JetStream is not enabled") from exc
    finally:
        await nc.close()


async def connect(url: str) -> nats.NATS:
    """One connection, no reconnect: an operator's command fails at once (exit 4) when NATS is away."""
    return await broker.connect(url, retry=False, quiet=True)
