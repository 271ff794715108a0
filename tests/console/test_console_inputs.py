"""What reaches libpq and SQL from a request: a NUL or any control character,
and anything longer than PostgreSQL takes, is refused with 400 and one line
before anything connects; no input gives a 5xx (a Hypothesis property throws
arbitrary text at every route and form, as a viewer and as an admin)."""

from __future__ import annotations

import asyncio
import collections
import re
import urllib.parse

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pgoutbox.dev.embedded import free_port
from support.console import person, seed_dead_letters, serving, worker_url

pytestmark = pytest.mark.slow


def _csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


async def _login(client: httpx.AsyncClient, user: str, password: str) -> httpx.Response:
    page = await client.get("/login")
    return await client.post("/login", data={"user": user, "password": password, "csrf": _csrf(page.text)})


async def _logged_in(client: httpx.AsyncClient) -> bool:
    return (await client.get("/")).status_code == 200


async def test_a_nul_in_the_user_is_refused_when_pgpassword_would_fill_in_the_password(console_db, monkeypatch):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    monkeypatch.setenv("PGPASSWORD", password)  # libpq would use it once the NUL cut the conninfo short
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        for user, typed in ((admin + "\0", "anything"), (admin + "\0'", "x"), (admin, "\0"), ("\0", "\0")):
            answer = await _login(client, user, typed)
            assert answer.status_code == 400 and "control character" in answer.text, (user, typed)
            assert not await _logged_in(client)


async def test_a_nul_password_is_refused_when_a_pgpass_file_holds_the_right_one(console_db, monkeypatch, tmp_path):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    parts = urllib.parse.urlsplit(url)
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"{parts.hostname}:{parts.port}:*:{admin}:{password}\n")
    pgpass.chmod(0o600)
    monkeypatch.setenv("PGPASSFILE", str(pgpass))
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        for typed in ("\0", "\0junk", password + "\0junk", "\x01", password + "\x7f"):
            answer = await _login(client, admin, typed)
            assert answer.status_code == 400 and "control character" in answer.text, typed
            assert not await _logged_in(client)
        # The right password still logs in (the check refuses only what libpq would cut).
        assert (await _login(client, admin, password)).status_code == 303
        assert await _logged_in(client)


async def test_oversized_logins_get_400_and_pages_before_login_do_not_say_where_the_database_is(console_db):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        answer = await _login(client, "u" * 10_000, password)
        assert answer.status_code == 400 and "63 bytes" in answer.text
        answer = await _login(client, admin, "p" * 1001)
        assert answer.status_code == 400 and "1000 bytes" in answer.text
        # The name the form keeps after a refusal: typed back into the field.
        answer = await _login(client, admin, "wrong")
        assert answer.status_code == 401 and f'value="{admin}"' in answer.text
    closed = f"postgresql://127.0.0.1:{free_port()}/nowhere"
    async with serving(closed) as (base, _), httpx.AsyncClient(base_url=base) as client:
        answer = await _login(client, admin, password)
        assert answer.status_code == 503 and "OUTBOX_CONSOLE_DATABASE_URL" in answer.text
        assert "127.0.0.1" not in answer.text and "nowhere" not in answer.text
        assert str(urllib.parse.urlsplit(closed).port) not in answer.text


async def test_a_nul_in_a_filter_a_path_or_an_action_form_is_a_400(console_db):
    su, url = console_db
    seed_dead_letters(worker_url(su, "pgoutbox_consumer"), "billing", "sea.event.order_paid.v1", 1, "HTTP 422: no")
    admin, password = person(su, "pgoutbox_admin")
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        await _login(client, admin, password)
        csrf = _csrf((await client.get("/")).text)
        for path in (
            "/dead-letters?owner=a%00b",
            "/dead-letters?error=%00",
            "/dead-letters/inbox/%00",
            "/dead-letters/groups/%00",
            "/dead-letters/inbox/00000000-0000-0000-0000-000000000000?handler=%00",
            "/dead-letters/groups/" + "0" * 32 + "?after=%00",
            "/actions/%00",
        ):
            answer = await client.get(path)
            assert answer.status_code == 400 and "control character" in answer.text, path
        for field in ("owner", "error", "reason", "handler", "ids", "back"):
            form = {"csrf": csrf, "action": "replay", "scope": "filter", "reason": "r", field: "x\0y"}
            answer = await client.post("/actions/prepare", data=form)
            assert answer.status_code == 400, (field, answer.text)
        # A Cancel link never leaves the console, however `back` is forged.
        form = {"csrf": csrf, "action": "replay", "scope": "filter", "back": "/\\evil.example/"}
        answer = await client.post("/actions/prepare", data=form)
        assert answer.status_code == 200 and "evil.example" not in answer.text
        assert '<a href="/dead-letters">Cancel</a>' in answer.text


# Every route and form, with the fields it reads.
_GETS = ("/", "/dead-letters", "/dead-letters/groups/{g}", "/dead-letters/{side}/{id}", "/actions/{id}", "/login")
_QUERY_KEYS = ("side", "owner", "subject", "error", "tenant", "since", "until", "shown", "group", "after", "handler")
_FORM_KEYS = (*_QUERY_KEYS, "action", "scope", "ids", "reason", "total", "words", "back", "action_id")
_POSTS = ("/actions/prepare", "/actions/run", "/actions/stop")

