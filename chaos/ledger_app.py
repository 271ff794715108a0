"""The application under test: an HTTP handler that applies each event's side
effect in its own database, in ONE transaction with its own inbox marker
(logical exactly-once). chaos.side_effects deliberately has no
unique key: a broken inbox would show up as a second row, not as an error.

Answers: 422 for a poison event (payload.poison, or payload.answer 422: the
hostile and foreign inputs' way to ask for a dead letter), 409 for one it
already applied, 200 once applied, 503 when its database is unreachable. It
never fails otherwise. Its 503s are counted per message id (`failures`); a
consumer of this release counts none of them against max_deliver (503 says
the handler is away: docs/handlers.md), an older one counted them all.

down() closes its HTTP server (and every keep-alive connection): connections
are refused until up() opens it again on the same port (faults.handler_down).

Its connections come from a bounded pool: the consumers' default concurrency
(64 calls in flight per process) must not open a PostgreSQL connection per
HTTP connection.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

APP_INBOX = "ledger_app"

SCHEMA = """
CREATE SCHEMA IF NOT EXISTS chaos;
CREATE TABLE IF NOT EXISTS chaos.side_effects (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id uuid NOT NULL,
    handled_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- The poison writer's business change: committed with an accepted hostile
-- emit, rolled back with a refused one.
CREATE TABLE IF NOT EXISTS chaos.business (
    marker uuid PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""

# The application's own tables, for the logins the harness makes (Pipeline.make_logins).
LOGIN_GRANTS = """
GRANT USAGE ON SCHEMA chaos TO chaos_app, chaos_writer, chaos_admin;
GRANT INSERT ON chaos.side_effects TO chaos_app;
GRANT INSERT ON chaos.business TO chaos_writer;
"""


class _QuietServer(ThreadingHTTPServer):
    # Two consumers open up to 65 keep-alive connections each at start-up; the
    # default listen backlog (5) would drop some, and the consumer would count
    # a failure the app never answered.
    request_queue_size = 512

    def handle_error(self, request, client_address):
        pass  # a consumer killed mid-request resets its connection: expected here


class LedgerApp:
    def __init__(self, database_url: str):
        self.database_url = database_url
        # check: a connection broken by a PostgreSQL restart is replaced at
        # checkout, not answered as a failure (one per pooled connection).
        self.pool = ConnectionPool(
            database_url,
            min_size=2,
            max_size=24,
            timeout=5,
            kwargs={"connect_timeout": 3},
            check=ConnectionPool.check_connection,
            open=False,
        )
        self.failures: Counter[uuid.UUID] = Counter()  # 503 answers per message id
        self.calls = 0  # requests received (faults.await_deliveries watches it)
        self._lock = threading.Lock()
        self.port = 0
        self.server: _QuietServer | None = None
        self.thread: threading.Thread | None = None
        self._down = threading.Event()  # requests on connections still open get no answer
        self._listen()

    def _listen(self) -> None:
        self.server = _QuietServer(("127.0.0.1", self.port), self._handler_class())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/events"

    def start(self) -> None:
        self.pool.open()
        assert self.thread is not None
        self.thread.start()

    def down(self) -> None:
        """Stops answering: the listening socket closed (connections refused)
        and each request on a keep-alive connection answered by closing it."""
        self._down.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def up(self) -> None:
        """Listens again on the same port."""
        deadline = time.monotonic() + 30
        while True:
            try:
                self._listen()
                break
            except OSError:  # the port not free yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self._down.clear()
        assert self.thread is not None
        self.thread.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        self.pool.close()

    def failed(self) -> dict[uuid.UUID, int]:
        with self._lock:
            return dict(self.failures)

    def apply(self, envelope: dict) -> int:
        """The side effect and the inbox marker, committed together."""
        payload = envelope.get("payload")
        if isinstance(payload, dict) and (payload.get("poison") or payload.get("answer") == 422):
            return 422
        try:
            with self.pool.connection() as conn, conn.transaction():
                status = conn.execute(
                    "SELECT status FROM inbox.receive(%s, %s, %s)",
                    (envelope["message_id"], APP_INBOX, envelope["subject"]),
                ).fetchone()[0]
                if status not in ("RECEIVED", "FAILED"):
                    return 409
                conn.execute("INSERT INTO chaos.side_effects (event_id) VALUES (%s)", (envelope["message_id"],))
                conn.execute("SELECT inbox.mark_processed(%s, %s)", (envelope["message_id"], APP_INBOX))
            return 200
        except (psycopg.Error, PoolTimeout):  # its database away (a restart, an outage): try again later
            with self._lock:
                self.failures[uuid.UUID(envelope["message_id"])] += 1
            return 503

    def _handler_class(self):
        app = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                app.calls += 1
                if app._down.is_set():  # the server is down: no answer, the connection closed
                    self.close_connection = True
                    return
                code = app.apply(json.loads(body))
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):  # quiet
                pass

        return Handler
