"""Every command runs as the role docs/reference.md gives it, and nothing more.

The table between the command-roles markers of docs/reference.md is the source
of truth. Three checks read it:

  * it names every command (and the application's outbox.emit()), and a
    command that connects to PostgreSQL names a pgoutbox role (migrate and
    testing aside: the owner of the schemas runs them);
  * every SQL function a command's code calls (the SQL strings of the
    modules it imports, followed through its imports), and every table it
    reads, is granted to the roles the table names for it;
  * each pairing runs end to end: a LOGIN role that is a member of exactly
    those roles runs the real `pgoutbox` command (a process, as an operator
    would) against the suite's PostgreSQL and nats-server, and the command
    does its job with exit code 0.

The archiver's pairing starts Spark, so archive and report carry the spark mark.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pgoutbox.cli import main as cli
from pgoutbox.core import wire
from pgoutbox.dev.embedded import PG_BIN, free_port
from support import archival
from support.inbox import FakeHandler, dlq_messages, event, jetstream, publish
from support.outbox import emit, status_counts
from support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference.md"
PGOUTBOX = Path(sys.executable).parent / "pgoutbox"
EMIT = "emit"  # the table's row for the application's outbox.emit()
OWNER_RUNS = {"migrate", "testing"}  # the schemas' owner, not a pgoutbox role (the table says so)
HANDLER = "billing"
SUBJECT = "sea.event.order_created.v1"


def documented_roles(text: str | None = None) -> dict[str, tuple[str, ...]]:
    """command -> the pgoutbox roles docs/reference.md names for it, in its order."""
    text = REFERENCE.read_text() if text is None else text
    m = re.search(r"<!-- command-roles:begin -->\n(.*?)<!-- command-roles:end -->", text, re.S)
    assert m, "docs/reference.md has no command-roles table"
    rows: dict[str, tuple[str, ...]] = {}
    for line in m.group(1).strip().splitlines()[2:]:
        first, rest = line.strip().strip("|").split("|", 1)
        command = re.fullmatch(r"`pgoutbox ([a-z-]+)`", first.strip())
        name = command.group(1) if command else (EMIT if first.strip().startswith("`outbox.emit()`") else None)
        assert name, f"docs/reference.md command-roles: not a command: {first.strip()!r}"
        assert name not in rows, f"docs/reference.md command-roles: {name} twice"
        rows[name] = tuple(re.findall(r"`(pgoutbox_[a-z]+)`", rest))
    return rows


ROLES = documented_roles()
COMMANDS = {mod.COMMAND: mod for mod in cli.COMMANDS}


def connects(command: str) -> bool:
    config = COMMANDS[command].CONFIG
    return config is not None and "database_url" in config.__dataclass_fields__


def test_the_roles_table_names_every_command_and_only_roles_that_exist(conn):
    assert set(ROLES) == set(COMMANDS) | {EMIT}
    created = {r for (r,) in conn.execute("SELECT rolname FROM pg_roles WHERE rolname LIKE 'pgoutbox\\_%'")}
    for command, roles in ROLES.items():
        assert set(roles) <= created, f"{command}: {set(roles) - created} do not exist"
        if command == EMIT or (connects(command) and command not in OWNER_RUNS):
            assert roles, f"{command} connects to PostgreSQL: docs/reference.md must name its role"
        else:
            assert not roles, f"{command} does not log in as a pgoutbox role, yet the table names {roles}"


def test_the_table_is_read_as_written():
    """The parser takes what a reader sees: several roles, in order; none."""
    text = (
        "<!-- command-roles:begin -->\n| command | runs as |\n|---|---|\n"
        "| `pgoutbox audit` | `pgoutbox_admin` and `pgoutbox_relay` |\n"
        "| `pgoutbox streams` | no database role |\n"
        "| `outbox.emit()`, by the application | `pgoutbox_writer` |\n"
        "<!-- command-roles:end -->"
    )
    assert documented_roles(text) == {
        "audit": ("pgoutbox_admin", "pgoutbox_relay"),
        "streams": (),
        EMIT: ("pgoutbox_writer",),
    }


# -- what each command's code calls --------------------------------------------

PACKAGES = {"pgoutbox": ROOT / "relay" / "pgoutbox", "pgoutbox_spark": ROOT / "spark" / "pgoutbox_spark"}
_CALL = re.compile(r"\b(outbox|inbox)\.([a-z_][a-z0-9_]*)\s*\(")
_READ = re.compile(r"\bFROM\s+(outbox|inbox)\.([a-z_][a-z0-9_]*)\b(?!\s*\()")


def module_file(name: str) -> Path | None:
    top, *rest = name.split(".")
    if top not in PACKAGES:
        return None
    base = PACKAGES[top].joinpath(*rest)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported(name: str, tree: ast.Module, is_package: bool) -> Iterator[str]:
    """Every module name an import statement anywhere in the module may load
    (imports inside functions too: the Spark jobs are imported when run)."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def closure(module: str) -> dict[str, ast.Module]:
    """The modules of pgoutbox and pgoutbox_spark that `module` imports, itself included."""
    seen: dict[str, ast.Module] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        path = module_file(name)
        if name in seen or path is None:
            continue
        seen[name] = tree = ast.parse(path.read_text())
        todo.extend(imported(name, tree, path.name == "__init__.py"))
    return seen


def docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def sql_strings(tree: ast.Module) -> Iterator[str]:
    """The string literals that are SQL statements (f-strings with their holes blanked)."""
    skip = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
        elif isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else " x " for v in node.values)
        else:
            continue
        if re.search(r"\bSELECT\b", text):
            yield re.sub(r"'[^']*'", "''", text)  # a name inside a literal is not called


def argument_count(text: str, start: int) -> int:
    """How many arguments the call whose "(" is at text[start - 1] passes."""
    depth, commas, i = 0, 0, start
    while True:
        c = text[i]
        if c in "([":
            depth += 1
        elif c in ")]":
            if depth == 0:
                return commas + 1 if text[start:i].strip() else 0
            depth -= 1
        elif c == "," and depth == 0:
            commas += 1
        i += 1


@dataclass(frozen=True)
class Call:
    function: str  # schema.name
    args: int | None  # None: any overload
    where: str


def calls(command_module: str) -> tuple[set[Call], set[tuple[str, str]]]:
    """The SQL functions (with their argument count) and the tables a command's code calls and reads."""
    functions, tables = set(), set()
    for name, tree in closure(command_module).items():
        for text in sql_strings(tree):
            for m in _CALL.finditer(text):
                functions.add(Call(f"{m.group(1)}.{m.group(2)}", argument_count(text, m.end()), name))
            tables.update((f"{m.group(1)}.{m.group(2)}", name) for m in _READ.finditer(text))
    return functions, tables


def test_the_call_finder_finds_what_the_code_runs():
    """So that the grant check below cannot pass by finding nothing."""
    relay_calls, _ = calls("pgoutbox.cli.relay")
    assert {(c.function, c.args) for c in relay_calls} >= {
        ("outbox.claim", 3),
        ("outbox.mark_published", 2),
        ("outbox.mark_failed", 4),
        ("outbox.schema_version", 0),
        ("outbox.serves_workers_from", 0),
        ("outbox.create_partitions", 1),
    }
    archive_calls, archive_tables = calls("pgoutbox.cli.archive")
    assert {"outbox.seal_partition", "outbox.schema_version", "inbox.purge_archived"} <= {
        c.function for c in archive_calls
    }
    _, audit_tables = calls("pgoutbox.cli.audit")
    assert "outbox.events" in {t for t, _ in audit_tables}
    assert "outbox.serves_workers_from" not in {c.function for c in calls("pgoutbox.cli.settings")[0]}


def grants_missing(conn: psycopg.Connection, roles: tuple[str, ...], functions, tables) -> list[str]:
    missing = []
    for call in sorted(functions, key=lambda c: (c.function, c.args or 0)):
        schema, name = call.function.split(".")
        candidates = conn.execute(
            """
            SELECT p.oid::regprocedure::text, bool_or(has_function_privilege(r, p.oid, 'EXECUTE'))
            FROM pg_proc AS p, unnest(%s::text[]) AS r
            WHERE p.pronamespace = to_regnamespace(%s) AND p.proname = %s
                AND (%s::int IS NULL OR %s::int BETWEEN p.pronargs - p.pronargdefaults AND p.pronargs)
            GROUP BY 1
            """,
            (list(roles), schema, name, call.args, call.args),
        ).fetchall()
        if not candidates:
            missing.append(f"{call.function} with {call.args} argument(s) ({call.where}) does not exist")
        missing.extend(
            f"{signature} ({call.where}) is not granted to {' or '.join(roles)}"
            for signature, granted in candidates
            if not granted
        )
    for table, where in sorted(tables):
        granted = conn.execute(
            "SELECT bool_or(has_table_privilege(r, %s, 'SELECT')) FROM unnest(%s::text[]) AS r", (table, list(roles))
        ).fetchone()[0]
        if not granted:
            missing.append(f"SELECT on {table} ({where}) is not granted to {' or '.join(roles)}")
    return missing


