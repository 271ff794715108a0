-- 0018_steady_under_faults (down): back to version 17.
--
-- What it cannot undo: the console's bulk actions of 0018 (outbox.dlq_actions and
-- their targets: bookkeeping, not events or messages) are dropped; nothing else is lost.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 18) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

-- ---- broker faults

-- ---- upcasters

-- ---- held snapshots

-- ---- the console

-- The three actions by filter as 0017 defined them, then what 0018 added.
-- Replays the dead letters matching the filter, max_rows per call, and
-- returns how many it took; call again until 0 (each call its own
-- transaction). Outbox: DEAD_LETTER -> PENDING as outbox.requeue does,
-- audited in outbox.requeue_log. Inbox: due now for the replayer, as
-- inbox.redrive does, audited in inbox.redrive_log; rows already asked for,
-- without an envelope or of an in-database handler are not taken.
CREATE OR REPLACE FUNCTION outbox.dlq_replay(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    picked record;
    outbox_moved integer;
    inbox_moved integer;
BEGIN
    SELECT
        coalesce(array_agg(b.row_id) FILTER (WHERE b.side = 'outbox'), '{}') AS row_ids,
        coalesce(array_agg(b.created_at) FILTER (WHERE b.side = 'outbox'), '{}') AS created,
        coalesce(array_agg(b.id) FILTER (WHERE b.side = 'inbox'), '{}') AS message_ids,
        coalesce(array_agg(b.handler) FILTER (WHERE b.side = 'inbox'), '{}') AS handlers
    INTO picked
    FROM outbox._dlq_batch(filter, 'replay', reason, max_rows) AS b;
    PERFORM set_config('pgoutbox.requeue_reason', reason, true);
    UPDATE outbox.events AS e
    SET status = 'PENDING', attempts = 0, available_at = now()
    FROM unnest(picked.row_ids, picked.created) AS p (row_id, created_at)
    WHERE e.id = p.row_id AND e.created_at = p.created_at AND e.status = 'DEAD_LETTER';
    GET DIAGNOSTICS outbox_moved = ROW_COUNT;
    PERFORM set_config('pgoutbox.requeue_reason', '', true);
    WITH marked AS (
        UPDATE inbox.messages AS m
        SET dlq_metadata = m.dlq_metadata
            || jsonb_build_object('redrive_requested', TRUE, 'next_replay_at', now())
        FROM unnest(picked.message_ids, picked.handlers) AS p (message_id, handler)
        WHERE m.message_id = p.message_id AND m.handler = p.handler
            AND m.status = 'DEAD_LETTER'
            AND NOT m.dlq_metadata ? 'discarded'
            AND NOT coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE)
        RETURNING m.message_id, m.handler, m.dlq_metadata, m.last_error
    )
    INSERT INTO inbox.redrive_log (
        message_id, handler, redriven_by, reason, replay_attempts_before, last_error
    )
    SELECT
        k.message_id, k.handler, session_user, dlq_replay.reason,
        coalesce((k.dlq_metadata ->> 'replay_attempts')::integer, 0), k.last_error
    FROM marked AS k;
    GET DIAGNOSTICS inbox_moved = ROW_COUNT;
    RETURN outbox_moved + inbox_moved;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_replay(jsonb, text, integer) IS
'Requeues (outbox) or redrives (inbox) up to max_rows dead letters matching a filter, audited; call until 0.';

