"""Bulk actions run in throttled batches in the background, with progress.

An action is confirmed with the exact set it will take: the dialog's request
fixes it in the database (outbox.dlq_prepare records the targets and their
number, which the dialog shows). Confirming, with a reason, starts a task that
calls outbox.dlq_act once per batch, as the person who confirmed it, with
`batch` targets at most, pausing `pause` seconds between batches, until a
batch takes nothing: every target is taken once, so the action ends at the
confirmed count even while the handler keeps failing (a row that fails again
is counted as failed again, never retaken). Stop (outbox.dlq_stop) ends it
after the batch under way. The first batch runs inside the confirming
request, so a role PostgreSQL refuses gets its 403 there and no task starts.

Actions live in this process's memory; the audit of who did what, and why,
is the database's (each SQL function records it with session_user)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pgoutbox.core.errors import one_line

log = logging.getLogger(__name__)

KEEP = 86400.0  # seconds a finished action's progress page stays

# One batch: (connection, max_rows) -> rows touched (0: done).
Batch = Callable[[Any, int], Awaitable[int]]
# A session as the acting role, opened once for the action's batches.
Opener = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


@dataclass
class Action:
    id: str
    title: str  # what it does, for the progress page ("Replay 12 dead letters of billing")
    user: str
    reason: str
    total: int  # the count shown when it was confirmed
    back: str  # the page to return to
    done: int = 0
    batches: int = 0
    state: str = "running"  # running, finished, stopped, failed
    error: str = ""
    started: float = field(default_factory=time.time)
    finished: float | None = None
    prepared: int | None = None  # the database's action id (outbox.dlq_actions), when it has one
    stopping: bool = False

    @property
    def percent(self) -> int:
        if self.total <= 0:
            return 100 if self.state != "running" else 0
        return min(100, int(self.done * 100 / self.total))

    @property
    def left(self) -> float | None:
        """Seconds still to go at the rate so far (None: not known yet, or not running)."""
        elapsed = time.time() - self.started
        if self.state != "running" or self.done <= 0 or elapsed <= 0:
            return None
        return max(0, self.total - self.done) * elapsed / self.done


class Actions:
    def __init__(self, batch: int, pause: float) -> None:
        self.batch = batch
        self.pause = pause
        self._by_id: dict[str, Action] = {}
        self._tasks: set[asyncio.Future[Any]] = set()

    def get(self, action_id: str) -> Action | None:
        return self._by_id.get(action_id)

    def of_prepared(self, prepared: int, user: str) -> Action | None:
        """The action already started for this prepared one (a Confirm sent twice runs it once)."""
        return next((a for a in self._by_id.values() if a.prepared == prepared and a.user == user), None)

    def keep(self, task: asyncio.Future[Any]) -> None:
        """Hold a reference to a background task until it ends (the loop keeps only weak ones)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self, action: Action, opener: Opener, batch: Batch) -> Action:
        """Runs the first batch now (its errors are the caller's), the rest in the background."""
        stack = contextlib.AsyncExitStack()
        conn = await stack.enter_async_context(opener())
        try:
            touched = await batch(conn, self.batch)
        except BaseException:
            await stack.aclose()
            raise
        action.done, action.batches = touched, 1
        self._forget_old()
        self._by_id[action.id] = action
        log.info(
            "action started",
            extra={"action": action.title, "user": action.user, "reason": action.reason, "total": action.total},
        )
        if touched == 0:
            self._finish(action)
            await stack.aclose()
        else:
            self.keep(asyncio.ensure_future(self._rest(action, stack, conn, batch)))
        return action

    async def _rest(self, action: Action, stack: contextlib.AsyncExitStack, conn: Any, batch: Batch) -> None:
        async with stack:
            try:
                while not action.stopping:
                    await asyncio.sleep(self.pause)
                    touched = await batch(conn, self.batch)
                    action.batches += 1
                    if touched == 0:
                        break
                    action.done += touched
            except asyncio.CancelledError:
                action.state, action.error = "failed", "stopped: the console shut down"
                raise
            except Exception as exc:  # one failed batch ends this action, never the console
                action.state, action.error = "failed", one_line(exc)
                log.warning("action failed", extra={"action": action.title, "error": action.error})
                action.finished = time.time()
                return
        self._finish(action)

    def _forget_old(self) -> None:
        """Finished actions stay a day for their progress page, then go (memory stays bounded)."""
        cutoff = time.time() - KEEP
        for old in [a for a in self._by_id.values() if a.finished is not None and a.finished < cutoff]:
            del self._by_id[old.id]

    def _finish(self, action: Action) -> None:
        done = action.stopping and action.done < action.total
        action.state, action.finished = ("stopped" if done else "finished"), time.time()
        log.info("action finished", extra={"action": action.title, "done": action.done, "batches": action.batches})

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)


def new_id() -> str:
    return secrets.token_urlsafe(12)


@contextlib.asynccontextmanager
async def nothing() -> AsyncIterator[None]:
    yield None
