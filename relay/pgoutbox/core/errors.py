"""Domain errors, built from the custom SQLSTATEs the SQL core raises.

Python never matches on message text: wrap_exceptions() maps exc.sqlstate to a
class below. The code table is the one in docs/reference.md ("Error codes"); a test
checks that both list the same codes.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

import psycopg


def one_line(exc: BaseException | str) -> str:
    """A message on one line (its lines joined by " / "); an exception without one: its type's name."""
    text = " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text or (type(exc).__name__ if isinstance(exc, BaseException) else "")


class SqlState(enum.StrEnum):
    INVALID_OUTBOX = "OB001"
    FUTURE_EVENT = "OB002"
    INVALID_SUBJECT_PART = "OB003"
    INVALID_PAYLOAD = "OB004"
    INVALID_SCHEMA_VERSION = "OB005"
    INVALID_ARGUMENT = "OB006"
    INVALID_SETTING = "OB007"
    TIMESTAMP_OUT_OF_RANGE = "OB008"
    VALUE_TOO_LARGE = "OB009"
    ILLEGAL_TRANSITION = "OB010"
    IMMUTABLE_EVENT = "OB011"
    DELETE_FORBIDDEN = "OB012"
    STALE_CLAIM = "OB013"
    REASON_REQUIRED = "OB014"
    NOT_DEAD_LETTER = "OB015"
    RESERVED_HEADER = "OB016"
    INVALID_HEADER = "OB017"
    EVENT_ID_CONFLICT = "OB018"  # emit(event_id => ...) of an id another event holds
    INVALID_EVENT_ID = "OB019"  # emit(event_id => ...) of a version-4 (random) UUID
    INVALID_MESSAGE = "OB020"
    UNKNOWN_MESSAGE = "OB021"
    DELIVERY_IN_PAST = "OB022"  # deliver_at / deliver_after more than a minute past
    DELIVERY_TOO_FAR = "OB023"  # deliver_at / deliver_after more than 366 days ahead
    NOT_CANCELLABLE = "OB024"  # outbox.cancel of an event not waiting for its delivery time
    CANCEL_NOT_ALLOWED = "OB025"  # outbox.cancel by neither the emitting login nor pgoutbox_admin
    INVALID_TENANT_WEIGHT = "OB026"  # outbox.set_tenant_weight with a weight not from 1 to 1000
    INVALID_TENANT = "OB027"  # outbox.set_tenant_weight with a tenant id emit would refuse
    MESSAGE_NOT_DEAD_LETTER = "OB030"
    MESSAGE_NOT_REPLAYABLE = "OB031"
    NOT_COMPLETED = "OB040"
    PUBLISHED_TOO_RECENTLY = "OB041"
    ARCHIVE_UNKNOWN_UNIT = "OB050"
    NOT_CLOSED = "OB051"
    RETENTION_NOT_REACHED = "OB052"
    ARCHIVE_MISMATCH = "OB053"
    NOT_ARCHIVED = "OB054"
    ARCHIVE_CONFLICT = "OB055"
    ARCHIVED_READ_ONLY = "OB056"
    RETENTION_BELOW_MAX_AGE = "OB057"
    UNSUPPORTED_COLUMN = "OB058"
    ARCHIVE_BUSY = "OB059"
    AUDIT_IMMUTABLE = "OB060"
    NOT_SEALED = "OB061"
    SEAL_BROKEN = "OB062"
    BATCH_ANSWER_MALFORMED = "OB063"  # the consumer, as a batch handler's messages' last_error
    BATCH_RESULT_INVALID = "OB064"  # the consumer, as one message's last_error of a batch handler
    INVALID_UPCASTER = "OB070"
    UPCAST_MISSING = "OB071"
    UPCAST_FAILED = "OB072"
    UNKNOWN_UPCASTER = "OB073"
    INVALID_COMMAND = "OB080"
    UNKNOWN_COMMAND = "OB081"
    MIGRATION_OUT_OF_ORDER = "OB090"
    DATA_WOULD_BE_LOST = "OB091"
    INVALID_FILTER = "OB100"
    DISCARDED = "OB101"
    UNAUDITED_DISCARD = "OB102"
    NOT_DISCARDABLE = "OB103"
    NOT_DISCARDED = "OB104"
    DEAD_LETTER_NOT_FOUND = "OB105"
    INVALID_ACTION = "OB106"
    INVALID_CURSOR = "OB107"
    ACTION_NOT_FOUND = "OB110"  # a console bulk action that does not exist, or that another role prepared
    ARCHIVE_TAMPERED = "OB111"  # backfill: an archived day's files are not what its audit recorded
    ARCHIVE_NOT_AUDITED = "OB112"  # backfill: an archived day without a standing audit