# Arbitrary text; values the console branches on; and text with a control
# character inside (what libpq and PostgreSQL's JSON refuse), each a third.
controlled = st.builds(
    lambda a, c, b: a + c + b,
    st.text(max_size=8),
    st.sampled_from(("\0", "\x01", "\n", "\x1f", "\x7f", "\x85", "\u2028")),
    st.text(max_size=8),
)
texts = (
    controlled
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=80)
    | st.sampled_from(
        (
            "",
            "\0",
            "inbox",
            "outbox",
            "replay",
            "discard",
            "restore",
            "pause",
            "filter",
            "group",
            "selection",
            "0" * 32,
            "2026-01-01T00:00",
            "-1",
            "99999999999999999999",
            "'",
            '"',
            "%",
            "/\\x",
            "all",
            "discarded",
            "{}",
            "[]",
        )
    )
)
# Mostly well-formed where the console branches (action, scope, side), so that
# arbitrary values reach the deeper code (SQL calls), not only the first check.
choices = {
    "action": st.sampled_from(("replay", "discard", "restore", "pause", "resume")) | texts,
    "scope": st.sampled_from(("filter", "group", "selection")) | texts,
    "side": st.sampled_from(("inbox", "outbox")) | texts,
    "shown": st.sampled_from(("live", "discarded", "all")) | texts,
}
requests = st.one_of(
    st.tuples(
        st.just("GET"),
        st.sampled_from(_GETS),
        st.fixed_dictionaries({}, optional={k: choices.get(k, texts) for k in _QUERY_KEYS}),
        st.fixed_dictionaries({"g": texts, "side": choices["side"], "id": texts}),
    ),
    st.tuples(
        st.just("POST"),
        st.sampled_from(_POSTS),
        st.fixed_dictionaries(
            {"action": choices["action"], "reason": texts},
            optional={k: choices.get(k, texts) for k in _FORM_KEYS if k not in ("action", "reason")},
        ),
        st.just({}),
    ),
)


def _one_field(known: dict[str, str]) -> st.SearchStrategy:
    """A well-formed request of a route with one field (or path segment) replaced
    by arbitrary text: every field is reached with every kind of value."""
    valid_form = {"action": "replay", "scope": "filter", "side": "inbox", "owner": "billing", "reason": "fuzz"}
    bases = [
        ("GET", "/dead-letters", {"side": "inbox", "owner": "billing"}, {}),
        ("GET", "/dead-letters/groups/{g}", {"shown": "all"}, {"g": known["group"]}),
        ("GET", "/dead-letters/{side}/{id}", {"handler": "billing"}, {"side": "inbox", "id": known["id"]}),
        ("POST", "/actions/prepare", valid_form, {}),
        ("POST", "/actions/run", valid_form, {}),
    ]

    def replaced(base: tuple, key: str, value: str) -> tuple:
        method, path, fields, segments = base
        if key in segments:
            return method, path, fields, {**segments, key: value}
        return method, path, {**fields, key: value}, segments

    def keys(base: tuple) -> st.SearchStrategy:
        method, _, fields, segments = base
        return st.sampled_from(sorted({*(_QUERY_KEYS if method == "GET" else _FORM_KEYS), *fields, *segments}))

    return st.sampled_from(bases).flatmap(lambda b: st.builds(replaced, st.just(b), keys(b), texts))


def _fuzz(base: str, cookies: httpx.Cookies, csrf: str, known: dict[str, str], checked: list[int]) -> None:
    """Runs in a thread (the console serves in the test's event loop)."""
    with httpx.Client(base_url=base, cookies=cookies, timeout=30) as client:

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(requests | _one_field(known))
        def route(request: tuple[str, str, dict[str, str], dict[str, str]]) -> None:
            method, path, fields, segments = request
            path = path.format(**{k: urllib.parse.quote(v, safe="") or "x" for k, v in segments.items()})
            if method == "GET":
                answer = client.get(path, params=fields)
            else:
                answer = client.post(path, data={"csrf": csrf, **fields})
            assert answer.status_code < 500, (method, path, fields, answer.status_code, answer.text[-400:])
            assert "Traceback" not in answer.text
            checked.append(answer.status_code)

        route()


@pytest.mark.parametrize("group", ["pgoutbox_viewer", "pgoutbox_admin"])
async def test_no_input_to_any_route_or_form_gives_a_5xx(console_db, group):
    su, url = console_db
    ids = seed_dead_letters(
        worker_url(su, "pgoutbox_consumer"), "billing", "sea.event.order_paid.v1", 3, "HTTP 422: no"
    )
    user, password = person(su, group)
    # not default: hundreds of generated actions, none of which is about the throttle
    async with serving(url, action_pause="0s") as (base, _), httpx.AsyncClient(base_url=base) as client:
        assert (await _login(client, user, password)).status_code == 303
        csrf = _csrf((await client.get("/")).text)
        groups = await client.get("/dead-letters")
        known = {"group": re.search(r'data-group="([0-9a-f]{32})"', groups.text).group(1), "id": ids[0]}
        checked: list[int] = []
        await asyncio.to_thread(_fuzz, base, client.cookies, csrf, known, checked)
        answers = collections.Counter(checked)
        print(f"{group}: {len(checked)} requests checked, none answered 5xx: {dict(sorted(answers.items()))}")
        assert len(checked) >= 300
        # Not a run of redirects to the login page: the pages and forms answered as the role.
        assert answers[200] > 0 and answers[400] > 0
        assert await _logged_in(client)  # the session survived it all