@pytest.mark.parametrize("command", sorted(c for c, roles in ROLES.items() if roles))
def test_every_function_a_command_calls_is_granted_to_its_documented_role(conn, command):
    if command == EMIT:
        functions, tables = {Call("outbox.emit", None, "docs/reference.md")}, set()
    else:
        functions, tables = calls(COMMANDS[command].__name__)
        assert functions, f"no SQL call found for {command}"
    assert grants_missing(conn, ROLES[command], functions, tables) == []


def test_the_grant_check_fails_on_a_missing_grant(conn):
    """The check above, on a role that lacks what the relay calls."""
    functions, tables = calls("pgoutbox.cli.relay")
    missing = grants_missing(conn, ("pgoutbox_writer",), functions, tables)
    assert any(line.startswith("outbox.claim(text,integer,interval) ") for line in missing), missing


# -- each pairing, end to end -----------------------------------------------------


@dataclass
class Run:
    """One pairing's world: the owner's URL (to set up and check), the login's
    URL (what the command runs with), NATS when the command needs it."""

    owner_url: str
    login_url: str
    tmp: Path
    request: pytest.FixtureRequest

    @property
    def nats_url(self) -> str:
        return self.request.getfixturevalue("nats_server").url

    def env(self, **settings: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
        return {**archival.spark_env(), **base, "OUTBOX_DATABASE_URL": self.login_url, **settings}

    def pgoutbox(self, *args: str, timeout: float = 120, **settings: str) -> str:
        """`pgoutbox args` to its end; its stdout. Exit code 0 or the test fails."""
        done = subprocess.run(
            [str(PGOUTBOX), *args],
            env=self.env(**settings),
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, (
            f"pgoutbox {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )
        return done.stdout

    @contextlib.contextmanager
    def worker(self, *args: str, started: str, **settings: str) -> Iterator[Path]:
        """`pgoutbox args` running from its `started` log line until the block
        ends (SIGTERM, then exit 0); its log, which must hold no error line."""
        log = self.tmp / f"{args[0]}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                [str(PGOUTBOX), *args], env=self.env(**settings), cwd=self.tmp, stdout=out, stderr=subprocess.STDOUT
            )
            try:
                wait_for(lambda: proc.poll() is not None or started in log.read_text(), 60, f"{args[0]} to start")
                assert proc.poll() is None, f"pgoutbox {args[0]} exited {proc.returncode}:\n{log.read_text()}"
                yield log
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(60) == 0, log.read_text()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
        text = log.read_text()
        errors = [line for line in text.splitlines() if '"level": "error"' in line or "Traceback" in line]
        assert errors == [], text

    def streams(self) -> None:
        """SEA_EVENTS, as an operator creates it (`pgoutbox streams`, no database role)."""
        path = self.tmp / "streams.toml"
        path.write_text("[streams.sea]\n")
        out = self.pgoutbox("streams", "--streams-file", str(path), OUTBOX_NATS_URL=self.nats_url)
        assert out.splitlines() == ["SEA_EVENTS: created"]

    def owner(self) -> psycopg.Connection:
        return psycopg.connect(self.owner_url, autocommit=True)

    def dead_letter(self, *, due: bool) -> str:
        """An inbox dead letter of HANDLER with its envelope, as the consumer leaves one."""
        ev = event({"n": 1})
        envelope = wire.from_nats(*wire.to_nats(ev))
        with self.owner() as conn:
            conn.execute("SELECT inbox.receive(%s, %s, %s, %s)", (ev["event_id"], HANDLER, SUBJECT, Jsonb(envelope)))
            conn.execute(
                "SELECT inbox.record_error(%s, %s, 'handler said 422', TRUE, %s)",
                (ev["event_id"], HANDLER, timedelta(0) if due else None),
            )
        return ev["event_id"]


def inbox_statuses(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return dict(conn.execute("SELECT status, count(*) FROM inbox.messages GROUP BY 1").fetchall())


def run_relay(run: Run) -> None:
    run.streams()
    emit(run.owner_url, 5)
    path = run.tmp / "streams.toml"
    with run.worker(
        "relay",
        started='"action": "started"',
        OUTBOX_NATS_URL=run.nats_url,
        OUTBOX_STREAMS_FILE=str(path),
        OUTBOX_RELAY_HTTP_PORT="0",
    ):
        wait_for(lambda: status_counts(run.owner_url) == {"COMPLETED": 5}, 60, "the relay to publish")


def run_status(run: Run) -> None:
    emit(run.owner_url, 2)
    with run.owner() as conn:
        conn.execute(
            "SELECT outbox.emit('order', '9', 'reminder_due', '{\"schema_version\": 1}', context => 'sea',"
            " deliver_after => interval '1 day')"
        )
    report = json.loads(run.pgoutbox("status"))
    assert [(r["context"], r["unpublished"], r["due"]) for r in report["outbox"]] == [("sea", 3, 2)]
    assert [(r["context"], r["scheduled"]) for r in report["scheduled"]] == [("sea", 1)]


def run_flow(run: Run) -> None:
    """A flow of two events: both shown in emit order, with their publish state."""
    flow = uuid.uuid4()
    with run.owner() as conn:
        ids = [
            conn.execute(
                "SELECT outbox.emit('order', '1', %s, '{\"schema_version\": 1}', context => 'sea', correlation_id => %s)",
                (kind, flow),
            ).fetchone()[0]
            for kind in ("placed", "paid")
        ]
        conn.execute("SELECT outbox.emit('order', '2', 'placed', '{\"schema_version\": 1}', context => 'sea')")
    out = run.pgoutbox("flow", str(flow)).splitlines()
    events = [line for line in out if not line.startswith(" ")]
    assert [str(i) in line for i, line in zip(ids, events)] == [True, True] and len(events) == 2, out
    assert "sea.event.placed.v1" in events[0] and "PENDING" in events[0], out


def run_requeue(run: Run) -> None:
    with run.owner() as conn:
        [dead] = archival.events(conn, archival.today(), 1, dead=1)
    assert run.pgoutbox("requeue", dead, "--reason", "stream created") == "requeued 1 event(s)\n"
    assert status_counts(run.owner_url) == {"PENDING": 1}


def run_audit(run: Run) -> None:
    """Events COMPLETED half an hour ago that the (new, empty) stream lacks:
    found, and requeued for republishing with --repair."""
    run.streams()
    with run.owner() as conn:
        archival.events(conn, archival.today(), 3, context="sea")
    out = run.pgoutbox("audit", "SEA_EVENTS", "--repair", "--reason", "stream lost", OUTBOX_NATS_URL=run.nats_url)
    assert "requeued 3 events for republishing" in out, out
    assert status_counts(run.owner_url) == {"PENDING": 3}


def run_partitions(run: Run) -> None:
    assert run.pgoutbox("partitions").startswith("created: ")


def run_consume(run: Run) -> None:
    """Two events processed and one dead-lettered (the handler answers 422)."""
    handler = FakeHandler()
    try:
        manifests = run.tmp / "handlers"
        manifests.mkdir()
        (manifests / "billing.toml").write_text(
            f'[[handler]]\nname = "{HANDLER}"\nurl = "{handler.url}"\nsubjects = ["{SUBJECT}"]\n'
        )
        run.pgoutbox("registry", "generate")  # no database role: the defaults' folder and file
        run.streams()

        async def send() -> None:
            async with jetstream(run.nats_url) as js:
                for answers in ([200], [200], [422]):
                    await publish(js, event({"answers": answers}))

        asyncio.run(send())
        with run.worker(
            "consume", started='"consumer started"', OUTBOX_NATS_URL=run.nats_url, OUTBOX_CONSUMER_HTTP_PORT="0"
        ):
            wait_for(
                lambda: inbox_statuses(run.owner_url) == {"PROCESSED": 2, "DEAD_LETTER": 1}, 60, "the inbox to settle"
            )
    finally:
        handler.close()


def run_replay(run: Run) -> None:
    run.dead_letter(due=True)
    out = run.pgoutbox("replay", "--once", OUTBOX_NATS_URL=run.nats_url)
    assert out == "re-published 1 dead letter(s)\n"

    async def replayed() -> list:
        async with jetstream(run.nats_url) as js:
            return await dlq_messages(js, subject=f"sea.dlq.replay.{HANDLER}")

    assert len(asyncio.run(replayed())) == 1


def run_redrive(run: Run) -> None:
    message_id = run.dead_letter(due=False)
    [listed] = run.pgoutbox("redrive", HANDLER, "--list").splitlines()
    assert json.loads(listed)["message_id"] == message_id
    out = run.pgoutbox("redrive", HANDLER, "--all", "--reason", "handler fixed")
    assert out.startswith(f"marked 1 dead letter(s) of {HANDLER} for redrive")
    run.dead_letter(due=False)
    out = run.pgoutbox("redrive", "--match", "--owner", HANDLER, "--reason", "handler fixed")
    assert out.endswith("replayed 1 dead letter(s): outbox events requeued, inbox messages marked for the replayer\n")


def run_dead_letters(run: Run) -> None:
    """Grouped, listed and shown (as the viewer may), discarded and restored (as the admin may)."""
    message_id = run.dead_letter(due=False)
    [group] = [json.loads(line) for line in run.pgoutbox("dead-letters", "groups", "--format", "json").splitlines()]
    assert (group["owner"], group["dead_letters"]) == (HANDLER, 1)
    [listed] = run.pgoutbox("dead-letters", "list", "--format", "json").splitlines()
    assert json.loads(listed)["id"] == message_id
    assert json.loads(run.pgoutbox("dead-letters", "show", message_id, "--format", "json"))["id"] == message_id
    assert run.pgoutbox("dead-letters", "discard", "--group", group["group_id"], "--reason", "obsolete").endswith(
        "discarded 1 dead letter(s)\n"
    )
    assert run.pgoutbox("dead-letters", "restore", "--id", message_id, "--reason", "wanted").endswith(
        "restored 1 dead letter(s)\n"
    )


def run_replay_switch(run: Run) -> None:
    assert (
        run.pgoutbox("replay-switch", HANDLER, "off", "--reason", "bug 12") == f"automated replay for {HANDLER}: off\n"
    )


def run_archive(run: Run) -> None:
    """A day of three events, old enough for both retentions, and a day of
    command keys, old enough for the command retention, archived and removed."""
    day, keys_day = archival.today() - timedelta(days=20), archival.today() - timedelta(days=40)
    with run.owner() as conn:
        archival.inbox_for(conn, archival.events(conn, day, 3))
        archival.commands(conn, keys_day, "start_run", 3)
    out = run.pgoutbox("archive", timeout=600, OUTBOX_ARCHIVE_URI=str(run.tmp / "archive"))
    removed = {(line.split()[0], line.split()[1]) for line in out.splitlines() if line.split()[2:3] == ["removed"]}
    assert removed == {
        ("outbox.events", str(day)),
        ("inbox.messages", str(day)),
        ("inbox.commands", str(keys_day)),
    }, out


def run_report(run: Run) -> None:
    with run.owner() as conn:
        archival.inbox_for(conn, archival.events(conn, archival.today() - timedelta(days=2), 3))
    run.pgoutbox("report", timeout=600, OUTBOX_REPORT_URI=str(run.tmp / "report"))
    assert (run.tmp / "report" / "delivery_report.csv").read_text().count("\n") > 1


def run_emit(run: Run) -> None:
    """The application's call, through psql, as the application's login."""
    statement = "SELECT outbox.emit('order', '1', 'created', '{\"schema_version\": 1}', context => 'sea')"
    done = subprocess.run(
        [str(PG_BIN / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", run.login_url, "-c", statement],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert status_counts(run.owner_url) == {"PENDING": 1}


def run_backfill(run: Run) -> None:
    """Three events the outbox keeps reach a handler through its inbox."""
    handler = FakeHandler()
    try:
        manifests = run.tmp / "handlers"
        manifests.mkdir()
        (manifests / "billing.toml").write_text(
            f'[[handler]]\nname = "{HANDLER}"\nurl = "{handler.url}"\nsubjects = ["{SUBJECT}"]\n'
        )
        run.pgoutbox("registry", "generate")
        emit(run.owner_url, 3)
        out = run.pgoutbox("backfill", "--handler", HANDLER)
        assert f"backfilled {HANDLER}: 3 delivered" in out, out
        assert inbox_statuses(run.owner_url) == {"PROCESSED": 3}
    finally:
        handler.close()


SCENARIOS: dict[str, Callable[[Run], None]] = {
    "backfill": run_backfill,
    "relay": run_relay,
    "status": run_status,
    "requeue": run_requeue,
    "flow": run_flow,
    "audit": run_audit,
    "partitions": run_partitions,
    "consume": run_consume,
    "replay": run_replay,
    "redrive": run_redrive,
    "replay-switch": run_replay_switch,
    "dead-letters": run_dead_letters,
    "archive": run_archive,
    "report": run_report,
    EMIT: run_emit,
}
SPARK = {"archive", "report"}


def run_console(run: Run) -> None:
    """The console serves its pages to a person logged in as the login (this server
    trusts loopback, so the password is not checked here: tests/console/ checks it)."""
    import httpx

    name = run.login_url.split("//", 1)[1].split("@", 1)[0]
    port = str(free_port())
    where = run.login_url.replace(f"{name}@", "", 1)  # the console's URL names no user
    with run.worker("console", started="console serving", OUTBOX_CONSOLE_DATABASE_URL=where, OUTBOX_CONSOLE_PORT=port):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            token = re.search(r'name="csrf" value="([^"]+)"', client.get("/login").text).group(1)
            answer = client.post("/login", data={"user": name, "password": "-", "csrf": token})
            assert answer.status_code == 303, answer.text
            for path in ("/", "/dead-letters"):
                page = client.get(path)
                assert page.status_code == 200 and name in page.text, (path, page.text)


SCENARIOS["console"] = run_console


def test_every_documented_pairing_has_its_run():
    assert set(SCENARIOS) == {c for c, roles in ROLES.items() if roles}


@pytest.fixture
def login(pg_server):
    """login(roles) -> the name of a fresh LOGIN role that is a member of exactly those roles."""
    made: list[str] = []

    def make(roles: tuple[str, ...]) -> str:
        name = f"t_login_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
            conn.execute(
                psycopg.sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                    psycopg.sql.Identifier(name), psycopg.sql.SQL(", ").join(map(psycopg.sql.Identifier, roles))
                )
            )
        made.append(name)
        return name

    yield make
    with psycopg.connect(pg_server.dsn(), autocommit=True) as conn:
        for name in made:
            conn.execute(psycopg.sql.SQL("DROP ROLE IF EXISTS {}").format(psycopg.sql.Identifier(name)))


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(c, marks=[pytest.mark.spark, pytest.mark.slow] if c in SPARK else [])
        for c in sorted(c for c, roles in ROLES.items() if roles)
    ],
)
def test_the_command_runs_as_its_documented_role(command, database_url, login, tmp_path, request):
    roles = ROLES[command]
    name = login(roles)
    with psycopg.connect(database_url, autocommit=True) as conn:
        member_of = {
            r
            for (r,) in conn.execute(
                "SELECT b.rolname FROM pg_auth_members AS m JOIN pg_roles AS b ON m.roleid = b.oid"
                " JOIN pg_roles AS u ON m.member = u.oid WHERE u.rolname = %s",
                (name,),
            )
        }
    assert member_of == set(roles)
    login_url = database_url.replace("postgresql://postgres@", f"postgresql://{name}@", 1)
    assert login_url != database_url
    SCENARIOS[command](Run(database_url, login_url, tmp_path, request))


# -- the suite's own helpers ----------------------------------------------------


def test_the_suites_helpers_run_each_command_as_its_documented_role(database_url, nats_server, tmp_path):
    """support.outbox and support.inbox start the relay and the consumer as a login
    in exactly the role this table gives the command (not as the suite's
    superuser), unless a test says why not (as_owner)."""
    from support.inbox import consumer_config, default_consumer_config, write_registry
    from support.outbox import RelayProcess, relay_config
    from support.roles import groups

    registry_file = write_registry(tmp_path, [{"name": HANDLER, "url": "http://127.0.0.1:1/e", "subjects": [SUBJECT]}])
    made = {
        "relay": [
            relay_config(database_url, nats_server.url).database_url,
            RelayProcess(tmp_path, "r", database_url, nats_server.url).env["OUTBOX_DATABASE_URL"],
        ],
        "consume": [
            consumer_config(database_url, nats_server.url, registry_file).database_url,
            default_consumer_config(database_url, nats_server.url, registry_file).database_url,
        ],
    }
    for command, urls in made.items():
        for url in urls:
            assert groups(url) == set(ROLES[command]), (command, url)
    assert groups(database_url) >= {"SUPERUSER"}
    # as owner: the test checks that as_owner leaves the URL as it is
    owner = consumer_config(database_url, nats_server.url, registry_file, as_owner="the test says why")
    assert owner.database_url == database_url
