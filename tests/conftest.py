"""Real components only: the suite starts its own PostgreSQL 15 (one server
per pytest-xdist worker, one template database with the migrations applied,
a fresh clone per test) and a fresh nats-server with JetStream per test that
asks for one. Both take free loopback ports and their own folders, so that
workers (and other processes on the machine) never meet; roles, being
cluster-wide, stay inside one worker's server."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
from _pytest.nodeid import NodeId

from pgoutbox.core import migrate as migrate_mod
from pgoutbox.dev.embedded import EmbeddedNats, EmbeddedPostgres
from support.archival import TEST_JVM_OPTIONS
from support.census import Census
from support.inbox import FakeHandler
from support.scheduling import ChainReport, LongestChainFirst, cpu_seconds, longest_chain_first
from support.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "pgoutbox_template"

# The suite's JVMs on the JIT's first tier (support.archival.TEST_JVM_OPTIONS).
for _name in ("SPARK_SUBMIT_OPTS", "SPARK_DAEMON_JAVA_OPTS"):
    os.environ.setdefault(_name, TEST_JVM_OPTIONS)
_counter = itertools.count()


# Heavy tests that must not run side by side (`make test` runs `--dist loadgroup`):
# each group goes to one worker, which runs its tests one after the other,
# while the other workers share the rest.
#   chaos:         the chaos harness's soaks (the run's longest chain, about 6 min);
#   chaos-cluster: the NATS cluster's soak and replica check (a chain of its own:
#                  with the soaks above it would be the whole run's length);
#   outage:        kills, outages and failovers under load, whose timeouts a
#                  starved machine would trip; and the 200,000 dead row
#                  versions of the held-snapshot test (a CPU-heavy minute);
#   spark-ops, spark: the tests on a SparkSession (a JVM on 2 cores, 20-30 s to
#                  start, one per worker that needs it), in two groups: one
#                  would be the run's longest chain. The standalone Spark
#                  cluster's test (master, workers, spark-submit) is in
#                  spark-ops: it reads the archive back through that chain's
#                  SparkSession, where a chain of its own started a third;
#                  The Spark jobs run as commands (`pgoutbox archive`, backfill
#                  from an archive, spark-submit) stay in `spark`: a chain of
#                  their own ran beside the others, and every JVM started
#                  slower on the two busy cores (the server tier 728 -> 1,075 s);
#   install:       PGXS installs the extension into the one PostgreSQL installation;
#   browser:       the console's tests: headless Chromium processes, and the
#                  password-checking PostgreSQL they share (tests/console/conftest.py).
#   jetstream-away, jetstream-away-cluster: a relay on the defaults through a
#                  5-minute JetStream outage (a server without JetStream; a
#                  cluster that lost 2 of 3 nodes): chains of about 6 minutes
#                  each, mostly waiting, beside the rest of the suite.
_GROUPS = {
    "tests/chaos/test_chaos.py": "chaos",
    "tests/chaos/test_cluster.py": "chaos-cluster",
    "tests/chaos/test_cluster_faults.py": "chaos-cluster-faults",
    "tests/chaos/test_failover.py": "outage",
    "tests/inbox/test_consumer_outages.py": "outage",
    "tests/inbox/test_consumer_crash.py": "outage",
    "tests/outbox/test_relay_processes.py": "outage",
    "tests/outbox/test_held_snapshot.py": "outage",
    "tests/archival/test_archive_cluster.py": "spark-ops",
    "tests/archival/test_archive_operations.py": "spark-ops",
    "tests/install/": "install",
    "tests/console/": "browser",
    "tests/outbox/test_jetstream_away.py": "jetstream-away",
    "tests/outbox/test_jetstream_away_cluster.py": "jetstream-away-cluster",
    "tests/inbox/test_handler_outage.py": "handler-outage",
}


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    # Before every other implementation (xdist's reads the groups).
    for item in items:
        path = item.nodeid.split("::")[0]
        group = next((g for prefix, g in _GROUPS.items() if path.startswith(prefix)), None)
        if group is None and (item.get_closest_marker("spark") or "spark" in getattr(item, "fixturenames", ())):
            group = "spark"
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
    result = yield
    # pytest-xdist 3.8 tells the scheduler a test's group by appending
    # "@group" to its node id, through Item._nodeid, which pytest 9.2 no longer
    # reads (the id is Item._id): without this, every group is scattered over
    # the workers. Done only when xdist's own did not take effect.
    if getattr(config.option, "loadgroup", False):
        for item in items:
            names = sorted(
                {
                    str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")
                }
            )
            suffix = "@" + "_".join(names)
            if names and not item.nodeid.endswith(suffix):
                item._id = NodeId.parse(item.nodeid + suffix)
        longest_chain_first(items)  # the order support.scheduling.LongestChainFirst hands them out in
    return result


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadgroup`: the longest chains first, nothing queued behind a
    5-minute outage (support.scheduling)."""
    if config.getvalue("dist") == "loadgroup":
        return LongestChainFirst(config, log)
    return None


_chains = ChainReport()
_cpu_mark = [cpu_seconds()]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # The CPU since the previous phase's report, on the report (xdist
    # carries a report's attributes to the controller's ChainReport).
    report = yield
    now = cpu_seconds()
    report.cpu, _cpu_mark[0] = now - _cpu_mark[0], now
    return report


