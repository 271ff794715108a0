"""pgoutbox report: the delivery report (delivery, duplicate
processing and DLQ rates, end-to-end latency percentiles) per context, event
type and day, over the archive and the live tables, as Parquet, CSV and PNG."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from datetime import UTC, datetime

from pgoutbox.cli.archive import SparkJobConfig
from pgoutbox.core import db, settings
from pgoutbox.core.errors import ConfigError
from pgoutbox.core.settings import option

COMMAND = "report"
HELP = "Write the delivery report (table + chart) over the archive and the live tables."


@dataclass(frozen=True)
class ReportConfig(SparkJobConfig):
    report_uri: str = option(
        settings.Setting(
            "report_uri",
            "OUTBOX_REPORT_URI",
            ".data/report",
            "Folder (or Hadoop-compatible URI) for delivery_report.parquet, .csv and .png",
        )
    )


CONFIG = ReportConfig
SETTINGS = settings.of(CONFIG)


def run(cfg: ReportConfig, args: argparse.Namespace) -> int:
    try:
        from pgoutbox_spark import jdbc, report, session, storage
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(f"pgoutbox report needs the spark extra (pip install 'pgoutbox[spark]'): {exc}") from exc
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    with db.connect(cfg.database_url, check_schema=True) as conn:
        target = jdbc.from_connection(conn, cfg.jdbc_url)
        with session.spark_session(cfg.spark_master, cfg.spark_jars, "pgoutbox-report") as spark:
            table = report.build(spark, conn, target, fetch_size=cfg.fetch_size, read_partitions=cfg.read_partitions)
            paths = report.write(
                spark,
                table,
                storage.normalise_uri(cfg.report_uri),
                title=f"pgoutbox delivery report, generated {generated}",
            )
    for kind, uri in paths.items():
        print(f"{kind:8} {uri}")
    return 0
