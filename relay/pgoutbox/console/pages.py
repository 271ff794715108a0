"""The dead-letter pages (groups, a group's messages, one dead letter) and the
actions (replay, discard, restore a selection, a group or a filter; pause and
resume a handler's automated replay), each confirmed with its exact count and
a reason, then run in throttled batches (console.actions).

A filter travels as query parameters on the pages and as hidden fields in the
action forms, and reaches SQL as the one jsonb filter every dead-letter
function takes (outbox.dlq_*): the console builds it, PostgreSQL checks it."""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import psycopg
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from pgoutbox.console import actions, calls, inputs
from pgoutbox.console.actions import Action
from pgoutbox.core.errors import SqlState, one_line

if TYPE_CHECKING:
    from pgoutbox.console.web import Console

# The filter's text fields, as the pages name them (form field = filter key).
TEXT_KEYS = ("side", "owner", "subject", "error", "tenant", "since", "until")
SHOWN = ("live", "discarded", "all")  # the `discarded` key: false, true, null
PAGE_ROWS = 50
_LOCAL_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d(:\d\d(\.\d+)?)?$")
GROUP_ROWS = 200
FLOW_EVENTS = 1000  # a flow's first events on its page (outbox.flow's max_rows)

VERBS = {
    "replay": ("Replay", "re-published to their handler (inbox) or requeued for the relay (outbox)"),
    "discard": ("Discard", "parked for good, kept, and reversible with Restore"),
    "restore": ("Restore", "dead letters again (parked: replayed only when asked)"),
    "pause": ("Pause", "automated replay stops for this handler (operator replays still run)"),
    "resume": ("Resume", "automated replay starts again for this handler"),
}


def filter_of(values: Mapping[str, Any]) -> dict[str, Any]:
    """The SQL filter from query parameters or form fields (empty fields left out)."""
    flt: dict[str, Any] = {}
    for key in TEXT_KEYS:
        value = str(values.get(key) or "").strip()
        if value and key in ("since", "until") and _LOCAL_TIME.match(value):
            value += "Z"  # the form's date-time field has no zone: the pages say UTC
        if value:
            flt[key] = value
    shown = str(values.get("shown") or "live")
    if shown == "discarded":
        flt["discarded"] = True
    elif shown == "all":
        flt["discarded"] = None
    group = str(values.get("group") or "").strip()
    if group:
        flt["group"] = group
    return flt


def query_of(flt: Mapping[str, Any]) -> dict[str, str]:
    """The page parameters that give this filter back."""
    q = {k: str(flt[k]) for k in TEXT_KEYS if flt.get(k)}
    if "discarded" in flt:
        q["shown"] = "all" if flt["discarded"] is None else ("discarded" if flt["discarded"] else "live")
    if flt.get("group"):
        q["group"] = str(flt["group"])
    return q


_HERE = re.compile(r"^/(?![/\\])[^\\\s]*$")
_GROUP = re.compile(r"^[0-9a-f]{32}$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")  # a handler or context, as the SQL checks it


def _back(value: object, default: str = "/dead-letters") -> str:
    """A page of this console to return to (never another site: browsers read
    `/\\host` and `//host` alike as another host, so neither is taken)."""
    text = str(value or "")
    return text if _HERE.match(text) else default


def _ids(form: FormData) -> list[str]:
    """The selected ids, each checked as a uuid here so a bad one is a 400, not a SQL error."""
    ids = []
    for value in form.getlist("ids"):
        try:
            ids.append(str(uuid.UUID(str(value))))
        except ValueError:
            raise BadRequest(f"not a message id: {str(value)[:60]!r}") from None
    return ids


def _line(exc: psycopg.Error) -> str:
    return f"{one_line(exc.diag.message_primary or str(exc))} [{exc.sqlstate}]"


def _prepared(value: object) -> int | None:
    """The dialog's prepared action id (outbox.dlq_actions), checked here: a bad one is a 400."""
    if value is None or value == "":
        return None
    text = str(value)
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise BadRequest("not an action id")
    return int(text)


