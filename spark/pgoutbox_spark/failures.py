"""What went wrong outside SQL, as one line with a stable code.

A day of archival touches three things besides the SQL steps: the database
over JDBC (from the driver and the executors), the archive's file system
(through Hadoop), and Spark itself. Their errors arrive as Java exceptions
wrapped by py4j or PySpark; this module walks the Java cause chain and names
the failure by the exception classes it finds (and PostgreSQL's SQLSTATE for
JDBC), so that each day reports one line and the run goes on.

Codes (docs/archival.md "Failure codes"):
    JDBC_UNREACHABLE      the database host is unknown, or its port closed or silent
    JDBC_NO_DATABASE      the server answered, the database does not exist
    JDBC_REFUSED          the server refused the login or a privilege
    JDBC_FAILED           another JDBC error (its SQLSTATE is shown)
    STORAGE_UNWRITABLE    the archive location refused a write (permissions, read-only)
    STORAGE_NOT_CONFIGURED  the URI's scheme has no file system here (missing jars or
                          Hadoop configuration)
    STORAGE_UNREACHABLE   the file system's server cannot be reached (a NameNode, ...)
    STORAGE_FAILED        another file-system error
    SPARK_FAILED          Spark failed otherwise (a job, an executor, the session)
    ARCHIVE_INCOMPLETE    the archive read back does not hold the sealed rows
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from py4j.protocol import Py4JError, Py4JJavaError
from pyspark.errors import PySparkException

from pgoutbox.core.errors import PgOutboxError, SparkUnavailable


class Failure(enum.StrEnum):
    JDBC_UNREACHABLE = "JDBC_UNREACHABLE"
    JDBC_NO_DATABASE = "JDBC_NO_DATABASE"
    JDBC_REFUSED = "JDBC_REFUSED"
    JDBC_FAILED = "JDBC_FAILED"
    STORAGE_UNWRITABLE = "STORAGE_UNWRITABLE"
    STORAGE_NOT_CONFIGURED = "STORAGE_NOT_CONFIGURED"
    STORAGE_UNREACHABLE = "STORAGE_UNREACHABLE"
    STORAGE_FAILED = "STORAGE_FAILED"
    SPARK_FAILED = "SPARK_FAILED"
    ARCHIVE_INCOMPLETE = "ARCHIVE_INCOMPLETE"


class ArchiveFailure(PgOutboxError):
    """A day could not be archived for a reason outside SQL; nothing of it was removed."""

    def __init__(self, failure: Failure, message: str):
        super().__init__(message)
        self.code = failure


# What the Spark and py4j layers raise: a Java exception, or PySpark's
# translation of one.
SPARK_ERRORS = (Py4JError, PySparkException)


@dataclass(frozen=True)
class JavaError:
    cls: str
    message: str
    sqlstate: str | None


def _java_throwable(exc: BaseException) -> Any:  # a py4j JavaObject, or None
    if isinstance(exc, Py4JJavaError):
        return exc.java_exception
    return getattr(exc, "_origin", None)  # PySpark's captured exceptions keep the Java one


def chain(exc: BaseException) -> list[JavaError]:
    """The Java cause chain behind exc (outermost first), or [] when there is none."""
    found: list[JavaError] = []
    throwable = _java_throwable(exc)
    seen = 0
    while throwable is not None and seen < 20:
        seen += 1
        try:
            cls = str(throwable.getClass().getName())
            message = str(throwable.getMessage() or "")
            sqlstate = str(throwable.getSQLState()) if cls.endswith("PSQLException") else None
            found.append(JavaError(cls, message, sqlstate))
            cause = throwable.getCause()
        except Py4JError:  # the JVM is gone
            break
        if cause is None or cause.equals(throwable):
            break
        throwable = cause
    return found


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _names(errors: list[JavaError]) -> Iterator[str]:
    for e in errors:
        yield e.cls
        yield e.message  # a task failure names the executor's exception in the text


def _has(errors: list[JavaError], *names: str) -> bool:
    return any(name in text for text in _names(errors) for name in names)


def jdbc_where(url: str) -> str:
    """host, port and database of a jdbc:postgresql:// URL."""
    parsed = urlparse(url.removeprefix("jdbc:"))
    database = parsed.path.lstrip("/") or "(default)"
    return f"host {parsed.hostname}, port {parsed.port or 5432}, database {database}"


def _jdbc(errors: list[JavaError], jdbc_url: str) -> ArchiveFailure | None:
    psql = [e for e in errors if e.cls.endswith("PSQLException")]
    if not psql and not _has(errors, "org.postgresql."):
        return None
    where = f"JDBC {jdbc_where(jdbc_url)}"
    states = [e.sqlstate for e in psql if e.sqlstate]
    reason = _first_line(psql[-1].message if psql else errors[-1].message)
    if "3D000" in states:
        return ArchiveFailure(Failure.JDBC_NO_DATABASE, f"{where}: the server answered, the database does not exist")
    if any(s.startswith("28") or s == "42501" for s in states):
        return ArchiveFailure(Failure.JDBC_REFUSED, f"{where}: refused [{states[0]}]: {reason}")
    if _has(errors, "java.net.UnknownHostException"):
        return ArchiveFailure(Failure.JDBC_UNREACHABLE, f"{where}: unknown host")
    if _has(errors, "java.net.ConnectException"):
        return ArchiveFailure(Failure.JDBC_UNREACHABLE, f"{where}: port closed (connection refused)")
    if _has(errors, "java.net.SocketTimeoutException", "java.net.NoRouteToHostException"):
        return ArchiveFailure(Failure.JDBC_UNREACHABLE, f"{where}: no answer (timed out)")
    state = f" [{states[0]}]" if states else ""
    return ArchiveFailure(Failure.JDBC_FAILED, f"{where}{state}: {reason}")


