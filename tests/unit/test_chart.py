"""The delivery chart, drawn from a rollup with a sparse context, a missing
day, an open day and rates all at 100 % or 0 %: what an operator must see is
checked on the figure's own objects."""

from __future__ import annotations

import math
from datetime import date, timedelta

import matplotlib.dates as mdates
import pytest
from matplotlib.lines import Line2D

from pgoutbox_spark import chart
from pgoutbox_spark.report import _cell

TODAY = date(2026, 11, 24)
DAYS = [TODAY - timedelta(days=n) for n in range(6, -1, -1)]  # six closed days and today
MISSING = DAYS[3]


def row(day: date, context: str, *, delivered: float = 1.0, p99: float = 80.0, events: int = 1000) -> dict:
    return {
        "day": day,
        "context": context,
        "events": events,
        "messages": round(events * delivered),
        "delivery_rate": delivered,
        "dlq_rate": 0.0,
        "duplicate_processing_rate": 0.0,
        "e2e_p50_ms": p99 / 4,
        "e2e_p99_ms": p99,
    }


@pytest.fixture(scope="module")
def drawn():
    rollup = [row(d, "sea", delivered=0.5 if d == TODAY else 1.0) for d in DAYS if d != MISSING]
    rollup += [row(DAYS[1], "rail", events=30), row(DAYS[5], "rail", events=30)]  # isolated days only
    fig = chart.figure(rollup, title="t", today=TODAY)
    panels = {ax.get_title().split(" (")[0].split(",")[0]: ax for ax in fig.axes if ax.get_title()}
    yield fig, panels
    chart.plt.close(fig)


def line(ax, context: str, linestyle: str = "-") -> Line2D:
    (found,) = [x for x in ax.get_lines() if x.get_label() == context and x.get_linestyle() == linestyle]
    return found


def test_every_series_has_markers_so_isolated_days_show(drawn):
    _, panels = drawn
    for title in ("Delivery rate", "End-to-end latency", "DLQ rate"):
        lines = [x for x in panels[title].get_lines() if x.get_color() != chart.TARGET]
        assert lines and all(x.get_marker() not in (None, "None", "") for x in lines), title
    # rail's p50 too: a dotted line with no markers would be invisible on isolated days.
    dotted = [line(panels["End-to-end latency"], context, ":") for context in ("rail", "sea")]
    assert all(x.get_marker() not in (None, "None", "") for x in dotted)


def test_a_missing_day_is_a_gap_and_open_days_are_not_on_the_line(drawn):
    _, panels = drawn
    sea = line(panels["Delivery rate"], "sea")
    by_day = {mdates.num2date(x).date() if not isinstance(x, date) else x: y for x, y in zip(*sea.get_data())}
    assert math.isnan(by_day[MISSING]) and math.isnan(by_day[TODAY])
    assert all(by_day[d] == 100.0 for d in DAYS if d not in (MISSING, TODAY))


def test_equal_values_nest_instead_of_hiding_each_other(drawn):
    _, panels = drawn
    rail, sea = line(panels["Delivery rate"], "rail"), line(panels["Delivery rate"], "sea")
    assert (sea.get_marker(), sea.get_markersize()) != (rail.get_marker(), rail.get_markersize())
    # drawn first (contexts in name order), rail's markers are the larger, under sea's
    assert rail.get_markersize() > sea.get_markersize() and sea.get_zorder() > rail.get_zorder()


def test_rate_axes_stay_in_range_and_open_days_do_not_stretch_them(drawn):
    _, panels = drawn
    low, high = panels["Delivery rate"].get_ylim()
    assert 99.9 < low < 99.99 < 100.0 < high < 100.1  # the 50 % of the open day is marked at the edge
    for title in ("DLQ rate", "Duplicate processing rate"):
        low, high = panels[title].get_ylim()
        assert low == 0.0 and high > 0.0, title
    hollow = [x for x in panels["Delivery rate"].get_lines() if x.get_markerfacecolor() == "white"]
    assert len(hollow) == 1 and hollow[0].get_ydata()[0] == pytest.approx(panels["Delivery rate"].get_ylim()[0])
    assert any(t.get_text() == "50 %" for t in panels["Delivery rate"].texts)


def test_open_days_are_shaded_and_targets_labelled_with_no_legend_on_the_data(drawn):
    fig, panels = drawn
    for title, ax in panels.items():
        assert ax.get_legend() is None, title
        spans = [p for p in ax.patches if p.get_facecolor()[:3] == pytest.approx((0.851, 0.851, 0.851), abs=0.01)]
        assert len(spans) == 1, title
    assert [t.get_text() for t in panels["End-to-end latency"].texts] == ["target p99 < 500 ms"]
    assert any(ax.get_legend() is not None for ax in fig.axes if not ax.get_title())


def test_volume_shows_each_days_events(drawn):
    _, panels = drawn
    bars = panels["Volume per day"].patches
    heights = sorted(round(b.get_height()) for b in bars if b.get_height() > 0 and b.get_width() < 1)
    assert heights == sorted([1000] * 6 + [30, 30])


def test_an_empty_report_still_draws():
    assert chart.render([], title="t", today=TODAY)[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_csv_rounds_rates_and_milliseconds():
    assert _cell("delivery_rate", 0.9999500000000001) == "0.99995"
    assert _cell("dlq_rate", 1e-06) == "0.000001"
    assert _cell("e2e_p99_ms", 123.45678912) == "123.457"
    assert _cell("delivery_rate", 1.0) == "1" and _cell("events", 12) == 12 and _cell("e2e_p50_ms", None) == ""
