"""The overview's small charts: the last hour of the backlogs, sampled by the
console into memory (nothing is stored in the database), drawn as inline SVG
on the server (no script, no chart library)."""

from __future__ import annotations

import collections
import html
import time
from collections.abc import Callable, Iterable, Mapping

HOUR = 3600.0


class Samples:
    """Per series (e.g. "outbox:orders:due"), (time, value) points of the last `keep` seconds."""

    def __init__(self, keep: float = HOUR, clock: Callable[[], float] = time.time) -> None:
        self._keep = keep
        self._clock = clock
        self._series: dict[str, collections.deque[tuple[float, float]]] = {}

    def add(self, values: Mapping[str, float], at: float | None = None) -> None:
        at = self._clock() if at is None else at
        for name, value in values.items():
            self._series.setdefault(name, collections.deque()).append((at, float(value)))
        self._trim()

    def points(self, name: str) -> list[tuple[float, float]]:
        self._trim()
        return list(self._series.get(name, ()))

    def _trim(self) -> None:
        cutoff = self._clock() - self._keep
        for points in self._series.values():
            while points and points[0][0] < cutoff:
                points.popleft()


def _minutes(seconds: float) -> str:
    return f"{round(seconds / 60)} min"


def sparkline(
    points: Iterable[tuple[float, float]],
    *,
    label: str,
    now: float,
    span: float = HOUR,
    min_span: float = 60.0,
    width: int = 160,
    height: int = 32,
) -> str:
    """An SVG polyline of the points over the last `span` seconds (x: time, y: 0 to the maximum).

    The accessible name says what the chart shows and its latest and highest
    values, so a screen reader gets the figures the picture gives."""
    pts = [(t, v) for t, v in points if t >= now - span]
    top = max((v for _, v in pts), default=0.0)
    # The x axis starts at the oldest sample (min_span at least), so a console
    # started a few minutes ago draws across the chart, not in its last pixels.
    start = max(now - span, min(pts[0][0] if pts else now, now - min_span))
    length = now - start
    summary = (
        f"{label}: last {_minutes(length)}, now {pts[-1][1]:g}, highest {top:g}"
        if pts
        else f"{label}: no samples in the last hour yet"
    )
    scale = top or 1.0
    coords = " ".join(f"{(t - start) / length * width:.1f},{height - 2 - v / scale * (height - 4):.1f}" for t, v in pts)
    line = (
        f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{coords}"/>'
        if len(pts) > 1
        else (f'<circle cx="{width - 2}" cy="{height / 2}" r="2" fill="currentColor"/>' if pts else "")
    )
    name = html.escape(summary, quote=True)
    return (
        f'<svg class="spark" role="img" aria-label="{name}" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}"><title>{name}</title>'
        f'<line x1="0" y1="{height - 1}" x2="{width}" y2="{height - 1}" class="axis"/>{line}</svg>'
    )