UNWRITABLE = (
    "org.apache.hadoop.security.AccessControlException",
    "java.nio.file.AccessDeniedException",
    "java.nio.file.ReadOnlyFileSystemException",
    "org.apache.hadoop.fs.FileAlreadyExistsException",
    "org.apache.hadoop.fs.ParentNotDirectoryException",
    "Permission denied",
    "Mkdirs failed",
)
NOT_CONFIGURED = (
    "org.apache.hadoop.fs.UnsupportedFileSystemException",
    "java.lang.ClassNotFoundException",
    "java.lang.NoClassDefFoundError",
    "Incomplete HDFS URI",
)


def _storage(errors: list[JavaError], uri: str) -> ArchiveFailure | None:
    deepest = _first_line(errors[-1].message) if errors else ""
    if _has(errors, *NOT_CONFIGURED):
        return not_configured(uri, deepest)
    if _has(errors, *UNWRITABLE):
        return ArchiveFailure(Failure.STORAGE_UNWRITABLE, f"cannot write {uri}: {deepest}")
    if _has(errors, "java.net.ConnectException", "java.net.UnknownHostException"):
        return ArchiveFailure(Failure.STORAGE_UNREACHABLE, f"cannot reach the file system of {uri}: {deepest}")
    if _has(errors, "java.io.IOException", "java.io.FileNotFoundException", "org.apache.hadoop.fs."):
        return ArchiveFailure(Failure.STORAGE_FAILED, f"{uri}: {deepest}")
    return None


# What each object-store scheme needs on the classpath (docs/archival.md).
NEEDS = {
    "s3a": "the hadoop-aws jar matching Spark's Hadoop version and the AWS SDK bundle jar",
    "gs": "the GCS connector jar (gcs-connector, shaded)",
    "abfs": "the hadoop-azure jar and its dependencies",
    "abfss": "the hadoop-azure jar and its dependencies",
}


def not_configured(uri: str, reason: str = "") -> ArchiveFailure:
    scheme = urlparse(uri).scheme
    if scheme == "hdfs":
        need = "HADOOP_CONF_DIR pointing at the cluster's core-site.xml and hdfs-site.xml, or a NameNode in the URI"
    else:
        need = NEEDS.get(scheme, f"a Hadoop file system for {scheme}://")
    detail = f" ({reason})" if reason else ""
    return ArchiveFailure(
        Failure.STORAGE_NOT_CONFIGURED,
        f"{uri}: no usable file system for {scheme}://{detail}; it needs {need} (docs/archival.md: Storage)",
    )


def hdfs_unconfigured(uri: str, default_fs: str | None) -> ArchiveFailure | None:
    """hdfs:/// with no NameNode in the URI and no Hadoop configuration to name
    one (default_fs: the session's fs.defaultFS, from HADOOP_CONF_DIR or
    spark.hadoop.fs.defaultFS)."""
    parsed = urlparse(uri)
    if parsed.scheme == "hdfs" and not parsed.netloc and not urlparse(default_fs or "").netloc:
        conf_dir = os.environ.get("HADOOP_CONF_DIR")
        where = f"HADOOP_CONF_DIR={conf_dir} names none" if conf_dir else "HADOOP_CONF_DIR is not set"
        return not_configured(uri, f"the URI names no NameNode and {where}")
    return None


def classify(exc: BaseException, *, jdbc_url: str, uri: str) -> ArchiveFailure:
    """The one-line failure for an error of Spark, JDBC or the file system
    (uri: the archive location the day was being written to or read from)."""
    if isinstance(exc, ArchiveFailure):
        return exc
    errors = chain(exc)
    if not errors:
        text = _first_line(str(exc)) or type(exc).__name__
        if isinstance(exc, OSError):
            return ArchiveFailure(Failure.STORAGE_FAILED, f"{uri}: {text}")
        return ArchiveFailure(Failure.SPARK_FAILED, f"{type(exc).__name__}: {text}")
    found = _jdbc(errors, jdbc_url) or _storage(errors, uri)
    if found is not None:
        return found
    return ArchiveFailure(Failure.SPARK_FAILED, f"{errors[0].cls}: {_first_line(errors[0].message)}")


def unavailable(failure: ArchiveFailure) -> SparkUnavailable:
    """The same failure as a whole-run one (exit code 5)."""
    error = SparkUnavailable(f"{failure}; nothing was sealed")
    error.code = failure.code
    return error
