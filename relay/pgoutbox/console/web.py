"""The console's plumbing and its first pages (login, logout, overview):
sessions, CSRF, errors, the database session per request, the sampler.

Every page and action opens a database session as the person logged in
(calls.session) and calls SQL functions only; what the role may not do,
PostgreSQL refuses (42501), and the page answers 403 with that one line.
Action controls are shown only where PostgreSQL says the role may run the
function behind them (has_function_privilege), but the grant is what decides:
a forged POST from a read-only role fails in PostgreSQL all the same."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import jinja2
import psycopg
import psycopg.errors
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pgoutbox import __version__
from pgoutbox.console import actions, calls, charts, inputs
from pgoutbox.console.sessions import LoginLimiter, Session, Sessions
from pgoutbox.console.settings import ConsoleConfig
from pgoutbox.core.errors import SqlState, from_database, one_line

log = logging.getLogger(__name__)

COOKIE = "pgoutbox_session"
LOGIN_COOKIE = "pgoutbox_login"  # the login form's CSRF token (before a session exists)

# What every answer carries: no framing, no sniffing, scripts and styles from the console only.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


class Forbidden(Exception):
    """A request the console refuses before asking PostgreSQL (a missing or wrong CSRF token)."""


class NotLoggedIn(Exception):
    """No live session: the login page."""


# SQLSTATEs that say the request was wrong (a field PostgreSQL refused), not the
# role nor the server: 400 with PostgreSQL's line. Class 22 is data exceptions
# (a time out of range, a bad uuid or number); the OB codes are pgoutbox's
# argument checks (docs/reference.md, error codes).
_BAD_REQUEST = (
    SqlState.INVALID_FILTER,
    SqlState.INVALID_ACTION,
    SqlState.INVALID_CURSOR,
    "OB006",  # INVALID_ARGUMENT
    "OB009",  # too long
    "OB014",  # REASON_REQUIRED
    "OB020",  # INVALID_MESSAGE (a handler name)
)


def _age(value: Any) -> str:
    """An interval (timedelta) as a short age: 3d 4h, 5m 2s, 800ms."""
    if value is None:
        return "–"
    seconds = value.total_seconds() if hasattr(value, "total_seconds") else float(value)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size or (unit == "s" and not parts):
            parts.append(f"{int(seconds // size)}{unit}")
            seconds %= size
        if len(parts) == 2:
            break
    return " ".join(parts)


def _when(value: Any) -> str:
    """A time as every page shows it: UTC, to the second (a datetime, or ISO text from a JSON document)."""
    if value is None or value == "":
        return "–"
    moment: datetime
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            return value
    elif isinstance(value, datetime):
        moment = value
    else:
        return str(value)
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _json(value: Any) -> str:
    """JSON as written, for a <pre>: indented, characters as they are (the template escapes them)."""
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def _pairs(value: Any) -> str:
    """A small JSON object on one line: `key: value; ...` (a history entry's detail)."""
    if not isinstance(value, dict):
        return "" if value is None else str(value)
    return "; ".join(f"{k}: {v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}" for k, v in value.items())


class Guard:
    """Checks every request's path and query string before routing (inputs):
    a control character or an oversized value is a 400 with one line."""

    def __init__(self, app: ASGIApp, console: Console) -> None:
        self.app = app
        self.console = console

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:
                inputs.text("the path", str(scope.get("path", "")), max_chars=inputs.FIELD_CHARS)
                raw = bytes(scope.get("query_string") or b"")
                if len(raw) > inputs.QUERY_CHARS:
                    raise inputs.BadInput(f"the query string is longer than {inputs.QUERY_CHARS} bytes: refused")
                inputs.fields(urllib.parse.parse_qsl(raw.decode("latin-1"), keep_blank_values=True))
            except inputs.BadInput as exc:
                response = self.console.error(Request(scope), 400, "Cannot do that", one_line(exc))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Console:
    def __init__(self, cfg: ConsoleConfig) -> None:
        self.cfg = cfg
        self.sessions = Sessions(cfg.session_lifetime)
        self.limiter = LoginLimiter(cfg.login_attempts, cfg.login_window)
        self.samples = charts.Samples()
        self.actions = actions.Actions(cfg.action_batch, cfg.action_pause)
        self.env = jinja2.Environment(
            loader=jinja2.PackageLoader("pgoutbox.console", "templates"),
            autoescape=jinja2.select_autoescape(default=True),
        )
        self.env.filters["age"] = _age
        self.env.filters["when"] = _when
        self.env.filters["json"] = _json
        self.env.filters["pairs"] = _pairs
        self.env.globals["sample_interval"] = _age(cfg.sample_interval)
        self._sampler: asyncio.Task[None] | None = None

    # -- plumbing ---------------------------------------------------------

    def client(self, request: Request) -> str:
        """The client's address: X-Forwarded-For's first entry when a trusted proxy sent it."""
        peer = request.client.host if request.client else "unknown"
        forwarded = request.headers.get("x-forwarded-for")
        if forwarded and peer in self.cfg.trusted_proxies:
            return forwarded.split(",")[0].strip()
        return peer

    def over_tls(self, request: Request) -> bool:
        if request.url.scheme == "https":
            return True
        peer = request.client.host if request.client else ""
        return peer in self.cfg.trusted_proxies and request.headers.get("x-forwarded-proto", "").lower() == "https"

    def secure(self, request: Request) -> bool:
        mode = self.cfg.secure_cookie
        return mode == "always" or (mode == "auto" and self.over_tls(request))

    def render(self, name: str, status: int = 200, **context: Any) -> HTMLResponse:
        text = self.env.get_template(name).render(version=__version__, **context)
        return HTMLResponse(text, status_code=status, headers=_HEADERS)

    def session_of(self, request: Request) -> Session:
        session = self.sessions.get(request.cookies.get(COOKIE))
        if session is None:
            raise NotLoggedIn()
        return session

    async def form(self, request: Request, session: Session) -> FormData:
        """The posted form, once its CSRF token matches the session's."""
        form = await request.form()
        token = form.get("csrf")
        if not session.csrf_ok(token if isinstance(token, str) else None):
            raise Forbidden("the form's CSRF token does not match this session (reload the page)")
        inputs.fields(form.multi_items(), multiline=("reason",))
        return form

    @contextlib.asynccontextmanager
    async def db(self, session: Session) -> AsyncIterator[calls.Conn]:
        try:
            async with calls.session(self.cfg.database_url, session.user, session.password) as conn:
                yield conn
        except calls.LoginRefused:
            # The password changed or the role was dropped since the login.
            self.sessions.close(session.id)
            raise NotLoggedIn() from None

    async def page(
        self,
        request: Request,
        template: str,
        build: Callable[[calls.Conn, calls.Row], Awaitable[dict[str, Any]]],
    ) -> Response:
        session = self.session_of(request)
        async with self.db(session) as conn:
            me = await calls.who(conn)
            context = await build(conn, me)
        status = int(context.pop("status", 200))
        return self.render(template, status=status, me=me, csrf=session.csrf, **context)

    # -- errors -------------------------------------------------------------

    def error(self, request: Request, status: int, title: str, message: str) -> Response:
        session = self.sessions.get(request.cookies.get(COOKIE))
        me = {"name": session.user} if session else None
        return self.render(
            "error.html", status=status, title=title, message=message, me=me, csrf=session.csrf if session else ""
        )

    async def on_sql_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, psycopg.Error)
        code = exc.sqlstate or ""
        message = one_line(exc.diag.message_primary or str(exc))
        if isinstance(exc, psycopg.errors.InsufficientPrivilege):
            return self.error(request, 403, "Not permitted", f"PostgreSQL refused your role: {message} [{code}]")
        if code in (SqlState.DEAD_LETTER_NOT_FOUND, SqlState.ACTION_NOT_FOUND):
            return self.error(request, 404, "Not found", f"{message} [{code}]")
        if code in _BAD_REQUEST or code.startswith("22"):
            return self.error(request, 400, "Cannot do that", f"{message} [{code}]")
        if not code and isinstance(exc, psycopg.DataError | psycopg.ProgrammingError):
            # psycopg refused a value before sending it (e.g. a NUL in a text).
            return self.error(request, 400, "Cannot do that", one_line(exc))
        # A rule of pgoutbox's refused it (its SQLSTATE is ours: OBnnn), also one
        # this build does not know yet (a newer schema): 403 with the rule's line.
        domain = from_database(exc)
        if domain is not None:
            return self.error(request, 403, "Refused", f"{type(domain).__name__} [{code}]: {message}")
        if code.startswith("OB"):
            return self.error(request, 403, "Refused", f"[{code}]: {message}")
        if calls.is_connection_error(exc):
            return self.error(request, 503, "Database unavailable", message)
        log.warning("SQL error on %s: [%s] %s", request.url.path, code, message)
        return self.error(request, 500, "Database error", f"[{code}] {message}")

    async def on_unavailable(self, request: Request, exc: Exception) -> Response:
        # Where the database is, only to someone logged in.
        if self.sessions.get(request.cookies.get(COOKIE)) is None:
            return self.error(request, 503, "Database unavailable", calls.UNAVAILABLE)
        return self.error(request, 503, "Database unavailable", one_line(exc))

    async def on_bad_input(self, request: Request, exc: Exception) -> Response:
        return self.error(request, 400, "Cannot do that", one_line(exc))

    async def on_forbidden(self, request: Request, exc: Exception) -> Response:
        return self.error(request, 403, "Not permitted", one_line(exc))

    async def on_not_logged_in(self, request: Request, exc: Exception) -> Response:
        if request.method == "POST":
            return self.error(request, 403, "Not logged in", "your session ended: log in again")
        return RedirectResponse("/login", status_code=303)

    # -- login ----------------------------------------------------------------

    async def login_page(self, request: Request, *, message: str = "", status: int = 200, user: str = "") -> Response:
        token = secrets.token_urlsafe(32)
        response = self.render(
            "login.html", status=status, login_csrf=token, message=message, me=None, csrf="", user=user
        )
        response.set_cookie(
            LOGIN_COOKIE, token, path="/login", httponly=True, samesite="strict", secure=self.secure(request)
        )
        return response

    async def login_form(self, request: Request) -> Response:
        return await self.login_page(request)

    async def login(self, request: Request) -> Response:
        form = await request.form()
        user, password, token = (str(form.get(k) or "") for k in ("user", "password", "csrf"))
        expected = request.cookies.get(LOGIN_COOKIE) or ""
        if not token or not secrets.compare_digest(token.encode(), expected.encode()):
            return await self.login_page(request, message="The form expired: try again.", status=403)
        # Before anything connects: a NUL would cut libpq's conninfo short (inputs).
        try:
            inputs.fields(form.multi_items())
        except inputs.BadInput as exc:
            return await self.login_page(request, message=f"{one_line(exc)}.", status=400)
        address = self.client(request)
        wait = self.limiter.retry_after(user, address)
        if wait > 0:
            log.warning("login refused: too many failures", extra={"user": user, "client": address})
            response = await self.login_page(
                request, message=f"Too many failed logins: try again in {int(wait) + 1} s.", status=429
            )
            response.headers["Retry-After"] = str(int(wait) + 1)
            return response
        if not user or not password:
            return await self.login_page(request, message="User and Password are both required.", status=400, user=user)
        try:
            # Connecting is the check: PostgreSQL took the password. What the
            # role may then see is for each page to ask.
            async with calls.session(self.cfg.database_url, user, password):
                pass
        except calls.LoginRefused:
            self.limiter.failed(user, address)
            log.info("login refused", extra={"user": user, "client": address})
            return await self.login_page(
                request, message="PostgreSQL refused this user or password.", status=401, user=user
            )
        except calls.Unavailable as exc:
            log.warning("login: %s", one_line(exc))
            return await self.login_page(request, message=calls.UNAVAILABLE, status=503, user=user)
        self.limiter.succeeded(user)
        session = self.sessions.open(user, password)
        log.info("login", extra={"user": user, "client": address})
        self.sample_soon()
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(
            COOKIE,
            session.id,
            max_age=int(self.cfg.session_lifetime),
            httponly=True,
            samesite="strict",
            secure=self.secure(request),
        )
        response.delete_cookie(LOGIN_COOKIE, path="/login")
        return response

    async def logout(self, request: Request) -> Response:
        session = self.session_of(request)
        await self.form(request, session)
        self.sessions.close(session.id)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE)
        return response

    # -- overview -------------------------------------------------------------

    def chart(self, series: str, label: str) -> Markup:
        points = self.samples.points(series)
        # At least ten samples' worth of time across, however recent the first one.
        return Markup(charts.sparkline(points, label=label, now=time.time(), min_span=10 * self.cfg.sample_interval))

    async def overview(self, request: Request) -> Response:
        async def build(conn: calls.Conn, me: calls.Row) -> dict[str, Any]:
            outbox = await calls.outbox_backlog(conn)
            inbox = await calls.inbox_backlog(conn)
            summary = await calls.dlq_summary(conn)
            self.record(outbox, inbox)
            now = datetime.now(UTC)
            for row in outbox:
                c = row["context"]
                row["discarded"] = summary.get(("outbox", c), {}).get("discarded", 0)
                row["due_chart"] = self.chart(f"outbox:{c}:due", f"Due events of {c}")
                row["dead_chart"] = self.chart(f"outbox:{c}:dead_letter", f"Dead letters of {c}")
            for row in inbox:
                h = row["handler"]
                dead = summary.get(("inbox", h), {})
                row["discarded"] = dead.get("discarded", 0)
                # Known where the handler has dead letters (what automated replay acts on).
                row["replay"] = dead.get("replay_enabled")
                oldest = row.get("oldest_unprocessed_at")
                row["oldest_age"] = now - oldest if oldest else None
                row["unprocessed_chart"] = self.chart(f"inbox:{h}:unprocessed", f"Unprocessed messages of {h}")
                row["dead_chart"] = self.chart(f"inbox:{h}:dead_letter", f"Dead letters of {h}")
            # Events waiting for their delivery time, apart from the backlog:
            # a year of reminders is not an outage.
            scheduled = await calls.outbox_scheduled(conn)
            return {"outbox": outbox, "inbox": inbox, "scheduled": scheduled}

        return await self.page(request, "overview.html", build)

    # -- sampling (the overview's charts) -----------------------------------

    def record(self, outbox: list[calls.Row], inbox: list[calls.Row]) -> None:
        values: dict[str, float] = {}
        for row in outbox:
            values[f"outbox:{row['context']}:due"] = row["due"]
            values[f"outbox:{row['context']}:dead_letter"] = row["dead_letter"]
        for row in inbox:
            values[f"inbox:{row['handler']}:unprocessed"] = row["unprocessed"]
            values[f"inbox:{row['handler']}:dead_letter"] = row["dead_letter"]
        self.samples.add(values)

    async def sample_once(self) -> None:
        """One sample of both backlogs, read as one of the people logged in
        (the console has no role of its own: with nobody logged in, the charts have a gap)."""
        session = self.sessions.any()
        if session is None:
            return
        try:
            async with calls.session(self.cfg.database_url, session.user, session.password) as conn:
                self.record(await calls.outbox_backlog(conn), await calls.inbox_backlog(conn))
        except (psycopg.Error, calls.LoginRefused, calls.Unavailable) as exc:
            log.info("backlog sample skipped: %s", one_line(exc))

    def sample_soon(self) -> None:
        task = asyncio.ensure_future(self.sample_once())
        self.actions.keep(task)

    async def sampler(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sample_interval)
            await self.sample_once()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._sampler = asyncio.ensure_future(self.sampler())
        try:
            yield
        finally:
            self._sampler.cancel()
            await self.actions.stop()
