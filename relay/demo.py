"""`make demo`: the whole pipeline on an embedded PostgreSQL (and, as the
relay lands, NATS) under .data/, started by the demo itself, or on the
servers named by OUTBOX_DATABASE_URL / OUTBOX_NATS_URL when set."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import db, migrate
from .embedded import EmbeddedPostgres

DATA = Path(os.environ.get("OUTBOX_DEMO_DIR", Path(__file__).resolve().parent.parent / ".data"))


def _print_rows(conn, title: str, query: str) -> None:
    cur = conn.execute(query)
    names = [c.name for c in cur.description]
    print(f"\n== {title}")
    for row in cur.fetchall():
        print("   " + json.dumps(dict(zip(names, row)), default=str))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pg = EmbeddedPostgres(DATA / "postgres")
    if "--stop" in argv:
        pg.stop()
        return 0
    url = os.environ.get("OUTBOX_DATABASE_URL")
    if not url:
        url = pg.start()
        print(f"embedded PostgreSQL at {url} (data in {pg.root})")
    try:
        with db.connect(url) as conn:
            for step in migrate.migrate(conn):
                print(f"migrated: {step}")
            with conn.transaction():  # the business change and its events commit together
                for n in range(3):
                    event_id = conn.execute(
                        "SELECT outbox.emit('order', %s, 'order_created', %s::jsonb, context => 'sea',"
                        " ordering_key => %s)",
                        (str(1000 + n), json.dumps({"schema_version": 1, "total": 10 * n}), str(1000 + n)),
                    ).fetchone()[0]
                    print(f"emitted {event_id}")
            _print_rows(conn, "outbox.backlog()", "SELECT * FROM outbox.backlog()")
    finally:
        if not os.environ.get("OUTBOX_DATABASE_URL"):
            pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
