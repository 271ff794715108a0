"""What both sides share, and nothing that belongs to one of them:

    errors     the OB SQLSTATE table, domain errors, exit codes
    settings   OUTBOX_* variables: declaration, parsing, the reference table
    wire       the event on NATS (subject, body, headers; a replay read back), publish error codes
    jetstream  JetStream's pull API driven by hand (the consumer's fetches, the audit's stream pass)
    db         connections: conninfo, one-line connection failures, schema version
    migrate    applying migrations/ in order, under an advisory lock
    backoff, health, logs   retry delays, /metrics /healthz /readyz, JSON log lines

core imports nothing from outbox/, inbox/, cli/ or dev/ (import-linter, pyproject.toml).
"""
