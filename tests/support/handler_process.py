"""A handler as its own process, for tests that stop and restart it:
answers 200 to every POST and appends the message id of each call to a
file (one line each), so that the calls of every run of it add up.

    python handler_process.py PORT CALLS_FILE
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class HandlerProcess:
    """The handler process on a fixed port: start() and stop() as often as a test needs."""

    def __init__(self, port: int, calls: Path, log: Path):
        self.port, self.calls, self.log = port, calls, log
        self.proc: subprocess.Popen | None = None
        self._runs = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/events"

    def start(self) -> None:
        self._runs += 1
        from support.waiting import wait_for  # not when this file runs as the handler

        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(self.port), str(self.calls)], stdout=out, stderr=subprocess.STDOUT
            )
        wait_for(lambda: self.log.read_text().count("listening") == self._runs, 30, "the handler process to listen")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.proc = None

    def called(self) -> list[str]:
        return self.calls.read_text().split() if self.calls.exists() else []


def _serve(port: int, calls: Path) -> None:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock, calls.open("a") as out:
                out.write(body["message_id"] + "\n")
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer.allow_reuse_address = True
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print("listening", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), Path(sys.argv[2]))
