"""Operations: metrics, health and readiness endpoints, JSON logs, the
schema-version check, configuration errors."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from pgoutbox.core.errors import ConfigError, SchemaMismatch
from pgoutbox.inbox import settings as cs
from pgoutbox.inbox.consumer import Consumer
from support.inbox import (
    add_stream,
    consumer_config,
    event,
    jetstream,
    publish,
    running_consumer,
    write_registry,
)
from support.schema import newer_schema
from support.waiting import until

H = "billing"


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_metrics_health_and_readiness(tmp_path, database_url, nats_server, handler):
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    # not default: the test reads the backlog gauges, refreshed every 200 ms instead of 15 s
    cfg = consumer_config(database_url, nats_server.url, registry_file, http_port="0", backlog_interval="200ms")
    async with jetstream(nats_server.url) as js:
        await add_stream(js)
        async with running_consumer(cfg) as consumer:
            port = consumer.health.port
            for answers in ([200], [200], [500, 200], [422]):
                await publish(js, event({"answers": answers}))
            await until(
                lambda: consumer.metrics.value(H, "processed") == 3 and consumer.metrics.value(H, "dead_lettered") == 1,
                15,
            )

            def backlog(kind):
                return consumer.metrics.registry.get_sample_value(
                    "pgoutbox_inbox_backlog_messages", {"context": "sea", "handler": H, "kind": kind}
                )

            await until(lambda: backlog("dead_letter") == 1 and backlog("unprocessed") == 0, 10, "a backlog refresh")
            status, text = await asyncio.to_thread(_get, port, "/metrics")
            assert status == 200
            for line in (
                f'pgoutbox_consumer_messages_total{{handler="{H}",outcome="processed"}} 3.0',
                f'pgoutbox_consumer_messages_total{{handler="{H}",outcome="retried"}} 1.0',
                f'pgoutbox_consumer_messages_total{{handler="{H}",outcome="dead_lettered"}} 1.0',
                f'pgoutbox_consumer_redeliveries_total{{handler="{H}"}} 1.0',
                f'pgoutbox_consumer_handler_duration_seconds_count{{handler="{H}"}} 5.0',
                f'pgoutbox_inbox_backlog_messages{{context="sea",handler="{H}",kind="dead_letter"}} 1.0',
                f'pgoutbox_inbox_backlog_messages{{context="sea",handler="{H}",kind="unprocessed"}} 0.0',
            ):
                assert line in text, line
            status, body = await asyncio.to_thread(_get, port, "/healthz")
            assert status == 200 and json.loads(body)["alive"] is True
            assert json.loads(body)["loop_tick_age_seconds"] < 1.5
            status, body = await asyncio.to_thread(_get, port, "/readyz")
            assert (status, json.loads(body)) == (200, {"ready": True, "problems": []})

            nats_server.stop()
            await until(lambda: not consumer.nc.is_connected, 10)
            status, body = await asyncio.to_thread(_get, port, "/readyz")
            assert status == 503 and "not connected to NATS" in json.loads(body)["problems"]
            nats_server.start()  # same port: the client reconnects
            await until(lambda: consumer.nc.is_connected, 15)
            status, _ = await asyncio.to_thread(_get, port, "/readyz")
            assert status == 200


async def test_the_consumer_refuses_a_schema_it_does_not_know(tmp_path, database_url, nats_server, handler):
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    newer_schema(database_url)  # a contract release that no longer serves this code
    consumer = Consumer(
        cs.load_handlers(consumer_config(database_url, nats_server.url, registry_file)),
        consumer_config(database_url, nats_server.url, registry_file),
    )
    with pytest.raises(SchemaMismatch, match="upgrade pgoutbox"):
        await consumer.start()
    await consumer.stop()


async def test_a_missing_event_stream_is_a_clear_configuration_error(tmp_path, database_url, nats_server, handler):
    registry_file = write_registry(
        tmp_path, [{"name": H, "url": handler.url, "subjects": ["sea.event.order_created.v1"]}]
    )
    cfg = consumer_config(database_url, nats_server.url, registry_file)
    consumer = Consumer(cs.load_handlers(cfg), cfg)
    with pytest.raises(ConfigError, match="stream SEA_EVENTS .* does not exist"):
        await consumer.start()
    await consumer.stop()