class BadRequest(inputs.BadInput):
    """A form the console cannot make sense of (400)."""


class Pages:
    def __init__(self, console: Console) -> None:
        self.c = console

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/dead-letters", self.groups, methods=["GET"]),
            Route("/dead-letters/groups/{group_id}", self.group, methods=["GET"]),
            Route("/dead-letters/{side}/{id}", self.detail, methods=["GET"]),
            Route("/flows", self.flows, methods=["GET"]),
            Route("/actions/prepare", self.prepare, methods=["POST"]),
            Route("/actions/run", self.run, methods=["POST"]),
            Route("/actions/{action_id}", self.progress, methods=["GET"]),
            Route("/actions/{action_id}/stop", self.stop, methods=["POST"]),
        ]

    # -- pages ------------------------------------------------------------------

    async def groups(self, request: Request) -> Response:
        flt = filter_of(request.query_params)
        flt.pop("group", None)

        async def build(conn: calls.Conn, me: calls.Row) -> dict[str, Any]:
            try:
                found = await calls.groups(conn, flt, GROUP_ROWS)
            except psycopg.Error as exc:
                # A mistyped filter: the page again, with its form as typed and the one line.
                if exc.sqlstate != SqlState.INVALID_FILTER:
                    raise
                return {"groups": [], "problem": _line(exc), "status": 400, **_filtered(request, flt)}
            return {
                "groups": found,
                **_filtered(request, flt),
            }

        return await self.c.page(request, "groups.html", build)

    async def group(self, request: Request) -> Response:
        group_id = request.path_params["group_id"]
        if not _GROUP.match(group_id):
            return self.c.error(request, 404, "Not found", "not a group id (32 hex digits)")
        flt = filter_of(request.query_params)
        flt["group"] = group_id
        after = request.query_params.get("after") or None

        async def build(conn: calls.Conn, me: calls.Row) -> dict[str, Any]:
            try:
                summary = await calls.groups(conn, flt, 1)
                found = await calls.dead_letters(conn, flt, PAGE_ROWS + 1, after)
            except psycopg.Error as exc:
                if exc.sqlstate not in (SqlState.INVALID_FILTER, SqlState.INVALID_CURSOR):
                    raise
                context = {"group": None, "group_id": group_id, "rows": [], "next": None}
                return {**context, "problem": _line(exc), "status": 400, **_filtered(request, flt)}
            more = len(found) > PAGE_ROWS
            found = found[:PAGE_ROWS]
            return {
                "group": summary[0] if summary else None,
                "group_id": group_id,
                "rows": found,
                "next": found[-1]["cursor"] if more and found else None,
                "after": after,
                **_filtered(request, flt),
            }

        return await self.c.page(request, "group.html", build)

    async def detail(self, request: Request) -> Response:
        side, id = request.path_params["side"], request.path_params["id"]
        handler = request.query_params.get("handler") or None
        if side not in ("outbox", "inbox"):
            return self.c.error(request, 404, "Not found", "a dead letter is under /dead-letters/outbox or /inbox")
        if handler is not None and not _NAME.match(handler):
            return self.c.error(request, 400, "Cannot do that", "handler is not a handler name ([A-Za-z0-9_.-])")
        try:
            uuid.UUID(id)
        except ValueError:
            return self.c.error(request, 404, "Not found", f"not a message id: {id[:60]!r}")

        async def build(conn: calls.Conn, me: calls.Row) -> dict[str, Any]:
            detail = await calls.show(conn, side, id, handler)
            envelope = detail.get("envelope") or {}
            if not detail.get("headers") and isinstance(envelope, dict) and envelope.get("trace"):
                # An inbox message keeps the headers it was received with (the
                # trace context) under envelope.trace.
                detail["headers"] = envelope["trace"]
            if self.c.cfg.payloads == "never":
                detail["payload"] = None
                detail["payload_visible"] = False
            return {"d": detail, "here": str(request.url.path) + "?" + request.url.query}

        return await self.c.page(request, "detail.html", build)

    async def flows(self, request: Request) -> Response:
        """The search by correlation id: a business flow's events in emit order,
        their publish state and each handler's inbox outcome (outbox.flow, which
        shows no payload: pgoutbox_viewer may run it)."""
        text = (request.query_params.get("correlation_id") or "").strip()

        async def build(conn: calls.Conn, me: calls.Row) -> dict[str, Any]:
            if not text:
                return {"correlation_id": "", "events": None}
            try:
                correlation_id = str(uuid.UUID(text))
            except ValueError:
                return {
                    "correlation_id": text,
                    "events": None,
                    "problem": "not a correlation id (a UUID)",
                    "status": 400,
                }
            events: list[dict[str, Any]] = []
            for row in await calls.flow(conn, correlation_id, FLOW_EVENTS):
                if not events or events[-1]["event_id"] != row["event_id"]:
                    events.append({**row, "handlers": []})
                if row["handler"] is not None:
                    events[-1]["handlers"].append(row)
            return {"correlation_id": correlation_id, "events": events, "limit": FLOW_EVENTS}

        return await self.c.page(request, "flow.html", build)

    # -- actions ------------------------------------------------------------------

    def _scope(self, form: FormData) -> tuple[str, dict[str, Any], str]:
        """(action, SQL filter, what the scope is, in words) from an action form."""
        action = str(form.get("action") or "")
        if action not in VERBS:
            raise BadRequest(f"unknown action {action[:30]!r}")
        if action in ("pause", "resume"):
            handler = str(form.get("handler") or "")
            if not _NAME.match(handler):
                raise BadRequest("a handler name is required ([A-Za-z0-9_.-], 1-128 characters)")
            return action, {}, f"handler {handler}"
        flt = filter_of(form)
        ids = _ids(form)
        scope = str(form.get("scope") or "filter")
        if scope not in ("selection", "group", "filter"):
            raise BadRequest("scope must be selection, group or filter")
        if scope == "selection" and form.get("all_matching") == "1" and flt.get("group"):
            scope = "group"  # "select all N matching": every row of the group, not this page's
        if scope == "selection":
            if not ids:
                raise BadRequest("select at least one dead letter first")
            flt["ids"] = ids
            words = f"the {len(ids)} selected"
        elif scope == "group":
            if not flt.get("group"):
                raise BadRequest("a group is required")
            words = f"group {flt['group']}"
        else:
            words = "every dead letter matching " + (
                ", ".join(f"{k}={v}" for k, v in query_of(flt).items()) or "no filter (all)"
            )
        return action, flt, words

    async def _group_words(self, conn: calls.Conn, group_id: str) -> str | None:
        """A group in words: side, owner, subject and cause."""
        found = await calls.groups(conn, {"group": group_id, "discarded": None}, 1)
        if not found:
            return None
        g = found[0]
        return f"the group {g['side']} · {g['owner']} · {g['subject']} · {g['error_class']} {g['error_pattern']}"

    async def prepare(self, request: Request) -> Response:
        """The confirmation dialog: the exact count the action will touch, and a Reason."""
        session = self.c.session_of(request)
        form = await self.c.form(request, session)
        try:
            action, flt, words = self._scope(form)
        except BadRequest as exc:
            return self.c.error(request, 400, "Cannot do that", str(exc))
        prepared = None
        async with self.c.db(session) as conn:
            me = await calls.who(conn)
            if action in ("pause", "resume"):
                total = 1
                known = {row["handler"] for row in await calls.inbox_backlog(conn)}
                if str(form.get("handler")) not in known:
                    return self.c.error(
                        request, 404, "Not found", f"no handler named {str(form.get('handler'))!r} has inbox messages"
                    )
            else:
                # The set is fixed now, and counted: Confirm acts on these rows and no others.
                prepared, total = await calls.prepare(conn, flt, action)
            if flt.get("group") and "ids" not in flt:
                words = await self._group_words(conn, str(flt["group"])) or words
        fields = [(k, v) for k, v in form.multi_items() if k not in ("csrf", "back", "prepared") and isinstance(v, str)]
        return self.c.render(
            "confirm.html",
            me=me,
            csrf=session.csrf,
            verb=VERBS[action][0],
            effect=VERBS[action][1],
            action=action,
            total=total,
            words=words,
            fields=fields,
            prepared=prepared,
            back=_back(form.get("back")),
        )

    async def run(self, request: Request) -> Response:
        session = self.c.session_of(request)
        form = await self.c.form(request, session)
        try:
            action, flt, words = self._scope(form)
        except BadRequest as exc:
            return self.c.error(request, 400, "Cannot do that", str(exc))
        reason = str(form.get("reason") or "").strip()
        back = _back(form.get("back"))
        try:
            total = int(str(form.get("total") or "0"))
        except ValueError:
            total = 0
        verb = VERBS[action][0]
        if action in ("pause", "resume"):
            handler = str(form.get("handler"))
            enabled = action == "resume"
            switched = False

            async def batch(conn: Any, max_rows: int) -> int:
                nonlocal switched
                if switched:
                    return 0
                await calls.set_replay(conn, handler, enabled, reason)
                switched = True
                return 1

            title = f"{verb} automated replay of {handler}"
        else:
            prepared = _prepared(form.get("prepared"))
            if prepared is not None:
                running = self.c.actions.of_prepared(prepared, session.user)
                if running is not None:  # Confirm sent twice: the one action it started
                    return RedirectResponse(f"/actions/{running.id}", status_code=303)
                async with self.c.db(session) as conn:
                    counts = await calls.progress(conn, prepared)  # OB110: not this role's
                total = int(counts["total"]) if counts else 0
            else:
                # A form without a dialog's set (posted directly): the set is fixed now.
                async with self.c.db(session) as conn:
                    prepared, total = await calls.prepare(conn, flt, action)
            fixed = prepared

            async def batch(conn: Any, max_rows: int) -> int:
                return await calls.act_prepared(conn, fixed, reason, max_rows)

            # The scope as the dialog said it (the group in words), for the progress page only.
            shown = str(form.get("words") or words)[:300]
            title = f"{verb} {total} dead letter(s): {shown}"

        @contextlib.asynccontextmanager
        async def opener() -> AsyncIterator[calls.Conn]:
            async with self.c.db(session) as conn:
                yield conn

        started = await self.c.actions.start(
            Action(
                id=actions.new_id(),
                title=title,
                user=session.user,
                reason=reason,
                total=total,
                back=back,
                prepared=None if action in ("pause", "resume") else fixed,
            ),
            opener,
            batch,
        )
        return RedirectResponse(f"/actions/{started.id}", status_code=303)

    async def progress(self, request: Request) -> Response:
        session = self.c.session_of(request)
        action = self.c.actions.get(request.path_params["action_id"])
        if action is None or action.user != session.user:
            return self.c.error(request, 404, "Not found", "no such action (the console keeps them until it restarts)")
        counts = None
        if action.prepared is not None:
            async with self.c.db(session) as conn:
                counts = await calls.progress(conn, action.prepared)
        return self.c.render("action.html", me={"name": session.user}, csrf=session.csrf, a=action, counts=counts)

    async def stop(self, request: Request) -> Response:
        """Stop: no batch takes anything after the one under way (outbox.dlq_stop)."""
        session = self.c.session_of(request)
        await self.c.form(request, session)
        action = self.c.actions.get(request.path_params["action_id"])
        if action is None or action.user != session.user:
            return self.c.error(request, 404, "Not found", "no such action (the console keeps them until it restarts)")
        action.stopping = True
        if action.prepared is not None:
            async with self.c.db(session) as conn:
                await calls.stop(conn, action.prepared)
        return RedirectResponse(f"/actions/{action.id}", status_code=303)


def _filtered(request: Request, flt: dict[str, Any]) -> dict[str, Any]:
    """What a page listing dead letters by a filter shows of it, and where it is (to come back to)."""
    query = query_of(flt)
    return {
        "flt": flt,
        "query": query,
        "shown": query.get("shown", "live"),
        "here": str(request.url.path) + ("?" + request.url.query if request.url.query else ""),
    }
