"""pgoutbox's pytest plugin for application tests (docs/testing.md).

Enable it with `-p pgoutbox.testing` (or `addopts = "-p pgoutbox.testing"`,
or `pytest_plugins = ["pgoutbox.testing"]` in a top conftest.py). It is not
registered as a pytest11 entry point on purpose: installing pgoutbox must
not change the test sessions of projects that do not ask for it.

Fixtures:

    pgoutbox_capture   capture(conn): a context manager collecting the events
                       a block emits in conn's open transaction (Captured,
                       with assert_emits, assert_emits_exactly,
                       assert_emits_nothing, assert_emitted_in_order)
    pgoutbox_acapture  the same for an async connection
    pgoutbox_handler   call_handler(url, event, ...): runs an HTTP handler
                       under the consumer's contract, without NATS
                       (call_batch_handler(url, events, ...): a handler
                       of format "batch")

The same functions are importable for use without the fixtures.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

import psycopg
import pytest

from pgoutbox.testing.capture import (
    Captured,
    EmittedEvent,
    KitMissing,
    TransactionEnded,
    acapture,
    capture,
    contains,
    install_kit,
)
from pgoutbox.testing.handlers import (
    HandlerResult,
    acall_batch_handler,
    acall_handler,
    call_batch_handler,
    call_handler,
    event,
)

__all__ = [
    "Captured",
    "EmittedEvent",
    "HandlerResult",
    "KitMissing",
    "TransactionEnded",
    "acall_batch_handler",
    "acall_handler",
    "acapture",
    "call_batch_handler",
    "call_handler",
    "capture",
    "contains",
    "event",
    "install_kit",
]


@pytest.fixture
def pgoutbox_capture() -> Callable[[psycopg.Connection[Any]], AbstractContextManager[Captured]]:
    """capture(conn): `with pgoutbox_capture(conn) as emitted: ...`."""
    return capture


@pytest.fixture
def pgoutbox_acapture() -> Callable[[psycopg.AsyncConnection[Any]], AbstractAsyncContextManager[Captured]]:
    """acapture(aconn): `async with pgoutbox_acapture(aconn) as emitted: ...`."""
    return acapture


@pytest.fixture
def pgoutbox_handler() -> Callable[..., HandlerResult]:
    """call_handler(url, event, handler=..., delivery=..., timeout=..., format=...)."""
    return call_handler
