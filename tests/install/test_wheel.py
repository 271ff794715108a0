"""pgoutbox as a user installs it: the wheel built from the checkout, installed
into a fresh virtualenv outside it (dependencies from wheels, no index), runs
migrate, streams, registry, relay, consume and status against the suite's
PostgreSQL and NATS; an event goes from outbox.emit() through the relay to a
fake HTTP handler through the consumer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import psycopg
import pytest
import wheelhouse
from pgxs import install_extension

from pgoutbox import SCHEMA_VERSION, __version__
from pgoutbox.core import migrate, tap
from support.inbox import FakeHandler
from support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]

# Builds a wheel and a virtualenv, starts relays and consumers: about a minute.
pytestmark = pytest.mark.slow


# A deadline against a hang, not a bound on speed: pip's wheel build took more
# than 120 s on 2 cores beside the rest of the suite and a CPU-bound process.
def run(*cmd, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{cmd} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("install")


@pytest.fixture(scope="module")
def wheel(work) -> Path:
    """The wheel, built from a copy of the files git knows (tracked or not
    ignored), so that nothing left over in the checkout can slip into it.
    pip builds it as for any user: setuptools in an isolated build
    environment (from pip's cache, as `make setup` leaves it, or PyPI)."""
    src = work / "src"
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # relay/pgoutbox/sql and migrations: links to the top-level folders
            (src / name).symlink_to(source.readlink())
        elif source.is_file():
            (src / name).write_bytes(source.read_bytes())
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", work / "dist", src)
    (built,) = (work / "dist").glob("pgoutbox-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(work, wheel) -> Path:
    """A fresh virtualenv with the wheel installed by pip from a folder of wheels only."""
    wheels = work / "wheelhouse"
    wheelhouse.build(wheels)
    target = work / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", target)
    run(
        sys.executable,
        *("-m", "pip", "--python", target / "bin" / "python", "install", "-q", "--no-index"),
        *("--find-links", wheels, wheel),
        cwd=work,
    )
    return target


def environment(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG", "PYTHON", "VIRTUAL_ENV"))}
    env.update({f"OUTBOX_{k.upper()}": v for k, v in settings.items()})
    return env


def test_the_wheel_holds_the_code_the_sql_the_consoles_assets_and_py_typed(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    code = {
        f"pgoutbox/{p.relative_to(ROOT / 'relay' / 'pgoutbox')}" for p in (ROOT / "relay" / "pgoutbox").rglob("*.py")
    }
    spark = {
        f"pgoutbox_spark/{p.relative_to(ROOT / 'spark' / 'pgoutbox_spark')}" for p in (ROOT / "spark").rglob("*.py")
    }
    sql = {f"pgoutbox/sql/{p.name}" for p in (ROOT / "sql").glob("*.sql")}
    found = migrate.discover(ROOT / "migrations")
    migrations = {f"pgoutbox/migrations/{p.name}" for m in found for p in (m.up, m.down)}
    kit_files = {f"pgoutbox/tap/{p.name}" for p in (ROOT / "pgtap" / "helpers").glob("*.sql")}
    assert kit_files >= {"pgoutbox/tap/events.sql", "pgoutbox/tap/upcasters.sql"}
    console = ROOT / "relay" / "pgoutbox" / "console"
    assets = {
        f"pgoutbox/console/{p.relative_to(console)}" for d in ("templates", "static") for p in (console / d).iterdir()
    }
    assert assets >= {"pgoutbox/console/templates/base.html", "pgoutbox/console/static/console.css"}
    assert not (code | spark | sql | migrations | kit_files | assets | {"pgoutbox/py.typed"}) - names
    info = zipfile.ZipFile(wheel).read(f"pgoutbox-{__version__}.dist-info/METADATA").decode()
    assert f"\nVersion: {__version__}\n" in info
    assert "\nProvides-Extra: console\n" in info


def test_the_installed_package_runs_away_from_the_checkout(venv, work):
    out = run(venv / "bin" / "pgoutbox", "--version", cwd=work, env=environment()).stdout
    assert out.strip() == f"pgoutbox {__version__}"
    listed = run(venv / "bin" / "pgoutbox", "--help", cwd=work, env=environment()).stdout
    for command in ("migrate", "relay", "consume", "status", "archive", "report", "restore-list"):
        assert command in listed
        run(venv / "bin" / "pgoutbox", command, "--help", cwd=work, env=environment())
    where = run(
        venv / "bin" / "python",
        "-c",
        "import pgoutbox.core.migrate as m; print(m.__file__); print(m.MIGRATIONS_DIR); print(len(m.discover()))",
        cwd=work,
        env=environment(),
    ).stdout.split()
    assert where[0].startswith(str(venv / "lib")), where
    assert Path(where[1]) == Path(where[0]).parents[1] / "migrations", "migrations/ read from the package"
    assert int(where[2]) == len(migrate.discover()) == SCHEMA_VERSION
    kit = run(venv / "bin" / "pgoutbox", "testing", "tap-sql", cwd=work, env=environment()).stdout
    assert kit == tap.kit_sql() and "FUNCTION pgoutbox_tap.emits(" in kit, "the testing kit's SQL from the package"


def running(proc: subprocess.Popen, log: Path, what: str):
    """For wait_for(alive=...): fails at once when the process exited."""

    def check() -> None:
        assert proc.poll() is None, f"{what}: the process exited {proc.returncode}:\n{log.read_text()}"

    return check


def start(venv: Path, work: Path, command: str, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    log = work / f"{command}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(venv / "bin" / "pgoutbox"), command], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    return proc, log


def stop(proc: subprocess.Popen, log: Path) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{log.read_text()}"


@pytest.mark.parametrize("mode", ["plain", "extension"])
def test_migrate_relay_consume_and_status_from_the_installed_wheel(
    venv, tmp_path, empty_database_url, nats_server, mode
):
    """In both install modes: on an extension-mode database (CREATE EXTENSION
    by a superuser first) `migrate` only adds today's partitions."""
    pgoutbox = venv / "bin" / "pgoutbox"
    base = {"database_url": empty_database_url, "nats_url": nats_server.url}
    work = tmp_path
    if mode == "extension":
        install_extension()
        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pgoutbox")

    out = run(pgoutbox, "migrate", cwd=work, env=environment(**base)).stdout
    assert f"schema at version {SCHEMA_VERSION}" in out
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        assert (migrate.extension_version(conn) is not None) == (mode == "extension")
        assert (
            conn.execute("SELECT count(*) FROM pg_inherits WHERE inhparent = 'outbox.events'::regclass").fetchone()[0]
            > 1
        )

    streams = work / "streams.toml"
    streams.write_text("[streams.sea]\n")
    run(pgoutbox, "streams", "--streams-file", streams, cwd=work, env=environment(**base))

    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        (event_id,) = conn.execute(
            "SELECT outbox.emit('order', '1', 'order_created', '{\"schema_version\": 1}', context => 'sea')::text"
        ).fetchone()

    def status() -> str:
        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            return conn.execute("SELECT status FROM outbox.events WHERE event_id = %s", (event_id,)).fetchone()[0]

    relay, relay_log = start(venv, work, "relay", environment(**base, relay_http_port="0", relay_name="wheel"))
    try:
        what = "the relay to publish the event"
        wait_for(
            lambda: status() == "COMPLETED", 60, what, alive=running(relay, relay_log, what), detail=relay_log.read_text
        )
    finally:
        stop(relay, relay_log)

    handler = FakeHandler()
    try:
        manifests = work / "handlers"
        manifests.mkdir()
        (manifests / "orders.toml").write_text(
            f'[[handler]]\nname = "orders"\nurl = "{handler.url}"\nsubjects = ["sea.event.order_created.v1"]\n'
        )
        registry = work / "handlers.registry.json"
        run(pgoutbox, "registry", "generate", "--manifest-dir", manifests, "--registry-file", registry, cwd=work)
        env = environment(**base, registry_file=str(registry), consumer_http_port="0", consumer_fetch_timeout="250ms")
        consume, consume_log = start(venv, work, "consume", env)
        try:

            def processed() -> bool:
                with psycopg.connect(empty_database_url, autocommit=True) as conn:
                    row = conn.execute(
                        "SELECT status FROM inbox.messages WHERE message_id = %s AND handler = 'orders'", (event_id,)
                    ).fetchone()
                return row is not None and row[0] == "PROCESSED"

            what = "the consumer to hand the event over"
            wait_for(processed, 60, what, alive=running(consume, consume_log, what), detail=consume_log.read_text)
        finally:
            stop(consume, consume_log)
        assert [c.message_id for c in handler.calls] == [event_id]
    finally:
        handler.close()

    out = run(pgoutbox, "status", cwd=work, env=environment(**base)).stdout
    assert out.strip(), "status printed nothing"
