"""One tenant's backlog beside other tenants, through a real relay on its
defaults, PostgreSQL and nats-server: the others' events go out while the
backlog drains, not after it (docs/relay.md, "Fair claims")."""

from __future__ import annotations

import psycopg

from support.outbox import apply_streams, relay_config, running_relay
from support.roles import login
from support.waiting import until

BACKLOG = 20_000
QUIET = [f"t{i}" for i in range(5)]


def emit_for(url: str, tenant: str, n: int) -> list[str]:
    """n events of `tenant` in one transaction, as a writer."""
    with psycopg.connect(url, autocommit=True) as conn:
        return [
            str(r[0])
            for r in conn.execute(
                "SELECT outbox.emit('order', %s || '-' || g::text, 'order_created', '{\"schema_version\": 1}',"
                " context => 'sea', tenant_id => %s) FROM generate_series(1, %s) AS g",
                (tenant, tenant, n),
            )
        ]


def unfinished(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return dict(
            conn.execute(
                "SELECT tenant_id, count(*) FROM outbox.events WHERE status <> 'COMPLETED' GROUP BY 1"
            ).fetchall()
        )


async def test_other_tenants_events_go_out_while_one_tenants_backlog_drains(database_url, nats_server):
    await apply_streams(nats_server.url)
    writer = login(database_url, "pgoutbox_writer")
    emit_for(writer, "bulk", BACKLOG)  # an import: all due at once
    async with running_relay(relay_config(database_url, nats_server.url)):
        await until(lambda: unfinished(database_url).get("bulk", 0) < BACKLOG - 1000, 60, "the backlog draining")
        for tenant in QUIET:  # one event each, each in its own transaction, as a user's requests come
            emit_for(writer, tenant, 1)
        await until(lambda: not set(QUIET) & set(unfinished(database_url)), 30, "the other tenants' events out")
        # With claims oldest first they would wait for the whole backlog; a
        # fair claim takes them in the next claims.
        left = unfinished(database_url).get("bulk", 0)
        assert left > 0, "the backlog drained before the other tenants' events went out"
        await until(lambda: not unfinished(database_url), 120, "the backlog drained")
