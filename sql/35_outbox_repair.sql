-- Repair after a broker lost acknowledged messages (`pgoutbox audit --repair`).
--
-- A JetStream ack is not a write to disk, and an operator can delete
-- messages: an event may be COMPLETED in the outbox and absent from its
-- stream. The audit finds such events; outbox.requeue_completed() sends them
-- back to PENDING so that a relay publishes them again. COMPLETED -> PENDING
-- is the one move out of COMPLETED, allowed by the update guard only inside
-- this function (pgoutbox.requeue_from = 'COMPLETED') and only with a reason,
-- and every such move is written to outbox.requeue_log by the guard, with the
-- status it left and the publish time it erased.

-- The status the requeue left (DEAD_LETTER for outbox.requeue) and, for a
-- COMPLETED event, when it had been published.
ALTER TABLE outbox.requeue_log
ADD COLUMN IF NOT EXISTS from_status text NOT NULL DEFAULT 'DEAD_LETTER'
CONSTRAINT from_status_is_requeueable CHECK (from_status IN ('DEAD_LETTER', 'COMPLETED')),
ADD COLUMN IF NOT EXISTS published_at_before timestamptz;

-- COMPLETED -> PENDING for the given events, all or nothing, audited in
-- outbox.requeue_log. published_before (optional) refuses events published
-- at or after it: JetStream drops a re-publish whose Nats-Msg-Id it saw within
-- the stream's duplicate_window, even when that message has since been lost
-- or deleted, so the caller passes now() minus that window. row_ids
-- (optional, outbox.events.id of each event, in the same order) lets the
-- lookup use the primary key instead of scanning for the event ids.
CREATE OR REPLACE FUNCTION outbox.requeue_completed(
    event_ids uuid[],
    reason text,
    published_before timestamptz DEFAULT NULL,
    row_ids bigint[] DEFAULT NULL
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    bad uuid [];
    young uuid [];
    moved integer;
BEGIN
    PERFORM outbox._check_text(reason, 'a requeue''s reason', 1000, TRUE);
    PERFORM outbox._check_ids(event_ids, 'event_ids');
    IF row_ids IS NOT NULL AND (
        array_ndims(row_ids) > 1 OR cardinality(row_ids) <> cardinality(event_ids)
        OR array_position(row_ids, NULL) IS NOT NULL
    ) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: row_ids must give one row id, not NULL, for each event id'
            USING ERRCODE = 'OB006';
    END IF;
    IF published_before IS NOT NULL AND NOT isfinite(published_before) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: published_before must be a finite time'
            USING ERRCODE = 'OB006';
    END IF;
    -- Two statements rather than one with "row_ids IS NULL OR ...": each
    -- keeps a plan of its own (the primary key, or one scan for all ids).
    IF row_ids IS NULL THEN
        SELECT
            array_agg(x.id) FILTER (WHERE e.event_id IS NULL),
            array_agg(x.id) FILTER (WHERE e.published_at >= published_before)
        INTO bad, young
        FROM unnest(event_ids) AS x (id)
        LEFT JOIN outbox.events AS e ON e.event_id = x.id AND e.status = 'COMPLETED';
    ELSE
        SELECT
            array_agg(x.id) FILTER (WHERE e.event_id IS NULL),
            array_agg(x.id) FILTER (WHERE e.published_at >= published_before)
        INTO bad, young
        FROM unnest(event_ids, row_ids) AS x (id, row_id)
        LEFT JOIN outbox.events AS e ON e.id = x.row_id AND e.event_id = x.id AND e.status = 'COMPLETED';
    END IF;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'NOT_COMPLETED: % of the given events are unknown or not COMPLETED', cardinality(bad)
            USING ERRCODE = 'OB040', DETAIL = array_to_string(bad[1:100], ', ');
    END IF;
    IF young IS NOT NULL THEN
        RAISE EXCEPTION 'PUBLISHED_TOO_RECENTLY: % of the given events were published at or after %', cardinality(young), published_before
            USING ERRCODE = 'OB041', DETAIL = array_to_string(young[1:100], ', '),
                  HINT = 'JetStream would drop their re-publish as a duplicate; requeue them once the duplicate window has passed.';
    END IF;
    PERFORM set_config('pgoutbox.requeue_reason', reason, true);
    PERFORM set_config('pgoutbox.requeue_from', 'COMPLETED', true);
    IF row_ids IS NULL THEN
        UPDATE outbox.events AS e
        SET status = 'PENDING', attempts = 0, available_at = now(), published_at = NULL
        WHERE e.event_id = ANY(requeue_completed.event_ids) AND e.status = 'COMPLETED';
    ELSE
        UPDATE outbox.events AS e
        SET status = 'PENDING', attempts = 0, available_at = now(), published_at = NULL
        FROM unnest(requeue_completed.event_ids, requeue_completed.row_ids) AS x (id, row_id)
        WHERE e.id = x.row_id AND e.event_id = x.id AND e.status = 'COMPLETED';
    END IF;
    GET DIAGNOSTICS moved = ROW_COUNT;
    PERFORM set_config('pgoutbox.requeue_reason', '', true);
    PERFORM set_config('pgoutbox.requeue_from', '', true);
    -- Another requeue took some of them between the check and the update.
    IF moved < cardinality(event_ids) THEN
        RAISE EXCEPTION 'NOT_COMPLETED: % of the given events stopped being COMPLETED while they were requeued', cardinality(event_ids) - moved
            USING ERRCODE = 'OB040';
    END IF;
    RETURN moved;
END;
$$;
COMMENT ON FUNCTION outbox.requeue_completed(uuid[], text, timestamptz, bigint[]) IS
'COMPLETED -> PENDING for events a broker lost (all or nothing), audited in outbox.requeue_log.';
