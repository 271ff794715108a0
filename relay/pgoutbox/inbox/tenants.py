"""Fair handling: at most `tenant_concurrency` calls of one handler in flight
for one tenant (the envelope's tenant_id, from the Pgoutbox-Tenant-Id
header; messages without one share one budget), so that a tenant whose
messages are slow in the handler cannot take every call the handler may
have in flight, and the other tenants' messages keep the free ones.

A message whose tenant is at its limit is held back: it is neither nak'ed
nor failed, and counts no delivery. Its inbox row is RECEIVED (the fetch
was recorded), JetStream keeps it in hand, and the consumer's heartbeat
keeps it alive with in-progress acks as it does any message in hand, so
that its ack_wait never runs out while it waits. While it waits it lends
its fetch slot to the handler's event fetch loop (Lender), so that the
fetch goes on and brings the other tenants' messages: what is held is
bounded by the durable's max_ack_pending, the most unacknowledged messages
JetStream hands out.

Order. Held messages go in the order they arrived: one of a tenant never
overtakes an earlier one of the same tenant, nor an earlier held one of the
same ordering key (whatever its tenant), so that the calls of one ordering
key start in the order the fetches brought them, as without a limit.

One Share per handler, in one event loop: no lock.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pgoutbox.core.errors import ConfigError

# The default share of a handler's concurrency one tenant may use (see default()).
DEFAULT_DIVISOR = 4


def default(concurrency: int) -> int:
    """A quarter of the handler's concurrency, never below 1: up to three
    tenants may be slow at once and a fourth still finds free calls; at the
    default concurrency of 64, one tenant still has 16 calls at once."""
    return max(1, -(-concurrency // DEFAULT_DIVISOR))


def checked(value: int, concurrency: int, where: str) -> int:
    """A limit above the handler's concurrency would never hold anything back."""
    if not 1 <= value <= concurrency:
        raise ConfigError(
            f"{where}: tenant_concurrency={value} must be from 1 to the handler's concurrency ({concurrency});"
            f" {concurrency} holds nothing back"
        )
    return value


class Lender(Protocol):
    """Where a held message's fetch slot goes while it waits (consumer.Slots)."""

    def give(self, count: int) -> None: ...

    def take_back(self, count: int) -> None: ...


class Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class Gauge(Counter, Protocol):
    def dec(self, amount: float = 1) -> None: ...


@dataclass(eq=False, slots=True)
class _Waiter:
    tenant: str | None
    key: str | None
    turn: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Share:
    """The calls in flight of one handler, per tenant, and the messages held
    back until their tenant has a free call."""

    def __init__(self, limit: int, held: Gauge | None = None, holds: Counter | None = None) -> None:
        self.limit = limit
        self.lender: Lender | None = None  # set once the handler's event fetch loop has its slots
        self._held_gauge, self._holds = held, holds
        self._running: dict[str | None, int] = {}
        self._queues: dict[str | None, deque[_Waiter]] = {}  # per tenant, in arrival order
        self._keys: dict[str, deque[_Waiter]] = {}  # per ordering key, the held ones in arrival order
        self.held = 0

    def _free(self, tenant: str | None, key: str | None) -> bool:
        return self._running.get(tenant, 0) < self.limit and tenant not in self._queues and key not in self._keys

    async def acquire(self, envelope: Mapping[str, Any], stopping: asyncio.Event) -> bool:
        """Waits for the message's turn (at once when its tenant has a free
        call and nothing of its tenant or its ordering key waits before it);
        False when the consumer stops first (the message is left for
        redelivery, its call not made)."""
        tenant, key = envelope.get("tenant_id"), envelope.get("ordering_key")
        if self._free(tenant, key):
            self._running[tenant] = self._running.get(tenant, 0) + 1
            return True
        if stopping.is_set():
            return False
        waiter = _Waiter(tenant, key)
        self._hold(waiter)
        stop = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait((waiter.turn, stop), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._leave(waiter)
            raise
        finally:
            stop.cancel()
        if waiter.turn.done():
            return True  # _release counted its call
        self._leave(waiter)
        return False

    def release(self, envelope: Mapping[str, Any]) -> None:
        """The call of a message that acquire() let through has ended: the
        next held ones that may go now go."""
        tenant = envelope.get("tenant_id")
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]
        self._wake(tenant)

    def _hold(self, waiter: _Waiter) -> None:
        self._queues.setdefault(waiter.tenant, deque()).append(waiter)
        if waiter.key is not None:
            self._keys.setdefault(waiter.key, deque()).append(waiter)
        self.held += 1
        if self._held_gauge is not None:
            self._held_gauge.inc()
        if self._holds is not None:
            self._holds.inc()
        if self.lender is not None:
            self.lender.give(1)  # the fetch goes on: the next message may be another tenant's

    def _unhold(self, waiter: _Waiter) -> None:
        """Takes a waiter out of its queues (released, stopped or cancelled)."""
        queue = self._queues[waiter.tenant]
        queue.remove(waiter)
        if not queue:
            del self._queues[waiter.tenant]
        if waiter.key is not None:
            keyed = self._keys[waiter.key]
            keyed.remove(waiter)
            if not keyed:
                del self._keys[waiter.key]
        self.held -= 1
        if self._held_gauge is not None:
            self._held_gauge.dec()
        if self.lender is not None:
            self.lender.take_back(1)

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter that will not call: out of the queues; a turn it was
        given meanwhile is passed on."""
        if waiter.turn.done() and not waiter.turn.cancelled():
            self.release({"tenant_id": waiter.tenant})
            return
        waiter.turn.cancel()
        self._unhold(waiter)
        # It may have been the one its tenant's or its key's next waited behind.
        self._wake(waiter.tenant)
        if waiter.key is not None and waiter.key in self._keys:
            self._wake(self._keys[waiter.key][0].tenant)

    def _wake(self, tenant: str | None) -> None:
        """Gives turns, in arrival order, to the held messages that may go
        now: the first of `tenant` while it has free calls, then whoever was
        waiting behind one of them for its ordering key."""
        pending = [tenant]
        while pending:
            current = pending.pop()
            queue = self._queues.get(current)
            while queue and self._running.get(current, 0) < self.limit:
                head = queue[0]
                if head.key is not None and self._keys[head.key][0] is not head:
                    break  # an earlier message of its ordering key waits: its turn comes first
                self._unhold(head)
                self._running[current] = self._running.get(current, 0) + 1
                head.turn.set_result(True)
                if head.key is not None and head.key in self._keys:
                    pending.append(self._keys[head.key][0].tenant)
                queue = self._queues.get(current)
