"""The consumer's and replayer's configurations (their settings are OUTBOX_*
variables, each with a documented default), and each handler's effective
configuration: what its manifest says, else the consumer's defaults."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgoutbox.core import bounds, settings
from pgoutbox.core.backoff import Backoff, jitter_fraction
from pgoutbox.core.errors import ConfigError
from pgoutbox.core.settings import option
from pgoutbox.inbox import registry, tenants

S = settings.Setting
# A linger is a pause of a busy fetch loop: longer ones only add latency.
MAX_FETCH_LINGER = 1.0

REGISTRY_FILE = S(
    "registry_file",
    "OUTBOX_REGISTRY_FILE",
    "handlers.registry.json",
    "Generated handler registry the consumer loads (the only file it reads)",
)
MANIFEST_DIR = S(
    "manifest_dir",
    "OUTBOX_MANIFEST_DIR",
    "handlers",
    "Directory of handler manifests (*.toml)",
)

DLQ_MAX_AGE = S(
    "dlq_max_age",
    "OUTBOX_DLQ_MAX_AGE",
    "30d",
    "max_age of a {CONTEXT}_DLQ stream the consumer creates",
    settings.duration,
)
DLQ_DUPLICATE_WINDOW = S(
    "dlq_duplicate_window",
    "OUTBOX_DLQ_DUPLICATE_WINDOW",
    "10m",
    "duplicate_window of a {CONTEXT}_DLQ stream the consumer creates",
    settings.duration,
)
REPLAY_POLL_INTERVAL = S(
    "replay_poll_interval",
    "OUTBOX_REPLAY_POLL_INTERVAL",
    "5s",
    "How often the replayer looks for due dead letters",
    settings.duration,
)
REPLAY_BATCH_SIZE = S(
    "replay_batch_size",
    "OUTBOX_REPLAY_BATCH_SIZE",
    "100",
    "Dead letters re-published per replayer transaction",
    settings.integer,
    bound=bounds.REPLAY_BATCH,
)
REPLAY_WORKER = S(
    "replay_worker",
    "OUTBOX_REPLAY_WORKER",
    None,
    "Replayer name recorded in dlq_metadata (default: hostname:pid)",
    fallback=settings.host_pid,
    bound=bounds.WORKER,
)


@dataclass(frozen=True)
class ConsumerConfig:
    """What `pgoutbox consume` runs with: the consumer and, in the same
    process, the replayer; checked as a whole when built."""

    database_url: str | None = option(settings.DATABASE_URL)
    nats_url: str = option(settings.NATS_URL)
    registry_file: str = option(REGISTRY_FILE)
    cloudevents_source: str = option(settings.CLOUDEVENTS_SOURCE)
    # Per-handler defaults; a manifest value wins.
    handler_timeout: float = option(
        S("handler_timeout", "OUTBOX_HANDLER_TIMEOUT", "10s", "HTTP handler timeout", settings.duration)
    )
    ack_wait: float = option(
        S(
            "ack_wait",
            "OUTBOX_CONSUMER_ACK_WAIT",
            "30s",
            "JetStream ack_wait: redelivery after this long without an ack (in-progress acks extend it)",
            settings.duration,
        )
    )
    max_deliver: int = option(
        S(
            "max_deliver",
            "OUTBOX_CONSUMER_MAX_DELIVER",
            "5",
            "Handler failures before a message is dead-lettered (the inbox counts them; no JetStream limit)",
            settings.positive_int,
        )
    )
    max_ack_pending: int = option(
        S(
            "max_ack_pending",
            "OUTBOX_CONSUMER_MAX_ACK_PENDING",
            "256",
            "JetStream max_ack_pending: unacknowledged messages per durable",
            settings.positive_int,
        )
    )
    concurrency: int = option(
        S(
            "concurrency",
            "OUTBOX_CONSUMER_CONCURRENCY",
            "64",
            "Messages processed at once per handler (handler calls in flight, per process)",
            settings.positive_int,
        )
    )
    tenant_concurrency: int | None = option(
        S(
            "tenant_concurrency",
            "OUTBOX_CONSUMER_TENANT_CONCURRENCY",
            None,
            "Handler calls in flight per tenant (the Pgoutbox-Tenant-Id header; messages without one share one "
            "budget), from 1 to the handler's concurrency; the others wait their turn, kept alive, uncounted "
            "(default: a quarter of the handler's concurrency, at least 1)",
            settings.positive_int,
        )
    )
    batch_size: int = option(
        S(
            "batch_size",
            "OUTBOX_CONSUMER_BATCH_SIZE",
            "32",
            "Most messages asked for in one fetch (never more than free concurrency), and sent in one"
            " request to a handler of format batch (at most 1000 for one)",
            settings.positive_int,
            bound=bounds.INBOX_BATCH,
        )
    )
    replay_max_attempts: int = option(
        S(
            "replay_max_attempts",
            "OUTBOX_REPLAY_MAX_ATTEMPTS",
            "3",
            "Automated replays of a dead letter before it stays parked (0: none)",
            settings.non_negative_int,
        )
    )
    # The replay policy.
    replay_base_delay: float = option(
        S(
            "replay_base_delay",
            "OUTBOX_REPLAY_BASE_DELAY",
            "1m",
            "Delay before the first automated replay; doubles with each replay",
            settings.duration,
        )
    )
    replay_max_delay: float = option(
        S(
            "replay_max_delay",
            "OUTBOX_REPLAY_MAX_DELAY",
            "1h",
            "Longest delay between replays",
            settings.duration,
            bound=bounds.REPLAY_AFTER,
        )
    )
    replay_jitter: float = option(
        S(
            "replay_jitter",
            "OUTBOX_REPLAY_JITTER",
            "0.5",
            "Jitter fraction: each delay is drawn from [(1 - jitter) x delay, delay]",
            jitter_fraction,
        )
    )
    dlq_max_age: float = option(DLQ_MAX_AGE)
    dlq_duplicate_window: float = option(DLQ_DUPLICATE_WINDOW)
    replay_poll_interval: float = option(REPLAY_POLL_INTERVAL)
    replay_batch_size: int = option(REPLAY_BATCH_SIZE)
    replay_worker: str = option(REPLAY_WORKER)
    handlers: str | None = option(
        S(
            "handlers",
            "OUTBOX_CONSUMER_HANDLERS",
            None,
            "Comma-separated handler names to run (default: every handler in the registry)",
        )
    )
    retry_delay: float = option(
        S(
            "retry_delay",
            "OUTBOX_CONSUMER_RETRY_DELAY",
            "1s",
            "Nak delay after the first transient failure; doubles per delivery",
            settings.duration,
        )
    )
    retry_max_delay: float = option(
        S(
            "retry_max_delay",
            "OUTBOX_CONSUMER_RETRY_MAX_DELAY",
            "1m",
            "Longest nak delay (also caps a handler's Retry-After)",
            settings.duration,
        )
    )
    fetch_timeout: float = option(
        S(
            "fetch_timeout",
            "OUTBOX_CONSUMER_FETCH_TIMEOUT",
            "2s",
            "How long one pull waits for messages when the stream is idle",
            settings.duration,
        )
    )
    fetch_linger: float = option(
        S(
            "fetch_linger",
            "OUTBOX_CONSUMER_FETCH_LINGER",
            "10ms",
            "Shortest time between two fetches of a handler while messages keep coming (a full fetch is followed "
            "at once; 0 = fetch as soon as slots are free): fewer, fuller fetches, at most this much later; "
            "0 to 1s, below the fetch timeout",
            settings.duration,
        )
    )
    db_pool_size: int = option(
        S(
            "db_pool_size",
            "OUTBOX_CONSUMER_DB_POOL_SIZE",
            "8",
            "PostgreSQL connections of one consumer process",
            settings.positive_int,
        )
    )
    drain_timeout: float = option(
        S(
            "drain_timeout",
            "OUTBOX_CONSUMER_DRAIN_TIMEOUT",
            "30s",
            "On SIGTERM, how long in-flight messages may finish (the rest are redelivered)",
            settings.duration,
        )
    )
    run_replayer: bool = option(
        S(
            "run_replayer",
            "OUTBOX_CONSUMER_RUN_REPLAYER",
            "true",
            "Run the replayer inside the consumer process",
            settings.boolean,
        )
    )
    backlog_interval: float = option(
        S(
            "backlog_interval",
            "OUTBOX_CONSUMER_BACKLOG_INTERVAL",
            "15s",
            "How often the inbox backlog gauges are refreshed from inbox.backlog()",
            settings.duration,
        )
    )
    http_host: str = option(
        S("http_host", "OUTBOX_CONSUMER_HTTP_HOST", "127.0.0.1", "Address of /metrics, /healthz, /readyz")
    )
    # None (only in-process, through dataclasses.replace): no HTTP server at all.
    http_port: int | None = option(
        S(
            "http_port",
            "OUTBOX_CONSUMER_HTTP_PORT",
            "9465",
            "Port of /metrics, /healthz, /readyz (0: any free port)",
            settings.integer,
            bound=bounds.PORT,
        )
    )
    log_level: str = option(settings.LOG_LEVEL)

    def __post_init__(self) -> None:
        settings.check_bounds(self)
        retry_backoff(self)
        replay_backoff(self)
        if self.tenant_concurrency is not None:
            tenants.checked(self.tenant_concurrency, self.concurrency, "OUTBOX_CONSUMER_TENANT_CONCURRENCY")
        if not 0 <= self.fetch_linger <= MAX_FETCH_LINGER or self.fetch_linger >= self.fetch_timeout:
            raise ConfigError(
                f"OUTBOX_CONSUMER_FETCH_LINGER ({self.fetch_linger:g}s) must be from 0 to {MAX_FETCH_LINGER:g}s and "
                f"shorter than OUTBOX_CONSUMER_FETCH_TIMEOUT ({self.fetch_timeout:g}s)"
            )


@dataclass(frozen=True)
class ReplayConfig:
    """What `pgoutbox replay` runs with: the replayer on its own."""

    database_url: str | None = option(settings.DATABASE_URL)
    nats_url: str = option(settings.NATS_URL)
    dlq_max_age: float = option(DLQ_MAX_AGE)
    dlq_duplicate_window: float = option(DLQ_DUPLICATE_WINDOW)
    replay_poll_interval: float = option(REPLAY_POLL_INTERVAL)
    replay_batch_size: int = option(REPLAY_BATCH_SIZE)
    replay_worker: str = option(REPLAY_WORKER)
    log_level: str = option(settings.LOG_LEVEL)


@dataclass(frozen=True)
class HandlerRuntime:
    """A handler's effective configuration."""

    spec: registry.HandlerSpec
    timeout: float
    ack_wait: float
    max_deliver: int
    max_ack_pending: int
    concurrency: int
    batch_size: int
    replay_max_attempts: int
    # Calls in flight per tenant (inbox/tenants.py).
    tenant_concurrency: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def progress_interval(self) -> float:
        """In-progress acks at a third of ack_wait: two may be lost in a row."""
        return self.ack_wait / 3