class ExitCode(enum.IntEnum):
    """What every `pgoutbox` command exits with (docs/reference.md lists them)."""

    OK = 0
    FAILED = 1  # the command ran and reports a failure of what it was asked to do
    USAGE = 2  # a bad flag, setting or argument, or a request the database refused
    DATABASE = 3  # PostgreSQL unreachable, login refused, database missing, schema version not supported
    BROKER = 4  # NATS unreachable or refused the connection
    SPARK = 5  # archive: Spark or the archive location cannot be used (nothing was sealed)


class PgOutboxError(Exception):
    """pgoutbox error."""

    code: SqlState | str | None = None  # str: a failure without a SQLSTATE (archival)
    exit_code: ExitCode = ExitCode.USAGE

    def __init__(self, message: str | None = None, *, code: SqlState | None = None):
        super().__init__(message or self.__doc__)
        if code is not None:
            self.code = code


class PolicyViolation(PgOutboxError):
    """The event breaks an outbox policy and was not written."""


class IllegalTransition(PgOutboxError):
    """The database refused a status move that the lifecycle does not allow."""


class StaleClaim(PgOutboxError):
    """The claim token no longer holds these events (lease taken over)."""


class NotDeadLetter(PgOutboxError):
    """Only DEAD_LETTER events can be requeued."""


class NotCompleted(PgOutboxError):
    """Only COMPLETED events can be requeued for a republish."""


class PublishedTooRecently(PgOutboxError):
    """JetStream would drop the republish as a duplicate: the event was published within the duplicate window."""


class UnknownMessage(PgOutboxError):
    """No inbox row for this message and handler."""


class NotRedrivable(PgOutboxError):
    """Only dead-lettered inbox messages with a stored envelope can be redriven."""


class DeadLetterNotFound(PgOutboxError):
    """No dead letter (live or discarded) with this id on that side."""


class ArchivalRefused(PgOutboxError):
    """The unit is not (or not yet) archivable: unknown, open, too young, or busy."""


class ArchiveMismatch(PgOutboxError):
    """The archive's row count or checksum differs from the live rows; nothing was removed."""


class ArchiveConflict(PgOutboxError):
    """The day already has a different standing audit, or was removed already."""


class MigrationError(PgOutboxError):
    """The schema cannot be migrated as asked."""


class SchemaMismatch(PgOutboxError):
    """The database schema is not the version this code was built for."""

    exit_code = ExitCode.DATABASE


class DatabaseUnavailable(PgOutboxError):
    """PostgreSQL could not be reached or refused the connection; may be retried after a pause.

    The one type both sides raise for a connection that failed or was lost
    (core.db); `retryable` is False when PostgreSQL answered but refuses this
    login what it needs (a missing grant), which no pause repairs."""

    exit_code = ExitCode.DATABASE
    retryable = True


class ConfigError(PgOutboxError):
    """The configuration is invalid."""


class TracingUnavailable(ConfigError):
    """OTEL_* variables ask for traces, but the OpenTelemetry SDK or its OTLP/HTTP exporter is not installed."""

    code = "OTEL_SDK_MISSING"


class TracingMisconfigured(ConfigError):
    """An OTEL_* variable asks for something pgoutbox's tracing does not do."""

    code = "OTEL_UNSUPPORTED"


class SparkUnavailable(PgOutboxError):
    """Spark or the archive location cannot be used for any day; nothing was sealed."""

    exit_code = ExitCode.SPARK


class BrokerUnavailable(PgOutboxError):
    """NATS could not be reached or refused the connection."""

    exit_code = ExitCode.BROKER


