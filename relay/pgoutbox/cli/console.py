"""pgoutbox console: the operator console, a web application on
OUTBOX_CONSOLE_HOST:OUTBOX_CONSOLE_PORT (127.0.0.1:8470 by default) until
SIGTERM/SIGINT. People log in with their own PostgreSQL role and password;
the console acts as that role and holds no privileges of its own
(docs/console.md). Needs the `console` extra (pip install 'pgoutbox[console]')."""

from __future__ import annotations

import argparse
import importlib.util

from pgoutbox.console.settings import ConsoleConfig
from pgoutbox.core import logs as json_logs
from pgoutbox.core import settings
from pgoutbox.core.errors import ConfigError

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

    json_logs.setup(cfg.log_level)
    # proxy_headers off: the console itself believes X-Forwarded-* only from
    # OUTBOX_CONSOLE_TRUSTED_PROXIES (console.app.Console.client).
    server = uvicorn.Server(
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
    server.run()
    return 0
