"""Explicit configuration: every knob is an environment variable with a
documented default, and every command-line flag is the twin of one.

Each worker and each command declares its configuration as a frozen
dataclass whose fields carry their Setting (option()); of() yields those
Settings in declaration order, the CLI turns them into flags (help shows the
variable and the default), build() parses them into the frozen instance, and
`pgoutbox settings --markdown` prints the settings table of docs/reference.md from
the same declarations. A config checks itself across fields in __post_init__;
a value derived when nothing sets it (a worker name) is the Setting's fallback.
Secrets never have a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import psycopg.conninfo

from pgoutbox.core import cloudevents
from pgoutbox.core.bounds import Bound
from pgoutbox.core.errors import ConfigError
from pgoutbox.core.logs import level_name

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def duration(text: str) -> float:
    """'250ms', '30s', '5m', '2h', '7d' or plain seconds -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 250ms, 30s, 5m, 2h, 7d)")
    return float(m.group(1)) * _UNIT[m.group(2)]


def bound(text: str, *, floor: timedelta, ceiling: timedelta) -> timedelta:
    """A duration that bounds a wait: 0 (which PostgreSQL and Spark read as
    "wait for ever") and anything below floor or above ceiling are refused."""
    value = timedelta(seconds=duration(text))
    if not floor <= value <= ceiling:
        raise ValueError(f"must be from {_shown(floor)} to {_shown(ceiling)}: 0 or less would wait for ever")
    return value


def _shown(value: timedelta) -> str:
    seconds = value.total_seconds()
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def positive_int(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


_URL_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@]*?:([^@/]*)@")
_KEYWORD_PASSWORD = re.compile(r"\bpassword\s*=\s*('(?:[^'\\]|\\.)*'?|\S+)")


# A password shorter than this is masked elsewhere only where it stands alone
# (not inside a longer word): masked everywhere, a one-letter password would
# turn every such letter of the message into ***.
_MASK_EVERYWHERE = 4


def redact(text: str, source: str | None = None) -> str:
    """text without the passwords that source (a conninfo or URL list) carries:
    in the places a URL or conninfo holds one, and wherever else they appear (a
    libpq message may quote a value), a short one only as a word of its own."""
    source = text if source is None else source
    secrets = {m.group(1) for part in source.split(",") if (m := _URL_PASSWORD.match(part.strip()))}
    secrets |= {m.group(1) for m in _KEYWORD_PASSWORD.finditer(source)}
    text = ",".join(_URL_PASSWORD.sub(_masked_url, part) for part in text.split(","))
    text = _KEYWORD_PASSWORD.sub("password=***", text)
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= _MASK_EVERYWHERE:
            text = text.replace(secret, "***")
        elif secret:
            text = re.sub(rf"(?<![A-Za-z0-9]){re.escape(secret)}(?![A-Za-z0-9])", "***", text)
    return text


def _masked_url(m: re.Match[str]) -> str:
    """A URL's beginning up to its @, the password (group 1) as ***."""
    start, end = m.span(1)
    whole = m.group(0)
    return whole[: start - m.start()] + "***" + whole[end - m.start() :]


def conninfo(text: str) -> str:
    """A libpq conninfo or URL, checked here so a typo is a bad setting, not a connection failure."""
    try:
        parts = psycopg.conninfo.conninfo_to_dict(text)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"not a PostgreSQL URL or conninfo: {redact(str(exc).strip(), text)}") from None
    for value in str(parts.get("port") or "").split(","):
        if value and not (value.isdigit() and 0 < int(value) <= 65535):
            raise ValueError(f"not a port: {value!r}")
    return text


_NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def nats_urls(text: str) -> str:
    """Comma-separated NATS URLs (scheme optional, as nats-py reads them), checked up front."""
    parts = [p.strip() for p in text.split(",")]
    for part in parts:
        where = f"{redact(part)!r}: " if len(parts) > 1 else ""
        url = urllib.parse.urlsplit(part if "://" in part else f"nats://{part}")
        if url.scheme not in _NATS_SCHEMES:
            raise ValueError(f"{where}the scheme must be one of {', '.join(_NATS_SCHEMES)}")
        try:
            url.port  # noqa: B018 - raises on a port that is not one
        except ValueError:
            raise ValueError(f"{where}not a host:port (port 1-65535)") from None
        if not url.hostname:
            raise ValueError(f"{where}no host")
    return ",".join(parts)  # spaces around the commas gone: every user splits on ","


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


@dataclass(frozen=True)
class Setting:
    name: str
    env: str
    default: str | None
    help: str
    parse: Callable[[str], Any] = str
    required: bool = False
    secret: bool = False  # may carry a password: never echoed whole in a message
    fallback: Callable[[], Any] | None = None  # computed when neither flag, variable nor default gives a value
    bound: Bound | None = None  # what the SQL function the value reaches accepts (core.bounds)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def is_flag(self) -> bool:
        """A boolean: a bare --name, and --no-name (the variable takes true / false)."""
        return self.parse is boolean

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.flag, "--no-" + self.flag[2:]) if self.is_flag else (self.flag,)

    @property
    def meaning(self) -> str:
        """The help, with the bound the database sets."""
        return f"{self.help}; {self.bound.text}" if self.bound else self.help


