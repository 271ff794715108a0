"""Structured logs: one JSON object per line on stderr, with the `extra`
fields of each call (`log.info("acked", extra={"handler": ..., "message_id": ...})`)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        document = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat().replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        document.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


def setup(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs each request at INFO: the relay's one start-up request to the NATS
    # monitoring endpoint would be a line that tells an operator nothing.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def level_name(text: str) -> str:
    if text.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"not a log level: {text!r} (DEBUG, INFO, WARNING, ERROR)")
    return text.upper()
