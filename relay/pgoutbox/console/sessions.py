"""Logins kept in the console's memory, and the failed-login limit.

A session is a random id in an HttpOnly, SameSite=Strict cookie; the role's
name and password stay in this process only (never on disk, never in the
cookie) until logout or the session's lifetime, because the console opens
every database session as that role and has no privileges of its own. Each
session carries its own CSRF token, which every form posts back.

Failed logins are counted per user and per client address in a sliding
window: past the limit a login is refused before PostgreSQL is even asked, so
a password cannot be guessed faster than the limit allows from one place, nor
for one role from many."""

from __future__ import annotations

import collections
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]


@dataclass
class Session:
    id: str
    user: str
    password: str = field(repr=False)
    csrf: str
    expires: float

    def csrf_ok(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.csrf.encode())


class Sessions:
    """The live logins, by cookie id."""

    def __init__(self, lifetime: float, clock: Clock = time.monotonic) -> None:
        self._lifetime = lifetime
        self._clock = clock
        self._by_id: dict[str, Session] = {}

    def open(self, user: str, password: str) -> Session:
        self._sweep()
        session = Session(
            id=secrets.token_urlsafe(32),
            user=user,
            password=password,
            csrf=secrets.token_urlsafe(32),
            expires=self._clock() + self._lifetime,
        )
        self._by_id[session.id] = session
        return session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        session = self._by_id.get(session_id)
        if session is None:
            return None
        if session.expires <= self._clock():
            self.close(session_id)
            return None
        return session

    def close(self, session_id: str) -> None:
        session = self._by_id.pop(session_id, None)
        if session is not None:
            session.password = ""  # drop the reference as soon as the login ends

    def any(self) -> Session | None:
        """A live session (the sampler reads the backlogs as one of the people logged in)."""
        self._sweep()
        return next(iter(self._by_id.values()), None)

    def _sweep(self) -> None:
        now = self._clock()
        for sid in [sid for sid, s in self._by_id.items() if s.expires <= now]:
            self.close(sid)


class LoginLimiter:
    """At most `attempts` failed logins per user and per client address within `window` seconds."""

    def __init__(self, attempts: int, window: float, clock: Clock = time.monotonic) -> None:
        self._attempts = attempts
        self._window = window
        self._clock = clock
        self._failures: dict[str, collections.deque[float]] = {}

    def _recent(self, key: str) -> collections.deque[float]:
        failures = self._failures.setdefault(key, collections.deque())
        cutoff = self._clock() - self._window
        while failures and failures[0] <= cutoff:
            failures.popleft()
        return failures

    def retry_after(self, user: str, address: str) -> float:
        """0 when a login may be tried now, else the seconds until it may."""
        wait = 0.0
        for key in (f"user:{user}", f"addr:{address}"):
            failures = self._recent(key)
            if len(failures) >= self._attempts:
                wait = max(wait, failures[0] + self._window - self._clock())
        return wait

    def failed(self, user: str, address: str) -> None:
        now = self._clock()
        for key in (f"user:{user}", f"addr:{address}"):
            self._recent(key).append(now)

    def succeeded(self, user: str) -> None:
        """A good password clears the user's count (the address's stays: one place trying many roles)."""
        self._failures.pop(f"user:{user}", None)
