"""The console's pure parts: the login store, the failed-login limit, the
charts, the settings and the filter a page builds (no server)."""

from __future__ import annotations

import pytest

from pgoutbox.console import charts, pages
from pgoutbox.console.sessions import LoginLimiter, Sessions
from pgoutbox.console.settings import ConsoleConfig
from pgoutbox.core import settings
from pgoutbox.core.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_ends_at_its_lifetime_and_forgets_the_password():
    clock = Clock()
    sessions = Sessions(60, clock)
    s = sessions.open("alice", "secret")
    assert sessions.get(s.id) is s and s.csrf_ok(s.csrf) and not s.csrf_ok("other") and not s.csrf_ok(None)
    assert "secret" not in repr(s)
    clock.now += 60
    assert sessions.get(s.id) is None and s.password == ""


def test_logout_forgets_the_password_and_ids_are_unguessable():
    sessions = Sessions(60)
    a, b = sessions.open("alice", "secret"), sessions.open("alice", "secret")
    assert a.id != b.id and a.csrf != b.csrf and len(a.id) >= 40
    sessions.close(a.id)
    assert sessions.get(a.id) is None and a.password == "" and sessions.get(b.id) is b


def test_failed_logins_are_limited_per_user_and_per_address_within_the_window():
    clock = Clock()
    limiter = LoginLimiter(3, 60, clock)
    for _ in range(3):
        assert limiter.retry_after("alice", "10.0.0.1") == 0
        limiter.failed("alice", "10.0.0.1")
    assert limiter.retry_after("alice", "10.0.0.2") == 60  # the user, from anywhere
    assert limiter.retry_after("bob", "10.0.0.1") == 60  # the address, for any user
    assert limiter.retry_after("bob", "10.0.0.2") == 0
    clock.now += 30
    assert limiter.retry_after("alice", "10.0.0.9") == 30
    clock.now += 30
    assert limiter.retry_after("alice", "10.0.0.1") == 0


def test_a_good_login_clears_the_users_count_but_not_the_addresss():
    limiter = LoginLimiter(2, 60, Clock())
    limiter.failed("alice", "a")
    limiter.failed("bob", "a")
    limiter.succeeded("alice")
    assert limiter.retry_after("alice", "b") == 0
    assert limiter.retry_after("carol", "a") > 0


def test_samples_keep_the_last_hour_only():
    clock = Clock()
    samples = charts.Samples(keep=3600, clock=clock)
    samples.add({"inbox:billing:dead_letter": 3})
    clock.now += 3000
    samples.add({"inbox:billing:dead_letter": 5})
    clock.now += 1000
    assert samples.points("inbox:billing:dead_letter") == [(4000.0, 5.0)]
    assert samples.points("unknown") == []


def test_a_sparkline_is_an_svg_with_an_accessible_summary():
    svg = charts.sparkline([(0, 1), (1800, 4), (3600, 2)], label="Dead letters of <b>", now=3600)
    assert svg.startswith("<svg") and 'role="img"' in svg and "<polyline" in svg
    assert "last 60 min, now 2, highest 4" in svg and "&lt;b&gt;" in svg and "<b>" not in svg
    empty = charts.sparkline([], label="Due", now=3600)
    assert "no samples in the last hour yet" in empty and "<polyline" not in empty


def _build(**env: str) -> ConsoleConfig:
    return settings.build(ConsoleConfig, environ=env)


def test_the_defaults_bind_to_loopback_and_need_no_secret():
    cfg = _build()
    assert (cfg.host, cfg.port, cfg.database_url, cfg.secure_cookie, cfg.payloads) == (
        "127.0.0.1",
        8470,
        None,
        "auto",
        "role",
    )
    assert cfg.session_lifetime == 8 * 3600 and cfg.action_batch == 250 and cfg.login_attempts == 5


