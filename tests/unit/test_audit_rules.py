"""`pgoutbox audit`'s rules without a server: the horizon follows the
retention, and subject patterns match as NATS matches them (split from
tests/outbox/test_audit.py, which runs the audit against a real stream)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pgoutbox.outbox import audit


def test_horizon_follows_the_retention():
    now = datetime(2026, 1, 2, tzinfo=UTC)
    base = audit.StreamView("S", ("a.>",), 120.0, 0.0, False, None, 10, 10)
    assert base.horizon(now, None, 60) is None, "a stream without limits keeps everything"
    aged = audit.StreamView("S", ("a.>",), 120.0, 86400.0, False, now - timedelta(days=1), 10, 10)
    assert aged.horizon(now, None, 60) == now - timedelta(days=1) + timedelta(seconds=180)
    assert aged.horizon(now, 3600, 60) == now - timedelta(hours=1), "--since narrows it"
    first = now - timedelta(hours=2)
    sized = audit.StreamView("S", ("a.>",), 120.0, 0.0, True, first, 10, 10)
    assert sized.horizon(now, None, 60) == first + timedelta(seconds=180)


def test_subject_patterns_match_like_nats():
    import re

    cases = {
        "sea.event.>": (["sea.event.a.v1", "sea.event.a"], ["sea.event", "sea.eventx.a", "xsea.event.a"]),
        "sea.*.a.v1": (["sea.event.a.v1"], ["sea.event.b.v1", "sea.e.f.a.v1"]),
        "a-b.c_d": (["a-b.c_d"], ["a-b.c_dx", "aab.c_d"]),
    }
    for subject, (yes, no) in cases.items():
        pattern = re.compile(audit.subject_pattern(subject))
        assert all(pattern.match(s) for s in yes), subject
        assert not any(pattern.match(s) for s in no), subject
