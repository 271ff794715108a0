"""Draws the delivery chart of docs/archival.md from a sample rollup: three
contexts, one every day, one every other day, one on two isolated days, a
missing day, a slow day, and today still open.

    python scripts/sample_chart.py [docs/images/delivery_report.png]
"""

from __future__ import annotations

import random
import sys
from datetime import date, timedelta
from pathlib import Path

from pgoutbox_spark.chart import render

TODAY = date(2026, 11, 24)


def sample_rollup(today: date = TODAY) -> list[dict]:
    rng = random.Random(7)
    rows = []
    for back in range(13, -1, -1):
        day = today - timedelta(days=back)
        for context, present in (("sea", back != 9), ("air", back % 2 == 0 and back != 9), ("rail", back in (11, 4))):
            if not present:
                continue
            events = {"sea": 40_000, "air": 9_000, "rail": 600}[context] + rng.randrange(0, 3_000)
            open_day = day >= today
            published = round(events * (0.62 if open_day else 1.0 if back != 6 or context != "sea" else 0.9995))
            dead = 0 if context != "air" or back != 2 else 4
            p99 = (1_450.0 if (context, back) == ("sea", 6) else rng.uniform(25, 160)) * (
                1.5 if context == "rail" else 1
            )
            rows.append(
                {
                    "day": day,
                    "context": context,
                    "events": events,
                    "messages": published,
                    "delivery_rate": published / events,
                    "dlq_rate": dead / published,
                    "duplicate_processing_rate": 0.0,
                    "e2e_p50_ms": p99 / rng.uniform(3, 6),
                    "e2e_p99_ms": p99,
                }
            )
    return rows


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images/delivery_report.png")
    out.write_bytes(render(sample_rollup(), title="pgoutbox delivery report (sample data)", today=TODAY))
    print(out)


if __name__ == "__main__":
    main()
