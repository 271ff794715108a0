"""The outbox side: from committed events in outbox.events to JetStream.

    relay      the worker: wake-ups or a poll -> claim -> publish -> mark, plus
               backlog metrics and partitions ahead
    calls      the SQL functions it calls (claim, mark_published, mark_failed, ...)
    publisher  pipelined JetStream publishing with Nats-Msg-Id, one outcome per event
    wakeups    LISTEN outbox_v1 on its own connection (a hint; polling is the truth)
    streams    the streams file and the start-up durability checks
    audit      which COMPLETED events a stream lacks (broker loss), and their requeue
    metrics, settings   the relay's Prometheus metrics and OUTBOX_RELAY_* settings

Imports core only; never inbox/ (tests/unit/test_layering.py).
"""
