-- A business flow by its correlation id: the events that carry it, in emit
-- order, each with its publish state and every handler's inbox outcome.
-- The one query behind `pgoutbox flow` and the console's search; for the
-- read-only operator (pgoutbox_viewer) and up, so it shows no payload.

-- One row per event and handler (handler NULL: no handler has received the
-- event yet, or none consumes it). Events come in id order (emit order, which
-- is commit order per ordering key), their handlers in name order; at most
-- max_rows events (the first ones of the flow), served by
-- events_correlation_idx. A discarded dead letter shows as DEAD_LETTER with
-- discarded true, on either side (outbox: a row in outbox.discarded_events).
CREATE OR REPLACE FUNCTION outbox.flow(correlation_id uuid, max_rows integer DEFAULT 1000)
RETURNS TABLE (
    id bigint,
    event_id uuid,
    created_at timestamptz,
    subject text,
    aggregate_type text,
    aggregate_id text,
    causation_id uuid,
    status text,
    attempts integer,
    published_at timestamptz,
    last_error text,
    handler text,
    inbox_status text,
    inbox_attempts integer,
    processed_at timestamptz,
    inbox_last_error text,
    discarded boolean
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF flow.correlation_id IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: correlation_id is required' USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_max_rows(max_rows);
    RETURN QUERY
    SELECT
        e.id, e.event_id, e.created_at, e.subject, e.aggregate_type, e.aggregate_id, e.causation_id,
        e.status, e.attempts, e.published_at, e.last_error,
        m.handler, m.status, m.attempts, m.processed_at, m.last_error,
        EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = e.event_id)
        OR coalesce(m.dlq_metadata ? 'discarded', FALSE)
    FROM (
        SELECT ev.*
        FROM outbox.events AS ev
        WHERE ev.correlation_id = flow.correlation_id
        ORDER BY ev.id
        LIMIT max_rows
    ) AS e
    LEFT JOIN inbox.messages AS m ON m.message_id = e.event_id
    ORDER BY e.id, m.handler;
END;
$$;
COMMENT ON FUNCTION outbox.flow(uuid, integer) IS
'The events of one correlation id in emit order, their publish state and each handler''s inbox outcome.';
