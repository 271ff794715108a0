"""Where the archive lives, and the few file-system moves the job makes,
through Hadoop's FileSystem API so that any Hadoop-compatible store works
(a local folder by default; hdfs://, s3a://, ... on a cluster).

Layout under the archive root:
    outbox_events/day=YYYY-MM-DD/context=<ctx>/part-*.parquet
    inbox_messages/day=YYYY-MM-DD/context=<ctx>/part-*.parquet
    inbox_commands/day=YYYY-MM-DD/handler=<handler>/part-*.parquet
    outbox_events/day=YYYY-MM-DD.attempt-N/...        (the day archived again after
                                                     N-1 voided audits: beside them)
    _staging/<dataset>/day=YYYY-MM-DD/<run id>/...   (a day being written)

A day is written to a fresh staging folder and then renamed into place as a
whole, so a reader never sees half a day, and a crash leaves either the old
folder, the new one, or no folder: never a mix. (Rename is atomic on HDFS and
local disks; on object stores it is a copy, which the verification after it
still checks.)
"""

from __future__ import annotations

import uuid
from datetime import date
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pyspark.sql import SparkSession

from .failures import ArchiveFailure, Failure

DATASETS = {"outbox.events": "outbox_events", "inbox.messages": "inbox_messages", "inbox.commands": "inbox_commands"}


def normalise_uri(text: str) -> str:
    """A URI for Spark: a bare path becomes an absolute file: URI."""
    if urlparse(text).scheme:
        return text.rstrip("/")
    return Path(text).expanduser().resolve().as_uri()


def dataset_uri(root: str, source: str) -> str:
    return f"{root.rstrip('/')}/{DATASETS[source]}"


def day_uri(root: str, source: str, day: date, attempt: int = 1) -> str:
    """The final folder of a day; attempt > 1 when earlier archives of it were
    voided (each keeps its own folder)."""
    suffix = "" if attempt == 1 else f".attempt-{attempt}"
    return f"{dataset_uri(root, source)}/day={day.isoformat()}{suffix}"


def free_day_uri(root: str, source: str, day: date, taken: set[str]) -> str:
    """The first day folder that no voided audit points to."""
    attempt = 1
    while day_uri(root, source, day, attempt) in taken:
        attempt += 1
    return day_uri(root, source, day, attempt)


def is_local(uri: str) -> bool:
    """A folder of one host's disk (file: URI), as opposed to a shared file system."""
    return urlparse(uri).scheme in ("", "file")


def staging_day_uri(root: str, source: str, day: date) -> str:
    return f"{root.rstrip('/')}/_staging/{DATASETS[source]}/day={day.isoformat()}"


def fresh_staging_uri(root: str, source: str, day: date) -> str:
    return f"{staging_day_uri(root, source, day)}/{uuid.uuid4().hex}"


def day_root(uri: str) -> str:
    """The dataset folder of a day folder (the basePath for reading days)."""
    head, sep, _ = uri.rpartition("/day=")
    if not sep:
        raise ValueError(f"not a day folder: {uri}")
    return head


class Storage:
    """Hadoop FileSystem operations for one Spark session."""

    def __init__(self, spark: SparkSession):
        jvm = spark.sparkContext._jvm
        if jvm is None:  # the context was stopped
            raise ArchiveFailure(Failure.SPARK_FAILED, "the Spark session has stopped (no JVM gateway)")
        self._jvm = jvm
        self._conf = spark.sparkContext._jsc.hadoopConfiguration()

    def _path(self, uri: str) -> Any:  # py4j: org.apache.hadoop.fs.Path
        return self._jvm.org.apache.hadoop.fs.Path(uri)

    def _fs(self, uri: str) -> Any:  # py4j: org.apache.hadoop.fs.FileSystem
        return self._path(uri).getFileSystem(self._conf)

    def exists(self, uri: str) -> bool:
        return bool(self._fs(uri).exists(self._path(uri)))

    def delete(self, uri: str) -> None:
        fs = self._fs(uri)
        if fs.exists(self._path(uri)):
            fs.delete(self._path(uri), True)

    def replace(self, staging: str, final: str) -> None:
        """Moves staging to final, replacing what was there."""
        fs = self._fs(final)
        target = self._path(final)
        if fs.exists(target):
            fs.delete(target, True)
        if not fs.mkdirs(target.getParent()):
            raise ArchiveFailure(
                Failure.STORAGE_UNWRITABLE, f"cannot create the folder {target.getParent().toString()}"
            )
        if not fs.rename(self._path(staging), target):
            raise ArchiveFailure(Failure.STORAGE_FAILED, f"cannot rename {staging} to {final}")

    def default_fs(self) -> str | None:
        """fs.defaultFS of the session's Hadoop configuration (file:/// unless configured)."""
        value = self._conf.get("fs.defaultFS")
        return None if value is None else str(value)

    def check_writable(self, root: str) -> None:
        """Creates the root if needed and writes and deletes a probe file in it
        (raises what the file system raises)."""
        probe = f"{root.rstrip('/')}/_probe-{uuid.uuid4().hex}"
        fs = self._fs(root)
        if not fs.mkdirs(self._path(root)):
            raise ArchiveFailure(Failure.STORAGE_UNWRITABLE, f"cannot create the folder {root}")
        out = fs.create(self._path(probe), True)
        try:
            out.write(bytearray(b"pgoutbox"))
        finally:
            out.close()
        fs.delete(self._path(probe), False)

    def write_bytes(self, uri: str, data: bytes) -> None:
        fs = self._fs(uri)
        fs.mkdirs(self._path(uri).getParent())
        out = fs.create(self._path(uri), True)
        try:
            out.write(bytearray(data))
        finally:
            out.close()
