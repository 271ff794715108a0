"""Where the archive lives, and the few file-system moves the job makes,
through Hadoop's FileSystem API so that any Hadoop-compatible store works
(a local folder by default; hdfs://, s3a://, ... on a cluster).

Layout under the archive root:
    outbox_events/day=YYYY-MM-DD/context=<ctx>/part-*.parquet
    inbox_messages/day=YYYY-MM-DD/context=<ctx>/part-*.parquet
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
from urllib.parse import urlparse

from pyspark.sql import SparkSession

DATASETS = {"outbox.events": "outbox_events", "inbox.messages": "inbox_messages"}


def normalise_uri(text: str) -> str:
    """A URI for Spark: a bare path becomes an absolute file: URI."""
    if urlparse(text).scheme:
        return text.rstrip("/")
    return Path(text).expanduser().resolve().as_uri()


def dataset_uri(root: str, source: str) -> str:
    return f"{root.rstrip('/')}/{DATASETS[source]}"


def day_uri(root: str, source: str, day: date) -> str:
    return f"{dataset_uri(root, source)}/day={day.isoformat()}"


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
        self._jvm = spark.sparkContext._jvm
        self._conf = spark.sparkContext._jsc.hadoopConfiguration()

    def _path(self, uri: str):
        return self._jvm.org.apache.hadoop.fs.Path(uri)

    def _fs(self, uri: str):
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
        fs.mkdirs(target.getParent())
        if not fs.rename(self._path(staging), target):
            raise OSError(f"could not rename {staging} to {final}")

    def write_bytes(self, uri: str, data: bytes) -> None:
        fs = self._fs(uri)
        fs.mkdirs(self._path(uri).getParent())
        out = fs.create(self._path(uri), True)
        try:
            out.write(bytearray(data))
        finally:
            out.close()