_CLASSES: dict[SqlState, type[PgOutboxError]] = {
    SqlState.INVALID_OUTBOX: PolicyViolation,
    SqlState.FUTURE_EVENT: PolicyViolation,
    SqlState.INVALID_SUBJECT_PART: PolicyViolation,
    SqlState.INVALID_PAYLOAD: PolicyViolation,
    SqlState.INVALID_SCHEMA_VERSION: PolicyViolation,
    SqlState.INVALID_ARGUMENT: PolicyViolation,
    SqlState.INVALID_SETTING: ConfigError,
    SqlState.TIMESTAMP_OUT_OF_RANGE: PolicyViolation,
    SqlState.VALUE_TOO_LARGE: PolicyViolation,
    SqlState.RESERVED_HEADER: PolicyViolation,
    SqlState.INVALID_HEADER: PolicyViolation,
    SqlState.INVALID_MESSAGE: PolicyViolation,
    SqlState.ILLEGAL_TRANSITION: IllegalTransition,
    SqlState.IMMUTABLE_EVENT: IllegalTransition,
    SqlState.DELETE_FORBIDDEN: IllegalTransition,
    SqlState.STALE_CLAIM: StaleClaim,
    SqlState.REASON_REQUIRED: PolicyViolation,
    SqlState.NOT_DEAD_LETTER: NotDeadLetter,
    SqlState.UNKNOWN_MESSAGE: UnknownMessage,
    SqlState.MESSAGE_NOT_DEAD_LETTER: NotRedrivable,
    SqlState.MESSAGE_NOT_REPLAYABLE: NotRedrivable,
    SqlState.NOT_COMPLETED: NotCompleted,
    SqlState.PUBLISHED_TOO_RECENTLY: PublishedTooRecently,
    SqlState.ARCHIVE_UNKNOWN_UNIT: ArchivalRefused,
    SqlState.NOT_CLOSED: ArchivalRefused,
    SqlState.RETENTION_NOT_REACHED: ArchivalRefused,
    SqlState.ARCHIVE_MISMATCH: ArchiveMismatch,
    SqlState.NOT_ARCHIVED: ArchivalRefused,
    SqlState.ARCHIVE_CONFLICT: ArchiveConflict,
    SqlState.ARCHIVED_READ_ONLY: IllegalTransition,
    SqlState.RETENTION_BELOW_MAX_AGE: ConfigError,
    SqlState.UNSUPPORTED_COLUMN: ArchivalRefused,
    SqlState.ARCHIVE_BUSY: ArchivalRefused,
    SqlState.AUDIT_IMMUTABLE: IllegalTransition,
    SqlState.NOT_SEALED: ArchivalRefused,
    SqlState.SEAL_BROKEN: ArchiveMismatch,
    SqlState.BATCH_ANSWER_MALFORMED: PolicyViolation,
    SqlState.BATCH_RESULT_INVALID: PolicyViolation,
    SqlState.INVALID_UPCASTER: PolicyViolation,
    SqlState.UPCAST_MISSING: PolicyViolation,
    SqlState.UPCAST_FAILED: PolicyViolation,
    SqlState.UNKNOWN_UPCASTER: PolicyViolation,
    SqlState.MIGRATION_OUT_OF_ORDER: MigrationError,
    SqlState.DATA_WOULD_BE_LOST: MigrationError,
    SqlState.INVALID_FILTER: PolicyViolation,
    SqlState.DISCARDED: IllegalTransition,
    SqlState.UNAUDITED_DISCARD: IllegalTransition,
    SqlState.NOT_DISCARDABLE: IllegalTransition,
    SqlState.NOT_DISCARDED: IllegalTransition,
    SqlState.DEAD_LETTER_NOT_FOUND: DeadLetterNotFound,
    SqlState.ACTION_NOT_FOUND: PolicyViolation,
    SqlState.ARCHIVE_TAMPERED: ArchiveMismatch,
    SqlState.ARCHIVE_NOT_AUDITED: ArchivalRefused,
    SqlState.INVALID_ACTION: PolicyViolation,
    SqlState.INVALID_CURSOR: PolicyViolation,
    SqlState.EVENT_ID_CONFLICT: PolicyViolation,
    SqlState.INVALID_EVENT_ID: PolicyViolation,
    SqlState.DELIVERY_IN_PAST: PolicyViolation,
    SqlState.DELIVERY_TOO_FAR: PolicyViolation,
    SqlState.NOT_CANCELLABLE: IllegalTransition,
    SqlState.CANCEL_NOT_ALLOWED: PolicyViolation,
    SqlState.INVALID_TENANT_WEIGHT: PolicyViolation,
    SqlState.INVALID_TENANT: PolicyViolation,
}


def from_database(exc: psycopg.Error) -> PgOutboxError | None:
    """The domain error for a database error carrying one of our codes."""
    try:
        code = SqlState(exc.sqlstate or "")
    except ValueError:
        return None
    message = exc.diag.message_primary or str(exc)
    return _CLASSES[code](message, code=code)


@contextlib.contextmanager
def wrap_exceptions() -> Iterator[None]:
    """Re-raise database errors with our SQLSTATEs as domain errors."""
    try:
        yield
    except psycopg.Error as exc:
        domain = from_database(exc)
        if domain is None:
            raise
        raise domain from exc
