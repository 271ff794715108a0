"""The relay: claim due outbox events, publish them to JetStream, mark them.

Three stages joined by one-slot queues, so that PostgreSQL and NATS work at
the same time (claiming batch n+1 while n is being published and n-1 marked):

    claim loop ──► publish loop ──► mark loop
    (outbox.claim)  (Nats-Msg-Id =    (mark_published / mark_failed,
                     event_id; up to    one call each per batch)
                     publish_batches
                     batches at once)

Safety comes from the database and JetStream, not from this process:
  * a claim is a lease; a relay that dies (kill -9) leaves PROCESSING rows
    that any relay re-claims once the lease expires, and re-publishes them
    with the same Nats-Msg-Id, which JetStream deduplicates (a duplicate ack
    is a success). Hence the start-up check lease < duplicate_window;
  * per-key order: outbox.claim hands out an event only when every earlier
    event of its ordering_key is COMPLETED, so a key has at most one event in
    flight, and a batch can be published fully pipelined;
  * the mark functions are fenced by the claim token: a relay whose lease was
    taken over cannot overwrite the new owner's work (STALE_CLAIM).

Pacing: a full batch is followed by another claim at once (more may be
due); a short one took everything due, so the loop waits for a wake-up
(notification, throttle re-check, due retry, a keyed event marked, a
scheduled event falling due: asked after an empty claim) or the
fallback poll, and claims no sooner than claim_interval after the previous
claim (but at once for a keyed event's successor). Housekeeping: outbox.create_partitions() every
partitions_every, and the backlog gauges every backlog_interval.

Failures belong to one event, never to its batch or the process: rows are
read so that no value can fail the fetch (calls.py), and whatever an
event carries that cannot be published (a timestamp RFC 3339 cannot express,
a header NATS cannot carry, an oversize message: publisher.PERMANENT) is
dead-lettered at once with its code; other errors are retried with
full-jitter backoff until max_attempts. While NATS is unreachable nothing is claimed (claiming would
only burn attempts). A publish the broker did not answer (Outcome.away:
timeout, no responders, JetStream 503 / no leader / no quorum) is not the
event's failure: it is handed back (outbox.hand_back, no attempt counted),
and claiming pauses until one probe with growing pauses finds JetStream
answering again (away.py; docs/relay.md, "JetStream away"). When
PostgreSQL goes away, calls are retried after a reconnection; a published
batch keeps trying to mark until its lease ends.

Shutdown (SIGTERM/SIGINT sets `stop`): stop claiming, publish and mark the
batches already claimed (handing them back as due-now when NATS is down),
within shutdown_grace; what is left then is recovered via its lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
import psycopg

from pgoutbox.core import db, tracing
from pgoutbox.core.backoff import Every, Retrier, RetryPolicy, retrying
from pgoutbox.core.errors import ConfigError, PgOutboxError, SchemaMismatch, StaleClaim, one_line
from pgoutbox.core.health import HealthServer
from pgoutbox.core.stopping import sleep, until_stopped
from pgoutbox.core.wire import PublishError
from pgoutbox.outbox import streams
from pgoutbox.outbox.away import JetStreamAway
from pgoutbox.outbox.calls import DatabaseUnavailable, OutboxCalls
from pgoutbox.outbox.metrics import RelayMetrics
from pgoutbox.outbox.publisher import Outcome, Publisher
from pgoutbox.outbox.settings import RelayConfig
from pgoutbox.outbox.wakeups import Wakeups

log = logging.getLogger(__name__)

# JetStream not answering at start-up: waited for, as while the relay runs.
_JETSTREAM_AWAY = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
)
T = TypeVar("T")
HAND_BACK_SCHEMA = 18  # the schema version that brought outbox.hand_back


@dataclass
class Batch:
    rows: list[dict[str, Any]]
    claimed_at: float  # monotonic
    outcomes: list[Outcome] = field(default_factory=list)
    handed_back: bool = False
    probe: asyncio.Event | None = None  # set once a probe batch's outcomes are known

    @property
    def token(self) -> Any:
        return self.rows[0]["claim_token"]


class OutboxRelay:
    def __init__(self, cfg: RelayConfig, publisher: Publisher | None = None, tracer: tracing.Tracer | None = None):
        self.cfg = cfg
        # OFF unless OTEL_* variables ask for traces; a missing SDK stops start-up here, with one line.
        self.tracing = tracing.from_environment(tracing.RELAY_SERVICE) if tracer is None else tracer
        self.publisher = publisher or Publisher(
            cfg.nats_url,
            timeout=cfg.publish_timeout,
            name=f"pgoutbox-relay {cfg.relay_name}",
            source=cfg.cloudevents_source,
        )
        self.policy = RetryPolicy(cfg.retry_base, cfg.retry_cap, cfg.max_attempts)
        self.metrics = RelayMetrics()
        # A claim commits with the database's own synchronous_commit: its
        # commit record follows the claimed events' own in the WAL, so once it
        # returns the events are as durable as a writer's commit makes them
        # (with a synchronous standby: on the standby too). Without that wait,
        # an event whose writer's wait for the standby was cancelled (visible
        # on the primary, not yet on the standby) could be published and then
        # vanish with its business change in a failover. Marks need not wait:
        # one lost in a crash reverts to a state the lease and Nats-Msg-Id
        # deduplication already recover from (re-claim, re-publish, dup ack).
        self.claims = OutboxCalls(cfg.database_url, "claim", wire_times=True)
        self.marks = OutboxCalls(cfg.database_url, "mark", synchronous_commit=cfg.synchronous_commit)
        self.monitor = OutboxCalls(cfg.database_url, "backlog", wire_times=True)
        self.wakeups = Wakeups(cfg.poll_interval)
        self.stopping = asyncio.Event()
        self.started = asyncio.Event()
        self.http: HealthServer | None = None
        self._last_progress = time.monotonic()
        self._due = 0
        self._in_flight = 0
        self.away = JetStreamAway()
        self._claim_retry = Retrier(self.stopping)  # the claim's retry pacing (_claim)
        # outbox.hand_back came with schema 18; on an older schema an away
        # outcome counts an attempt, as it did before (until `pgoutbox migrate`).
        self.can_hand_back = True
        # outbox.next_scheduled likewise (schema 18): without it, scheduled
        # events go out at the fallback poll after they fall due.
        self._asks_schedules = True
        self._schedules_near = False  # the last answer fell before the next poll

    # -- lifecycle ---------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Runs until `stop` is set (or a fatal error); raises ConfigError on unsafe settings."""
        stop_task = asyncio.create_task(stop.wait())
        background: list[asyncio.Task[None]] = []
        try:
            start = asyncio.create_task(self._start())
            await asyncio.wait({start, stop_task}, return_when=asyncio.FIRST_COMPLETED)
            if not start.done():
                start.cancel()
                # A connection attempt being abandoned may not end at once; the pools'
                # close (below, 1 s each) ends it. Waiting longer here made a stop while
                # PostgreSQL was down take over 5 s under load.
                await asyncio.wait({start}, timeout=1)
                log.info("stopped before start-up completed", extra={"action": "stopped"})
                return
            start.result()
            claimed: asyncio.Queue[Batch | None] = asyncio.Queue(maxsize=1)
            published: asyncio.Queue[Batch | None] = asyncio.Queue(maxsize=self.cfg.publish_batches)
            pipeline = [
                asyncio.create_task(self._claim_loop(claimed), name="claim"),
                asyncio.create_task(self._publish_loop(claimed, published), name="publish"),
                asyncio.create_task(self._mark_loop(published), name="mark"),
            ]
            background.append(asyncio.create_task(self._backlog_loop(), name="backlog"))
            if self.http is not None:
                background.append(asyncio.create_task(self.http.ticking(), name="tick"))
            if self.cfg.partitions_every > 0:
                background.append(asyncio.create_task(self._partitions_loop(), name="partitions"))
            if self.cfg.wakeups:
                background.append(asyncio.create_task(self.wakeups.listen(self.cfg.database_url), name="listen"))
            self.started.set()
            log.info(
                "relay started",
                extra={
                    "action": "started",
                    "worker": self.cfg.relay_name,
                    "batch_size": self.cfg.batch_size,
                    "lease": self.cfg.lease,
                    "wakeups": self.cfg.wakeups,
                    "http_port": self.http_port,
                },
            )
            watched = {stop_task, *pipeline, *background}
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            crashed = [t for t in done if t is not stop_task and t.exception() is not None]
            if crashed:
                for task in pipeline:
                    task.cancel()  # claimed batches are recovered through their lease
                await asyncio.gather(*pipeline, return_exceptions=True)
                raise crashed[0].exception() or RuntimeError("a relay task ended")
            await self._drain(pipeline)
        finally:
            stop_task.cancel()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self._close()

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http else None

    async def _start(self) -> None:
        cfg = self.cfg
        found = await self._retry_db(self.claims.schema_version, "start-up")  # the pool refuses an unknown schema
        log.info(
            "schema version %s (this pgoutbox runs on %s)",
            found,
            db.supported_schemas(),
            extra={"action": "schema_checked", "schema_version": found},
        )
        self.can_hand_back = found >= HAND_BACK_SCHEMA
        if not self.can_hand_back:
            log.warning(
                "schema version %s has no outbox.hand_back: a publish JetStream does not answer counts an "
                "attempt of its event until `pgoutbox migrate` brings the schema to %s",
                found,
                HAND_BACK_SCHEMA,
                extra={"action": "startup_check"},
            )
        self.wakeups.throttle = await self._retry_db(self.claims.notify_throttle, "start-up")
        specs = streams.load(cfg.streams_file) if cfg.streams_file else None
        if specs:
            streams.check_lease(specs, cfg.lease)
        await self.publisher.connect()
        # JetStream away at start-up (a server without it for now, a cluster
        # without its quorum) is waited out, as it is once the relay runs: a
        # relay restarted during an outage must not exit (the consumer waits too).
        try:
            findings = await retrying(
                lambda: streams.check(self.publisher.js, cfg.lease, specs, cfg.nats_monitor_url),
                retry_on=lambda exc: isinstance(exc, _JETSTREAM_AWAY),
                log=log,
                line=lambda exc, attempt: (
                    f"start-up (attempt {attempt}): JetStream not answering ({type(exc).__name__}); retrying"
                ),
                action="nats_retry",
            )
        except nats.errors.Error as exc:  # an answer that is not "away": the streams cannot be listed
            raise ConfigError(f"cannot list the JetStream streams: {exc}") from exc
        for text in findings.notices + findings.durability:
            log.warning(text, extra={"action": "startup_check"})
        refusals = findings.errors + (findings.durability if cfg.durability_strict else [])
        if refusals:
            raise ConfigError("refusing to start: " + " | ".join(refusals))
        self.http = HealthServer(
            cfg.http_host,
            cfg.http_port,
            self.metrics,
            self._readiness,
            setting="OUTBOX_RELAY_HTTP_HOST/PORT or --http-host/--http-port; 0 for any free port",
        )
        self.http.start()

    async def _drain(self, pipeline: list[asyncio.Task[None]]) -> None:
        """Stop claiming; let claimed batches finish (or be handed back) within the grace."""
        self.stopping.set()
        self.wakeups.stop()
        log.info(
            "stopping: finishing in-flight batches", extra={"action": "stopping", "in_flight_batches": self._in_flight}
        )
        _, late = await asyncio.wait(pipeline, timeout=self.cfg.shutdown_grace)
        if late:
            log.error(
                "shutdown grace over: %d batch(es) left PROCESSING; they are re-claimed when their lease ends",
                self._in_flight,
                extra={"action": "shutdown_timeout"},
            )
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    async def _close(self) -> None:
        if self.http:
            self.http.stop()
        await self.publisher.close()
        for calls in (self.claims, self.marks, self.monitor):
            await calls.close()
        await self.tracing.shutdown()  # exports the spans still held

    # -- the three stages ---------------------------------------------------

    async def _claim_loop(self, out: asyncio.Queue[Batch | None]) -> None:
        cfg = self.cfg
        size = cfg.batch_size
        while not self.stopping.is_set():
            if not self.publisher.connected:
                self.metrics.nats_up.set(0)
                await until_stopped(self.publisher.wait_connected(cfg.poll_interval), self.stopping)
                continue
            self.metrics.nats_up.set(1)
            if self.away.active:
                await self._probe(out)
                continue
            self.wakeups.arm()
            started = time.monotonic()
            rows = await self._claim(size, started)
            if rows is None:
                continue
            if rows:
                self._in_flight += 1
                self.metrics.batch_size.observe(len(rows))
                await out.put(Batch(rows, started))
                if len(rows) == size:
                    size = self._drain_size(rows, size)
                    continue  # a full batch: more may be due, claim again without waiting
                if self._schedules_near:  # the next of several scheduled events, on time too
                    await self._next_scheduled()
            else:
                self._progress()  # nothing claimable is not "stuck"
                await self._next_scheduled()
            size = cfg.batch_size
            # A short batch took everything due. What commits next notifies,
            # or falls in a throttle window whose re-check is scheduled. The
            # next claim comes no sooner than claim_interval after this one,
            # so that under steady traffic each claim takes what several
            # wake-ups announced (a claim cycle costs the relay and PostgreSQL
            # far more than an event in it: docs/relay.md); the pause comes
            # first, so that what arrives meanwhile wakes nobody.
            await self.wakeups.pause(started + cfg.claim_interval - time.monotonic())
            await self.wakeups.wait()
        await out.put(None)

    def _drain_size(self, rows: list[dict[str, Any]], size: int) -> int:
        """The next claim's size while a backlog drains. A full batch mostly of
        one tenant, with others' events in it, is a fair claim beside that
        tenant's backlog (outbox.claim). The claims then follow each other at
        once, and another tenant's event waits for the claim under way, then
        for its own: a claim's time, which grows with its rows (8 ms for 125
        on the bench machine). So until the backlog has drained the relay
        claims batch_size / (4 x publish_batches) at a time (31 by default):
        the others' events wait about as long as with no backlog, and the
        backlog drains more slowly, at more claims per event (docs/relay.md,
        "Fair claims"). Batches shared among many busy tenants, none most of
        it, keep the full size (that is throughput, and no one waits behind
        another)."""
        small = max(1, self.cfg.batch_size // (4 * self.cfg.publish_batches))
        if size == small:
            return small
        tenants = Counter(r["tenant_id"] for r in rows)
        if len(tenants) > 1 and 2 * max(tenants.values()) > len(rows):
            return small
        return self.cfg.batch_size

    async def _claim(self, batch_size: int, started: float) -> list[dict[str, Any]] | None:
        """One claim; None when it failed (logged, and paced by a stop-aware pause)."""
        try:
            rows = await self.claims.claim(self.cfg.relay_name, batch_size, self.cfg.lease)
        except DatabaseUnavailable as exc:
            self.metrics.database_up.set(0)
            if self._claim_retry.failed():
                log.warning(
                    "claim failed (attempt %d), PostgreSQL unavailable: %s",
                    self._claim_retry.attempts,
                    exc,
                    extra={"action": "db_retry"},
                )
            await self._claim_retry.pause()
            return None
        except psycopg.Error as exc:
            # Not expected (rows are read so that none can fail the fetch),
            # but a worker retries rather than exits; claimed rows, if
            # any, come back when their lease ends.
            if self._claim_retry.failed():
                log.error(
                    "claim failed (attempt %d): %s [%s]",
                    self._claim_retry.attempts,
                    one_line(exc),
                    exc.sqlstate,
                    extra={"action": "claim_error", "sqlstate": exc.sqlstate},
                )
            await self._claim_retry.pause()
            return None
        self._claim_retry.succeeded()
        self.metrics.database_up.set(1)
        self.metrics.claim_seconds.observe(time.monotonic() - started)
        return rows

    async def _next_scheduled(self) -> None:
        """After a claim that found nothing due: when does the next scheduled
        event (emit's deliver_at / deliver_after) fall due? If before the next
        poll, the wait ends then, so that it is published on time without
        polling faster. Asked after an empty claim (one index probe, at most
        once a poll while idle), and after a short one while the last answer
        fell before the next poll (several scheduled events close together);
        a busy relay claims often enough anyway. No notification can
        announce it: NOTIFY is sent at commit, not later."""
        if not self._asks_schedules:
            return
        try:
            seconds = await self.claims.next_scheduled()
        except DatabaseUnavailable:
            return  # the next claim meets it, and says so
        except psycopg.Error as exc:
            # Not expected (granted since schema 18); the fallback poll still
            # publishes scheduled events, within one poll interval.
            self._asks_schedules = False
            log.warning(
                "cannot ask when scheduled events fall due, polling for them: %s [%s]",
                one_line(exc),
                exc.sqlstate,
                extra={"action": "next_scheduled_error", "sqlstate": exc.sqlstate},
            )
            return
        self._schedules_near = seconds is not None and seconds < self.cfg.poll_interval
        if seconds is not None and self._schedules_near:
            self.wakeups.wake_at(time.monotonic() + max(seconds, 0.0))

    async def _probe(self, out: asyncio.Queue[Batch | None]) -> None:
        """One probe of a JetStream that did not answer, after a growing pause.
        First a $JS.API.INFO request (no database work, no event moved, so a
        long outage costs one request per pause); once JetStream answers it,
        a claim of one event, published as usual, is the real test (a stream
        without a leader fails it while INFO answers). The episode ends when
        that publish is answered, or when nothing is due to try it with."""
        self.metrics.jetstream_up.set(0)
        if not await sleep(self.away.next_pause(), self.stopping) or not self.publisher.connected:
            return
        reason = await self.publisher.jetstream_answers()
        if reason is not None:
            self.away.still(reason)
            return
        started = time.monotonic()
        rows = await self._claim(1, started)
        if rows is None:
            return
        if not rows:
            self._jetstream_back()
            return
        answered = asyncio.Event()
        batch = Batch(rows, started, probe=answered)
        self._in_flight += 1
        await out.put(batch)
        if await until_stopped(answered.wait(), self.stopping) and not any(o.away for o in batch.outcomes):
            self._jetstream_back()

    def _jetstream_away(self, outcome: Outcome) -> None:
        """A publish the broker did not answer: starts an episode (one line, the
        gauge at 0), or keeps the current one's reason up to date."""
        reason = outcome.error
        if self.away.begin(reason):
            self.metrics.jetstream_up.set(0)
            log.warning(
                "JetStream not answering: %s; claiming paused, claimed events are handed back with no attempt "
                "counted, probing with growing pauses",
                reason,
                extra={"action": "jetstream_away", "code": outcome.code},
            )
            self.wakeups.wake(urgent=True)  # an idle claim loop starts probing now

    def _jetstream_back(self) -> None:
        episode = self.away.end()
        self.metrics.jetstream_up.set(1)
        if episode is not None:
            log.warning(
                "JetStream answering again after %.1fs; %d event(s) were handed back meanwhile (no attempt counted)",
                episode.seconds,
                episode.handed_back,
                extra={
                    "action": "jetstream_back",
                    "seconds": round(episode.seconds, 1),
                    "handed_back": episode.handed_back,
                },
            )

    async def _publish_loop(self, inp: asyncio.Queue[Batch | None], out: asyncio.Queue[Batch | None]) -> None:
        """Publishes up to publish_batches claimed batches at once. They are
        independent: a claim never hands out an event while an earlier one of
        its key is unfinished, so no two batches in flight share a key. Without
        this, a batch claimed while the previous one awaits its acks would
        wait for them too (the tail of the latency at high rates)."""
        slots = asyncio.Semaphore(self.cfg.publish_batches)
        in_flight: set[asyncio.Task[None]] = set()
        try:
            while (batch := await inp.get()) is not None:
                await slots.acquire()
                task = asyncio.create_task(self._publish(batch, out, slots))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            await asyncio.gather(*in_flight)
        except asyncio.CancelledError:
            for task in in_flight:
                task.cancel()
            raise
        await out.put(None)

    async def _publish(self, batch: Batch, out: asyncio.Queue[Batch | None], slots: asyncio.Semaphore) -> None:
        try:
            if self.stopping.is_set() and not self.publisher.connected:
                batch.handed_back = True
                batch.outcomes = [
                    Outcome(
                        r["event_id"],
                        code=PublishError.NATS_UNAVAILABLE,
                        detail="relay stopped while NATS was unreachable; handed back",
                        away=True,
                    )
                    for r in batch.rows
                ]
            elif self.tracing.on:
                span = self.tracing.send(batch.rows)
                try:
                    await self._publish_timed(batch)
                finally:
                    span.end([o.code for o in batch.outcomes if o.code is not None])
            else:
                await self._publish_timed(batch)
            away = next((o for o in batch.outcomes if o.away), None)
            if away is not None and not batch.handed_back:
                self._jetstream_away(away)
            if batch.probe is not None:
                batch.probe.set()
            await out.put(batch)
        finally:
            slots.release()

    async def _publish_timed(self, batch: Batch) -> None:
        started = time.monotonic()
        batch.outcomes = await self._publish_rows(batch.rows)
        self.metrics.publish_seconds.observe(time.monotonic() - started)
        try:  # at the batch's last ack: what lets the relay mark its events published
            self.metrics.ages(batch.rows, batch.outcomes, time.time())
        except Exception:  # a metric never holds a batch back (its events would wait for the lease)
            log.exception("observing event ages failed", extra={"action": "metrics_error"})

    async def _publish_rows(self, rows: list[dict[str, Any]]) -> list[Outcome]:
        """Each row's outcome; an unexpected failure of the whole call is every
        row's transient failure (retried, then dead-lettered), not the relay's."""
        try:
            return await self.publisher.publish_batch(rows)
        except Exception as exc:
            log.exception("publishing a batch failed", extra={"action": "publish_error"})
            return [
                Outcome(
                    r["event_id"],
                    code=PublishError.JETSTREAM_ERROR,
                    detail=f"publishing the batch failed: {type(exc).__name__}: {exc}",
                )
                for r in rows
            ]

    async def _mark_loop(self, inp: asyncio.Queue[Batch | None]) -> None:
        while (batch := await inp.get()) is not None:
            try:
                await self._mark(batch)
            finally:
                self._in_flight -= 1

    async def _mark(self, batch: Batch) -> None:
        now = datetime.now(UTC)
        done: list[Any] = []
        failed_ids: list[Any] = []
        errors: list[str] = []
        retry_at: list[datetime | None] = []
        dead: set[Any] = set()
        back: list[Any] = []  # away: handed back, no attempt counted
        keyed = False
        for row, outcome in zip(batch.rows, batch.outcomes):
            if outcome.ok:
                done.append(outcome.event_id)
                keyed = keyed or row["ordering_key"] is not None
                continue
            if outcome.away and self.can_hand_back:
                back.append(outcome.event_id)
                continue
            if batch.handed_back:
                delay: float | None = 0.0
            elif outcome.permanent:
                delay = None
            else:
                delay = self.policy.delay(row["attempts"])
            error = outcome.error
            if delay is None:
                dead.add(outcome.event_id)
                if not outcome.permanent:
                    error += f" (gave up after {row['attempts']} attempts)"
                log.error(
                    "dead-lettered %s: %s",
                    outcome.event_id,
                    error,
                    extra={
                        "action": "dead_letter",
                        "event_id": str(outcome.event_id),
                        "subject": str(row["subject"])[:300],
                        "code": outcome.code,
                    },
                )
            failed_ids.append(outcome.event_id)
            errors.append(error)
            retry_at.append(None if delay is None else now + timedelta(seconds=delay))
        deadline = batch.claimed_at + self.cfg.lease
        if done:
            marked = await self._mark_call(lambda: self.marks.mark_published(batch.token, done), deadline, len(done))
            if marked:
                self._progress()
        if failed_ids:
            await self._mark_call(
                lambda: self.marks.mark_failed(batch.token, failed_ids, errors, retry_at), deadline, len(failed_ids)
            )
            retried = len(failed_ids) - len(dead)
            soonest = min((r for r in retry_at if r is not None), default=None)
            if soonest is not None:
                self.wakeups.wake_at(time.monotonic() + (soonest - now).total_seconds() + 0.005)
            if retried:
                first = next(e for i, e in zip(failed_ids, errors) if i not in dead)
                log.warning(
                    "%d event(s) failed to publish, will retry: %s",
                    retried,
                    first,
                    extra={"action": "publish_failed", "count": retried},
                )
        if back:
            reason = next(o.error for o in batch.outcomes if o.away) + " (handed back, no attempt counted)"
            handed = await self._mark_call(lambda: self.marks.hand_back(batch.token, back, reason), deadline, len(back))
            self.away.counted(handed)
        self.metrics.count({r["event_id"]: r["context"] for r in batch.rows}, batch.outcomes, dead, set(back))
        if keyed:
            self.wakeups.wake(urgent=True)  # their successors of the same key are now claimable

    async def _mark_call(self, call: Callable[[], Awaitable[int]], deadline: float, expected: int) -> int:
        """Runs one mark call, retrying across reconnections until the lease ends
        (also while the relay stops: the batches in hand are marked first)."""
        retry = Retrier()
        while True:
            try:
                marked = await call()
            except StaleClaim:
                marked = 0
            except (DatabaseUnavailable, psycopg.Error) as exc:
                if time.monotonic() > deadline:
                    log.error(
                        "could not mark a batch before its lease ended (%s); it will be re-claimed "
                        "and re-published, deduplicated by Nats-Msg-Id",
                        one_line(exc),
                        extra={"action": "mark_abandoned"},
                    )
                    return 0
                if retry.failed():
                    log.warning(
                        "mark failed (attempt %d): %s", retry.attempts, one_line(exc), extra={"action": "db_retry"}
                    )
                await retry.pause()
                continue
            except (SchemaMismatch, ConfigError):
                raise  # e.g. the schema changed under the relay: stop with its one line
            except PgOutboxError as exc:
                # The database refused the call itself: retrying cannot help,
                # and the process must not die of it; the lease hands the
                # events to the next claim.
                log.error(
                    "the database refused to mark %d event(s): %s [%s]",
                    expected,
                    exc,
                    exc.code,
                    extra={"action": "mark_refused", "code": exc.code},
                )
                return 0
            if marked < expected:
                # The lease expired and another relay re-claimed these (or a
                # retried call had already committed): their state is theirs.
                self.metrics.stale_claims.inc()
                log.warning(
                    "%d of %d event(s) no longer held by this claim",
                    expected - marked,
                    expected,
                    extra={"action": "stale_claim"},
                )
            return marked

    # -- monitoring ----------------------------------------------------------

    async def _backlog_loop(self) -> None:
        lines = Every(60)
        snapshots = True
        while True:
            try:
                rows = await self.monitor.backlog()
                self.metrics.backlog(rows)
                self._due = sum(r["due"] for r in rows)
                if snapshots:
                    try:
                        seconds, xids = await self.monitor.oldest_snapshot()
                        self.metrics.oldest_snapshot_age.set(seconds)
                        self.metrics.oldest_snapshot_xids.set(xids)
                    except psycopg.errors.UndefinedFunction:
                        snapshots = False  # a schema before 18: no such function, no such gauge
            except DatabaseUnavailable:
                pass  # the claim loop reports it; readiness shows it
            except psycopg.Error as exc:  # e.g. a row's infinite timestamp: the gauges wait, delivery does not
                if lines():
                    log.error(
                        "backlog metrics unavailable: %s [%s]",
                        one_line(exc),
                        exc.sqlstate,
                        extra={"action": "backlog_error", "sqlstate": exc.sqlstate},
                    )
            self._readiness()
            await asyncio.sleep(self.cfg.backlog_interval)

    async def _partitions_loop(self) -> None:
        """Keeps daily partitions created ahead (idempotent, serialised in SQL), so
        that events never land in the default partition for want of a cron job."""
        while True:
            try:
                created = await self.monitor.create_partitions(self.cfg.days_ahead)
                if created:
                    log.info("created partitions %s", ", ".join(created), extra={"action": "partitions"})
            except DatabaseUnavailable:
                pass  # next round
            except (SchemaMismatch, ConfigError):
                raise
            except (psycopg.Error, PgOutboxError) as exc:  # housekeeping must not stop delivery
                log.error("creating partitions failed: %s", one_line(exc), extra={"action": "partitions_error"})
            await asyncio.sleep(self.cfg.partitions_every)

    def _progress(self) -> None:
        self._last_progress = time.monotonic()

    def problems(self) -> list[str]:
        """Why the relay is not ready (empty: ready); changes nothing."""
        problems = []
        if not self.started.is_set():
            problems.append("starting")
        if self.stopping.is_set():
            problems.append("stopping")
        if not self.claims.connected:
            problems.append("PostgreSQL unreachable")
        if not self.publisher.connected:
            problems.append("NATS unreachable")
        elif self.away.active:
            problems.append(self.away.describe())
        idle = time.monotonic() - self._last_progress
        if (self._due > 0 or self._in_flight > 0) and idle > self.cfg.stall_after:
            problems.append(f"no progress for {idle:.0f}s while {self._due} event(s) are due")
        return problems

    def _readiness(self) -> list[str]:
        """problems(), also shown by the ready gauge: /readyz (the HTTP thread) and each backlog round."""
        problems = self.problems()
        self.metrics.ready.set(0 if problems else 1)
        return problems

    async def _retry_db(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        return await retrying(
            call,
            retry_on=lambda exc: isinstance(exc, DatabaseUnavailable),
            log=log,
            line=lambda exc, attempt: f"{what} (attempt {attempt}): {exc}; retrying",
            action="db_retry",
        )
