"""The one classifier of database errors (core.db.failure_of), over every
SQLSTATE psycopg knows and a few it does not: only PostgreSQL itself away is
AWAY (class 08, 57P01-57P03, class 53, libpq's own failures, a session on a
server that takes no writes); a clash with a concurrent transaction is CLASH;
everything else a statement raises is that statement's own failure."""

from __future__ import annotations

import psycopg
import psycopg.errors
import pytest

from pgoutbox.core import db
from pgoutbox.core.db import Failure


def server_error(state: str) -> psycopg.Error:
    """The exception psycopg raises for a server error with this SQLSTATE."""
    try:
        cls = psycopg.errors.lookup(state)
    except KeyError:
        cls = psycopg.errors.get_base_exception(state)
    exc = cls(f"error {state}")
    exc.sqlstate = state  # what psycopg reads from the result's diagnostics
    return exc


AWAY = {"08000", "08003", "08006", "08001", "08004", "08P01", "57P01", "57P02", "57P03", "25006"}
AWAY |= {"53000", "53100", "53200", "53300", "53400"}
CLASH = {"40001", "40P01"}
# An upcaster's own failures among them: ASSERT, RAISE (default and custom
# codes, one in a class psycopg does not know), statement_timeout or cancel,
# division by zero, a bad cast, a program limit, a lock not available.
STATEMENT = {"P0004", "P0001", "OB072", "AB123", "ZZ999", "57014", "22012", "22P02", "54001", "55P03", "XX000"}


@pytest.mark.parametrize("state", sorted(AWAY))
def test_postgresql_away(state):
    assert db.failure_of(server_error(state)) is Failure.AWAY
    assert db.is_connection_error(server_error(state))


@pytest.mark.parametrize("state", sorted(CLASH))
def test_a_clash_runs_again(state):
    assert db.failure_of(server_error(state)) is Failure.CLASH


@pytest.mark.parametrize("state", sorted(STATEMENT))
def test_a_statements_own_failure(state):
    assert db.failure_of(server_error(state)) is Failure.STATEMENT
    assert not db.is_connection_error(server_error(state))


def test_every_other_known_sqlstate_is_the_statements_own_failure():
    known = set(psycopg.errors._sqlcodes)  # every SQLSTATE of PostgreSQL's errcodes.txt
    assert len(known) > 200
    for state in sorted(known - AWAY - CLASH):
        expected = Failure.AWAY if state.startswith(("08", "53")) else Failure.STATEMENT
        assert db.failure_of(server_error(state)) is expected, state


def test_libpqs_own_failures_and_a_closed_connection_are_away():
    assert db.failure_of(psycopg.OperationalError("connection failed: Connection refused")) is Failure.AWAY
    assert db.failure_of(psycopg.InterfaceError("the connection is closed")) is Failure.AWAY


def test_what_is_not_a_database_error_is_no_outage():
    assert db.failure_of(psycopg.DataError("no state")) is Failure.STATEMENT
    assert db.failure_of(ValueError("x")) is Failure.STATEMENT