-- Discards the live dead letters matching the filter, max_rows per call
-- (call until 0): parked for good, kept, reversible by dlq_restore; an inbox
-- row's pending replay is cancelled. Audited in outbox/inbox.discard_log.
CREATE OR REPLACE FUNCTION outbox.dlq_discard(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    picked record;
    outbox_moved integer;
    inbox_moved integer;
BEGIN
    SELECT
        coalesce(array_agg(b.row_id) FILTER (WHERE b.side = 'outbox'), '{}') AS row_ids,
        coalesce(array_agg(b.created_at) FILTER (WHERE b.side = 'outbox'), '{}') AS created,
        coalesce(array_agg(b.id) FILTER (WHERE b.side = 'inbox'), '{}') AS message_ids,
        coalesce(array_agg(b.handler) FILTER (WHERE b.side = 'inbox'), '{}') AS handlers
    INTO picked
    FROM outbox._dlq_batch(filter, 'discard', reason, max_rows) AS b;
    PERFORM set_config('pgoutbox.dlq_action', 'discard', true);
    PERFORM set_config('pgoutbox.dlq_reason', reason, true);
    UPDATE outbox.events AS e
    SET status = 'DISCARDED'
    FROM unnest(picked.row_ids, picked.created) AS p (row_id, created_at)
    WHERE e.id = p.row_id AND e.created_at = p.created_at AND e.status = 'DEAD_LETTER';
    GET DIAGNOSTICS outbox_moved = ROW_COUNT;
    UPDATE inbox.messages AS m
    SET dlq_metadata = m.dlq_metadata || jsonb_build_object(
        'discarded', jsonb_build_object('at', now(), 'by', session_user, 'reason', dlq_discard.reason),
        'next_replay_at', NULL,
        'redrive_requested', FALSE
    )
    FROM unnest(picked.message_ids, picked.handlers) AS p (message_id, handler)
    WHERE m.message_id = p.message_id AND m.handler = p.handler
        AND m.status = 'DEAD_LETTER' AND NOT m.dlq_metadata ? 'discarded';
    GET DIAGNOSTICS inbox_moved = ROW_COUNT;
    PERFORM set_config('pgoutbox.dlq_action', '', true);
    PERFORM set_config('pgoutbox.dlq_reason', '', true);
    RETURN outbox_moved + inbox_moved;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_discard(jsonb, text, integer) IS
'Discards up to max_rows live dead letters matching a filter (kept, restorable), audited; call until 0.';

-- Restores the discarded dead letters matching the filter, max_rows per
-- call (call until 0): back to DEAD_LETTER, parked (no replay scheduled).
CREATE OR REPLACE FUNCTION outbox.dlq_restore(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    picked record;
    outbox_moved integer;
    inbox_moved integer;
BEGIN
    SELECT
        coalesce(array_agg(b.row_id) FILTER (WHERE b.side = 'outbox'), '{}') AS row_ids,
        coalesce(array_agg(b.created_at) FILTER (WHERE b.side = 'outbox'), '{}') AS created,
        coalesce(array_agg(b.id) FILTER (WHERE b.side = 'inbox'), '{}') AS message_ids,
        coalesce(array_agg(b.handler) FILTER (WHERE b.side = 'inbox'), '{}') AS handlers
    INTO picked
    FROM outbox._dlq_batch(filter, 'restore', reason, max_rows) AS b;
    PERFORM set_config('pgoutbox.dlq_action', 'restore', true);
    PERFORM set_config('pgoutbox.dlq_reason', reason, true);
    UPDATE outbox.events AS e
    SET status = 'DEAD_LETTER'
    FROM unnest(picked.row_ids, picked.created) AS p (row_id, created_at)
    WHERE e.id = p.row_id AND e.created_at = p.created_at AND e.status = 'DISCARDED';
    GET DIAGNOSTICS outbox_moved = ROW_COUNT;
    UPDATE inbox.messages AS m
    SET dlq_metadata = m.dlq_metadata - 'discarded'
    FROM unnest(picked.message_ids, picked.handlers) AS p (message_id, handler)
    WHERE m.message_id = p.message_id AND m.handler = p.handler
        AND m.status = 'DEAD_LETTER' AND m.dlq_metadata ? 'discarded';
    GET DIAGNOSTICS inbox_moved = ROW_COUNT;
    PERFORM set_config('pgoutbox.dlq_action', '', true);
    PERFORM set_config('pgoutbox.dlq_reason', '', true);
    RETURN outbox_moved + inbox_moved;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_restore(jsonb, text, integer) IS
'Restores up to max_rows discarded dead letters matching a filter to DEAD_LETTER, audited; call until 0.';

DROP FUNCTION IF EXISTS outbox.dlq_action_progress(bigint);
DROP FUNCTION IF EXISTS outbox.dlq_stop(bigint);
DROP FUNCTION IF EXISTS outbox.dlq_act(bigint, text, integer);
DROP FUNCTION IF EXISTS outbox._dlq_action(bigint);
DROP FUNCTION IF EXISTS outbox.dlq_prepare(jsonb, text);
DROP FUNCTION IF EXISTS outbox._dlq_action_function(text);
DROP FUNCTION IF EXISTS outbox._dlq_act_on(jsonb, text, text, integer);
DROP FUNCTION IF EXISTS outbox._dlq_apply(text, text, bigint[], timestamptz[], uuid[], text[]);
DROP TABLE IF EXISTS outbox.dlq_action_targets;
DROP TABLE IF EXISTS outbox.dlq_actions;

DELETE FROM outbox.schema_migrations WHERE version = 18;

COMMIT;
