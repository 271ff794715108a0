"""A small HTTP API that starts a workflow run once per command, runnable.
A client's retry (a timeout, a proxy's resend, a double click) gets the first
request's answer, the same run id, instead of a second run.

    python examples/command_api.py --create-schema          # once, as the database owner
    OUTBOX_DATABASE_URL=postgresql://app@host/db \\
        python examples/command_api.py [--port 8080] [--work-seconds S]

Its login needs only `pgoutbox_writer` (and the grants --create-schema gives
that role on the example's own table).

    POST /workflow-runs
    Idempotency-Key: <the client's key for this command, 1-256 characters>
    {"workflow": "<name>", "input": {...}}

    201 {"run_id": ..., "workflow": ..., "command_key": ...}
        the first request, and every retry of it, byte for byte
    422 the key was used before with a different request
    409 the key's first request committed its claim but not its answer yet
        (an application that claims in its own transaction; never this one)
    400 no key, a key that is too long, or a body that is not such an object
    413 a body over 64 KiB

One transaction per request: inbox.claim_command(), then, for the first
claim only, the run's row, its outbox event (wf.event.run_started.v1) and
inbox.complete_command() with the answer. A retry that arrives while the
first is still running waits for that commit, then answers from the stored
result; if the first rolls back, the retry runs the command itself. Nothing
is kept of a request that fails (the database rolls back), so its retry runs
it again. --work-seconds holds each first request's transaction open that
long: the latency of a real workflow engine, and the window for a retry.

It prints "listening on http://HOST:PORT" once it accepts requests, and
stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from pgoutbox.core.errors import SqlState

log = logging.getLogger(__name__)

HANDLER = "start_workflow_run"
MAX_BODY = 65536

SCHEMA = """
CREATE SCHEMA IF NOT EXISTS wf;
CREATE TABLE IF NOT EXISTS wf.workflow_runs (
    run_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    workflow text NOT NULL,
    input jsonb NOT NULL,
    command_key text NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now()
);
GRANT USAGE ON SCHEMA wf TO pgoutbox_writer;
GRANT SELECT, INSERT ON wf.workflow_runs TO pgoutbox_writer;
"""


class Refused(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def fingerprint(request: dict[str, Any]) -> str:
    """The request a key was first used with (its canonical JSON's digest)."""
    return hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def start_run(pool: ConnectionPool, key: str, request: dict[str, Any], work_seconds: float) -> tuple[int, Any]:
    """The command: (HTTP status, body), the first time and every time after."""
    digest = fingerprint(request)
    with pool.connection() as conn:  # one transaction, committed on a clean exit
        claimed, status, result = conn.execute(
            "SELECT claimed, status, result FROM inbox.claim_command(%s, %s)", (HANDLER, key)
        ).fetchone()
        if not claimed:
            if status != "DONE":
                raise Refused(HTTPStatus.CONFLICT, f"the first request with this key is {status.lower()}")
            if result["request"] != digest:
                raise Refused(HTTPStatus.UNPROCESSABLE_ENTITY, "this key was used with a different request")
            return result["status"], result["body"]
        run_id = conn.execute(
            "INSERT INTO wf.workflow_runs (workflow, input, command_key) VALUES (%s, %s, %s) RETURNING run_id",
            (request["workflow"], Jsonb(request["input"]), key),
        ).fetchone()[0]
        body = {"run_id": str(run_id), "workflow": request["workflow"], "command_key": key}
        conn.execute(
            "SELECT outbox.emit('workflow_run', %s, 'run_started', %s, context => 'wf')",
            (str(run_id), Jsonb({"schema_version": 1, **body})),
        )
        time.sleep(work_seconds)
        conn.execute(
            "SELECT inbox.complete_command(%s, %s, %s)",
            (HANDLER, key, Jsonb({"request": digest, "status": HTTPStatus.CREATED.value, "body": body})),
        )
    return HTTPStatus.CREATED.value, body


def parse(handler: BaseHTTPRequestHandler) -> tuple[str, dict[str, Any]]:
    key = handler.headers.get("Idempotency-Key")
    if not key:
        raise Refused(HTTPStatus.BAD_REQUEST, "an Idempotency-Key header is required")
    try:
        length = int(handler.headers.get("Content-Length") or 0)
    except ValueError:
        raise Refused(HTTPStatus.BAD_REQUEST, "Content-Length is not a number") from None
    if not 0 <= length <= MAX_BODY:  # a negative length would read until the client hangs up
        raise Refused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a body of 0 to {MAX_BODY} bytes, please")
    try:
        request = json.loads(handler.rfile.read(length) or b"null")
    except ValueError:
        raise Refused(HTTPStatus.BAD_REQUEST, "the body is not JSON") from None
    if not (
        isinstance(request, dict)
        and isinstance(request.get("workflow"), str)
        and request["workflow"]
        and isinstance(request.get("input", {}), dict)
    ):
        raise Refused(HTTPStatus.BAD_REQUEST, 'the body must be {"workflow": "<name>", "input": {...}}')
    return key, {"workflow": request["workflow"], "input": request.get("input", {})}


def make_handler(pool: ConnectionPool, work_seconds: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/workflow-runs":
                self.answer(HTTPStatus.NOT_FOUND.value, {"error": "POST /workflow-runs"})
                return
            try:
                key, request = parse(self)
                self.answer(*start_run(pool, key, request, work_seconds))
            except Refused as e:
                self.answer(e.status.value, {"error": str(e)})
            except psycopg.Error as e:
                if e.sqlstate == SqlState.INVALID_COMMAND:
                    self.answer(HTTPStatus.BAD_REQUEST.value, {"error": "the Idempotency-Key is not 1-256 characters"})
                    return
                log.warning("request failed, nothing kept: %s", e.sqlstate)
                self.answer(HTTPStatus.SERVICE_UNAVAILABLE.value, {"error": "try again"})

        def answer(self, status: int, body: Any) -> None:
            data = json.dumps(body, sort_keys=True).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    return Handler


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a burst of retries must not find the backlog full


def serve(database_url: str, host: str, port: int, work_seconds: float) -> int:
    with ConnectionPool(database_url, min_size=1, max_size=20, open=True) as pool:
        server = Server((host, port), make_handler(pool, work_seconds))
        stop = threading.Event()

        def on_signal(signum: int, frame: object) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        print(f"listening on http://{host}:{server.server_address[1]}", flush=True)
        stop.wait()
        server.shutdown()
        server.server_close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="0: any free port (printed)")
    parser.add_argument("--work-seconds", type=float, default=0.0, metavar="S", help="hold each first request S s")
    parser.add_argument("--create-schema", action="store_true", help="create wf.workflow_runs and exit")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    url = os.environ.get("OUTBOX_DATABASE_URL", "")
    if args.create_schema:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(SCHEMA)
        return 0
    if args.work_seconds < 0:
        parser.error("--work-seconds must not be negative")
    return serve(url, args.host, args.port, args.work_seconds)


if __name__ == "__main__":
    sys.exit(main())