@pytest.mark.parametrize(
    "env, message",
    [
        ({"OUTBOX_CONSOLE_DATABASE_URL": "postgresql://alice:pw@db/app"}, "must not name a user or password"),
        ({"OUTBOX_CONSOLE_DATABASE_URL": "host=db user=alice"}, "must not name a user or password"),
        ({"OUTBOX_CONSOLE_PORT": "70000"}, "OUTBOX_CONSOLE_PORT"),
        ({"OUTBOX_CONSOLE_SECURE_COOKIE": "sometimes"}, "auto"),
        ({"OUTBOX_CONSOLE_PAYLOADS": "all"}, "role"),
        ({"OUTBOX_CONSOLE_ACTION_BATCH": "0"}, "OUTBOX_CONSOLE_ACTION_BATCH"),
        ({"OUTBOX_CONSOLE_SESSION_LIFETIME": "0s"}, "more than 0"),
    ],
)
def test_a_bad_setting_is_one_line_at_start_up(env, message):
    with pytest.raises(ConfigError, match=message) as caught:
        _build(**env)
    assert "pw" not in str(caught.value) and "\n" not in str(caught.value)


def test_a_url_without_credentials_is_accepted():
    assert _build(OUTBOX_CONSOLE_DATABASE_URL="postgresql://db:5432/app").database_url == "postgresql://db:5432/app"


def test_the_pages_filter_leaves_out_empty_fields_and_maps_what_is_shown():
    flt = pages.filter_of({"side": "inbox", "owner": " billing ", "subject": "", "shown": "all", "group": "ab" * 16})
    assert flt == {"side": "inbox", "owner": "billing", "discarded": None, "group": "ab" * 16}
    assert pages.filter_of({"shown": "discarded"}) == {"discarded": True}
    assert pages.filter_of({}) == {}
    assert pages.query_of(flt) == {"side": "inbox", "owner": "billing", "shown": "all", "group": "ab" * 16}


def test_an_action_returns_only_to_a_page_of_the_console():
    assert pages._back("/dead-letters?side=inbox") == "/dead-letters?side=inbox"
    assert pages._back("//evil.example/") == "/dead-letters"
    assert pages._back("https://evil.example/") == "/dead-letters"


def test_the_command_answers_a_bad_setting_with_one_line(capsys):
    from pgoutbox.core.errors import ExitCode
    from support.commands import assert_one_line

    line = assert_one_line(
        capsys, ["console", "--database-url", "postgresql://alice:hunter2@db/app"], ExitCode.USAGE, "ConfigError"
    )
    assert "hunter2" not in line
    assert_one_line(capsys, ["console", "--port", "99999"], ExitCode.USAGE, "OUTBOX_CONSOLE_PORT")


def test_a_time_from_the_forms_date_time_field_is_read_as_utc():
    assert pages.filter_of({"since": "2026-11-26T16:00", "until": "2026-11-26T17:00:30"}) == {
        "since": "2026-11-26T16:00Z",
        "until": "2026-11-26T17:00:30Z",
    }
    assert pages.filter_of({"since": "2026-11-26T16:00+01:00"}) == {"since": "2026-11-26T16:00+01:00"}


