"""The delivery report as a picture: one panel per metric, one line per
context, days along the bottom, the metric's target as a dashed line."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # no display on servers
import matplotlib.dates as mdates
import matplotlib.pyplot as plt

# (field, title, scale, unit, target, target label)
PANELS = (
    ("delivery_rate", "Delivery rate (published / events)", 100.0, "%", 99.99, "target 99.99%"),
    ("dlq_rate", "DLQ rate (inbox dead letters / messages)", 100.0, "%", 0.1, "target < 0.1%"),
    (
        "e2e_p99_ms",
        "End-to-end latency p99 and p50 (occurred -> processed, log scale)",
        1.0,
        "ms",
        500.0,
        "target p99 < 500 ms",
    ),
    ("duplicate_processing_rate", "Duplicate processing rate", 100.0, "%", 0.0, "target 0%"),
)


def _value(record: dict, field: str, scale: float) -> float:
    value = record.get(field)
    return math.nan if value is None else float(value) * scale


def render(rollup: Sequence[dict], *, title: str) -> bytes:
    """PNG bytes for the per-(day, context) rollup rows of the report."""
    contexts = sorted({r["context"] for r in rollup})
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), dpi=100, sharex=True)
    for ax, (field, label, scale, unit, target, target_label) in zip(axes.flat, PANELS):
        for context in contexts:
            points = sorted((r["day"], _value(r, field, scale)) for r in rollup if r["context"] == context)
            ax.plot([d for d, _ in points], [v for _, v in points], marker="o", linewidth=1.8, label=context)
        if field == "e2e_p99_ms":
            for context, line in zip(contexts, ax.get_lines()):
                points = sorted((r["day"], _value(r, "e2e_p50_ms", 1.0)) for r in rollup if r["context"] == context)
                ax.plot(
                    [d for d, _ in points],
                    [v for _, v in points],
                    linestyle=":",
                    color=line.get_color(),
                    linewidth=1.4,
                    label=f"{context} p50",
                )
        if field == "e2e_p99_ms":
            ax.set_yscale("log")  # one late redelivery must not flatten every other day
        ax.axhline(target, color="crimson", linestyle="--", linewidth=1.2, label=target_label)
        ax.set_title(label, fontsize=11)
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%Y-%m-%d"))
    for ax in axes[1]:
        ax.tick_params(axis="x", labelrotation=30)
    events = sum(int(r.get("events") or 0) for r in rollup)
    messages = sum(int(r.get("messages") or 0) for r in rollup)
    days = len({r["day"] for r in rollup})
    fig.suptitle(
        f"{title}\n{events} events, {messages} inbox messages, {days} day(s), {len(contexts)} context(s)", fontsize=13
    )
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()
