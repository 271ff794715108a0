"""Connections. A conninfo/URL from OUTBOX_DATABASE_URL, else libpq's PG*
variables (an empty conninfo lets libpq read them); no default credentials.

connect() (one-shot commands) and Pool (the workers, both sides) turn a failed
or lost connection into DatabaseUnavailable (one line: where, which setting,
libpq's reason; never the password), so every command and worker reports it
the same way and retries on that one type.

Failover: a conninfo may name several servers (`host=h1,h2 port=p1,p2
target_session_attrs=read-write`, or postgresql://h1:p1,h2:p2/db?...); libpq
then connects to whichever accepts writes, so after a standby's promotion every
new connection reaches the new primary. A session that finds itself on a
server that no longer accepts writes (25006 read_only_sql_transaction: a
standby, or a primary fenced with default_transaction_read_only) counts as a
lost connection: the call fails with DatabaseUnavailable, the caller retries,
and the pool closes that session rather than keep it (docs/failover.md)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Self

import psycopg
import psycopg.errors
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from pgoutbox import OLDEST_SCHEMA, SCHEMA_VERSION
from pgoutbox.core.errors import ConfigError, DatabaseUnavailable, PgOutboxError, SchemaMismatch, one_line
from pgoutbox.core.settings import redact

SETTING = "OUTBOX_DATABASE_URL or --database-url; the PG* variables when unset"

CONNECT_TIMEOUT = 5  # seconds: an unreachable host fails a connect, it does not hang it
POOL_TIMEOUT = 30.0  # seconds a call waits for a busy pool's connection before failing

# SQLSTATEs that mean PostgreSQL itself is away, not that a statement failed:
# connection exceptions (class 08), the server shutting down or not yet up
# (57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now), and
# insufficient resources (class 53: too many connections, out of memory, disk
# full). libpq's own connection failures carry no SQLSTATE at all.
AWAY_STATES = ("08", "57P01", "57P02", "57P03", "53")
# A statement refused because the server does not take writes (a standby, a
# fenced primary): the session is on the wrong server, which a new connection
# (target_session_attrs=read-write) repairs.
READ_ONLY = "25006"
# The transaction was rolled back for a clash with a concurrent one
# (serialization_failure, deadlock_detected): the same call may run again.
CLASH_STATES = frozenset({"40001", "40P01"})


class Failure(enum.Enum):
    """What a database error means to a worker (failure_of())."""

    AWAY = "away"  # PostgreSQL (or this session's server) is away: wait for it, call again
    CLASH = "clash"  # rolled back by a concurrent transaction: call again now
    STATEMENT = "statement"  # this statement's own failure (its values, its code, its time): not the server's


def failure_of(exc: BaseException) -> Failure:
    """The one classifier of database errors, for every worker: only an error
    that means PostgreSQL itself is away is AWAY (a worker then waits for the
    server; a relay or consumer closes its database gate). Everything else a
    statement raises, whatever its SQLSTATE (an ASSERT, a RAISE with any
    code, a statement_timeout or cancel (57014), a division by zero), is that
    statement's own failure, and so the failure of the message it was for."""
    if isinstance(exc, psycopg.InterfaceError):  # e.g. a call on a closed connection
        return Failure.AWAY
    if not isinstance(exc, psycopg.Error):
        return Failure.STATEMENT
    state = exc.sqlstate
    if state is None:  # libpq's own failure: no server answered
        return Failure.AWAY if isinstance(exc, psycopg.OperationalError) else Failure.STATEMENT
    if state == READ_ONLY or state.startswith(AWAY_STATES):
        return Failure.AWAY
    if state in CLASH_STATES:
        return Failure.CLASH
    return Failure.STATEMENT


def conninfo(database_url: str | None) -> str:
    return database_url or ""


