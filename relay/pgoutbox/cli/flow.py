"""pgoutbox flow: a business flow by its correlation id (outbox.flow)."""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass
from typing import Any

from pgoutbox.core import bounds, db, settings
from pgoutbox.core.errors import ConfigError, wrap_exceptions
from pgoutbox.core.settings import option

COMMAND = "flow"
HELP = (
    "Show the events of one correlation id in emit order, their publish state and each handler's inbox outcome"
    " (outbox.flow; pgoutbox_viewer may run it)."
)


@dataclass(frozen=True)
class FlowConfig:
    database_url: str | None = option(settings.DATABASE_URL)
    max_rows: int = option(
        settings.Setting(
            "max_rows",
            "OUTBOX_FLOW_MAX_ROWS",
            "1000",
            "How many events of the flow to show (its first ones)",
            settings.integer,
            bound=bounds.MAX_ROWS,
        )
    )


CONFIG = FlowConfig
SETTINGS = settings.of(CONFIG)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("correlation_id", metavar="CORRELATION_ID", help="the flow's correlation id (a UUID)")


def lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per event, then one indented line per handler that received it."""
    out: list[str] = []
    last = None
    for r in rows:
        if r["event_id"] != last:
            last = r["event_id"]
            state = r["status"] + (f" at {r['published_at']:%Y-%m-%d %H:%M:%S%z}" if r["published_at"] else "")
            if r["status"] == "DEAD_LETTER" and r["discarded"] and r["handler"] is None:
                state += " (discarded)"
            caused = f" caused by {r['causation_id']}" if r["causation_id"] else ""
            out.append(
                f"{r['created_at']:%Y-%m-%d %H:%M:%S%z}  {r['event_id']}  {r['subject']}"
                f"  {r['aggregate_type']}/{r['aggregate_id']}  {state} (attempts {r['attempts']}){caused}"
            )
            if r["last_error"]:
                out.append(f"    error: {r['last_error']}")
        if r["handler"] is None:
            out.append("    no handler has received it")
            continue
        outcome = r["inbox_status"] + (" (discarded)" if r["discarded"] else "")
        error = f": {r['inbox_last_error']}" if r["inbox_last_error"] and r["inbox_status"] != "PROCESSED" else ""
        out.append(f"    {r['handler']}: {outcome}, attempts {r['inbox_attempts']}{error}")
    return out


def run(cfg: FlowConfig, args: argparse.Namespace) -> int:
    try:
        correlation_id = uuid.UUID(args.correlation_id)
    except ValueError as exc:
        raise ConfigError(f"not a correlation id (a UUID): {args.correlation_id[:100]!r}") from exc
    with db.connect(cfg.database_url, check_schema=True) as conn, wrap_exceptions():
        cur = conn.execute("SELECT * FROM outbox.flow(%s, %s)", (correlation_id, cfg.max_rows))
        names = [c.name for c in cur.description or ()]
        rows = [dict(zip(names, row)) for row in cur.fetchall()]
    if not rows:
        print(f"no event carries correlation id {correlation_id}")
        return 0
    print("\n".join(lines(rows)))
    return 0