def resolve(spec: registry.HandlerSpec, cfg: ConsumerConfig) -> HandlerRuntime:
    def pick(name: str, default_name: str | None = None) -> Any:
        value = getattr(spec, name)
        return value if value is not None else getattr(cfg, default_name or name)

    if spec.batch_size is not None:  # a manifest's own, refused as OUTBOX_CONSUMER_BATCH_SIZE would be
        try:
            bounds.INBOX_BATCH.check(spec.batch_size)
        except ValueError as exc:
            raise ConfigError(f"handler {spec.name}: batch_size={spec.batch_size}: {exc}") from exc
    concurrency = pick("concurrency")
    tenant_concurrency = pick("tenant_concurrency")
    if tenant_concurrency is None:
        tenant_concurrency = tenants.default(concurrency)
    tenants.checked(tenant_concurrency, concurrency, f"handler {spec.name}")
    if spec.format == "batch" and spec.batch_size is None and cfg.batch_size > registry.BATCH_MAX:
        # The default the manifest left to OUTBOX_CONSUMER_BATCH_SIZE, refused as the manifest's own would be.
        raise ConfigError(
            f"handler {spec.name} (format batch): OUTBOX_CONSUMER_BATCH_SIZE={cfg.batch_size}: BAD_BATCH_SIZE:"
            f" at most {registry.BATCH_MAX} for a handler of format batch"
        )
    return HandlerRuntime(
        spec=spec,
        timeout=pick("timeout", "handler_timeout"),
        ack_wait=pick("ack_wait"),
        max_deliver=pick("max_deliver"),
        max_ack_pending=pick("max_ack_pending"),
        concurrency=concurrency,
        batch_size=pick("batch_size"),
        replay_max_attempts=pick("replay_max_attempts"),
        tenant_concurrency=tenant_concurrency,
    )