def describe(database_url: str | None) -> str:
    """Where a conninfo points, for messages: every host:port, the database and
    target_session_attrs when given; never the password."""
    try:
        parts = psycopg.conninfo.conninfo_to_dict(conninfo(database_url))
    except psycopg.ProgrammingError:
        return "(unparsable OUTBOX_DATABASE_URL)"
    hosts = str(parts.get("host") or os.environ.get("PGHOST") or "(libpq default host)").split(",")
    ports = str(parts.get("port") or os.environ.get("PGPORT") or "5432").split(",")
    if len(ports) == 1:  # libpq: one port serves every host
        ports = ports * len(hosts)
    where = ",".join(f"{h or '(libpq default host)'}:{p or '5432'}" for h, p in zip(hosts, ports))
    dbname = parts.get("dbname") or os.environ.get("PGDATABASE") or "(default)"
    attrs = parts.get("target_session_attrs") or os.environ.get("PGTARGETSESSIONATTRS")
    return f"{where} database {dbname}" + (f" ({attrs})" if attrs and attrs != "any" else "")


def is_read_only(exc: BaseException) -> bool:
    """The server refused a write because it does not take writes (now)."""
    return isinstance(exc, psycopg.Error) and exc.sqlstate == READ_ONLY


def is_connection_error(exc: BaseException) -> bool:
    """A failure of the connection itself (unreachable, refused, dropped, the
    server out of resources, or on a server that does not take writes), not
    of a statement: failure_of(exc) is AWAY."""
    return failure_of(exc) is Failure.AWAY


def _reason(exc: BaseException, database_url: str | None) -> str:
    return redact(one_line(str(exc)).removeprefix("connection failed: "), conninfo(database_url))


def unavailable(exc: BaseException, database_url: str | None, *, lost: bool = False) -> DatabaseUnavailable:
    """One line for a connection that failed: where, which setting, and libpq's reason.

    libpq gives connection failures no SQLSTATE, so the reason is shown, never matched on."""
    what = "lost the connection to" if lost else "cannot connect to"
    if is_read_only(exc):
        what = "reached a server that does not accept writes (a standby, or a fenced primary) among"
    return DatabaseUnavailable(
        f"{what} PostgreSQL at {describe(database_url)} ({SETTING}): {_reason(exc, database_url)}"
    )


def refused(exc: psycopg.Error, database_url: str | None) -> DatabaseUnavailable:
    """One line for a statement the login role may not run (a missing grant, not a bug)."""
    return DatabaseUnavailable(
        f"PostgreSQL at {describe(database_url)} refused [{exc.sqlstate}]: {_reason(exc, database_url)}; "
        f"grant the role of {SETTING} the pgoutbox role this command needs (docs/reference.md: Roles)"
    )


def _bad_conninfo(exc: psycopg.ProgrammingError, database_url: str | None) -> ConfigError:
    return ConfigError(
        f"OUTBOX_DATABASE_URL (flag --database-url) is not a PostgreSQL URL or conninfo: {_reason(exc, database_url)}"
    )


def connect(
    database_url: str | None, *, autocommit: bool = True, check_schema: bool = False, **kwargs: Any
) -> psycopg.Connection[Any]:
    """A connection; with check_schema, only to a schema this code was built for."""
    try:
        conn = psycopg.connect(conninfo(database_url), autocommit=autocommit, **kwargs)
    except psycopg.OperationalError as exc:
        raise unavailable(exc, database_url) from exc
    except psycopg.ProgrammingError as exc:  # an option libpq does not know
        raise _bad_conninfo(exc, database_url) from exc
    if check_schema:
        try:
            found = applied_version(conn)
            check_schema_version(found, serves_from(conn) if found > SCHEMA_VERSION else None)
        except BaseException:
            conn.close()
            raise
    return conn


def applied_version(conn: psycopg.Connection) -> int:
    """The schema version of the database (0: pgoutbox was never migrated there)."""
    exists = conn.execute("SELECT to_regclass('outbox.schema_migrations') IS NOT NULL").fetchone()
    if not (exists and exists[0]):
        return 0
    version = conn.execute("SELECT outbox.schema_version()").fetchone()
    return int(version[0]) if version else 0