def pytest_runtest_logreport(report):
    _chains.add(report)


_census: list[Census] = []


def pytest_configure(config):
    # The main process of an xdist run: what every process of the run used.
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", default=None):
        _census.append(Census())
        _census[0].start()


def pytest_terminal_summary(terminalreporter):
    if _chains.workers:  # the controller of an xdist run
        terminalreporter.write_sep("-", "chains (each group's tests added up) and workers' busy time")
        for line in _chains.lines():
            terminalreporter.write_line(line)
    if _census:
        _census[0].stop()
        terminalreporter.write_sep("-", "CPU by kind of process, every process started after pytest (support.census)")
        for line in _census[0].lines():
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True, scope="session")
def _clean_environment():
    """Tests configure pgoutbox explicitly; stray OUTBOX_*/PG*/OTEL_* vars must not leak in
    (an OTEL_* variable turns traces on)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(("OUTBOX_", "PG", "OTEL_"))}
    yield
    os.environ.update(saved)


@pytest.fixture(scope="session")
def pg_server():
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-pg-"))
    server = EmbeddedPostgres(root, settings={"fsync": "off", "synchronous_commit": "off"})
    server.start()
    try:  # a failed migration must not leave the server running
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {TEMPLATE}")
        with psycopg.connect(server.dsn(TEMPLATE), autocommit=True) as conn:
            migrate_mod.migrate(conn)
            conn.execute("CREATE EXTENSION IF NOT EXISTS pgtap")
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


def create_database(server: EmbeddedPostgres, template: str = TEMPLATE) -> str:
    name = f"t{os.getpid()}_{next(_counter)}"
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
    return name


def drop_database(server: EmbeddedPostgres, name: str) -> None:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def database_url(pg_server):
    """A fresh database with the schema migrated, dropped after the test."""
    name = create_database(pg_server)
    yield pg_server.dsn(name)
    drop_database(pg_server, name)


@pytest.fixture
def empty_database_url(pg_server):
    """A fresh database with nothing applied."""
    name = create_database(pg_server, "template0")
    yield pg_server.dsn(name)
    drop_database(pg_server, name)


@pytest.fixture
def conn(database_url):
    with psycopg.connect(database_url, autocommit=True) as c:
        yield c


@pytest.fixture
def nats_server(tmp_path):
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def handler():
    """An HTTP handler on a free loopback port, answering as each message's
    payload says (support.inbox.FakeHandler), stopped after the test."""
    fake = FakeHandler()
    yield fake
    fake.close()


@pytest.fixture(scope="session")
def spark():
    """One local SparkSession for the whole run: starting one takes 10-30 s here."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pgoutbox_spark import session

    # A JVM zone other than UTC: a time-zone slip in the JDBC reads would show
    # as a count or checksum mismatch in every archival test.
    s = session.build(
        "local[2]",
        "/usr/share/java/postgresql.jar",
        "pgoutbox-tests",
        conf={"spark.driver.extraJavaOptions": f"-Duser.timezone=America/New_York {TEST_JVM_OPTIONS}"},
    )
    assert s.sparkContext._jvm.java.util.TimeZone.getDefault().getID() == "America/New_York"
    logging.getLogger("py4j").setLevel(logging.WARNING)  # no chatter from its finalisers at exit
    yield s
    s.stop()


# -- the console's PostgreSQL -------------------------------------------------
# The console's tests log in with a role and a password, so they run on a
# PostgreSQL of their own that checks passwords (scram-sha-256 for every role
# but the superuser, which sets up): the shared servers trust loopback, where
# a wrong password would pass. (Here, not in tests/console/conftest.py: two
# conftest modules would both be imported as `conftest`, and the tests that
# import helpers from this one would get the other.)

CONSOLE_TEMPLATE = "console_template"

_CONSOLE_HBA = """\
local all all trust
host all postgres 127.0.0.1/32 trust
host all all 127.0.0.1/32 scram-sha-256
"""


@pytest.fixture(scope="session")
def password_pg():
    root = Path(tempfile.mkdtemp(prefix="pgoutbox-console-pg-"))
    server = EmbeddedPostgres(root, settings={"fsync": "off", "synchronous_commit": "off"})
    server.start()
    try:
        (server.datadir / "pg_hba.conf").write_text(_CONSOLE_HBA)
        server.reload()
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {CONSOLE_TEMPLATE}")
            conn.execute("CREATE ROLE hba_probe LOGIN PASSWORD 'right'")

        def checks_passwords() -> bool:  # a reload takes effect a moment after pg_ctl returns
            try:
                psycopg.connect(server.dsn().replace("postgres@", "hba_probe:wrong@", 1)).close()
                return False
            except psycopg.OperationalError:
                return True

        wait_for(checks_passwords, 10, "pg_hba.conf to ask for passwords")
        with psycopg.connect(server.dsn(CONSOLE_TEMPLATE), autocommit=True) as conn:
            migrate_mod.migrate(conn)
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def console_db(password_pg):
    """A fresh migrated database on the password-checking server: (superuser URL, URL without a user)."""
    name = f"c{time.monotonic_ns()}"
    with psycopg.connect(password_pg.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {CONSOLE_TEMPLATE}")
    yield password_pg.dsn(name), f"postgresql://127.0.0.1:{password_pg.port}/{name}"
    with psycopg.connect(password_pg.dsn(), autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
