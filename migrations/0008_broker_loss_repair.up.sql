-- 0008_broker_loss_repair (up): repair after the broker lost messages it
-- had acknowledged (`pgoutbox audit --repair`).
--
--   * outbox.requeue_completed(event_ids, reason, published_before, row_ids):
--     COMPLETED -> PENDING, all or nothing, for events the audit found
--     missing from their stream, so that a relay publishes them again. A new
--     transition: the update guard allows it only inside that function and
--     with a reason, and writes each move to outbox.requeue_log;
--   * outbox.requeue_log gains from_status (DEAD_LETTER for every existing
--     row and for outbox.requeue) and published_at_before (the publish time
--     the requeue erased).
--
-- Expand only: nothing the workers of version 7 call changes; they simply
-- republish the requeued events like any PENDING one.
--
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 7 or 8.
-- Adding the two columns (a constant default) rewrites no row.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0008 needs 0001 to 0007 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (7, 8) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0008 applies on version 7 (or re-runs on 8) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

ALTER TABLE outbox.requeue_log
ADD COLUMN IF NOT EXISTS from_status text NOT NULL DEFAULT 'DEAD_LETTER'
CONSTRAINT from_status_is_requeueable CHECK (from_status IN ('DEAD_LETTER', 'COMPLETED')),
ADD COLUMN IF NOT EXISTS published_at_before timestamptz;

-- Every status move the trigger's WHEN clause (below) lets through: a no-op,
-- an operator requeue (of a dead letter, or of a COMPLETED event whose
-- message the broker lost), or an illegal move.
CREATE OR REPLACE FUNCTION outbox.tg_events__guard_update()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    reason text;
BEGIN
    -- A no-op update is not a move.
    IF (NEW.status, NEW.attempts, NEW.last_error, NEW.available_at, NEW.claimed_at,
        NEW.claimed_by, NEW.claim_token, NEW.published_at)
        IS NOT DISTINCT FROM
       (OLD.status, OLD.attempts, OLD.last_error, OLD.available_at, OLD.claimed_at,
        OLD.claimed_by, OLD.claim_token, OLD.published_at) THEN
        RETURN NEW;
    END IF;

    -- COMPLETED -> PENDING only inside outbox.requeue_completed(), which sets
    -- pgoutbox.requeue_from (sql/35_outbox_repair.sql): the broker lost it.
    IF NEW.status = 'PENDING' AND (
        OLD.status = 'DEAD_LETTER'
        OR (OLD.status = 'COMPLETED' AND current_setting('pgoutbox.requeue_from', true) = 'COMPLETED')
    ) THEN
        reason := nullif(btrim(current_setting('pgoutbox.requeue_reason', true)), '');
        IF reason IS NULL THEN
            RAISE EXCEPTION 'REASON_REQUIRED: requeueing event % needs a reason', OLD.event_id
                USING ERRCODE = 'OB014',
                      HINT = 'Use outbox.requeue(event_ids, reason) or outbox.requeue_completed(event_ids, reason).';
        END IF;
        INSERT INTO outbox.requeue_log (
            event_id, requeued_by, reason, attempts_before, last_error, from_status, published_at_before
        )
        VALUES (OLD.event_id, session_user, reason, OLD.attempts, OLD.last_error, OLD.status, OLD.published_at);
        RETURN NEW;
    END IF;

    RAISE EXCEPTION 'ILLEGAL_TRANSITION: event % cannot move from % to %', OLD.event_id, OLD.status, NEW.status
        USING ERRCODE = 'OB010',
              DETAIL = format('available_at=%s, now=%s', OLD.available_at, now()),
              HINT = 'Legal moves are listed in the README (Lifecycle).';
END;
$$;

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

REVOKE ALL ON FUNCTION outbox.requeue_completed(uuid[], text, timestamptz, bigint[]) FROM public;
GRANT EXECUTE ON FUNCTION outbox.requeue_completed(uuid[], text, timestamptz, bigint[]) TO pgoutbox_admin;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (8, '0008_broker_loss_repair')
ON CONFLICT (version) DO NOTHING;

COMMIT;
