"""The database layer (core.db.Pool) against a closed port: the waiting call
fails at once with libpq's reason (split from tests/cli/test_db_layer.py)."""

from __future__ import annotations

import time

import pytest

from pgoutbox.core import db
from pgoutbox.core.errors import DatabaseUnavailable
from pgoutbox.dev.embedded import free_port


async def test_a_refused_connect_fails_the_waiting_call_at_once_with_libpqs_reason():
    port = free_port()
    pool = db.Pool(f"postgresql://postgres@127.0.0.1:{port}/shop", name="t")
    try:
        for _ in range(2):  # also once the pool has given its first attempt up
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable) as raised:
                async with pool.connection():
                    pass
            # not a race: promptness is what this tests: a refusal must not wait for the connect timeout
            assert time.monotonic() - started < db.CONNECT_TIMEOUT
            message = str(raised.value)
            assert message.startswith(f"cannot connect to PostgreSQL at 127.0.0.1:{port} database shop ({db.SETTING})")
            assert "Connection refused" in message and "\n" not in message
            assert raised.value.retryable
    finally:
        await pool.close()
