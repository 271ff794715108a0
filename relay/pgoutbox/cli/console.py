"""pgoutbox console: the operator console, a web application on
OUTBOX_CONSOLE_HOST:OUTBOX_CONSOLE_PORT (127.0.0.1:8470 by default) until
SIGTERM/SIGINT. People log in with their own PostgreSQL role and password;
the console acts as that role and holds no privileges of its own
(docs/console.md). Needs the `console` extra (pip install 'pgoutbox[console]')."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
from collections.abc import Iterator
from typing import Any

from pgoutbox.cli import event_loop
from pgoutbox.console.settings import ConsoleConfig
from pgoutbox.core import logs as json_logs
from pgoutbox.core import settings
from pgoutbox.core.errors import ConfigError
from pgoutbox.core.stopping import stop_on_signals

log = logging.getLogger(__name__)

COMMAND = "console"
HELP = (
    "Serve the operator console (overview, dead letters grouped by cause, replay/discard/restore in "
    "throttled batches), acting as the PostgreSQL role each person logs in with."
)
CONFIG = ConsoleConfig
SETTINGS = settings.of(CONFIG)

_NEEDS = ("starlette", "uvicorn", "jinja2", "multipart")


def run(cfg: ConsoleConfig, args: argparse.Namespace) -> int:
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"pgoutbox console needs the console extra ({', '.join(missing)} missing): pip install 'pgoutbox[console]'"
        )
    import uvicorn

    from pgoutbox.console.app import create_app

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # Ours, not uvicorn's: uvicorn re-raises the signal after its
            # shutdown, so the process would end by SIGTERM instead of exit 0.
            yield

    json_logs.setup(cfg.log_level)
    # proxy_headers off: the console itself believes X-Forwarded-* only from
    # OUTBOX_CONSOLE_TRUSTED_PROXIES (console.web.Console.client).
    server = Server(
        uvicorn.Config(
            create_app(cfg),
            host=cfg.host,
            port=cfg.port,
            proxy_headers=False,
            server_header=False,
            log_config=None,
            access_log=False,
        )
    )
    event_loop.run(_serve(server))
    return 0


async def _serve(server: Any) -> None:
    """Serves until SIGTERM or SIGINT, then lets running requests finish."""
    stop = stop_on_signals()
    serving = asyncio.ensure_future(server.serve())
    stopped = asyncio.ensure_future(stop.wait())
    while not (server.started or serving.done() or stop.is_set()):
        await asyncio.sleep(0.05)
    if server.started:
        cfg = server.config
        log.info("console serving", extra={"url": f"http://{cfg.host}:{cfg.port}"})
    await asyncio.wait([serving, stopped], return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopped.cancel()
    await serving
