"""The console in a real browser: headless Chromium (Debian's, driven by
Playwright), the console served in the test's event loop, a real PostgreSQL
that checks passwords, a real nats-server and consumer (with its replayer),
and the `handler` fixture as the handler.

Three failure groups are seeded through the real pipeline: events published
to JetStream, consumed, answered 422 by the handler, dead-lettered. People
log in as roles in pgoutbox_admin or pgoutbox_viewer only. The same tests
take the screenshots of docs/console.md: into the test's folder, or into the
folder CONSOLE_SCREENSHOTS names (`make docs/screenshots` renews
docs/images/console-*.png), so that a test run leaves the checkout as it was."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import psycopg
from playwright.async_api import Page, async_playwright, expect

from support.console import person, seed_dead_letters, serving, worker_url
from support.inbox import (
    add_stream,
    default_consumer_config,
    event,
    jetstream,
    publish,
    running_consumer,
    write_registry,
)
from support.outbox import emit
from support.waiting import until

H = "billing"
# Three causes: one handler, three subjects, each dead-lettered by a 422.
SEEDED = {"sea.event.order_created.v1": 3, "sea.event.order_paid.v1": 2, "sea.event.order_cancelled.v1": 1}
CHROMIUM = "/usr/bin/chromium"
AN_ID = re.compile("^[0-9a-f-]{36}$")  # the link to a dead letter is its id


@contextlib.asynccontextmanager
async def browser_page(width: int = 1280, height: int = 900):
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            context = await browser.new_context(viewport={"width": width, "height": height})
            yield await context.new_page()
        finally:
            await browser.close()


def dead_letters(superuser_url: str) -> dict[str, int]:
    with psycopg.connect(superuser_url) as c:
        rows = c.execute(
            "SELECT subject, count(*) FROM inbox.messages WHERE status = 'DEAD_LETTER' GROUP BY subject"
        ).fetchall()
    return dict(rows)


@contextlib.asynccontextmanager
async def seeded(console_db, tmp_path, nats_server, handler):
    """A consumer (with its replayer) whose handler answered 422 to every message of SEEDED.
    Automated replays are switched off first, as an operator would (inbox.set_replay): on the
    defaults they fall due 30 to 60 s in, within a loaded run, and would move the counts a test
    reads; the operator's replays still run."""
    su, _ = console_db
    with psycopg.connect(su, autocommit=True) as c:
        c.execute("SELECT inbox.set_replay(%s, false, 'test: operator replays only')", (H,))
    registry_file = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": list(SEEDED)}])
    cfg = default_consumer_config(worker_url(su, "pgoutbox_consumer"), nats_server.url, registry_file)
    handler.answers = [422]
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg):
            for subject, n in SEEDED.items():
                for _ in range(n):
                    await publish(js, event(event_type=subject.split(".")[2], payload={"order": "A-17"}))
            await until(lambda: dead_letters(su) == SEEDED, 20, "the seeded dead letters")
            yield


async def login(page: Page, base: str, user: str, password: str) -> None:
    await page.goto(f"{base}/login")
    await page.get_by_label("User").fill(user)
    await page.get_by_label("Password").fill(password)
    await page.get_by_role("button", name="Log in").click()


# The controls of a page that have no accessible name (a label, aria-label or text).
UNNAMED = """
[...document.querySelectorAll("a, button, input:not([type=hidden]), select, textarea")]
  .filter(e => !(e.getAttribute("aria-label") || (e.labels && e.labels.length) || e.textContent.trim()))
  .map(e => e.outerHTML)
"""


def group_row(page: Page, subject: str):
    return page.get_by_role("row").filter(has_text=subject)


async def confirm(page: Page, reason: str) -> None:
    dialog = page.get_by_role("dialog")
    await dialog.get_by_label("Reason").fill(reason)
    await dialog.get_by_role("button", name="Confirm").click()


