"""The delivery report as a picture an operator reads at a glance.

One panel per metric, one line per context over every day of the range:
a day without rows is a gap, not a line drawn across it; every point has a
marker, so a context seen on isolated days still shows; contexts sharing a
value (all at 100 %) nest their markers (the first drawn is the largest)
instead of hiding each other. Days not over yet (UTC today and later) are
shaded and their points hollow: their rates are still moving. Targets are
labelled on the line, and the legend has a panel of its own, so nothing sits
on the data. A volume panel shows what each day's rates are made of.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers
import matplotlib.dates as mdates
import matplotlib.pyplot as plt
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h")
OPEN_SHADE = "#d9d9d9"
TARGET = "crimson"


@dataclass(frozen=True)
class Panel:
    field: str
    title: str
    scale: float  # stored value -> shown value (fractions shown as %)
    unit: str
    target: float
    target_label: str
    higher_is_better: bool = False


RATES = (
    Panel("delivery_rate", "Delivery rate (published / events)", 100.0, "%", 99.99, "target ≥ 99.99 %", True),
    Panel("dlq_rate", "DLQ rate (inbox dead letters / messages)", 100.0, "%", 0.1, "target < 0.1 %"),
    Panel("duplicate_processing_rate", "Duplicate processing rate", 100.0, "%", 0.0, "target 0 %"),
)
# A rollup row of the report (column -> value), and a day's point on a line.
Row = dict[str, Any]
Point = tuple[date, float]

LATENCY = Panel("e2e_p99_ms", "End-to-end latency, occurred → processed (log)", 1.0, "ms", 500.0, "target p99 < 500 ms")


def _value(record: Row, field: str, scale: float) -> float:
    value = record.get(field)
    return math.nan if value is None else float(value) * scale


def _days(rollup: Sequence[Row]) -> list[date]:
    first, last = min(r["day"] for r in rollup), max(r["day"] for r in rollup)
    return [first + timedelta(days=i) for i in range((last - first).days + 1)]


class _Series:
    """Each context's values on the full day grid (NaN where it has no row)."""

    def __init__(self, rollup: Sequence[Row], days: list[date]):
        self.days = days
        self.contexts = sorted({r["context"] for r in rollup})
        self._rows = {(r["context"], r["day"]): r for r in rollup}

    def values(self, context: str, field: str, scale: float = 1.0) -> list[float]:
        return [_value(self._rows.get((context, d), {}), field, scale) for d in self.days]

    def style(self, i: int) -> dict[str, Any]:
        # Nested markers: later contexts smaller and on top, so equal values stay visible.
        return {
            "marker": MARKERS[i % len(MARKERS)],
            "markersize": max(10.0 - 2.0 * i, 3.5),
            "linewidth": max(2.4 - 0.4 * i, 1.0),
            "zorder": 3 + i,
        }


def _plot(ax: Axes, series: _Series, i: int, values: list[float], open_days: set[date], **extra: Any) -> list[Point]:
    """Draws the closed days' line; returns the open days' points, which the
    caller draws hollow (their rates are still moving, so no line leads to
    them and they do not set the axis)."""
    closed = [math.nan if d in open_days else v for d, v in zip(series.days, values)]
    ax.plot(
        mdates.date2num(series.days),  # type: ignore[no-untyped-call]
        closed,
        color=f"C{i}",
        label=series.contexts[i],
        **series.style(i),
        **extra,
    )
    return [(d, v) for d, v in zip(series.days, values) if d in open_days and not math.isnan(v)]


def _hollow(ax: Axes, series: _Series, i: int, points: list[Point], unit: str = "") -> None:
    """Open days' points, hollow; one outside the axis sits on its edge, labelled with its value."""
    if not points:
        return
    low, high = ax.get_ylim()
    style = series.style(i)
    for d, v in points:
        shown = min(max(v, low), high)
        ax.plot(
            [d],  # type: ignore[arg-type]  # matplotlib converts dates; its stubs take numbers only
            [shown],
            linestyle="none",
            marker=style["marker"],
            markersize=style["markersize"],
            markerfacecolor="white",
            markeredgecolor=f"C{i}",
            zorder=style["zorder"] + 0.5,
            clip_on=False,
        )
        if shown != v:
            ax.annotate(
                f"{v:.4g}{unit}",
                xy=(d, shown),
                xytext=(0, 8 if shown == low else -14),
                textcoords="offset points",
                ha="center",
                fontsize=7,
                color=f"C{i}",
            )


def _target(ax: Axes, panel: Panel) -> None:
    ax.axhline(panel.target, color=TARGET, linestyle="--", linewidth=1.1, zorder=2)
    ax.annotate(
        panel.target_label,
        xy=(1.0, panel.target),
        xycoords=("axes fraction", "data"),
        xytext=(-4, 3),
        textcoords="offset points",
        ha="right",
        va="bottom",
        fontsize=8,
        color=TARGET,
        zorder=20,
        bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
    )


def _rate_limits(ax: Axes, panel: Panel, shown: list[float]) -> None:
    """Rates never go below 0 or above 100 %; the axis spans what matters."""
    if panel.higher_is_better:
        low = min([*shown, panel.target])
        pad = max((100.0 - low) * 0.15, 0.002)
        ax.set_ylim(max(low - pad, 0.0), 100.0 + pad)
    else:
        high = max([*shown, panel.target])
        ax.set_ylim(0.0, high * 1.3 if high > 0 else 0.01)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.4g}"))


