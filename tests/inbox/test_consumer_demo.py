"""The consuming half of the demo runs and tells what happened."""

from __future__ import annotations

from pgoutbox.dev import consumer_demo


async def test_the_consumer_demo_processes_two_orders_and_dead_letters_the_poison_one(
    database_url, nats_server, capsys
):
    await consumer_demo._standalone(database_url, nats_server.url)
    out = capsys.readouterr().out
    assert "published 3 event(s)" in out
    assert "handler order_mailer was called 4 time(s)" in out  # 2 orders, the poison one and its replay
    assert out.count("-> 200") == 2 and out.count("-> 422") == 2
    assert '"dead_letter": 1' in out and '"unprocessed": 0' in out
    assert out.count("sea.dlq.dead.order_mailer.order_created.v1: HTTP 422") == 2