def load_handlers(cfg: ConsumerConfig) -> list[HandlerRuntime]:
    """The registry's handlers (or the OUTBOX_CONSUMER_HANDLERS subset), resolved."""
    specs = registry.load(Path(cfg.registry_file))
    if cfg.handlers:
        wanted = [h.strip() for h in cfg.handlers.split(",") if h.strip()]
        known = {s.name for s in specs}
        missing = sorted(set(wanted) - known)
        if missing:
            raise ConfigError(f"handler(s) {', '.join(missing)} not in {cfg.registry_file}")
        specs = [s for s in specs if s.name in wanted]
    return [resolve(s, cfg) for s in specs]


def _backoff(what: str, base: float, max_delay: float, jitter: float) -> Backoff:
    try:
        return Backoff(base, max_delay, jitter)
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}") from exc


def retry_backoff(cfg: ConsumerConfig) -> Backoff:
    return _backoff("OUTBOX_CONSUMER_RETRY_DELAY/_MAX_DELAY", cfg.retry_delay, cfg.retry_max_delay, 0.5)


def replay_backoff(cfg: ConsumerConfig) -> Backoff:
    return _backoff(
        "OUTBOX_REPLAY_BASE_DELAY/_MAX_DELAY/_JITTER", cfg.replay_base_delay, cfg.replay_max_delay, cfg.replay_jitter
    )


def worker_name(cfg: ConsumerConfig | ReplayConfig) -> str:
    return cfg.replay_worker  # host:pid unless set (the loader's fallback)