def serves_from(conn: psycopg.Connection) -> int | None:
    """What a schema newer than this code says about older workers (None: it
    predates outbox.serves_workers_from(), so it serves no other build)."""
    exists = conn.execute("SELECT to_regprocedure('outbox.serves_workers_from()') IS NOT NULL").fetchone()
    if not (exists and exists[0]):
        return None
    row = conn.execute("SELECT outbox.serves_workers_from()").fetchone()
    return int(row[0]) if row else None


def supported_schemas() -> str:
    return f"{OLDEST_SCHEMA} to {SCHEMA_VERSION}, and newer schemas that still serve {SCHEMA_VERSION}"


def check_schema_version(found: int, serves_workers_from: int | None = None) -> None:
    """Refuse to run against a schema this code does not understand: one older
    than OLDEST_SCHEMA, or a newer one that no longer serves this build
    (serves_workers_from: what the newer schema says, None if it says nothing)."""
    if OLDEST_SCHEMA <= found <= SCHEMA_VERSION:
        return
    if found > SCHEMA_VERSION and serves_workers_from is not None and serves_workers_from <= SCHEMA_VERSION:
        return
    raise SchemaMismatch(
        f"database schema is at version {found}, this pgoutbox runs on {supported_schemas()}: "
        + ("run `pgoutbox migrate`" if found < OLDEST_SCHEMA else "upgrade pgoutbox")
    )


# The pool's own log lines repeat, per attempt, what our workers already report
# once per outage (rate-limited, with the setting to check).
logging.getLogger("psycopg.pool").setLevel(logging.ERROR)

Configure = Callable[[psycopg.AsyncConnection], Awaitable[None]]
Refusal = Callable[[psycopg.Error], PgOutboxError | None]


