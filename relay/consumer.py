"""The inbox consumer (DESIGN §3): JetStream durable pull consumers, one per
handler of the generated registry, feeding message_flow with bounded
concurrency.

For each handler it binds two durables named after the handler:
  * on the context's event stream, filtered on the manifest's subjects
    (explicit ack, ack_wait, max_deliver, max_ack_pending from the manifest
    or the OUTBOX_CONSUMER_* defaults);
  * on the context's DLQ stream, filtered on `{context}.dlq.replay.{handler}`:
    the replays addressed to this handler only.

It also listens to JetStream's MAX_DELIVERIES advisories for those durables:
a last delivery that got no outcome here (the process died, or lost
PostgreSQL or NATS) is dead-lettered from the advisory instead of vanishing.

Backpressure: a fetch never asks for more messages than the handler has free
slots (`concurrency`), so nothing waits unprocessed while its ack_wait runs;
`max_ack_pending` bounds the same thing on the server side.

Shutdown (SIGTERM/SIGINT, see commands/consume.py): stop fetching, let the
in-flight messages finish for up to drain_timeout, then close. A message
that did not finish is simply not acknowledged: JetStream redelivers it and
the inbox tells what was already done.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from types import SimpleNamespace

import nats
import nats.errors
import nats.js.errors
import psycopg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from . import db, dlq
from .consumer_metrics import ConsumerMetrics
from .health_server import HealthServer
from .consumer_settings import HandlerRuntime, replay_backoff, retry_backoff, worker_name
from .errors import ConfigError
from .handler_client import HandlerClient
from .inbox_store import ConnectionPool, Inbox
from .message_flow import MessageFlow
from .replayer import Replayer

log = logging.getLogger("pgoutbox.consumer")


class Slots:
    """Free processing slots of one handler. A fetch waits until half a batch
    is free, then takes up to a batch: fetching one message whenever one slot
    frees would cost a round trip to the server per message."""

    def __init__(self, size: int):
        self.size = size
        self.free = size
        self._changed = asyncio.Condition()

    async def take(self, most: int) -> int:
        least = max(1, min(most, self.size) // 2)
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= least)
            taken = min(most, self.free)
            self.free -= taken
            return taken

    async def give(self, count: int) -> None:
        if count:
            async with self._changed:
                self.free += count
                self._changed.notify_all()


class Consumer:
    def __init__(self, handlers: list[HandlerRuntime], cfg: SimpleNamespace):
        if not handlers:
            raise ConfigError("no handler to run")
        self.handlers = handlers
        self.cfg = cfg
        # Validated before anything connects.
        self._retry_backoff, self._replay_backoff = retry_backoff(cfg), replay_backoff(cfg)
        self.metrics = ConsumerMetrics()
        self.stopping = asyncio.Event()
        self.health: HealthServer | None = None
        self.nc = None
        self._bound: set[str] = set()
        self._loops: list[asyncio.Task] = []
        self._background: list[asyncio.Task] = []
        self._in_flight: set[asyncio.Task] = set()
        self._db_ok = False

    # -- life cycle ---------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        self.nc = await nats.connect(
            servers=[u.strip() for u in cfg.nats_url.split(",")], name="pgoutbox-consumer",
            max_reconnect_attempts=-1, reconnect_time_wait=1,
        )
        self.js = self.nc.jetstream()
        self.pool = ConnectionPool(cfg.database_url, cfg.db_pool_size)
        self.inbox = Inbox(self.pool)
        db.check_schema_version(await self.inbox.schema_version())
        self._db_ok = True
        self.client = HandlerClient(per_origin=max(h.concurrency for h in self.handlers) + 1)
        self.flow = MessageFlow(
            inbox=self.inbox, client=self.client, js=self.js, metrics=self.metrics,
            retry_backoff=self._retry_backoff, replay_backoff=self._replay_backoff, stopping=self.stopping,
        )
        subscriptions = []
        for h in self.handlers:
            subscriptions += await self._bind(h)
        for h, sub, slots, batch in subscriptions:
            self._loops.append(asyncio.create_task(self._fetch_loop(h, sub, slots, batch)))
        self._background.append(asyncio.create_task(self._backlog_loop()))
        if cfg.run_replayer:
            self.replayer = Replayer(
                inbox=self.inbox, js=self.js, metrics=self.metrics, worker=worker_name(cfg),
                batch_size=cfg.replay_batch_size, poll_interval=cfg.replay_poll_interval,
                dlq_max_age=cfg.dlq_max_age, dlq_duplicate_window=cfg.dlq_duplicate_window,
            )
            self._background.append(asyncio.create_task(self.replayer.run(self.stopping)))
        if cfg.http_port is not None:
            self.health = HealthServer(cfg.http_host, cfg.http_port, self.metrics, self.problems)
            self.health.start()
            self._background.append(asyncio.create_task(self._tick_loop()))
        log.info("consumer started", extra={
            "handlers": [h.name for h in self.handlers],
            "http_port": self.health.port if self.health else None,
        })

    async def stop(self) -> None:
        self.stopping.set()
        # A fetch in progress returns within fetch_timeout; do not wait for it.
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self._in_flight:
            done, pending = await asyncio.wait(self._in_flight, timeout=self.cfg.drain_timeout)
            for task in pending:
                task.cancel()
            if pending:
                log.warning("drain timeout: unfinished messages will be redelivered",
                            extra={"unfinished": len(pending)})
                await asyncio.gather(*pending, return_exceptions=True)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.health:
            self.health.stop()
        with contextlib.suppress(Exception):
            await self.client.aclose()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()  # flushes the acks already written
        with contextlib.suppress(Exception):
            await self.pool.close()
        log.info("consumer stopped")

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self.start()
            await stop.wait()
        finally:
            await self.stop()  # also after a failed start: close what was opened

    # -- JetStream ----------------------------------------------------------
    def _consumer_config(self, h: HandlerRuntime, subjects: list[str], description: str) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=h.name,
            description=description,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=h.ack_wait,
            max_deliver=h.max_deliver,
            max_ack_pending=h.max_ack_pending,
            filter_subjects=subjects,
        )

    async def _durable(self, stream: str, config: ConsumerConfig):
        try:
            await self.js.add_consumer(stream, config)  # creates, or updates in place
        except nats.js.errors.APIError as exc:
            raise ConfigError(f"cannot create or update durable {config.durable_name} on {stream}: {exc}") from exc
        return await self.js.pull_subscribe_bind(config.durable_name, stream)

    async def _bind(self, h: HandlerRuntime):
        spec = h.spec
        try:
            await self.js.stream_info(spec.stream)
        except nats.js.errors.NotFoundError as exc:
            raise ConfigError(
                f"stream {spec.stream} (handler {h.name}) does not exist: provision the context's streams first"
            ) from exc
        events = await self._durable(spec.stream, self._consumer_config(
            h, list(spec.subjects), f"pgoutbox handler {h.name}: {spec.url}"))
        dlq_stream = await dlq.ensure_stream(
            self.js, spec.context, max_age=self.cfg.dlq_max_age, duplicate_window=self.cfg.dlq_duplicate_window,
        )
        replays = await self._durable(dlq_stream, self._consumer_config(
            h, [dlq.replay_subject(spec.context, h.name)], f"pgoutbox replays for handler {h.name}"))
        # JetStream gives up after max_deliver without telling anyone but an
        # advisory: a last delivery that got no outcome here (the consumer
        # died, or lost PostgreSQL/NATS) is dead-lettered from it. A queue
        # group, so that one process of many handles each advisory.
        for stream in (spec.stream, dlq_stream):
            await self.nc.subscribe(
                f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{h.name}",
                queue=f"pgoutbox_{h.name}", cb=functools.partial(self._on_max_deliveries, h),
            )
        self._bound.add(h.name)
        # Replays are rare: their own single slot, so that an idle replay pull
        # never holds capacity the event stream needs.
        return [(h, events, Slots(h.concurrency), h.batch_size), (h, replays, Slots(1), 1)]

    async def _fetch_loop(self, h: HandlerRuntime, sub, slots: Slots, batch: int) -> None:
        while not self.stopping.is_set():
            wanted = await slots.take(batch)
            try:
                msgs = await sub.fetch(wanted, timeout=self.cfg.fetch_timeout)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):  # idle: nothing to fetch
                msgs = []
            except (nats.errors.Error, OSError) as exc:
                await slots.give(wanted)
                log.warning("fetch failed; retrying: %r", exc, extra={"handler": h.name, "error": repr(exc)})
                await asyncio.sleep(1)
                continue
            await slots.give(wanted - len(msgs))
            for msg in msgs:
                task = asyncio.create_task(self._process(h, msg, slots))
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)

    async def _process(self, h: HandlerRuntime, msg, slots: Slots) -> None:
        gauge = self.metrics.in_flight.labels(h.name)
        gauge.inc()
        try:
            outcome = await self.flow.handle(msg, h)
            self._db_ok = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - not acked: JetStream redelivers
            outcome = "error"
            self._db_ok = not _is_database_error(exc)
            log.error("message left unacknowledged after an error", exc_info=True, extra={
                "handler": h.name, "subject": msg.subject,
            })
        finally:
            gauge.dec()
            await slots.give(1)
        self.metrics.count(h.name, outcome)

    async def _on_max_deliveries(self, h: HandlerRuntime, advisory_msg) -> None:
        task = asyncio.create_task(self._exhausted(h, json.loads(advisory_msg.data)))
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _exhausted(self, h: HandlerRuntime, advisory: dict) -> None:
        try:
            raw = await self.js.get_msg(advisory["stream"], advisory["stream_seq"])
            raw.stream = raw.stream or advisory["stream"]
            outcome = await self.flow.exhausted(h, raw, advisory["deliveries"])
        except Exception:  # noqa: BLE001 - the inbox row stays FAILED/RECEIVED, visible in the backlog
            outcome = "error"
            log.error("could not dead-letter a message JetStream gave up on", exc_info=True,
                      extra={"handler": h.name, "advisory": advisory})
        self.metrics.count(h.name, outcome)
        log.warning("max deliveries advisory handled", extra={
            "handler": h.name, "stream": advisory["stream"], "stream_sequence": advisory["stream_seq"],
            "outcome": outcome,
        })

    # -- operations ---------------------------------------------------------
    async def _backlog_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                self.metrics.set_backlog(await self.inbox.backlog(), time.time())
                self._db_ok = True
            except Exception as exc:  # noqa: BLE001 - reported through /readyz
                self._db_ok = False
                log.warning("inbox.backlog() failed", extra={"error": repr(exc)})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.cfg.backlog_interval)

    async def _tick_loop(self) -> None:
        while True:
            self.health.tick()
            await asyncio.sleep(1)

    def problems(self) -> list[str]:
        """Why the consumer is not ready (empty: ready). Called from the health thread."""
        found = []
        if self.nc is None or not self.nc.is_connected:
            found.append("not connected to NATS")
        if not self._db_ok:
            found.append("PostgreSQL unreachable (last call failed)")
        missing = sorted({h.name for h in self.handlers} - self._bound)
        if missing:
            found.append(f"durables not bound: {', '.join(missing)}")
        if self.stopping.is_set():
            found.append("stopping")
        return found


def _is_database_error(exc: BaseException) -> bool:
    return isinstance(exc, psycopg.Error) or isinstance(exc.__cause__, psycopg.Error)
