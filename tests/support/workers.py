"""The workers as a user runs them: `pgoutbox relay` / `pgoutbox consume`
as processes, on the environment a test gives them and nothing inherited
(no OUTBOX_* or PG* variable of the test run), until the block ends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from support.waiting import wait_for

PGOUTBOX = Path(sys.executable).parent / "pgoutbox"


@contextlib.contextmanager
def worker(tmp: Path, command: str, started: str, **settings: str) -> Iterator[int | None]:
    """`pgoutbox command` in `tmp` until the block ends (SIGTERM, then exit
    0 is required); yields the port of its /metrics when the log line that
    contains `started` names one (a JSON line with http_port), else None."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PG"))}
    log = tmp / f"{command}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(PGOUTBOX), command], env={**env, **settings}, cwd=tmp, stdout=out, stderr=subprocess.STDOUT
        )
        try:

            def up() -> tuple[int | None] | None:
                assert proc.poll() is None, f"pgoutbox {command} exited {proc.returncode}:\n{log.read_text()}"
                for line in log.read_text().splitlines():
                    if started in line:
                        return (json.loads(line).get("http_port") if line.startswith("{") else None,)
                return None

            (port,) = wait_for(up, 60, f"pgoutbox {command} to start")
            yield port
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
