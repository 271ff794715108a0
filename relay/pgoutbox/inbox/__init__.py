"""The inbox side: from JetStream to a handler, exactly once per handler.

    consumer        the worker: durable pull subscriptions, fetch loops, health
    flow            one message: envelope -> inbox.receive -> handler -> outcome -> ack
    database_gate   PostgreSQL away: the fetch loops wait, inbox calls wait and run again
    store           the SQL functions it calls (inbox.receive, mark_processed, ...)
    handler_client, handler_contract   the HTTP call and what each answer means
    in_database     the same inbox inside the application's own transaction
    dlq, replayer   dead-letter notices, the path of a message dead-lettered or unreadable,
                    and the automated replay of dead letters
    registry        handler manifests -> the static registry file the consumer loads
    metrics, settings   the consumer's Prometheus metrics and OUTBOX_CONSUMER_* settings

Imports core only; never outbox/ (import-linter, pyproject.toml).
"""
