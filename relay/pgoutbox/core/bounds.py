"""The bounds the SQL functions put on arguments that come from settings, in
one place.

A setting whose value reaches one of these arguments carries its Bound
(settings.Setting.bound), so that a value the database would refuse is
refused when the command starts, with the same limit and in one line (exit 2),
instead of failing every call once the worker runs. The numbers are the
database's own (sql/, RAISE ... INVALID_ARGUMENT and friends):
tests/cli/test_bounds.py calls each SQL function just at and just past each
bound. PORT is the one bound not set by SQL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

DAY = 86400.0
MICROSECOND = 1e-6  # PostgreSQL's interval resolution


def _seconds(value: float) -> str:
    if value == 0:
        return "0"
    for unit, size in (("d", DAY), ("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if value >= size and value % size == 0:
            return f"{value / size:g}{unit}"
    return f"{value * 1000:g}ms" if value < 1 else f"{value:g}s"


@dataclass(frozen=True)
class Bound:
    """What one SQL argument accepts: a number (a count, or a duration in
    seconds), a text's length, or a text's pattern."""

    sql: str  # the argument(s) that take the value, for messages
    low: float | None = None  # None: the database sets no lower bound
    high: float | None = None  # None: no upper bound
    low_open: bool = False  # low itself is refused (a lease must be more than 0)
    unit: str = ""  # "s": seconds; "characters": a text's length; "": a count
    pattern: str | None = None  # a text must match it whole
    why: str = ""  # what a value outside would do, when that is not plain
    high_shown: str = ""  # the high end as the SQL writes it, when that reads better

    def shown(self, value: float) -> str:
        if value == self.high and self.high_shown:
            return self.high_shown
        if self.unit == "s":
            return _seconds(value)
        return str(int(value)) if value == int(value) else f"{value:g}"

    @property
    def range(self) -> str:
        """The accepted values: `from 1 to 10000`, `at most 30d`, ..."""
        if self.pattern:
            return f"matching {self.pattern}"
        unit = " characters" if self.unit == "characters" else ""
        if self.low is None:
            assert self.high is not None
            return f"at most {self.shown(self.high)}{unit}"
        assert self.high is not None
        if self.low_open:
            return f"more than {self.shown(self.low)} and at most {self.shown(self.high)}{unit}"
        return f"from {self.shown(self.low)} to {self.shown(self.high)}{unit}"

    @property
    def text(self) -> str:
        """For help and docs: `from 1 to 10000 (outbox.claim(batch_size))`."""
        return f"{self.range} ({self.sql})"

    def check(self, value: object) -> None:
        """Raises ValueError (one line) when the database would refuse value."""
        if isinstance(value, str):
            if self.pattern is not None:
                if not re.fullmatch(self.pattern, value):
                    raise ValueError(f"must match {self.pattern} ({self.sql})")
                return
            if not value.strip(" "):  # as btrim() in SQL
                raise ValueError(f"must not be blank ({self.sql})")
            number = float(len(value))
        elif isinstance(value, timedelta):
            number = value.total_seconds()
        elif isinstance(value, (int, float)):
            number = float(value)
        else:
            raise TypeError(f"no bound on a {type(value).__name__}")
        too_low = self.low is not None and (number <= self.low if self.low_open else number < self.low)
        too_high = self.high is not None and number > self.high
        if too_low or too_high:
            why = f": {self.why}" if self.why else ""
            raise ValueError(f"must be {self.text}{why}")


CLAIM_BATCH = Bound("outbox.claim(batch_size)", 1, 10000)
LEASE = Bound("outbox.claim(lease)", 0, DAY, low_open=True, unit="s")
RETRY_AHEAD = Bound("outbox.mark_failed(retry_at - now())", None, 30 * DAY, unit="s")
WORKER = Bound("outbox.claim(worker), inbox.claim_replays(worker)", 1, 256, unit="characters")
DAYS_AHEAD = Bound("outbox.create_partitions(days_ahead)", 0, 366)
MAX_ROWS = Bound("outbox.dead_letters(max_rows), outbox.dlq_*(max_rows)", 1, 10000)
CONTEXT = Bound("the context of outbox.backlog, inbox.backlog, outbox.dead_letters", pattern=r"[A-Za-z0-9_-]{1,64}")
REASON = Bound(
    "the reason of outbox.requeue, outbox.requeue_completed, inbox.redrive, inbox.set_replay, outbox.dlq_*",
    1,
    1000,
    unit="characters",
)
INBOX_BATCH = Bound("the message ids of inbox.receive_batch, inbox.settle, inbox.receive_processed", None, 10000)
REPLAY_BATCH = Bound("inbox.claim_replays(batch_size)", 1, 10000)
REPLAY_AFTER = Bound("inbox.record_error(replay_after)", 0, 366 * DAY, unit="s")
# 100 years: PostgreSQL compares intervals counting a year as 12 months of 30 days.
RETENTION = Bound(
    "the retentions of outbox.archivable_partitions, inbox.archivable_days, inbox.archivable_command_days",
    0,
    36000 * DAY,
    unit="s",
    high_shown="100 years (36000d)",
)
LOCK_TIMEOUT = Bound(
    "outbox.seal_partition(lock_timeout), outbox.drop_archived(lock_timeout)",
    0.001,
    3600.0,
    unit="s",
    why="0 or less would wait for ever",
)
PORT = Bound("a TCP port", 0, 65535)

# Every bound the database sets, by name (tests/cli/test_bounds.py probes each).
SQL_BOUNDS = {
    name: bound
    for name, bound in globals().items()
    if isinstance(bound, Bound) and name.isupper() and bound is not PORT
}