def add_arguments(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    for s in settings:
        shown = "(none)" if s.default is None else repr(s.default)
        text = f"{s.meaning} [env: {s.env}; default: {shown}]"
        if s.is_flag:
            parser.add_argument(s.flag, dest=s.name, default=None, action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument(s.flag, dest=s.name, default=None, metavar=s.name.upper(), help=text)


_SETTING = "pgoutbox.setting"
Config = TypeVar("Config")


def option(setting: Setting) -> Any:
    """A config dataclass field read from setting (named like the field)."""
    return dataclasses.field(metadata={_SETTING: setting})


def of(cls: type) -> tuple[Setting, ...]:
    """The Settings of a config dataclass, in declaration order."""
    found = []
    for f in dataclasses.fields(cls):
        s = f.metadata.get(_SETTING)
        if s is None:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with settings.option()")
        if s.name != f.name:
            raise TypeError(f"{cls.__name__}.{f.name} carries the setting {s.name}")
        found.append(s)
    return tuple(found)


def build(
    cls: type[Config],
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """The frozen config: values from flags (overrides), then the environment,
    then defaults, then fallbacks; the class checks them as a whole."""
    environ = os.environ if environ is None else environ
    overrides = overrides or {}
    values: dict[str, Any] = {}
    for s in of(cls):
        raw = overrides.get(s.name)
        if raw is None:
            raw = environ.get(s.env) or s.default
        if raw is None:
            if s.required:
                raise ConfigError(f"{s.env} (or {s.flag}) is required: {s.help}")
            values[s.name] = None
        else:
            try:
                values[s.name] = s.parse(raw) if isinstance(raw, str) else raw
                # An empty value falls back (a worker's name) before any bound applies.
                if s.bound is not None and not (s.fallback and not values[s.name]):
                    s.bound.check(values[s.name])
            except ValueError as exc:
                shown = repr(redact(raw)) if s.secret and isinstance(raw, str) else repr(raw)
                raise ConfigError(f"{s.env}={shown}: {exc} (flag {s.flag})") from exc
        if s.fallback and not values[s.name]:
            values[s.name] = s.fallback()
    return cls(**values)


def check_bounds(config: object) -> None:
    """A built config's values within their bounds, however it was built
    (build() checks each value as it reads it; dataclasses.replace() does not)."""
    for s in of(type(config)):
        value = getattr(config, s.name)
        if s.bound is not None and value is not None:
            try:
                s.bound.check(value)
            except ValueError as exc:
                raise ConfigError(f"{s.env}={value!r}: {exc} (flag {s.flag})") from exc


def host_pid() -> str:
    """The default name of a worker: host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def markdown_table(groups: Mapping[str, Iterable[Setting]]) -> str:
    lines = ["| variable | flag | default | used by | meaning |", "|---|---|---|---|---|"]
    for group, settings in groups.items():
        for s in settings:
            default = "*(none)*" if s.default is None else f"`{s.default}`"
            if s.required:
                default = "*(required)*"
            flags = " / ".join(f"`{f}`" for f in s.flags)
            lines.append(f"| `{s.env}` | {flags} | {default} | {group} | {s.meaning} |")
    return "\n".join(lines)


DATABASE_URL = Setting(
    "database_url",
    "OUTBOX_DATABASE_URL",
    None,
    "PostgreSQL conninfo or URL; when unset, the libpq PG* variables apply",
    conninfo,
    secret=True,
)

LOG_LEVEL = Setting("log_level", "OUTBOX_LOG_LEVEL", "INFO", "Log level (JSON lines on stderr)", level_name)

NATS_URL = Setting(
    "nats_url",
    "OUTBOX_NATS_URL",
    "nats://127.0.0.1:4222",
    "NATS server URL(s), comma-separated",
    nats_urls,
    secret=True,
)

# The relay writes it into ce-source; the consumer derives it for a handler of
# format "cloudevents" when a message came without CloudEvents attributes.
CLOUDEVENTS_SOURCE = Setting(
    "cloudevents_source",
    "OUTBOX_CLOUDEVENTS_SOURCE",
    cloudevents.DEFAULT_SOURCE,
    "CloudEvents source attribute (a URI-reference; {context} stands for the event's context)",
    cloudevents.source_template,
)


# `pgoutbox archive` and `report` run Spark jobs; `pgoutbox backfill` reads
# archived days on Spark too (here, so backfill need not import the archiver).
SPARK_MASTER = Setting(
    "spark_master",
    "OUTBOX_SPARK_MASTER",
    "local[*]",
    "Spark master when not started by spark-submit (which then sets it)",
)
