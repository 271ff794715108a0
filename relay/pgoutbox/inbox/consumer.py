"""The inbox consumer: JetStream durable pull consumers, one per
handler of the generated registry, feeding the message flow (flow.py) with bounded
concurrency.

For each handler it binds two durables named after the handler:
  * on the context's event stream, filtered on the manifest's subjects
    (explicit ack, ack_wait, max_deliver, max_ack_pending from the manifest
    or the OUTBOX_CONSUMER_* defaults);
  * on the context's DLQ stream, filtered on `{context}.dlq.replay.{handler}`:
    the replays addressed to this handler only.

Both durables redeliver without a limit (max_deliver -1): the handler's
max_deliver counts its failures in the inbox (see flow), so no message
depends on JetStream's MAX_DELIVERIES advisory, which nobody is guaranteed
to receive, and no outage or crash uses up its deliveries.

While PostgreSQL is away the fetch loops wait (database_gate.DatabaseGate): nothing
is fetched that could not be recorded, and the messages in hand wait for it.
While a handler is away its fetch loops wait too (gates.HandlerGate), but for
one probe of one message with growing pauses: its messages go back without
counting a failure, so that an outage of any length only delays them.

Backpressure: a fetch never asks for more messages than the handler has free
slots (`concurrency`), so nothing waits unprocessed while its ack_wait runs;
`max_ack_pending` bounds the same thing on the server side. A message held
back for its tenant's turn (tenants.py) lends its slot to the fetch while it
waits, kept alive by the heartbeat: then max_ack_pending alone bounds what
is in hand.

Start-up waits for NATS and PostgreSQL for as long as they are unreachable
(one log line per attempt, at most every few seconds, no traceback); a bad
setting or an unsupported schema ends it with one line (cli.main). The NATS
client reconnects by itself after a lost connection; a connection the
server closes for good (nats-py's CLOSED state: after a protocol error such
as a too-large publish) is re-established here, and the pull subscriptions
and advisory subscriptions bound again on it.

Shutdown (SIGTERM/SIGINT, see cli/consume.py), at any moment, start-up
included: stop fetching, let the in-flight messages finish for up to
drain_timeout, then close. A message that did not finish is simply not
acknowledged: JetStream redelivers it and the inbox tells what was already
done.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Coroutine
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from pgoutbox.core import broker, db, tracing
from pgoutbox.core.backoff import Every, Retrier, retrying
from pgoutbox.core.errors import ConfigError, DatabaseUnavailable, SchemaMismatch
from pgoutbox.core.health import HealthServer
from pgoutbox.core.jetstream import Puller
from pgoutbox.core.stopping import sleep, until_stopped
from pgoutbox.inbox import dlq, tenants
from pgoutbox.inbox import settings as cs
from pgoutbox.inbox import store as inbox_store
from pgoutbox.inbox.database_gate import DatabaseGate
from pgoutbox.inbox.flow import MessageFlow, transient
from pgoutbox.inbox.gates import HandlerGate
from pgoutbox.inbox.handler_client import HandlerClient
from pgoutbox.inbox.metrics import ConsumerMetrics, Outcome
from pgoutbox.inbox.replayer import Replayer
from pgoutbox.inbox.settings import HandlerRuntime, replay_backoff, retry_backoff, worker_name
from pgoutbox.inbox.store import Inbox

log = logging.getLogger(__name__)

# JetStream not answering (yet): waited for, the durables bound once it does.
_JETSTREAM_AWAY = (
    nats.errors.TimeoutError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
)


async def check_schema(inbox: Inbox, database_url: str | None, *, retry: bool = True) -> None:
    """Checks the schema version, waiting (retry) for as long as PostgreSQL is
    unreachable, else DatabaseUnavailable; SchemaMismatch for a schema this
    code does not know or a database without one (the pool checks each new
    connection: inbox_store.pool)."""
    version = await retrying(
        inbox.schema_version,
        retry_on=lambda exc: retry and isinstance(exc, DatabaseUnavailable) and exc.retryable,
        log=log,
        line=lambda exc, _: f"{exc}; retrying",
        action="db_retry",
    )
    # The pool checked it (each new connection is checked): say what it found.
    log.info(
        "schema version %s (this pgoutbox runs on %s)",
        version,
        db.supported_schemas(),
        extra={"action": "schema_checked", "schema_version": version},
    )


class Slots:
    """Free processing slots of one handler. A fetch waits until half a batch
    is free, then takes up to a batch: fetching one message whenever one slot
    frees would cost a round trip to the server per message."""

    def __init__(self, size: int):
        self.size = size
        self.free = size
        self._freed: asyncio.Event | None = None

    async def take(self, most: int) -> int:
        least = max(1, min(most, self.size) // 2)
        while self.free < least:
            self._freed = asyncio.Event()
            await self._freed.wait()
        taken = min(most, self.free)
        self.free -= taken
        return taken

    def give(self, count: int) -> None:
        if count:
            self.free += count
            if self._freed is not None:
                self._freed.set()

    def take_back(self, count: int) -> None:
        """A slot lent by a message held back for its tenant's turn (tenants.py)
        is its own again: the next fetch waits for it to be given back."""
        self.free -= count


class Linger:
    """The pacing of one fetch loop (OUTBOX_CONSUMER_FETCH_LINGER): after a
    short fetch, the next one comes no sooner than `seconds` after it started
    (as the relay's claim_interval), so that at moderate rates a fetch carries
    what arrived meanwhile, not one or two messages, and shares its costs
    (the pull request, the inbox's receive and settle calls). A full fetch is
    followed at once: more may be waiting."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._next = 0.0

    def pause(self, now: float) -> float:
        """How long to wait before the next fetch (0: none)."""
        return max(0.0, self._next - now)

    def fetched(self, started: float, got: int, wanted: int) -> None:
        self._next = started + self.seconds if got < wanted else 0.0


class Consumer:
    def __init__(self, handlers: list[HandlerRuntime], cfg: cs.ConsumerConfig):
        if not handlers:
            raise ConfigError("no handler to run")
        self.handlers = handlers
        self.cfg = cfg
        # Validated before anything connects.
        self._retry_backoff, self._replay_backoff = retry_backoff(cfg), replay_backoff(cfg)
        self.metrics = ConsumerMetrics()
        # OFF unless OTEL_* variables ask for traces; a missing SDK stops start-up here, with one line.
        self.tracing = tracing.from_environment(tracing.CONSUMER_SERVICE)
        self.stopping = asyncio.Event()
        self.health: HealthServer | None = None
        # nats-py's client and JetStream context; None until connected (and after the server closed it).
        self.nc: Any = None
        self.js: Any = None
        self.pool: db.Pool | None = None
        self.client: HandlerClient | None = None
        self.replayer: Replayer | None = None
        self._started = False
        self._closed = asyncio.Event()  # nats-py gave the connection up (CLOSED)
        self._bound: set[str] = set()
        self._slots: dict[tuple[str, str], Slots] = {}
        self._loops: list[asyncio.Task[None]] = []
        self._background: list[asyncio.Task[None]] = []
        self._in_flight: set[asyncio.Task[None]] = set()
        self._db_ok = False
        self._left_every = Every()  # one "left for redelivery" line per outage
        self.gate: DatabaseGate | None = None
        self.handler_gates: dict[str, HandlerGate] = {}

    # -- life cycle ---------------------------------------------------------
    async def start(self) -> None:
        cfg = self.cfg
        if cfg.http_port is not None:
            # First: /healthz and /readyz answer while start-up waits for the servers.
            self.health = HealthServer(
                cfg.http_host,
                cfg.http_port,
                self.metrics,
                self.problems,
                liveness=self.liveness_problems,
                setting="OUTBOX_CONSUMER_HTTP_HOST/PORT or --http-host/--http-port; 0 for any free port",
            )
            self.health.start()
            self._background.append(asyncio.create_task(self.health.ticking()))
        await self._connect()
        self.pool = inbox_store.pool(cfg.database_url, cfg.db_pool_size)
        self.inbox = Inbox(self.pool)
        await self._check_schema()
        self.gate = DatabaseGate(self.inbox.schema_version)
        self.client = HandlerClient(per_origin=max(h.concurrency for h in self.handlers) + 1)
        self.handler_gates = {
            h.name: HandlerGate(h.name, self.metrics.handler_up.labels(h.name), stopping=self.stopping)
            for h in self.handlers
        }
        self.flow = MessageFlow(
            inbox=self.inbox,
            client=self.client,
            nc=self.nc,
            js=self.js,
            metrics=self.metrics,
            retry_backoff=self._retry_backoff,
            replay_backoff=self._replay_backoff,
            stopping=self.stopping,
            gate=self.gate,
            tracer=self.tracing,
            cloudevents_source=cfg.cloudevents_source,
            handler_gates=self.handler_gates,
            tenants={
                h.name: tenants.Share(
                    h.tenant_concurrency,
                    self.metrics.tenant_held.labels(h.name),
                    self.metrics.tenant_holds.labels(h.name),
                )
                for h in self.handlers
            },
        )
        await self._bind_all()
        self._started = True
        self._background.append(asyncio.create_task(self.flow.heartbeat.run()))
        self._background.append(asyncio.create_task(self._backlog_loop()))
        self._background.append(asyncio.create_task(self._keep_connected()))
        if cfg.run_replayer:
            self.replayer = Replayer(
                inbox=self.inbox,
                js=self.js,
                nc=self.nc,
                metrics=self.metrics,
                worker=worker_name(cfg),
                batch_size=cfg.replay_batch_size,
                poll_interval=cfg.replay_poll_interval,
                dlq_max_age=cfg.dlq_max_age,
                dlq_duplicate_window=cfg.dlq_duplicate_window,
            )
            self._background.append(asyncio.create_task(self.replayer.run(self.stopping)))
        log.info(
            "consumer started",
            extra={
                "handlers": [h.name for h in self.handlers],
                "http_port": self.health.port if self.health else None,
            },
        )

    async def stop(self) -> None:
        self.stopping.set()
        # A fetch in progress returns within fetch_timeout; do not wait for it.
        await self._stop_loops()
        if self._in_flight:
            done, pending = await asyncio.wait(self._in_flight, timeout=self.cfg.drain_timeout)
            for task in pending:
                task.cancel()
            if pending:
                log.warning(
                    "drain timeout: unfinished messages will be redelivered", extra={"unfinished": len(pending)}
                )
                await asyncio.gather(*pending, return_exceptions=True)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.gate is not None:
            self.gate.close()
        for handler_gate in self.handler_gates.values():
            handler_gate.close()
        if self.health:
            self.health.stop()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.aclose()
        await self._close_nats(self.nc)
        if self.pool is not None:
            with contextlib.suppress(Exception):
                await self.pool.close()
        await self.tracing.shutdown()  # exports the spans still held
        log.info("consumer stopped")

    async def run(self, stop: asyncio.Event) -> None:
        """Runs until `stop` is set, which may happen at any moment, start-up included."""
        watcher = asyncio.create_task(self._stop_when(stop))
        try:
            if await until_stopped(self.start(), self.stopping):
                await self.stopping.wait()
        finally:
            watcher.cancel()
            await self.stop()  # also after a failed or interrupted start: close what was opened

    async def _stop_when(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.stopping.set()

    # -- connections ----------------------------------------------------------
    async def _connect(self) -> None:
        """Connects to NATS, waiting for as long as it is unreachable; nats-py
        then reconnects a lost connection by itself."""
        this: list[Any] = []  # the connection, once made: only its own closing counts

        async def on_closed() -> None:
            if this and this[0] is self.nc and not self.stopping.is_set():
                self._closed.set()

        nc = await broker.connect(self.cfg.nats_url, "pgoutbox-consumer", closed_cb=on_closed)
        this.append(nc)
        self._closed.clear()
        self.nc, self.js = nc, nc.jetstream()

    async def _close_nats(self, nc: Any) -> None:
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()  # flushes the acks already written

    async def _check_schema(self) -> None:
        await check_schema(self.inbox, self.cfg.database_url)
        versioned = sorted(h.name for h in self.handlers if h.spec.version is not None)
        if versioned and not self.inbox.upcasts:
            raise SchemaMismatch(
                f"handler(s) {', '.join(versioned)} declare a version; upcasters need schema "
                f"{inbox_store.UPCASTS_FROM} or newer: run `pgoutbox migrate`"
            )
        self._db_ok = True

    async def _keep_connected(self) -> None:
        """Re-establishes a connection nats-py gave up (CLOSED), and binds
        everything again on it; in-flight messages of the old one are
        redelivered (their acks are lost with it)."""
        while not self.stopping.is_set():
            if not await until_stopped(self._closed.wait(), self.stopping):
                return
            old = self.nc
            log.error(
                "NATS closed the connection (%s); re-establishing it",
                repr(old.last_error),
                extra={"action": "nats_closed"},
            )
            await self._stop_loops()
            self._bound.clear()
            retry = Retrier(self.stopping, every=0.0)  # a line for each failure
            while not self.stopping.is_set():
                try:
                    await self._connect()
                    self.flow.use(self.nc, self.js)
                    if self.replayer is not None:
                        self.replayer.use(self.nc, self.js)
                    await self._bind_all()
                    log.info("NATS connection re-established", extra={"action": "nats_reestablished"})
                    break
                except Exception as exc:
                    if retry.failed():
                        log.error(
                            "re-establishing the NATS connection failed (%r); trying again",
                            exc,
                            extra={"action": "nats_rebind_failed"},
                        )
                    await self._stop_loops()
                    self._bound.clear()
                    failed, self.nc = self.nc, None
                    await self._close_nats(failed)
                    await retry.pause()

    # -- JetStream ----------------------------------------------------------
    def _consumer_config(self, h: HandlerRuntime, subjects: list[str], description: str) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=h.name,
            description=description,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=h.ack_wait,
            # No limit: the inbox counts the handler's failures (h.max_deliver),
            # so that deliveries lost to an outage or a crash cost nothing.
            max_deliver=-1,
            max_ack_pending=h.max_ack_pending,
            filter_subjects=subjects,
        )

    async def _durable(self, stream: str, config: ConsumerConfig) -> Puller:
        assert config.durable_name is not None
        try:
            await self.js.add_consumer(stream, config)  # creates, or updates in place
        except nats.js.errors.ServiceUnavailableError:
            raise
        except nats.js.errors.APIError as exc:
            raise ConfigError(f"cannot create or update durable {config.durable_name} on {stream}: {exc}") from exc
        return await Puller(self.nc, stream, config.durable_name).start()

    async def _bind_all(self) -> None:
        """Binds every handler's durables and starts their fetch loops; waits
        while JetStream does not answer (a missing stream is a ConfigError)."""
        where = broker.where(self.cfg.nats_url)
        for h in self.handlers:
            subscriptions = await retrying(
                functools.partial(self._bind, h),
                retry_on=lambda exc: isinstance(exc, _JETSTREAM_AWAY),
                log=log,
                line=lambda exc, _: f"JetStream unavailable at {where} ({type(exc).__name__}); retrying",
                action="nats_retry",
                extra={"handler": h.name},
            )
            for kind, sub, batch in subscriptions:
                slots = self._slots.setdefault((h.name, kind), Slots(h.concurrency if kind == "events" else 1))
                if kind == "events":  # held messages lend their slots to the event fetch
                    self.flow.tenants[h.name].lender = slots
                self._loops.append(asyncio.create_task(self._fetch_loop(h, sub, slots, batch)))

    async def _bind(self, h: HandlerRuntime) -> list[tuple[str, Puller, int]]:
        spec = h.spec
        try:
            await self.js.stream_info(spec.stream)
        except nats.js.errors.NotFoundError as exc:
            raise ConfigError(
                f"stream {spec.stream} (handler {h.name}) does not exist: provision the context's streams first"
            ) from exc
        events = await self._durable(
            spec.stream, self._consumer_config(h, list(spec.subjects), f"pgoutbox handler {h.name}: {spec.url}")
        )
        dlq_stream = await dlq.ensure_stream(
            self.js,
            spec.context,
            max_age=self.cfg.dlq_max_age,
            duplicate_window=self.cfg.dlq_duplicate_window,
        )
        replays = await self._durable(
            dlq_stream,
            self._consumer_config(
                h, [dlq.replay_subject(spec.context, h.name)], f"pgoutbox replays for handler {h.name}"
            ),
        )
        self._bound.add(h.name)
        # Replays are rare: their own single slot, so that an idle replay pull
        # never holds capacity the event stream needs.
        return [("events", events, h.batch_size), ("replays", replays, 1)]

    async def _stop_loops(self) -> None:
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops.clear()

    async def _fetch_loop(self, h: HandlerRuntime, sub: Puller, slots: Slots, batch: int) -> None:
        """Fetches for as long as the consumer runs: no error ends it (a closed
        connection is re-established by _keep_connected, which restarts it)."""
        every = Every()
        assert self.gate is not None
        handler_gate = self.handler_gates[h.name]
        loop = asyncio.get_running_loop()
        linger = Linger(self.cfg.fetch_linger)
        while not self.stopping.is_set():
            # Nothing is fetched that could not be recorded.
            if not await self.gate.wait(self.stopping):
                return
            # Nothing is fetched for a handler that is away, but its probe.
            probe = await handler_gate.admit(self.stopping)
            if probe is None:
                return
            pause = linger.pause(loop.time())
            if pause > 0:
                await asyncio.sleep(pause)  # short: the loop's condition sees a stop right after
            wanted = await slots.take(1 if probe else batch)
            started = loop.time()
            try:
                msgs = await sub.fetch(wanted, timeout=self.cfg.fetch_timeout)
            except (TimeoutError, nats.errors.TimeoutError):  # idle: nothing to fetch
                msgs = []
            except asyncio.CancelledError:
                slots.give(wanted)
                if probe:
                    handler_gate.probe_unused()
                raise
            except Exception as exc:
                slots.give(wanted)
                if probe:
                    handler_gate.probe_unused()
                if every():
                    log.warning("fetch failed; retrying: %r", exc, extra={"handler": h.name, "error": repr(exc)})
                await asyncio.sleep(1)
                continue
            slots.give(wanted - len(msgs))
            linger.fetched(started, len(msgs), wanted)
            if msgs:
                self._track(self._process(h, msgs, slots, probe=probe))
            elif probe:
                handler_gate.probe_unused()

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        """An in-flight task, waited for at shutdown; an exception it raises
        (a defect: flow reports each message itself) is logged, never left
        unretrieved."""
        task = asyncio.create_task(work)
        self._in_flight.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("in-flight task failed", exc_info=task.exception())

    async def _process(self, h: HandlerRuntime, msgs: list[Any], slots: Slots, *, probe: bool = False) -> None:
        """One fetch, through the message flow; each message frees its slot
        and is counted as soon as it finishes (flow reports each exactly once)."""
        gauge = self.metrics.in_flight.labels(h.name)
        gauge.inc(len(msgs))

        def done(msg: Any, outcome: Outcome | Exception | None) -> None:
            gauge.dec()
            slots.give(1)
            if outcome is None:  # cancelled, or the consumer stopped: redelivered, not counted
                return
            if isinstance(outcome, Exception):
                self._left(h, msg, outcome)
                outcome = Outcome.ERROR
            elif outcome is not Outcome.DEFERRED:  # recorded: how old the event is by now
                self.metrics.observe_age(h.name, outcome, msg.headers, time.time())
            self.metrics.count(h.name, outcome)

        try:
            await self.flow.handle_fetch(msgs, h, done)
        finally:
            if probe:  # still away: the next probe after a longer pause
                self.handler_gates[h.name].probe_done()

    def _left(self, h: HandlerRuntime, msg: Any, exc: Exception) -> None:
        """A message left unacknowledged (a server away, or a failure to
        dead-letter it): nak'ed with the retry delay of its delivery, so that
        it comes back without waiting for ack_wait; it records no failure."""
        if transient(exc):
            if self._left_every():  # one line per outage, not a traceback per message
                log.warning("messages left for redelivery: %s", exc, extra={"handler": h.name, "action": "left"})
        else:
            log.error(
                "message left unacknowledged after an error",
                exc_info=exc,
                extra={"handler": h.name, "subject": msg.subject},
            )
        delay = self._retry_backoff.delay(max(1, msg.metadata.num_delivered))

        async def nak() -> None:
            with contextlib.suppress(Exception):  # no connection: ack_wait redelivers it anyway
                await msg.nak(delay=delay)

        self._track(nak())

    # -- operations ---------------------------------------------------------
    async def _backlog_loop(self) -> None:
        """Also the PostgreSQL check of /readyz: it fails within one interval
        of PostgreSQL going away."""
        every = Every()
        while not self.stopping.is_set():
            try:
                self.metrics.set_backlog(await self.inbox.backlog(), time.time())
                self._db_ok = True
            except Exception as exc:
                self._db_ok = False
                if every():
                    log.warning("inbox.backlog() failed: %s", exc, extra={"error": repr(exc)})
            await sleep(self.cfg.backlog_interval, self.stopping)

    def problems(self) -> list[str]:
        """Why the consumer is not ready (empty: ready). Called from the health thread."""
        found = []
        if not self._started:
            found.append("starting")
        if self.nc is None or not self.nc.is_connected:
            found.append("not connected to NATS")
        if not self._db_ok or (self.gate is not None and not self.gate.is_up):
            found.append("PostgreSQL unreachable (last call failed)")
        found.extend(g.describe() for g in self.handler_gates.values() if not g.is_up)
        missing = sorted({h.name for h in self.handlers} - self._bound)
        if missing:
            found.append(f"durables not bound: {', '.join(missing)}")
        if self.stopping.is_set():
            found.append("stopping")
        return found

    def liveness_problems(self) -> list[str]:
        """Why nothing can be consumed although the process runs (/healthz 503):
        the NATS connection is closed, or a fetch loop ended."""
        if not self._started or self.stopping.is_set():
            return []
        found = []
        if self.nc is None or self.nc.is_closed:
            found.append("NATS connection closed (being re-established)")
        ended = [t for t in self._loops if t.done()]
        if ended:
            found.append(f"{len(ended)} fetch loop(s) ended")
        elif not self._loops:
            found.append("no fetch loop running")
        return found
