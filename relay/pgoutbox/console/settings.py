"""The console's settings (OUTBOX_CONSOLE_*), each with a documented default,
checked when the command starts.

The console holds no privileges of its own: its database URL names where to
connect, never who; each person's role and password come from the login form."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg.conninfo

from pgoutbox.core import bounds, settings
from pgoutbox.core.errors import ConfigError
from pgoutbox.core.settings import option

S = settings.Setting


def credential_free_conninfo(text: str) -> str:
    """A conninfo or URL that names no user and no password: the login form gives both."""
    settings.conninfo(text)
    parts = psycopg.conninfo.conninfo_to_dict(text)
    if parts.get("password") or parts.get("user"):
        raise ValueError("must not name a user or password: each person logs in with their own PostgreSQL role")
    return text


def payload_mode(text: str) -> str:
    if text not in ("role", "never"):
        raise ValueError("must be 'role' (what the database gives the role) or 'never'")
    return text


def secure_mode(text: str) -> str:
    if text not in ("auto", "always", "never"):
        raise ValueError("must be auto (Secure behind TLS: X-Forwarded-Proto from a trusted proxy), always or never")
    return text


def addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


DATABASE_URL = S(
    "database_url",
    "OUTBOX_CONSOLE_DATABASE_URL",
    None,
    "Where the console connects (conninfo or URL without user or password; the PG* variables apply when unset); "
    "each person logs in with their own PostgreSQL role",
    credential_free_conninfo,
    secret=True,  # refused when it carries a password, and then never echoed whole
)
HOST = S("host", "OUTBOX_CONSOLE_HOST", "127.0.0.1", "Address the console listens on")
PORT = S("port", "OUTBOX_CONSOLE_PORT", "8470", "Port the console listens on", settings.integer, bound=bounds.PORT)
SESSION_LIFETIME = S(
    "session_lifetime",
    "OUTBOX_CONSOLE_SESSION_LIFETIME",
    "8h",
    "How long a login lasts (the password is kept in the console's memory only that long)",
    settings.duration,
)
SECURE_COOKIE = S(
    "secure_cookie",
    "OUTBOX_CONSOLE_SECURE_COOKIE",
    "auto",
    "Secure flag of the session cookie: auto (when the request came over TLS, or X-Forwarded-Proto: https "
    "from a trusted proxy), always or never",
    secure_mode,
)
TRUSTED_PROXIES = S(
    "trusted_proxies",
    "OUTBOX_CONSOLE_TRUSTED_PROXIES",
    "127.0.0.1,::1",
    "Client addresses whose X-Forwarded-Proto and X-Forwarded-For are believed (comma-separated)",
    addresses,
)
PAYLOADS = S(
    "payloads",
    "OUTBOX_CONSOLE_PAYLOADS",
    "role",
    "Payloads on the detail page: role (shown when the database gives them to the role) or never",
    payload_mode,
)
ACTION_BATCH = S(
    "action_batch",
    "OUTBOX_CONSOLE_ACTION_BATCH",
    "250",
    "Rows one batch of a bulk action takes (one SQL call and transaction each)",
    settings.integer,
    bound=bounds.MAX_ROWS,
)
ACTION_PAUSE = S(
    "action_pause",
    "OUTBOX_CONSOLE_ACTION_PAUSE",
    "200ms",
    "Pause between two batches of a bulk action (throttle)",
    settings.duration,
)
LOGIN_ATTEMPTS = S(
    "login_attempts",
    "OUTBOX_CONSOLE_LOGIN_ATTEMPTS",
    "5",
    "Failed logins allowed per user and per client address within the login window",
    settings.positive_int,
)
LOGIN_WINDOW = S(
    "login_window",
    "OUTBOX_CONSOLE_LOGIN_WINDOW",
    "15m",
    "The window of the failed-login limit (a refused login waits for the oldest failure to leave it)",
    settings.duration,
)
SAMPLE_INTERVAL = S(
    "sample_interval",
    "OUTBOX_CONSOLE_SAMPLE_INTERVAL",
    "30s",
    "How often the console samples the backlogs for the overview's charts (the last hour, in memory)",
    settings.duration,
)


@dataclass(frozen=True)
class ConsoleConfig:
    database_url: str | None = option(DATABASE_URL)
    host: str = option(HOST)
    port: int = option(PORT)
    session_lifetime: float = option(SESSION_LIFETIME)
    secure_cookie: str = option(SECURE_COOKIE)
    trusted_proxies: tuple[str, ...] = option(TRUSTED_PROXIES)
    payloads: str = option(PAYLOADS)
    action_batch: int = option(ACTION_BATCH)
    action_pause: float = option(ACTION_PAUSE)
    login_attempts: int = option(LOGIN_ATTEMPTS)
    login_window: float = option(LOGIN_WINDOW)
    sample_interval: float = option(SAMPLE_INTERVAL)
    log_level: str = option(settings.LOG_LEVEL)

    def __post_init__(self) -> None:
        for name in ("session_lifetime", "login_window", "sample_interval"):
            if getattr(self, name) <= 0:
                setting = next(s for s in settings.of(ConsoleConfig) if s.name == name)
                raise ConfigError(f"{setting.env}: must be more than 0 (flag {setting.flag})")
        if self.action_pause < 0:
            raise ConfigError("OUTBOX_CONSOLE_ACTION_PAUSE: must be 0 or more (flag --action-pause)")