def test_the_cli_loads_without_the_console_extra():
    """`pgoutbox --help` and every other command must not need starlette, uvicorn or jinja2."""
    import subprocess
    import sys

    code = (
        "import sys; import pgoutbox.cli.main as m; m.build_parser(); "
        "print(sorted(n for n in ('starlette', 'uvicorn', 'jinja2', 'multipart') if n in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


async def _settled(action):
    import asyncio

    for _ in range(200):
        if action.state != "running":
            return action
        await asyncio.sleep(0.005)
    raise AssertionError(f"{action} still running")


def _action(**kw):
    from pgoutbox.console.actions import Action

    return Action(id=kw.pop("id", "a1"), title="Replay", user="alice", reason="why", total=7, back="/", **kw)


def _opener():
    from pgoutbox.console.actions import nothing

    return nothing()


async def test_an_action_runs_batches_until_one_touches_nothing():
    from pgoutbox.console.actions import Actions

    sizes = iter([3, 3, 1, 0])
    seen = []

    async def batch(conn, max_rows):
        seen.append(max_rows)
        return next(sizes)

    actions = Actions(batch=3, pause=0)
    action = await _settled(await actions.start(_action(), _opener, batch))
    assert (action.state, action.done, action.batches, action.percent) == ("finished", 7, 4, 100)
    assert seen == [3, 3, 3, 3] and actions.get("a1") is action


async def test_a_failing_batch_ends_its_action_with_one_line_not_the_console():
    from pgoutbox.console.actions import Actions

    calls = 0

    async def batch(conn, max_rows):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("connection lost\nat line 2")
        return 3

    action = await _settled(await Actions(batch=3, pause=0).start(_action(), _opener, batch))
    assert (action.state, action.done, action.error) == ("failed", 3, "connection lost / at line 2")


async def test_a_refused_first_batch_is_the_callers_and_starts_nothing():
    from pgoutbox.console.actions import Actions

    async def batch(conn, max_rows):
        raise PermissionError("permission denied for function dlq_replay")

    actions = Actions(batch=3, pause=0)
    with pytest.raises(PermissionError):
        await actions.start(_action(), _opener, batch)
    assert actions.get("a1") is None


@pytest.mark.parametrize(
    "user, password, refused",
    [
        ("admin", "secret", None),
        ("admin\0", "x", "control character"),
        ("admin", "\0", "control character"),
        ("admin", "right\0junk", "control character"),
        ("ad\x1bmin", "x", "control character"),
        ("admin", "x\x85", "control character"),  # C1 too
        ("é" * 31 + "e", "x", None),  # 63 bytes
        ("é" * 32, "x", "63 bytes"),  # 64 bytes, 32 characters
        ("admin", "p" * 1000, None),
        ("admin", "p" * 1001, "1000 bytes"),
    ],
)
def test_a_login_holding_a_control_character_or_too_long_is_refused(user, password, refused):
    from pgoutbox.console import inputs

    if refused is None:
        inputs.fields([("user", user), ("password", password)])
    else:
        with pytest.raises(inputs.BadInput, match=refused):
            inputs.fields([("user", user), ("password", password)])


def test_a_reason_may_hold_line_breaks_and_no_other_control_character():
    from pgoutbox.console import inputs

    inputs.fields([("reason", "line one\r\nline two\tthree")], multiline=("reason",))
    for value in ("a\0b", "a\x0bb"):
        with pytest.raises(inputs.BadInput):
            inputs.fields([("reason", value)], multiline=("reason",))
    with pytest.raises(inputs.BadInput):
        inputs.fields([("owner", "line one\nline two")], multiline=("reason",))


@pytest.mark.parametrize(
    "back, kept",
    [
        ("/dead-letters?side=inbox", True),
        ("/", True),
        ("//evil.example/", False),
        ("/\\evil.example/", False),
        ("/x\\y", False),
        ("https://evil.example/", False),
        ("/a b", False),
        ("", False),
    ],
)
def test_a_back_link_is_a_page_of_the_console_or_the_default(back, kept):
    assert pages._back(back) == (back if kept else "/dead-letters")


def test_times_show_as_utc_to_the_second_from_datetimes_and_json_text():
    from datetime import datetime, timedelta, timezone

    from pgoutbox.console.web import _pairs, _when

    east = timezone(timedelta(hours=2))
    assert _when(datetime(2026, 11, 28, 12, 0, 1, 500, tzinfo=east)) == "2026-11-28 10:00:01 UTC"
    assert _when("2026-11-28T12:00:01.123+02:00") == "2026-11-28 10:00:01 UTC"
    assert _when(None) == "–" and _when("not a time") == "not a time"
    assert (
        _pairs({"last_error": "HTTP 422: <no>", "attempts_before": 3})
        == "last_error: HTTP 422: <no>; attempts_before: 3"
    )