async def test_an_admin_replays_a_group_and_watches_its_count_fall_as_the_handler_recovers(
    console_db, tmp_path, nats_server, handler
):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    emit(worker_url(su, "pgoutbox_writer"), 4)  # an outbox backlog for the overview (no relay runs)
    images = Path(os.environ.get("CONSOLE_SCREENSHOTS") or tmp_path)
    async with (
        seeded(console_db, tmp_path, nats_server, handler),  # the counts fall by the operator's replay only
        # not default: the test watches the overview's trend fill up: a sample a second, not every 30 s
        serving(url, sample_interval="1s") as (base, console),
        browser_page() as page,
    ):
        await login(page, base, admin, password)
        await expect(page.get_by_role("heading", name="Overview")).to_be_visible()
        await until(lambda: len(console.samples.points(f"inbox:{H}:dead_letter")) >= 6, 15, "six samples")
        await page.reload()
        await expect(page.get_by_role("row").filter(has_text=H)).to_contain_text("6")
        await page.screenshot(path=str(images / "console-overview.png"), full_page=True)

        await page.get_by_role("link", name="Dead letters", exact=True).click()
        for subject, n in SEEDED.items():
            await expect(group_row(page, subject).locator("td.count")).to_have_text(str(n))

        # Open the group of order_paid (2), look at one of its dead letters.
        await group_row(page, "order_paid").get_by_role("link").click()
        await expect(page.get_by_role("heading", level=1)).to_contain_text("sea.event.order_paid.v1")
        await page.screenshot(path=str(images / "console-group.png"), full_page=True)
        await page.get_by_role("link", name=AN_ID).first.click()
        await expect(page.get_by_role("heading", level=1)).to_contain_text("Dead letter")
        await expect(page.get_by_label("Payload")).to_contain_text("A-17")  # an admin may read payloads
        await expect(page.get_by_text(re.compile(r"^[A-Z_]+DLQ #\d+$"))).to_be_visible()  # the notice's place
        await page.screenshot(path=str(images / "console-detail.png"), full_page=True)
        await page.go_back()

        # The handler is fixed: replay the group, with a reason.
        handler.answers = [200]
        await page.get_by_role("group", name="The whole group").get_by_role("button", name="Replay").click()
        await expect(page.get_by_role("dialog")).to_contain_text("touch 2 dead letter")
        await confirm(page, "INC-42: billing fixed the tax lookup")
        await expect(page.get_by_role("status")).to_contain_text("of 2")

        # The count falls as the replayer re-publishes and the handler answers 200.
        await page.goto(f"{base}/dead-letters")
        for _ in range(100):
            if await group_row(page, "order_paid").count() == 0:
                break
            await page.wait_for_timeout(200)
            await page.reload()
        assert await group_row(page, "order_paid").count() == 0
        await expect(group_row(page, "order_created").locator("td.count")).to_have_text("3")
        assert dead_letters(su) == {"sea.event.order_created.v1": 3, "sea.event.order_cancelled.v1": 1}
        with psycopg.connect(su) as c:
            audit = c.execute("SELECT redriven_by, reason FROM inbox.redrive_log").fetchall()
        assert audit and {r[0] for r in audit} == {admin}
        assert {r[1] for r in audit} == {"INC-42: billing fixed the tax lookup"}


