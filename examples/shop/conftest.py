"""The shop example's fixtures: `db`, a connection of the shop's login
(SHOP_DATABASE_URL: a login holding pgoutbox_writer, on a database where
`pgoutbox testing install-tap` and schema.sql ran) whose transaction each
test rolls back; `projection`, the handler of projection.py on a free port."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from projection import serve


@pytest.fixture
def db():
    url = os.environ.get("SHOP_DATABASE_URL")
    if not url:
        pytest.skip("SHOP_DATABASE_URL is not set")
    with psycopg.connect(url) as conn:  # autocommit off: the test's transaction stays open
        yield conn
        conn.rollback()


@pytest.fixture
def projection():
    server, state = serve()
    yield f"http://127.0.0.1:{server.server_address[1]}/orders", state
    server.shutdown()
    server.server_close()
