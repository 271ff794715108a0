"""The one way to NATS for the workers and the commands: the servers of
OUTBOX_NATS_URL, where they are for messages (host:port, never a user or
password), and a connection with one of two reconnect policies:

  retry=True   (the relay, the consumer, the replayer) waits for as long as
               NATS is unreachable, one log line per attempt at most every
               5 seconds; nats-py then reconnects a lost connection by itself;
  retry=False  (a one-shot command) fails at once with BrokerUnavailable, one
               line, exit 4.
"""

from __future__ import annotations

import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable

import nats
import nats.errors

from pgoutbox.core.backoff import Every
from pgoutbox.core.errors import BrokerUnavailable, ConfigError, one_line
from pgoutbox.core.settings import redact

log = logging.getLogger(__name__)

SETTING = "OUTBOX_NATS_URL or --nats-url"
# nats-py's pause between attempts on one server; a worker is back within this after NATS is.
RECONNECT_WAIT = 0.25
CONNECT_TIMEOUT = 2.0

Callback = Callable[[], Awaitable[None]]


def servers(url: str) -> list[str]:
    """Every server of a comma-separated URL list (every node of a cluster)."""
    return [u.strip() for u in url.split(",") if u.strip()]


def where(url: str) -> str:
    """The servers of a NATS URL list, for messages: host:port, without user or password."""
    out = []
    for one in servers(url):
        try:
            parts = urllib.parse.urlsplit(one if "://" in one else f"nats://{one}")
            out.append(f"{parts.hostname or '?'}:{parts.port or 4222}")
        except ValueError:
            out.append("(unparsable URL)")
    return ",".join(out)


def unavailable(url: str, why: str, what: str = "cannot reach NATS") -> BrokerUnavailable:
    """One line for NATS that cannot be reached: where, which setting, why (never a password)."""
    return BrokerUnavailable(f"{what} at {where(url)} ({SETTING}): {redact(why, url)}")


# nats-py 2.16 parses every received message's headers with a Python-level
# generator over each name's characters (any(c.isspace() for c in key)):
# about a third of the consumer's CPU per message (yappi), for messages with
# the relay's 17 headers. A connection made here parses them as it does, with
# that test done by one regex search; tests/unit/test_broker_headers.py checks
# that both give the same dict. Only when nats-py has that hook.
_NATS_PARSER = getattr(nats.NATS, "_parse_header_lines", None)
_WHITESPACE = re.compile(r"\s")  # str.isspace()'s characters (the Unicode database's)


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """nats-py's NATS._parse_header_lines (`Name: Value` lines), but for how
    it finds white space inside a name."""
    out: dict[str, str] = {}
    for line in raw.split(b"\r\n"):
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue  # as nats-py: a name that is not ASCII is no header
        if _WHITESPACE.search(key) is not None:
            continue  # as nats-py: a name is a token
        out[key] = value.strip().decode("utf-8", "replace")
    return out


async def connect(
    url: str,
    name: str | None = None,
    *,
    retry: bool = True,
    quiet: bool = False,
    closed_cb: Callback | None = None,
    disconnected_cb: Callback | None = None,
    reconnected_cb: Callback | None = None,
) -> nats.NATS:
    """A NATS connection to every server of `url` (see the module's docstring
    for `retry`). The callbacks run after this module's own log lines; quiet:
    none (an operator's command, which prints its own)."""
    lines = Every()
    last: list[str] = []  # the last error nats-py reported (a list: set from the callback)
    made: list[nats.NATS] = []

    async def error(exc: Exception) -> None:
        last[:] = [f"{type(exc).__name__}: {exc}"]  # instead of nats-py's traceback on stderr
        if not retry or not lines():
            return
        if made and made[0].is_connected:
            log.warning("NATS: %s", one_line(exc), extra={"action": "nats_error"})
        else:
            log.warning(
                "%s (attempt %d); retrying",
                unavailable(url, one_line(exc), "cannot connect to NATS"),
                lines.attempts,
                extra={"action": "nats_error"},
            )

    async def disconnected() -> None:
        if made and not made[0].is_closed and not quiet:  # not our own close
            log.warning("NATS disconnected; reconnecting", extra={"action": "nats_disconnected"})
        if disconnected_cb is not None:
            await disconnected_cb()

    async def reconnected() -> None:
        if not quiet:
            log.info("NATS reconnected", extra={"action": "nats_reconnected"})
        if reconnected_cb is not None:
            await reconnected_cb()

    try:
        nc = await nats.connect(
            servers(url),
            name=name,
            # -1 also retries the first connect; nats-py's 0 would too (it only drops a
            # server after more than max_reconnect_attempts failures): 1 is two attempts.
            max_reconnect_attempts=-1 if retry else 1,
            allow_reconnect=retry,
            reconnect_time_wait=RECONNECT_WAIT,
            connect_timeout=CONNECT_TIMEOUT,
            error_cb=error,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            closed_cb=closed_cb,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        if retry:  # raised at once only for what no retry can fix, e.g. a malformed URL
            raise ConfigError(f"OUTBOX_NATS_URL {where(url)}: {redact(one_line(exc), url)}") from exc
        raise unavailable(url, last[0] if last else one_line(exc), "cannot connect to NATS") from None
    made.append(nc)
    if _NATS_PARSER is not None:
        nc._parse_header_lines = parse_header_lines  # type: ignore[method-assign]
    if not quiet:
        log.info("NATS connected", extra={"action": "nats_connected", "max_payload": nc.max_payload})
    return nc