def _open_days(ax: Axes, open_days: set[date]) -> None:
    for d in open_days:
        start = datetime(d.year, d.month, d.day)
        left = mdates.date2num(start - timedelta(hours=12))  # type: ignore[no-untyped-call]
        right = mdates.date2num(start + timedelta(hours=12))  # type: ignore[no-untyped-call]
        ax.axvspan(left, right, color=OPEN_SHADE, zorder=0, linewidth=0)


def figure(rollup: Sequence[Row], *, title: str, today: date | None = None) -> Figure:
    """The chart of the per-(day, context) rollup rows (today: the first open day)."""
    today = today or datetime.now(UTC).date()
    fig, axes = plt.subplots(3, 2, figsize=(13, 11.5), dpi=100)
    data_axes = [axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1], axes[2, 0]]
    key = axes[2, 1]
    key.axis("off")
    if not rollup:
        for ax in data_axes:
            ax.axis("off")
        fig.suptitle(f"{title}\nno events or inbox messages", fontsize=13)
        return fig
    days = _days(rollup)
    series = _Series(rollup, days)
    open_days = {d for d in days if d >= today}

    for ax, panel in zip((axes[0, 0], axes[0, 1], axes[1, 1]), RATES):
        shown, hollow = [], []
        for i, context in enumerate(series.contexts):
            values = series.values(context, panel.field, panel.scale)
            shown += [v for d, v in zip(days, values) if d not in open_days and not math.isnan(v)]
            hollow.append(_plot(ax, series, i, values, open_days))
        _rate_limits(ax, panel, shown)
        for i, points in enumerate(hollow):
            _hollow(ax, series, i, points, " %")
        _target(ax, panel)
        ax.set_title(panel.title, fontsize=11)
        ax.set_ylabel(panel.unit)

    ax = axes[1, 0]
    latency_hollow = []
    for i, context in enumerate(series.contexts):
        latency_hollow.append((i, _plot(ax, series, i, series.values(context, "e2e_p99_ms"), open_days)))
        latency_hollow.append((i, _plot(ax, series, i, series.values(context, "e2e_p50_ms"), open_days, linestyle=":")))
    ax.set_yscale("log")  # one late redelivery must not flatten every other day
    for i, points in latency_hollow:
        _hollow(ax, series, i, points)
    _target(ax, LATENCY)
    ax.set_title(LATENCY.title, fontsize=11)
    ax.set_ylabel(LATENCY.unit)

    ax = axes[2, 0]
    bottom = [0.0] * len(days)
    for i, context in enumerate(series.contexts):
        counts = [0.0 if math.isnan(v) else v for v in series.values(context, "events")]
        ax.bar(days, counts, bottom=bottom, width=0.8, color=f"C{i}", alpha=0.85, zorder=3)
        bottom = [b + c for b, c in zip(bottom, counts)]
    messages = [
        sum(0.0 if math.isnan(v) else v for v in col)
        for col in zip(*(series.values(c, "messages") for c in series.contexts))
    ]
    ax.plot(days, messages, color="black", marker="_", markersize=14, linestyle="none", zorder=4)
    ax.set_ylim(0, max([*bottom, *messages, 1.0]) * 1.15)
    ax.set_title("Volume per day (events stacked by context; — inbox messages)", fontsize=11)
    ax.set_ylabel("count")

    span = (
        datetime.combine(days[0], datetime.min.time()) - timedelta(hours=16),
        datetime.combine(days[-1], datetime.min.time()) + timedelta(hours=16),
    )
    locator = mdates.AutoDateLocator(minticks=3, maxticks=10)  # type: ignore[no-untyped-call]
    for ax in data_axes:
        _open_days(ax, open_days)
        ax.set_xlim(*span)
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d"))  # type: ignore[no-untyped-call]
        ax.grid(True, alpha=0.3, zorder=1)

    handles: list[Artist] = [
        Line2D([], [], color=f"C{i}", **{k: v for k, v in series.style(i).items() if k != "zorder"}, label=c)
        for i, c in enumerate(series.contexts)
    ]
    handles += [
        Line2D([], [], color="grey", linewidth=1.8, label="p99"),
        Line2D([], [], color="grey", linewidth=1.4, linestyle=":", label="p50"),
        Line2D([], [], color=TARGET, linestyle="--", label="target"),
        Line2D([], [], color="grey", marker="o", markerfacecolor="white", linestyle="none", label="open day (hollow)"),
        Patch(facecolor=OPEN_SHADE, label="open day: not over yet (UTC)"),
        Line2D([], [], color="black", marker="_", markersize=14, linestyle="none", label="inbox messages"),
    ]
    key.legend(handles=handles, loc="center", fontsize=10, title="contexts and marks", frameon=False)

    events = sum(int(r.get("events") or 0) for r in rollup)
    messages_total = sum(int(r.get("messages") or 0) for r in rollup)
    fig.suptitle(
        f"{title}\n{events} events, {messages_total} inbox messages, {days[0]} to {days[-1]}"
        f" ({len({r['day'] for r in rollup})} of {len(days)} days with data), {len(series.contexts)} context(s)",
        fontsize=13,
    )
    fig.tight_layout()
    return fig


def render(rollup: Sequence[Row], *, title: str, today: date | None = None) -> bytes:
    """PNG bytes for the per-(day, context) rollup rows of the report."""
    fig = figure(rollup, title=title, today=today)
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()
