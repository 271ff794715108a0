"""`pgoutbox archive` and `report` settings without Spark or a database: every
setting has its environment twin (split from tests/archival/test_archive_cli.py)."""

from __future__ import annotations

from pgoutbox.cli import main as cli


def test_every_archival_setting_has_an_environment_twin(capsys):
    assert cli.main(["settings"]) == 0
    out = capsys.readouterr().out
    for env in (
        "OUTBOX_ARCHIVE_URI=.data/archive",
        "OUTBOX_ARCHIVE_RETENTION=7d",
        "OUTBOX_ARCHIVE_DEAD_LETTER_RETENTION=30d",
        "OUTBOX_INBOX_RETENTION=14d",
        "OUTBOX_ARCHIVE_DROP=true",
        "OUTBOX_ARCHIVE_LOCK_TIMEOUT=5s",
        "OUTBOX_COMMAND_RETENTION=30d",
        "OUTBOX_ARCHIVE_SOURCES=outbox,inbox,commands ",
        "OUTBOX_ARCHIVE_DRY_RUN=false",
        "OUTBOX_SPARK_MASTER=local[*]",
        "OUTBOX_SPARK_JARS=/usr/share/java/postgresql.jar",
        "OUTBOX_JDBC_URL=",
        "OUTBOX_SPARK_READ_PARTITIONS=4",
        "OUTBOX_SPARK_FETCH_SIZE=10000",
        "OUTBOX_ARCHIVE_SHARED=false",
        "OUTBOX_SPARK_START_TIMEOUT=2m",
        "OUTBOX_REPORT_URI=.data/report",
    ):
        assert env in out, env
