"""The relay's configuration: its settings (each an OUTBOX_* variable with a
documented default) and the cross-checks between them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pgoutbox.core import bounds, settings
from pgoutbox.core.errors import ConfigError
from pgoutbox.core.settings import Setting, boolean, duration, integer, option, positive_int

STREAMS_FILE = Setting(
    "streams_file",
    "OUTBOX_STREAMS_FILE",
    None,
    "TOML file of JetStream streams per context (see docs/relay.md)",
)
# Shared with `pgoutbox partitions`, which does by hand what the relay does every partitions_every.
DAYS_AHEAD = Setting(
    "days_ahead",
    "OUTBOX_PARTITION_DAYS_AHEAD",
    "7",
    "How many days of partitions to keep ready",
    integer,
    bound=bounds.DAYS_AHEAD,
)
LEASE = Setting(
    "lease",
    "OUTBOX_RELAY_LEASE",
    "30s",
    "How long a claimed batch is ours; must be shorter than every stream's duplicate_window",
    duration,
    bound=bounds.LEASE,
)


@dataclass(frozen=True)
class RelayConfig:
    """What `pgoutbox relay` runs with; checked as a whole when built."""

    database_url: str | None = option(settings.DATABASE_URL)
    nats_url: str = option(settings.NATS_URL)
    relay_name: str = option(
        Setting(
            "relay_name",
            "OUTBOX_RELAY_NAME",
            None,
            "Worker name recorded in claimed_by (default: host:pid)",
            fallback=settings.host_pid,
            bound=bounds.WORKER,
        )
    )
    batch_size: int = option(
        Setting(
            "batch_size",
            "OUTBOX_RELAY_BATCH_SIZE",
            "500",
            "Events claimed and published per batch",
            integer,
            bound=bounds.CLAIM_BATCH,
        )
    )
    lease: float = option(LEASE)
    publish_batches: int = option(
        Setting(
            "publish_batches",
            "OUTBOX_RELAY_PUBLISH_BATCHES",
            "4",
            "Claimed batches in flight to JetStream at once, each awaiting its own acks; 1 = one at a time",
            positive_int,
        )
    )
    poll_interval: float = option(
        Setting(
            "poll_interval",
            "OUTBOX_RELAY_POLL_INTERVAL",
            "1s",
            "Fallback poll when no wake-up arrives (a lost NOTIFY costs at most this)",
            duration,
        )
    )
    wakeups: bool = option(
        Setting(
            "wakeups", "OUTBOX_RELAY_WAKEUPS", "true", "LISTEN for the outbox_v1 wake-up; false = poll only", boolean
        )
    )
    claim_interval: float = option(
        Setting(
            "claim_interval",
            "OUTBOX_RELAY_CLAIM_INTERVAL",
            "10ms",
            "Shortest time between two claims while events keep coming (a full batch is followed at once; "
            "0 = claim on every wake-up): fewer, fuller batches, at most this much later",
            duration,
        )
    )
    synchronous_commit: bool = option(
        Setting(
            "synchronous_commit",
            "OUTBOX_RELAY_SYNCHRONOUS_COMMIT",
            "false",
            "Wait for the WAL flush on mark commits; false is safe (a lost mark is redone through "
            "the lease and deduplicated by Nats-Msg-Id). Claims always commit with the database's "
            "own synchronous_commit, so that no event is published before it is durable",
            boolean,
        )
    )
    publish_timeout: float = option(
        Setting(
            "publish_timeout",
            "OUTBOX_RELAY_PUBLISH_TIMEOUT",
            "5s",
            "How long to wait for a batch's JetStream acks; shorter than the lease",
            duration,
        )
    )
    retry_base: float = option(
        Setting(
            "retry_base",
            "OUTBOX_RELAY_RETRY_BASE",
            "1s",
            "Backoff ceiling after the first failed publish; the n-th waits uniform(0, min(cap, base*2^(n-1)))",
            duration,
        )
    )
    retry_cap: float = option(
        Setting(
            "retry_cap",
            "OUTBOX_RELAY_RETRY_CAP",
            "60s",
            "Longest backoff between two attempts",
            duration,
            bound=bounds.RETRY_AHEAD,
        )
    )
    max_attempts: int = option(
        Setting(
            "max_attempts",
            "OUTBOX_RELAY_MAX_ATTEMPTS",
            "10",
            "Publish attempts before an event is dead-lettered",
            positive_int,
        )
    )
    streams_file: str | None = option(STREAMS_FILE)
    cloudevents_source: str = option(settings.CLOUDEVENTS_SOURCE)
    nats_monitor_url: str | None = option(
        Setting(
            "nats_monitor_url",
            "OUTBOX_NATS_MONITOR_URL",
            None,
            "NATS monitoring URL (http://host:8222) to verify the fsync policy at start-up",
        )
    )
    durability_strict: bool = option(
        Setting(
            "durability_strict",
            "OUTBOX_RELAY_DURABILITY_STRICT",
            "false",
            "Refuse to start (instead of warning) on weak stream durability",
            boolean,
        )
    )
    http_host: str = option(
        Setting("http_host", "OUTBOX_RELAY_HTTP_HOST", "127.0.0.1", "Address of /metrics, /healthz, /readyz")
    )
    http_port: int = option(
        Setting(
            "http_port",
            "OUTBOX_RELAY_HTTP_PORT",
            "9464",
            "Port of /metrics, /healthz, /readyz (0: any free port)",
            integer,
            bound=bounds.PORT,
        )
    )
    stall_after: float = option(
        Setting(
            "stall_after",
            "OUTBOX_RELAY_STALL_AFTER",
            "60s",
            "Not ready when events are due and nothing was published for this long",
            duration,
        )
    )
    backlog_interval: float = option(
        Setting(
            "backlog_interval",
            "OUTBOX_RELAY_BACKLOG_INTERVAL",
            "5s",
            "How often outbox.backlog() refreshes the backlog metrics",
            duration,
        )
    )
    partitions_every: float = option(
        Setting(
            "partitions_every",
            "OUTBOX_RELAY_PARTITIONS_EVERY",
            "1h",
            "How often the relay creates the daily outbox partitions ahead (0: never)",
            duration,
        )
    )
    days_ahead: int = option(DAYS_AHEAD)
    shutdown_grace: float = option(
        Setting(
            "shutdown_grace",
            "OUTBOX_RELAY_SHUTDOWN_GRACE",
            "15s",
            "On SIGTERM, how long in-flight batches may take to finish",
            duration,
        )
    )
    log_level: str = option(settings.LOG_LEVEL)

    def __post_init__(self) -> None:
        settings.check_bounds(self)
        if self.publish_timeout <= 0 or self.publish_timeout >= self.lease:
            raise ConfigError(
                f"OUTBOX_RELAY_PUBLISH_TIMEOUT ({self.publish_timeout:g}s) must be positive and shorter "
                f"than OUTBOX_RELAY_LEASE ({self.lease:g}s), or a slow batch outlives its claim"
            )
        if self.poll_interval <= 0:
            raise ConfigError("OUTBOX_RELAY_POLL_INTERVAL must be positive")
        if not 0 <= self.claim_interval < self.poll_interval:
            raise ConfigError(
                f"OUTBOX_RELAY_CLAIM_INTERVAL ({self.claim_interval:g}s) must be at least 0 and shorter than "
                f"OUTBOX_RELAY_POLL_INTERVAL ({self.poll_interval:g}s)"
            )
        if self.retry_base <= 0 or self.retry_base > self.retry_cap:
            raise ConfigError(
                f"OUTBOX_RELAY_RETRY_BASE ({self.retry_base:g}s) must be positive and at most "
                f"OUTBOX_RELAY_RETRY_CAP ({self.retry_cap:g}s)"
            )


RELAY = settings.of(RelayConfig)


def load(environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None) -> RelayConfig:
    """The relay's configuration, validated as a whole."""
    return settings.build(RelayConfig, environ=environ, overrides=overrides)
