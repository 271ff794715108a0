"""What the console takes from a request, checked before anything reaches
libpq or SQL: one line and 400 for anything else.

A NUL cuts libpq's connection string short: a user `admin\\0` would reach the
server as `admin`, and an empty rest lets libpq take the password from
PGPASSWORD or a pgpass file, so a login without the password would pass.
Every text from a request is therefore refused when it holds a control
character (C0, DEL or C1; a Reason may hold line breaks and tabs), or when it
is longer than PostgreSQL takes: a role name is at most NAMEDATALEN - 1 = 63
bytes (longer names are truncated by the server, so `admin` + 60 bytes of
anything would be `admin...` cut short, never another role, but libpq would
still be handed the whole text); a password at most 1,000 bytes (PostgreSQL
15 reads a password packet of up to 65,535 bytes: 1,000 is far above any
password a person types and keeps a form's memory bounded)."""

from __future__ import annotations

import re
from collections.abc import Iterable

ROLE_BYTES = 63  # NAMEDATALEN - 1
PASSWORD_BYTES = 1000
FIELD_CHARS = 2000  # any other field: filters (error text <= 1000, subject <= 1024), ids, cursors
QUERY_CHARS = 8000  # a whole query string or form
REASON_CHARS = 1000  # as the SQL functions take it

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # tab, LF and CR allowed
# Unpaired surrogates come from percent-decoding of bytes that are not UTF-8
# in some servers; they cannot be encoded for libpq either.
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class BadInput(Exception):
    """A request field the console refuses before it reaches PostgreSQL (400, one line)."""


def _shown(name: str) -> str:
    return name if name.isidentifier() and len(name) <= 30 else "a field"


def text(name: str, value: str, *, max_chars: int = FIELD_CHARS, lines: bool = False) -> str:
    """`value` when it holds no control character (lines: but tab and line breaks) and fits."""
    pattern = _CONTROL_BUT_LINES if lines else _CONTROL
    if pattern.search(value) or _SURROGATE.search(value):
        raise BadInput(f"{_shown(name)} holds a control character (such as NUL): refused")
    if len(value) > max_chars:
        raise BadInput(f"{_shown(name)} is longer than {max_chars} characters: refused")
    return value


def role(value: str) -> str:
    text("user", value, max_chars=len(value))
    if len(value.encode()) > ROLE_BYTES:
        raise BadInput(f"user is longer than PostgreSQL's {ROLE_BYTES} bytes for a role name: refused")
    return value


def password(value: str) -> str:
    text("password", value, max_chars=len(value))
    if len(value.encode()) > PASSWORD_BYTES:
        raise BadInput(f"password is longer than {PASSWORD_BYTES} bytes: refused")
    return value


def fields(items: Iterable[tuple[str, object]], *, multiline: Iterable[str] = ()) -> None:
    """Every (name, value) of a query string or form: names and text values checked
    (a file upload is refused: no form of the console has one)."""
    lines = set(multiline)
    for name, value in items:
        text("a field name", name, max_chars=100)
        if not isinstance(value, str):
            raise BadInput(f"{_shown(name)} is a file: no form of the console takes one")
        if name == "password":
            password(value)
        elif name == "user":
            role(value)
        else:
            text(name, value, max_chars=REASON_CHARS if name in lines else FIELD_CHARS, lines=name in lines)
