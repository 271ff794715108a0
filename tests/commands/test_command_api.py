"""examples/command_api.py end to end: the real process, a real PostgreSQL,
its login a member of pgoutbox_writer only, requests over HTTP.

What it shows: 50 parallel duplicates of one command give one workflow
run and 50 identical answers; and a retry fired while the first request is
still running gets the first one's run id."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg
import pytest

from support.roles import login

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "command_api.py"
BODY = {"workflow": "onboarding", "input": {"customer": "c-42"}}


def environment(database_url: str) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))},
        "OUTBOX_DATABASE_URL": database_url,
    }


@pytest.fixture
def start_api(database_url) -> Iterator[Callable[[float], str]]:
    """Starts the example as a pgoutbox_writer login; returns its base URL."""
    subprocess.run(
        [sys.executable, str(EXAMPLE), "--create-schema"], env=environment(database_url), check=True, timeout=60
    )
    writer_url = login(database_url, "pgoutbox_writer")
    procs: list[subprocess.Popen[str]] = []

    def start(work_seconds: float) -> str:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--port", "0", "--work-seconds", str(work_seconds)],
            env=environment(writer_url),
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("listening on "), f"the example did not start: {line!r}"
        return line.removeprefix("listening on ").strip()

    yield start
    for proc in procs:
        proc.terminate()
        assert proc.wait(timeout=15) == 0


def post(base: str, key: str | None, body: object = BODY) -> tuple[int, dict]:
    headers = {} if key is None else {"Idempotency-Key": key}
    r = httpx.post(f"{base}/workflow-runs", json=body, headers=headers, timeout=60)
    return r.status_code, r.json()


def runs_and_events(database_url: str) -> tuple[int, int]:
    with psycopg.connect(database_url) as c:
        return (
            c.execute("SELECT count(*) FROM wf.workflow_runs").fetchone()[0],
            c.execute("SELECT count(*) FROM outbox.events WHERE event_type = 'run_started'").fetchone()[0],
        )


def test_a_retry_gets_the_first_answer_and_starts_nothing(start_api, database_url):
    base = start_api(0)
    first = post(base, "cmd-1")
    assert first[0] == 201 and first[1]["command_key"] == "cmd-1"
    assert post(base, "cmd-1") == first
    other = post(base, "cmd-2")
    assert other[0] == 201 and other[1]["run_id"] != first[1]["run_id"]
    assert runs_and_events(database_url) == (2, 2)
    with psycopg.connect(database_url) as c:
        assert c.execute("SELECT status, attempts FROM inbox.commands WHERE command_key = 'cmd-1'").fetchone() == (
            "DONE",
            1,
        )


def test_a_retry_fired_while_the_first_is_running_waits_and_gets_the_same_run(start_api, database_url):
    # The first request holds its transaction 20 s: the retry must reach the
    # database inside that window. With 1.5 s a quiet clean-clone run (9
    # workers on 2 cores, load 8) once saw the first commit before the retry
    # asked, and no lock wait ever came.
    base = start_api(20)
    answers: dict[str, tuple[int, dict]] = {}
    first = threading.Thread(target=lambda: answers.__setitem__("first", post(base, "cmd-1")))
    first.start()
    with psycopg.connect(database_url, autocommit=True) as admin:
        # The first request has claimed and is inside its work (its
        # transaction open, the claim uncommitted) when the retry is sent ...
        wait_for(
            admin,
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND usename LIKE 't_writer_%'",
        )
        retry = threading.Thread(target=lambda: answers.__setitem__("retry", post(base, "cmd-1")))
        retry.start()
        # ... and the retry waits on it, in the database.
        wait_for(
            admin, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND usename LIKE 't_writer_%'"
        )
        assert runs_and_events(database_url) == (0, 0)
    first.join(30)
    retry.join(30)
    assert answers["first"][0] == 201
    assert answers["retry"] == answers["first"]
    assert runs_and_events(database_url) == (1, 1)


# A deadline the row ends, not a bound: 10 s ran out at load average 40 on 2 cores.
def wait_for(conn: psycopg.Connection, count_sql: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while conn.execute(count_sql).fetchone()[0] == 0:
        assert time.monotonic() < deadline, f"never true: {count_sql}"
        time.sleep(0.02)


def test_50_parallel_duplicates_give_one_run_and_50_identical_answers(start_api, database_url):
    base = start_api(0.5)
    n = 50
    barrier = threading.Barrier(n)

    def one(_: int) -> tuple[int, dict]:
        barrier.wait()
        return post(base, "cmd-burst")

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(one, range(n)))
    assert len(answers) == n
    assert answers[0][0] == 201
    assert all(a == answers[0] for a in answers), {str(a) for a in answers}
    assert runs_and_events(database_url) == (1, 1)


def test_a_key_reused_with_another_request_and_requests_without_a_good_key_are_refused(start_api, database_url):
    base = start_api(0)
    assert post(base, "cmd-1")[0] == 201
    assert post(base, "cmd-1", {"workflow": "offboarding", "input": {}})[0] == 422
    assert post(base, None)[0] == 400
    assert post(base, "k" * 257)[0] == 400
    assert post(base, "cmd-3", ["not", "an", "object"])[0] == 400
    assert post(base, "cmd-4", {"workflow": "w", "input": {"x": "y" * 70000}})[0] == 413
    # A negative Content-Length must not make the server read until the client hangs up.
    host, port = base.removeprefix("http://").split(":")
    raw = http.client.HTTPConnection(host, int(port), timeout=10)
    raw.putrequest("POST", "/workflow-runs")
    raw.putheader("Idempotency-Key", "cmd-5")
    raw.putheader("Content-Length", "-1")
    raw.endheaders()
    assert raw.getresponse().status == 413
    raw.close()
    assert runs_and_events(database_url) == (1, 1)
