-- 0008_broker_loss_repair (down): back to version 7: no
-- outbox.requeue_completed(), and the update guard refuses COMPLETED ->
-- PENDING again.
--
-- What it cannot undo: outbox.requeue_log loses from_status and
-- published_at_before, so its rows of COMPLETED events requeued under
-- version 8 then read like requeues of dead letters (their reason says
-- otherwise). Events requeued under version 8 stay where they are: PENDING
-- ones are published by any relay, as under version 7.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 8) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

DROP FUNCTION IF EXISTS outbox.requeue_completed(uuid[], text, timestamptz, bigint[]);

-- ---- version 7 definitions (from sql/ before this migration) ----
-- Every status move the trigger's WHEN clause (below) lets through: a no-op,
-- an operator requeue, or an illegal move.
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

    IF OLD.status = 'DEAD_LETTER' AND NEW.status = 'PENDING' THEN
        reason := nullif(btrim(current_setting('pgoutbox.requeue_reason', true)), '');
        IF reason IS NULL THEN
            RAISE EXCEPTION 'REASON_REQUIRED: requeueing event % needs a reason', OLD.event_id
                USING ERRCODE = 'OB014',
                      HINT = 'Use outbox.requeue(event_ids, reason).';
        END IF;
        INSERT INTO outbox.requeue_log (event_id, requeued_by, reason, attempts_before, last_error)
        VALUES (OLD.event_id, session_user, reason, OLD.attempts, OLD.last_error);
        RETURN NEW;
    END IF;

    RAISE EXCEPTION 'ILLEGAL_TRANSITION: event % cannot move from % to %', OLD.event_id, OLD.status, NEW.status
        USING ERRCODE = 'OB010',
              DETAIL = format('available_at=%s, now=%s', OLD.available_at, now()),
              HINT = 'Legal moves are listed in the README (Lifecycle).';
END;
$$;

ALTER TABLE outbox.requeue_log
DROP COLUMN IF EXISTS from_status,
DROP COLUMN IF EXISTS published_at_before;

DELETE FROM outbox.schema_migrations
WHERE version = 8;

COMMIT;
