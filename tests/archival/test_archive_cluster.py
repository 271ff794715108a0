"""The documented spark-submit path on a real Spark standalone cluster: a
master and two workers on 127.0.0.1 (spark-class), one cluster for all the
checks. spark-submit relay/pgoutbox/cli/submit.py archive:

  * refuses the default local archive folder (the executors would each write
    their share to their own disk) unless OUTBOX_ARCHIVE_SHARED=true says it
    is shared: one line, exit 2, nothing sealed;
  * with executors that no worker can host (spark.executor.memory above the
    workers' memory) stops after OUTBOX_SPARK_START_TIMEOUT: one line, exit
    5, nothing sealed, instead of waiting for ever;
  * otherwise archives every day on the executors of both workers (the
    workers' status pages list an executor of the application, and the
    application's event log shows tasks on each), and the archive holds
    exactly the live rows."""

from __future__ import annotations

import subprocess
from datetime import timedelta
from pathlib import Path

import pytest

from pgoutbox_spark import database as db
from support.archival import (
    SPARK_DEADLINE,
    TEST_JVM_OPTIONS,
    SparkCluster,
    archived_rows,
    events,
    inbox_for,
    live_rows,
    spark_env,
    spark_home,
    tasks_per_executor,
    today,
)
from support.roles import login

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
OUTBOX, INBOX = db.OUTBOX, db.INBOX


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SparkCluster(tmp_path_factory.mktemp("spark-cluster"), workers=2, memory="1g")
    c.start()
    yield c
    c.stop()


def submit(cluster: SparkCluster, env: dict[str, str], *conf: str) -> subprocess.CompletedProcess:
    command = [
        str(spark_home() / "bin" / "spark-submit"),
        *("--master", cluster.url, "--deploy-mode", "client"),
        *("--jars", "/usr/share/java/postgresql.jar"),
        *("--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1"),
        *("--conf", "spark.ui.enabled=false", "--conf", "spark.executor.memory=512m"),
        *("--conf", f"spark.executor.extraJavaOptions={TEST_JVM_OPTIONS}"),
        *conf,
        str(ROOT / "relay" / "pgoutbox" / "cli" / "submit.py"),
        "archive",
    ]
    full = {k: v for k, v in spark_env(**env).items() if not k.startswith("PG")}
    return subprocess.run(command, env=full, capture_output=True, text=True, timeout=SPARK_DEADLINE, cwd=ROOT)


def ours(run: subprocess.CompletedProcess) -> list[str]:
    """Our error lines. spark-submit merges the Python driver's stderr into
    its stdout; its own log lines go to stderr."""
    return [line for line in (run.stdout + run.stderr).splitlines() if line.startswith("pgoutbox ")]


def sealed(conn) -> int:
    return conn.execute("SELECT count(*) FROM pg_trigger WHERE tgname = '_050_archived_read_only'").fetchone()[0]


def test_spark_submit_on_a_standalone_cluster(cluster, spark, conn, database_url, tmp_path):
    # Older than both default retentions (outbox 7d, inbox 14d): every day is archived on the defaults.
    days = [today() - timedelta(days=k) for k in (17, 16, 15)]
    for k, day in enumerate(days):
        inbox_for(conn, events(conn, day, 400 + 100 * k, context=("sea", "vibespro")[k % 2]))
    before = {(s, d): live_rows(conn, s, d) for d in days for s in (OUTBOX, INBOX)}
    env = {
        "OUTBOX_DATABASE_URL": login(database_url, "pgoutbox_archiver"),
        "OUTBOX_ARCHIVE_URI": str(tmp_path / "archive"),
        "OUTBOX_SPARK_READ_PARTITIONS": "4",
    }

    # 1. A folder of one host's disk under a cluster master: refused.
    refused = submit(cluster, env)
    assert refused.returncode == 2, refused.stderr[-3000:]
    (line,) = ours(refused)
    assert line.startswith("pgoutbox archive: ConfigError: OUTBOX_ARCHIVE_URI=file://"), line
    assert "OUTBOX_ARCHIVE_SHARED=true" in line and cluster.url in line
    assert "Traceback" not in refused.stdout + refused.stderr and sealed(conn) == 0

    # The workers of a loopback cluster do share this disk: the operator says so.
    env["OUTBOX_ARCHIVE_SHARED"] = "true"

    # 2. Executors no worker can host: a bounded wait, then one line, nothing sealed.
    # not default: the bounded wait is what this step tests (2 min on the default)
    too_big = submit(cluster, {**env, "OUTBOX_SPARK_START_TIMEOUT": "5s"}, "--conf", "spark.executor.memory=64g")
    assert too_big.returncode == 5, too_big.stderr[-3000:]
    (line,) = ours(too_big)
    assert line.startswith("pgoutbox archive: SparkUnavailable: no Spark executor registered within 5s"), line
    assert "spark.executor.memory=64g" in line and "nothing was sealed" in line
    assert "Traceback" not in too_big.stdout + too_big.stderr and sealed(conn) == 0

    # 3. The archival itself, on both workers' executors.
    events_dir = tmp_path / "events"
    events_dir.mkdir()
    done = submit(
        cluster,
        env,
        *("--conf", "spark.cores.max=2", "--conf", "spark.scheduler.minRegisteredResourcesRatio=1.0"),
        *("--conf", "spark.eventLog.enabled=true", "--conf", "spark.eventLog.compress=false"),
        *("--conf", f"spark.eventLog.dir={events_dir.as_uri()}"),
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    for day in days:
        for source in (OUTBOX, INBOX):
            assert f"{source:15} {day}  removed " in done.stdout, done.stdout
            (audit,) = [a for a in db.audits(conn, source) if a.day == day]
            assert audit.removed_at is not None
            assert archived_rows(spark, audit.archive_uri) == before[(source, day)]
            assert live_rows(conn, source, day) == []

    app = max(cluster.master()["completedapps"], key=lambda a: a["starttime"])  # the last of the three
    used = []
    for page in cluster.worker_pages():
        executors = [e for e in page["finishedexecutors"] + page["executors"] if e["appid"] == app["id"]]
        used.append(len(executors))
    assert used == [1, 1], f"one executor of {app['id']} on each worker: {used}"
    tasks = tasks_per_executor(events_dir, app["id"])
    assert len([n for executor, n in tasks.items() if executor != "driver" and n > 0]) == 2, tasks
