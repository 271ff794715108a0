"""The console over plain HTTP (httpx), against its own password-checking
PostgreSQL: login, cookies, CSRF, the failed-login limit, and PostgreSQL's
grants answering 403. The browser tests (test_console_browser.py) drive the
same pages through Chromium."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid

import httpx
import psycopg

from pgoutbox.dev.embedded import free_port
from support.console import person, seed_dead_letters, seed_outbox_dead_letters, serving, worker_url
from support.waiting import until, wait_for


def _csrf(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


async def _login(client: httpx.AsyncClient, user: str, password: str) -> httpx.Response:
    page = await client.get("/login")
    return await client.post("/login", data={"user": user, "password": password, "csrf": _csrf(page.text)})


async def test_an_admin_logs_in_with_a_session_cookie_that_scripts_and_other_sites_cannot_use(console_db):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        answer = await _login(client, admin, password)
        assert answer.status_code == 303 and answer.headers["location"] == "/"
        cookie = next(h for h in answer.headers.get_list("set-cookie") if h.startswith("pgoutbox_session="))
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Secure" not in cookie  # plain HTTP
        overview = await client.get("/")
        assert overview.status_code == 200 and "Overview" in overview.text and admin in overview.text
        assert "default-src 'self'" in overview.headers["content-security-policy"]
        # Behind a TLS proxy (a trusted address sends X-Forwarded-Proto: https) the cookie is Secure.
        page = await client.get("/login", headers={"X-Forwarded-Proto": "https"})
        login_cookie = next(h for h in page.headers.get_list("set-cookie") if h.startswith("pgoutbox_login="))
        assert "Secure" in login_cookie
        # httpx keeps a Secure cookie from a plain-HTTP exchange to itself: handed over by hand.
        answer = await client.post(
            "/login",
            data={"user": admin, "password": password, "csrf": _csrf(page.text)},
            headers={"X-Forwarded-Proto": "https", "Cookie": f"pgoutbox_login={page.cookies['pgoutbox_login']}"},
        )
        cookie = next(h for h in answer.headers.get_list("set-cookie") if h.startswith("pgoutbox_session="))
        assert "Secure" in cookie


async def test_a_wrong_password_is_refused_by_postgresql_and_pages_need_a_login(console_db):
    su, url = console_db
    admin, _ = person(su, "pgoutbox_admin")
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        answer = await _login(client, admin, "not-the-password")
        assert answer.status_code == 401 and "refused this user or password" in answer.text
        assert (await client.get("/")).headers["location"] == "/login"


async def test_failed_logins_are_limited_per_user_and_per_address(console_db):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    # not default: the test is about the failed-login limit
    async with serving(url, login_attempts="3", login_window="1m") as (base, _):
        async with httpx.AsyncClient(base_url=base) as client:
            for _ in range(3):
                assert (await _login(client, admin, "wrong")).status_code == 401
            refused = await _login(client, admin, password)  # the right password, too late
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) > 0
            assert "Too many failed logins" in refused.text
            # The same address trying another role is refused too.
            other, other_password = person(su, "pgoutbox_admin")
            assert (await _login(client, other, other_password)).status_code == 429


async def test_a_post_without_the_sessions_csrf_token_is_refused(console_db):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        await _login(client, admin, password)
        answer = await client.post("/logout", data={"csrf": "forged"})
        assert answer.status_code == 403 and "CSRF" in answer.text
        assert (await client.get("/")).status_code == 200  # still logged in


def test_pgoutbox_console_serves_until_sigterm(console_db, tmp_path):
    _, url = console_db
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    env.update(OUTBOX_CONSOLE_DATABASE_URL=url, OUTBOX_CONSOLE_PORT=str(port))
    log = (tmp_path / "console.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "pgoutbox.cli.main", "console"], env=env, stdout=log, stderr=log)
    try:

        def login_page():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/login").status_code == 200
            except httpx.TransportError:
                assert process.poll() is None, (tmp_path / "console.log").read_text()
                return False

        # A deadline the page itself ends, not a bound: the console's imports took
        # over 20 s on a 2-core machine at load average 50 (a clean-clone run
        # beside two soaks), and a SIGTERM before its handlers are set is -15.
        wait_for(login_page, 120, "the console's login page")
        assert httpx.get(f"http://127.0.0.1:{port}/static/console.css").status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(10) == 0


async def _admin_client(client: httpx.AsyncClient, su: str) -> str:
    admin, password = person(su, "pgoutbox_admin")
    await _login(client, admin, password)
    return admin


async def test_another_sql_refusal_shows_its_one_line_and_code(console_db):
    su, url = console_db
    seed_dead_letters(worker_url(su, "pgoutbox_consumer"), "billing", "sea.event.order_paid.v1", 2, "HTTP 422: no")
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        await _admin_client(client, su)
        csrf = _csrf((await client.get("/")).text)
        form = {"csrf": csrf, "action": "replay", "scope": "filter", "side": "inbox", "reason": "  ", "total": "2"}
        answer = await client.post("/actions/run", data=form)
        assert answer.status_code == 400 and "[OB014]" in answer.text and "Traceback" not in answer.text
        answer = await client.post("/actions/prepare", data={**form, "since": "not a time"})
        assert answer.status_code == 400 and "[OB100]" in answer.text
    with psycopg.connect(su) as c:
        assert c.execute("SELECT count(*) FROM inbox.redrive_log").fetchone()[0] == 0


async def test_payloads_can_be_hidden_from_every_role(console_db):
    su, url = console_db
    (id,) = seed_dead_letters(worker_url(su, "pgoutbox_consumer"), "billing", "sea.event.order_paid.v1", 1, "HTTP 422")
    for payloads, shown in (("role", True), ("never", False)):
        async with serving(url, payloads=payloads) as (base, _), httpx.AsyncClient(base_url=base) as client:
            await _admin_client(client, su)
            page = await client.get(f"/dead-letters/inbox/{id}", params={"handler": "billing"})
            assert page.status_code == 200
            assert ("A-17" in page.text) is shown
            missing = await client.get(f"/dead-letters/inbox/{uuid.uuid4()}", params={"handler": "billing"})
            assert missing.status_code == 404 and "[OB105]" in missing.text


async def test_a_batched_action_touches_every_match_in_batches_and_reports_progress(console_db):
    su, url = console_db
    seed_dead_letters(worker_url(su, "pgoutbox_consumer"), "billing", "sea.event.order_paid.v1", 7, "HTTP 500: down")
    # not default: the test is about batches: 3 rows each, so that 7 take three of them
    async with serving(url, action_batch="3", action_pause="10ms") as (base, console):
        async with httpx.AsyncClient(base_url=base) as client:
            await _admin_client(client, su)
            csrf = _csrf((await client.get("/")).text)
            form = {"csrf": csrf, "action": "discard", "scope": "filter", "side": "inbox", "owner": "billing"}
            dialog = await client.post("/actions/prepare", data=form)
            assert 'data-count="7"' in dialog.text and "Reason" in dialog.text and "Confirm" in dialog.text
            started = await client.post("/actions/run", data={**form, "reason": "noise", "total": "7"})
            assert started.status_code == 303
            action = console.actions.get(started.headers["location"].rsplit("/", 1)[1])
            await until(lambda: action.state != "running", 10, "the action's end")
            assert (action.state, action.done, action.batches) == ("finished", 7, 4)  # 3 + 3 + 1, then 0
            page = await client.get(started.headers["location"])
            assert "Done: 7 of 7" in page.text and "refresh" not in page.text
    with psycopg.connect(su) as c:
        audit = c.execute("SELECT acted_by, reason, action FROM inbox.discard_log").fetchall()
    assert len(audit) == 7 and {tuple(r[1:]) for r in audit} == {("noise", "discard")}


async def test_replaying_an_outbox_group_requeues_its_events_for_the_relay(console_db):
    su, url = console_db
    seed_outbox_dead_letters(su, 3, "NATS: no stream for subject sea.event.order_created.v1")
    async with serving(url) as (base, console), httpx.AsyncClient(base_url=base) as client:
        admin = await _admin_client(client, su)
        groups = await client.get("/dead-letters", params={"side": "outbox"})
        group_id = re.search(r'data-group="([0-9a-f]{32})"', groups.text).group(1)
        csrf = _csrf(groups.text)
        form = {"csrf": csrf, "action": "replay", "scope": "group", "group": group_id, "side": "outbox"}
        dialog = await client.post("/actions/prepare", data=form)
        assert 'data-count="3"' in dialog.text
        started = await client.post("/actions/run", data={**form, "reason": "stream created", "total": "3"})
        action = console.actions.get(started.headers["location"].rsplit("/", 1)[1])
        await until(lambda: action.state != "running", 10, "the action's end")
        assert (action.state, action.done) == ("finished", 3)
    with psycopg.connect(su) as c:
        assert c.execute("SELECT status, count(*) FROM outbox.events GROUP BY status").fetchall() == [("PENDING", 3)]
        audit = c.execute("SELECT requeued_by, reason FROM outbox.requeue_log").fetchall()
    assert audit == [(admin, "stream created")] * 3


async def test_a_login_in_no_pgoutbox_group_gets_403_with_postgresqls_line(console_db):
    su, url = console_db
    nobody, password = person(su, "pg_read_all_settings")  # may log in, holds no pgoutbox role
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        assert (await _login(client, nobody, password)).status_code == 303
        for path in ("/", "/dead-letters"):
            page = await client.get(path)
            assert page.status_code == 403, path
            assert "PostgreSQL refused your role" in page.text and "[42501]" in page.text
            assert "Traceback" not in page.text


async def test_logout_ends_the_session(console_db):
    su, url = console_db
    async with serving(url) as (base, console), httpx.AsyncClient(base_url=base) as client:
        await _admin_client(client, su)
        old = client.cookies["pgoutbox_session"]
        answer = await client.post("/logout", data={"csrf": _csrf((await client.get("/")).text)})
        assert answer.status_code == 303 and answer.headers["location"] == "/login"
        assert console.sessions.get(old) is None
        client.cookies.set("pgoutbox_session", old)  # a copy of the cookie is worth nothing now
        assert (await client.get("/")).headers["location"] == "/login"


async def test_an_empty_password_is_refused_before_postgresql_is_asked(console_db, monkeypatch):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    monkeypatch.setenv("PGPASSWORD", password)  # libpq would use it for a login without one
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        answer = await _login(client, admin, "")
        assert answer.status_code == 400 and "both required" in answer.text
        assert (await client.get("/")).headers["location"] == "/login"


async def test_what_operators_noticed_in_issue_32(console_db):
    su, url = console_db
    ids = seed_dead_letters(
        worker_url(su, "pgoutbox_consumer"), "billing", "sea.event.order_paid.v1", 60, "HTTP 422: no"
    )
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        await _admin_client(client, su)
        groups = await client.get("/dead-letters")
        assert "HTTP 422: no" in groups.text  # the handler's status, not "HTTP <n>"
        group_id = re.search(r'data-group="([0-9a-f]{32})"', groups.text).group(1)
        # A mistyped filter: 400, the page again with the form as typed and the one line.
        answer = await client.get("/dead-letters", params={"since": "yesterday-ish", "owner": "billing"})
        assert answer.status_code == 400 and "[OB100]" in answer.text
        assert 'aria-label="Filter dead letters"' in answer.text and 'value="billing"' in answer.text
        # 60 rows: two pages; "select all 60 matching" means all 60.
        page = await client.get(f"/dead-letters/groups/{group_id}")
        assert "Next page" in page.text and "Select all 60 matching" in page.text
        csrf = _csrf(page.text)
        form = {"csrf": csrf, "scope": "selection", "group": group_id, "ids": ids[0], "action": "discard"}
        dialog = await client.post("/actions/prepare", data={**form, "all_matching": "1"})
        assert 'data-count="60"' in dialog.text
        dialog = await client.post("/actions/prepare", data=form)
        assert 'data-count="1"' in dialog.text
        # The detail: trace headers, JSON as written, a parked row's replay state, one time format.
        detail = await client.get(f"/dead-letters/inbox/{ids[0]}", params={"handler": "billing"})
        assert "traceparent" in detail.text and "\\u003c" not in detail.text
        assert "Automated replay: on" not in detail.text and "automated: next at" in detail.text
        assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", detail.text)
        # Pausing a handler that does not exist.
        answer = await client.post("/actions/prepare", data={"csrf": csrf, "action": "pause", "handler": "nobody"})
        assert answer.status_code == 404 and "no handler named" in answer.text and "nobody" in answer.text
        overview = await client.get("/")
        assert "every 30s" in overview.text  # the default sample interval


async def test_a_viewer_finds_a_business_flow_by_its_correlation_id(console_db):
    """The search box of /flows (outbox.flow): the flow's events in emit order, each
    with its publish state and each handler's inbox outcome; none of another flow."""
    su, url = console_db
    flow, other = str(uuid.uuid4()), str(uuid.uuid4())
    emit = "SELECT outbox.emit('order', %s, %s, '{\"schema_version\": 1}', context => 'sea', correlation_id => %s)"
    with psycopg.connect(worker_url(su, "pgoutbox_writer"), autocommit=True) as c:
        placed = str(c.execute(emit, ("1", "order_placed", flow)).fetchone()[0])
        paid = str(c.execute(emit, ("1", "order_paid", flow)).fetchone()[0])
        elsewhere = str(c.execute(emit, ("2", "order_placed", other)).fetchone()[0])
    with psycopg.connect(worker_url(su, "pgoutbox_relay"), autocommit=True) as c:
        token = c.execute("SELECT claim_token FROM outbox.claim('w', 1, '1m')").fetchone()[0]
        c.execute("SELECT outbox.mark_published(%s, %s::uuid[])", (token, [placed]))
    with psycopg.connect(worker_url(su, "pgoutbox_consumer"), autocommit=True) as c:
        c.execute("SELECT inbox.receive(%s, 'billing', 'sea.event.order_placed.v1')", (placed,))
        c.execute("SELECT inbox.mark_processed(%s, 'billing')", (placed,))
    viewer, password = person(su, "pgoutbox_viewer")
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        assert (await _login(client, viewer, password)).status_code == 303
        empty = await client.get("/flows")
        assert empty.status_code == 200 and 'role="search"' in empty.text
        page = await client.get("/flows", params={"correlation_id": flow.upper()})
        assert page.status_code == 200, page.text
        assert re.findall(r'data-event="([^"]+)"', page.text) == [placed, paid], "emit order, none of another flow"
        assert elsewhere not in page.text
        assert 'data-handler="billing">billing: PROCESSED' in page.text
        assert "none has received it" in page.text and "PENDING" in page.text
        bad = await client.get("/flows", params={"correlation_id": "order-17"})
        assert bad.status_code == 400 and "not a correlation id" in bad.text


async def test_the_overview_shows_scheduled_events_apart_from_the_backlog(console_db):
    su, url = console_db
    viewer, password = person(su, "pgoutbox_viewer")
    writer, writer_password = person(su, "pgoutbox_writer")
    with psycopg.connect(url, user=writer, password=writer_password, autocommit=True) as conn:
        conn.execute(
            "SELECT outbox.emit('order', '1', 'reminder_due', '{\"schema_version\": 1}', context => 'later',"
            " deliver_after => interval '30 days')"
        )
    async with serving(url) as (base, _), httpx.AsyncClient(base_url=base) as client:
        assert (await _login(client, viewer, password)).status_code == 303
        overview = await client.get("/")
        section = overview.text.split('id="scheduled-h"', 1)[1].split("</section>", 1)[0]
        assert re.search(r'<th scope="row">later</th><td>1</td>', section), section
        backlog = overview.text.split('id="outbox-h"', 1)[1].split("</section>", 1)[0]
        # In the backlog it is pending, never due.
        assert re.search(r'<th scope="row">later</th><td>1</td><td>0</td>', backlog), backlog