async def test_a_viewer_sees_no_action_controls_and_a_forged_post_is_refused_by_postgresql(
    console_db, tmp_path, nats_server, handler
):
    su, url = console_db
    viewer, password = person(su, "pgoutbox_viewer")
    async with (
        seeded(console_db, tmp_path, nats_server, handler),
        serving(url) as (base, _),
        browser_page() as page,
    ):
        await login(page, base, viewer, password)
        await expect(page.get_by_role("row").filter(has_text=H)).to_contain_text("6")
        assert await page.get_by_role("button", name=re.compile("Pause|Resume")).count() == 0
        await page.get_by_role("link", name="Dead letters", exact=True).click()
        await expect(group_row(page, "order_created").locator("td.count")).to_have_text("3")
        for name in ("Replay", "Discard", "Restore", "Replay all matching", "Discard all matching"):
            assert await page.get_by_role("button", name=name).count() == 0
        group_id = await group_row(page, "order_created").get_attribute("data-group")
        await group_row(page, "order_created").get_by_role("link").click()
        assert await page.get_by_role("checkbox").count() == 0
        await page.get_by_role("link", name=AN_ID).first.click()
        await expect(page.get_by_role("main")).to_contain_text("Hidden: your role may not read payloads")
        assert await page.get_by_label("Payload").count() == 0

        # The forged action: the viewer's own session and CSRF token, the admin's form.
        csrf = await page.locator("input[name=csrf]").first.input_value()
        answer = await page.request.post(
            f"{base}/actions/run",
            form={
                "csrf": csrf,
                "action": "replay",
                "scope": "group",
                "group": group_id,
                "reason": "forged",
                "total": "3",
            },
        )
        assert answer.status == 403
        assert "42501" in await answer.text()
    assert dead_letters(su) == SEEDED
    with psycopg.connect(su) as c:
        assert c.execute("SELECT count(*) FROM inbox.redrive_log").fetchone()[0] == 0


async def test_discard_and_restore_round_trip(console_db, tmp_path, nats_server, handler):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    async with (
        seeded(console_db, tmp_path, nats_server, handler),
        serving(url) as (base, _),
        browser_page() as page,
    ):
        await login(page, base, admin, password)
        await page.goto(f"{base}/dead-letters")
        await group_row(page, "order_created").get_by_role("button", name="Discard").click()
        await expect(page.get_by_role("dialog")).to_contain_text("touch 3 dead letter")
        await confirm(page, "duplicates of a test run")
        await expect(page.get_by_role("status")).to_contain_text("Done: 3 of 3")

        await page.goto(f"{base}/dead-letters")
        assert await group_row(page, "order_created").count() == 0  # live dead letters only
        await page.get_by_label("Show").select_option("discarded")
        await page.get_by_role("button", name="Filter").click()
        await expect(group_row(page, "order_created")).to_be_visible()
        await group_row(page, "order_created").get_by_role("button", name="Restore").click()
        await expect(page.get_by_role("dialog")).to_contain_text("touch 3 dead letter")
        await confirm(page, "not duplicates after all")
        await expect(page.get_by_role("status")).to_contain_text("Done: 3 of 3")

        await page.goto(f"{base}/dead-letters")
        await expect(group_row(page, "order_created").locator("td.count")).to_have_text("3")
        await group_row(page, "order_created").get_by_role("link").click()
        await page.get_by_role("link", name=AN_ID).first.click()
        history = page.get_by_role("table").filter(has_text="Why")
        await expect(history).to_contain_text("duplicates of a test run")
        await expect(history).to_contain_text("not duplicates after all")
        await expect(history).to_contain_text(admin)
    assert dead_letters(su) == SEEDED


async def test_failed_logins_are_limited_in_the_browser(console_db):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    # not default: the test is about the failed-login limit
    async with serving(url, login_attempts="2") as (base, _), browser_page() as page:
        for _ in range(2):
            await login(page, base, admin, "wrong")
            await expect(page.get_by_role("alert")).to_contain_text("refused this user or password")
        await login(page, base, admin, password)
        await expect(page.get_by_role("alert")).to_contain_text("Too many failed logins")


