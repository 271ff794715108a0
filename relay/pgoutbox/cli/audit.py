"""pgoutbox audit: which COMPLETED events does a stream lack (a broker that
lost acknowledged messages, or deleted ones)? With --repair, requeue them for
republishing (COMPLETED -> PENDING, recorded in outbox.requeue_log).

Exit 0: nothing missing, or everything missing requeued; 1: missing events
remain (found without --repair, or still inside the duplicate window)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors

from pgoutbox.cli import streams
from pgoutbox.core import bounds, broker, settings
from pgoutbox.core.errors import ConfigError, ExitCode
from pgoutbox.core.settings import option
from pgoutbox.outbox import audit

COMMAND = "audit"
HELP = (
    "Compare the COMPLETED events still inside each stream's retention with the stream (by Nats-Msg-Id) "
    "and report what the stream lacks; --repair requeues those events for republishing."
)


def _seconds(text: str) -> float:
    value = settings.duration(text)
    if value <= 0:
        raise ValueError("must be positive")
    return value


@dataclass(frozen=True)
class AuditConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    nats_url: str = option(settings.NATS_URL)
    reason: str | None = option(
        settings.Setting(
            "reason",
            "OUTBOX_AUDIT_REASON",
            None,
            "Why the repair requeues (recorded; --repair only)",
            bound=bounds.REASON,
        )
    )
    since: float | None = option(
        settings.Setting(
            "since",
            "OUTBOX_AUDIT_SINCE",
            None,
            "Audit only events published within this duration (e.g. 6h); default: the stream's whole retention",
            _seconds,
        )
    )
    slack: float = option(
        settings.Setting(
            "slack",
            "OUTBOX_AUDIT_SLACK",
            "1m",
            "Clock skew between NATS and PostgreSQL plus the longest delay from a JetStream ack to its mark",
            settings.duration,
        )
    )
    page: int = option(
        settings.Setting("page", "OUTBOX_AUDIT_PAGE", "10000", "Outbox ids per query", settings.positive_int)
    )
    fetch: int = option(
        settings.Setting("fetch", "OUTBOX_AUDIT_FETCH", "2000", "Stream messages per fetch", settings.positive_int)
    )
    bucket: int = option(
        settings.Setting(
            "bucket",
            "OUTBOX_AUDIT_BUCKET",
            "250000",
            "Events compared in memory at once (bounds the memory; the rest waits in temporary files)",
            settings.positive_int,
        )
    )
    sample: int = option(
        settings.Setting("sample", "OUTBOX_AUDIT_SAMPLE", "10", "Missing event ids shown", settings.non_negative_int)
    )
    progress: float = option(
        settings.Setting("progress", "OUTBOX_AUDIT_PROGRESS", "5s", "Seconds between progress lines", _seconds)
    )
    spill_dir: str | None = option(
        settings.Setting(
            "spill_dir", "OUTBOX_AUDIT_SPILL_DIR", None, "Directory for the temporary files (default: the system's)"
        )
    )

    def options(self) -> audit.Options:
        return audit.Options(
            page=self.page,
            fetch=self.fetch,
            bucket=self.bucket,
            slack=self.slack,
            since=self.since,
            sample=self.sample,
            progress_every=self.progress,
            spill_dir=self.spill_dir,
        )


CONFIG = AuditConfig
SETTINGS = settings.of(CONFIG)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("streams", nargs="+", metavar="STREAM", help="JetStream stream names, e.g. SEA_EVENTS")
    parser.add_argument(
        "--repair",
        action="store_true",
        help="requeue the missing events published before the duplicate window (needs --reason)",
    )


def run(cfg: AuditConfig, args: argparse.Namespace) -> int:
    if args.repair and not (cfg.reason or "").strip():
        raise ConfigError("--repair needs a reason: --reason or OUTBOX_AUDIT_REASON (it is recorded)")
    if args.repair:
        audit.check_repairable(cfg.database_url)
    reports = asyncio.run(audit_streams(cfg, args.streams, args.repair))
    return int(ExitCode.FAILED) if any(r.missing.count > r.requeued for r in reports) else 0


def _say(line: str) -> None:
    print(line, flush=True)


# NATS gone or silent in the middle of an audit (the connection does not reconnect).
_LOST = (
    nats.errors.TimeoutError,
    nats.errors.ConnectionClosedError,
    nats.errors.StaleConnectionError,
    nats.errors.UnexpectedEOF,
)


async def audit_streams(
    cfg: AuditConfig, names: list[str], repair: bool, say: Callable[[str], None] = _say
) -> list[audit.Report]:
    """Audits (and repairs) each stream in turn, saying progress and reports through `say`."""
    nc = await streams.connect(cfg.nats_url)
    reports = []
    try:
        async with audit.workspace(cfg.options()) as root:
            for name in names:
                report = await audit.audit_stream(cfg.database_url, nc, name, cfg.options(), root, say)
                if repair:
                    await asyncio.to_thread(audit.repair, cfg.database_url, report, cfg.reason or "", say)
                for line in report.lines():
                    say(line)
                reports.append(report)
    except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError) as exc:
        raise broker.unavailable(cfg.nats_url, "start nats-server with -js", "JetStream is not enabled") from exc
    except _LOST as exc:
        raise broker.unavailable(cfg.nats_url, f"{type(exc).__name__}: {exc}", "lost NATS during the audit") from exc
    finally:
        await nc.close()
    return reports