class Pool:
    """The workers' connections (relay and consumer alike): a
    psycopg_pool.AsyncConnectionPool of `size` long-lived autocommit sessions,
    each set up on connect (`options`: session settings; `configure`: e.g.
    loaders) and checked against the schema version this code expects.

    A connect that fails (unreachable, login refused, schema unknown) fails the
    calls waiting for it at once, as DatabaseUnavailable (SchemaMismatch and
    the like as they are), instead of letting them wait out the pool's
    timeout; the pool then gives the connection up, and the next call tries
    again, so the callers' own retry loops set the pace, as with a plain
    connection. A call on a connection that breaks raises DatabaseUnavailable
    and the pool replaces the connection."""

    def __init__(
        self,
        database_url: str | None,
        *,
        name: str,
        size: int = 1,
        options: dict[str, str] | None = None,
        configure: Configure | None = None,
        refused: Refusal | None = None,
        timeout: float = POOL_TIMEOUT,
    ):
        self.database_url = database_url
        self.name = name
        self._configure_more = configure
        self._refused = refused
        self._error: BaseException | None = None
        self._failed = asyncio.Event()
        kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": CONNECT_TIMEOUT}
        if options:
            kwargs["options"] = " ".join(f"-c {k}={v}" for k, v in options.items())
        self._pool = AsyncConnectionPool(
            conninfo(database_url),
            connection_class=_recording(self),
            kwargs=kwargs,
            min_size=size,
            max_size=size,
            open=False,
            configure=self._configure,
            name=name,
            timeout=timeout,
            # Give a failed connect up after one retry: the next call asks
            # again (no hidden schedule doubling its pause for minutes).
            reconnect_timeout=0,
            num_workers=1,
        )
        self._opened = False
        self.schema_found: int | None = None  # the schema version the last new connection saw

    def _fail(self, error: BaseException) -> None:
        """A connect failed: every call waiting for a connection gets `error`."""
        self._error = error
        self._failed.set()
        self._failed = asyncio.Event()

    async def _configure(self, conn: psycopg.AsyncConnection) -> None:
        """The pool's configure hook: the schema check, then the side's own set-up."""
        try:
            try:
                cur = conn.cursor(row_factory=tuple_row)
                await cur.execute(
                    "SELECT outbox.schema_version(), to_regprocedure('outbox.serves_workers_from()') IS NOT NULL"
                )
                found, says = await cur.fetchone() or (0, False)
                serves = None
                if found > SCHEMA_VERSION and says:
                    await cur.execute("SELECT outbox.serves_workers_from()")
                    serves = (await cur.fetchone() or (None,))[0]
                check_schema_version(found, serves)
                self.schema_found = found
            except psycopg.Error as exc:
                refusal = self._refused(exc) if self._refused else None
                if refusal is None:
                    raise
                raise refusal from None
            if self._configure_more is not None:
                await self._configure_more(conn)
        except BaseException as exc:
            await conn.close()
            self._fail(unavailable(exc, self.database_url) if is_connection_error(exc) else exc)
            raise

    async def getconn(self) -> psycopg.AsyncConnection:
        """A connection to keep (the relay holds one per stage, so that its
        prepared statements live as long as the session); give it back with
        putconn()."""
        if not self._opened:
            await self._pool.open(wait=False)
            self._opened = True
        if self._pool.get_stats().get("pool_available"):
            return await self._pool.getconn()
        failed = asyncio.ensure_future(self._failed.wait())
        got = asyncio.ensure_future(self._pool.getconn())
        try:
            await asyncio.wait({failed, got}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await self._abandon(got)
            raise
        finally:
            failed.cancel()
        if not got.done():
            await self._abandon(got)
            assert self._error is not None
            raise self._error
        try:
            return got.result()
        except PoolTimeout as exc:
            raise DatabaseUnavailable(
                f"no PostgreSQL connection of pool {self.name} free within {self._pool.timeout:g}s "
                f"(at {describe(self.database_url)})"
            ) from exc

    async def _abandon(self, got: asyncio.Future[Any]) -> None:
        got.cancel()
        try:
            conn = await got
        except BaseException:
            return
        await self._pool.putconn(conn)  # it arrived while we gave up on it

    async def putconn(self, conn: psycopg.AsyncConnection) -> None:
        """Back to the pool; a broken connection, or one on a server that no
        longer accepts writes, is replaced."""
        if not conn.closed and on_read_only_server(conn):
            await conn.close()
        await self._pool.putconn(conn)

    def lost(self, exc: BaseException) -> DatabaseUnavailable:
        return unavailable(exc, self.database_url, lost=True)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection]:
        """A connection for one call (or one transaction)."""
        conn = await self.getconn()
        try:
            yield conn
        except psycopg.Error as exc:
            if conn.broken or conn.closed or is_connection_error(exc):
                if not conn.closed:
                    await conn.close()  # e.g. on a standby: the pool connects anew
                raise self.lost(exc) from exc
            raise
        finally:
            await self.putconn(conn)

    async def close(self) -> None:
        if self._opened:
            await self._pool.close(timeout=1.0)  # a stop must not wait on a connect in progress


def on_read_only_server(conn: psycopg.AsyncConnection) -> bool:
    """What the server last reported (PostgreSQL 14+ reports both at once when
    they change): a hot standby, or writes refused by default."""
    status = conn.info.parameter_status
    return status("in_hot_standby") == "on" or status("default_transaction_read_only") == "on"


def _recording(pool: Pool) -> type[psycopg.AsyncConnection]:
    """The pool's connection class: records why a connect failed (libpq's reason
    for the one line), since the pool connects in a worker of its own."""

    class Connection(psycopg.AsyncConnection):
        @classmethod
        async def connect(cls, conninfo: str = "", **kwargs: Any) -> Self:
            try:
                return await super().connect(conninfo, **kwargs)
            except psycopg.OperationalError as exc:
                pool._fail(unavailable(exc, pool.database_url))
                raise
            except psycopg.ProgrammingError as exc:  # an option libpq does not know
                pool._fail(_bad_conninfo(exc, pool.database_url))
                raise

    return Connection