async def test_pages_fit_a_390_px_phone_screen(console_db, tmp_path, nats_server, handler):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    async with (
        seeded(console_db, tmp_path, nats_server, handler),
        serving(url) as (base, _),
        browser_page(390, 844) as page,
    ):
        await login(page, base, admin, password)

        async def fits(what: str) -> None:
            # Nothing wider than the screen: wide tables scroll inside their own box.
            width = await page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, f"{what} is {width} px wide"
            await expect(page.get_by_role("button", name="Log out")).to_be_in_viewport()
            assert await page.evaluate(UNNAMED) == [], f"controls without an accessible name on {what}"

        await fits("the overview")
        await page.goto(f"{base}/dead-letters")
        await fits("the groups")
        await expect(group_row(page, "order_created").get_by_role("button", name="Replay")).to_be_visible()
        await group_row(page, "order_created").get_by_role("link").click()
        await fits("a group")
        await page.get_by_role("link", name=AN_ID).first.click()
        await fits("a dead letter")
        await page.go_back()
        await page.get_by_role("group", name="The whole group").get_by_role("button", name="Replay").click()
        await fits("the confirmation")
        await expect(page.get_by_role("dialog").get_by_role("button", name="Confirm")).to_be_in_viewport()


async def test_an_admin_pauses_and_resumes_a_handlers_automated_replay(console_db):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    seed_dead_letters(worker_url(su, "pgoutbox_consumer"), H, "sea.event.order_paid.v1", 1, "HTTP 503: busy")
    async with serving(url) as (base, _), browser_page() as page:
        await login(page, base, admin, password)
        for verb, state in (("Pause", False), ("Resume", True)):
            await page.get_by_role("button", name=f"{verb} automated replay of {H}").click()
            await expect(page.get_by_role("dialog")).to_contain_text(f"touch 1 handler {H}")
            await confirm(page, f"{verb.lower()}: INC-43")
            await expect(page.get_by_role("status")).to_contain_text("Done: 1 of 1")
            with psycopg.connect(su) as c:
                row = c.execute("SELECT enabled, changed_by, reason FROM inbox.replay_switches").fetchone()
            assert row == (state, admin, f"{verb.lower()}: INC-43")
            await page.get_by_role("link", name="Back").click()
            await expect(page.get_by_role("row").filter(has_text=H)).to_contain_text("off" if verb == "Pause" else "on")


async def _login_typed(page: Page, base: str, user: str, password: str) -> None:
    """A login whose fields hold exactly these strings (a NUL too: set by script,
    as a forged or pasted value would arrive), posted by the form's own button."""
    await page.goto(f"{base}/login")
    await page.evaluate(
        "([u, p]) => { document.getElementById('user').value = u; document.getElementById('password').value = p; }",
        [user, password],
    )
    await page.get_by_role("button", name="Log in").click()


async def test_nul_logins_are_refused_with_pgpassword_set_and_with_a_pgpass_file(console_db, tmp_path, monkeypatch):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    pgpass = tmp_path / "pgpass"
    pgpass.write_text(f"*:*:*:{admin}:{password}\n")
    pgpass.chmod(0o600)
    for variable, value in (("PGPASSWORD", password), ("PGPASSFILE", str(pgpass))):
        monkeypatch.setenv(variable, value)  # what libpq would fall back on, were the conninfo cut short
        async with serving(url) as (base, _), browser_page() as page:
            for user, typed in ((admin + "\0", "anything"), (admin, "\0"), (admin, password + "\0junk")):
                await _login_typed(page, base, user, typed)
                await expect(page.get_by_role("alert")).to_contain_text("control character")
                await page.goto(f"{base}/")
                await expect(page).to_have_url(f"{base}/login")  # not logged in
            await login(page, base, admin, password)
            await expect(page.get_by_role("heading", name="Overview")).to_be_visible()
        monkeypatch.delenv(variable)


def _redrives(superuser_url: str, reason: str) -> list[str]:
    with psycopg.connect(superuser_url) as c:
        rows = c.execute("SELECT message_id::text FROM inbox.redrive_log WHERE reason = %s", (reason,)).fetchall()
    return [r[0] for r in rows]


