"""For applications that emit events: the current OpenTelemetry span's trace
context as `outbox.emit` headers, so that the relay's and the consumer's
spans join the application's trace (docs/observability.md#traces).

    from psycopg.types.json import Jsonb
    from pgoutbox import tracing

    conn.execute(
        "SELECT outbox.emit('order', %s, 'order_created', %s, headers => %s)",
        (order_id, Jsonb(payload), Jsonb(tracing.current_traceparent())),
    )

Needs only opentelemetry-api; without it, or outside any span, the headers are empty.
"""

from pgoutbox.core.tracing import current_traceparent

__all__ = ["current_traceparent"]