def _failed_again(superuser_url: str, ids: list[str]) -> int:
    """Of these messages, how many are parked dead letters again after a replay."""
    with psycopg.connect(superuser_url) as c:
        return c.execute(
            "SELECT count(*) FROM inbox.messages WHERE message_id = ANY(%s::uuid[]) AND status = 'DEAD_LETTER'"
            " AND (dlq_metadata ->> 'dead_letters')::int >= 2"
            " AND NOT coalesce((dlq_metadata ->> 'redrive_requested')::boolean, false)",
            (ids,),
        ).fetchone()[0]


async def test_replay_all_matching_against_a_failing_handler_ends_at_the_confirmed_count_and_stops(
    console_db, tmp_path, nats_server, handler
):
    su, url = console_db
    admin, password = person(su, "pgoutbox_admin")
    subject = "sea.event.order_paid.v1"
    registry_file = write_registry(tmp_path, [{"name": H, "url": handler.url, "subjects": [subject]}])
    cfg = default_consumer_config(worker_url(su, "pgoutbox_consumer"), nats_server.url, registry_file)
    handler.answers = [422]  # the handler keeps failing, before and during the replay
    ids = seed_dead_letters(worker_url(su, "pgoutbox_consumer"), H, subject, 24, "HTTP 422: tax lookup failed")
    with psycopg.connect(su, autocommit=True) as c:
        # Only the operator's replay sends here: automated replay off for the handler.
        c.execute("SELECT inbox.set_replay(%s, false, 'test: operator replays only')", (H,))
    async with (
        jetstream(nats_server.url) as js,
        # not default: batches of 2, 2 s apart (22 s or more for 24): slow enough to
        # press Stop mid-way even when the page takes seconds to load (at 300 ms
        # apart, a run at load average 50 ended before the page showed it)
        serving(url, action_batch="2", action_pause="2s") as (base, _),
        browser_page() as page,
    ):
        await add_stream(js)
        async with running_consumer(cfg):
            await login(page, base, admin, password)
            await page.goto(f"{base}/dead-letters?owner={H}")
            await page.get_by_role("button", name="Replay all matching").click()
            await expect(page.get_by_role("dialog")).to_contain_text("touch 24 dead letter")
            await confirm(page, "INC-44: once more")
            # Every replayed message fails again and matches again; the action ends all the same.
            await expect(page.get_by_role("status")).to_contain_text("Done: 24 of 24", timeout=90_000)
            await until(lambda: _failed_again(su, ids) == 24, 60, "all 24 replayed and dead-lettered again")
            await page.reload()
            await expect(page.locator("[data-n=failed_again]")).to_have_text("24")
            await expect(page.locator("[data-n=taken]")).to_have_text("24")
            assert sorted(_redrives(su, "INC-44: once more")) == sorted(ids)  # each taken once
            assert [len(handler.calls_for(i)) for i in ids] == [1] * 24  # each sent once

            # Stop, mid-way through the same replay again.
            await page.goto(f"{base}/dead-letters?owner={H}")
            await page.get_by_role("button", name="Replay all matching").click()
            await expect(page.get_by_role("dialog")).to_contain_text("touch 24 dead letter")
            await confirm(page, "INC-45: and stop")
            await expect(page.get_by_role("status")).to_contain_text(
                re.compile(r"Running: ([2-9]|1\d) of 24"), timeout=20_000
            )
            await page.get_by_role("button", name="Stop").click()
            await expect(page.get_by_role("status")).to_contain_text("Stopped:", timeout=10_000)
            taken = len(_redrives(su, "INC-45: and stop"))
            assert 0 < taken < 24
            await expect(page.get_by_role("status")).to_contain_text(f"Stopped: {taken} of 24 taken")
            with psycopg.connect(su) as c:
                row = c.execute("SELECT taken, stopped_by FROM outbox.dlq_actions WHERE reason = 'INC-45: and stop'")
                assert row.fetchone() == (taken, admin)
