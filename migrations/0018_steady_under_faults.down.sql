-- 0018_steady_under_faults (down): back to version 17.
--
-- What it cannot undo: nothing is lost.

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

-- claim and backlog as 0017 defined them (from the bottom of the index).
CREATE OR REPLACE FUNCTION outbox.claim(
    worker text,
    batch_size integer,
    lease interval
)
RETURNS SETOF outbox.events
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    token uuid := gen_random_uuid();
BEGIN
    PERFORM outbox._check_text(worker, 'worker', 256);
    IF batch_size IS NULL OR batch_size < 1 OR batch_size > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: batch_size must be between 1 and 10000, got %', batch_size
            USING ERRCODE = 'OB006';
    END IF;
    IF lease IS NULL OR lease <= interval '0' OR lease > interval '1 day' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: lease must be positive and at most 1 day, got %', lease
            USING ERRCODE = 'OB006';
    END IF;
    RETURN QUERY
    WITH candidates AS (
        SELECT e.id, e.created_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND e.available_at <= now()
            AND (
                e.ordering_key IS NULL
                OR NOT EXISTS (
                    SELECT 1
                    FROM outbox.events AS earlier
                    WHERE earlier.ordering_key = e.ordering_key
                        AND earlier.id < e.id
                        AND earlier.status <> 'COMPLETED'
                )
            )
        ORDER BY e.id
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox.events AS e
    SET status = 'PROCESSING',
        attempts = e.attempts + 1,
        claimed_at = now(),
        claimed_by = worker,
        claim_token = token,
        available_at = now() + lease
    WHERE e.id = ANY(ARRAY(SELECT c.id FROM candidates AS c))
        AND e.created_at = ANY(ARRAY(SELECT c.created_at FROM candidates AS c))
        AND e.created_at >= (SELECT min(c.created_at) FROM candidates AS c)
        AND e.created_at <= (SELECT max(c.created_at) FROM candidates AS c)
    RETURNING e.*;
END;
$$;
COMMENT ON FUNCTION outbox.claim(text, integer, interval) IS
'Claims up to batch_size due events (new, retry due, or lease expired) under a lease.';

CREATE OR REPLACE FUNCTION outbox.backlog(context text DEFAULT NULL)
RETURNS TABLE (
    context text,
    unpublished bigint,
    oldest_unpublished_at timestamptz,
    due bigint,
    oldest_due_age interval,
    processing bigint,
    failed bigint,
    dead_letter bigint
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(backlog.context);
    -- Two branches so that each is served by its own partial index.
    WITH unfinished AS (
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND (backlog.context IS NULL OR e.context = backlog.context)
        UNION ALL
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status = 'DEAD_LETTER'
            AND (backlog.context IS NULL OR e.context = backlog.context)
    ),
    contexts AS (
        SELECT DISTINCT u.context FROM unfinished AS u
        UNION
        SELECT backlog.context WHERE backlog.context IS NOT NULL
    )
    SELECT
        c.context,
        count(u.status) FILTER (WHERE u.status <> 'DEAD_LETTER'),
        min(u.created_at) FILTER (WHERE u.status <> 'DEAD_LETTER'),
        count(u.status) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now()),
        -- greatest(): a row stored by an older version with available_at
        -- -infinity is due and very old, not an error (interval has no infinity).
        now() - greatest(
            min(u.available_at) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now()),
            timestamptz '0001-01-01 00:00:00+00'
        ),
        count(u.status) FILTER (WHERE u.status = 'PROCESSING'),
        count(u.status) FILTER (WHERE u.status = 'FAILED'),
        count(u.status) FILTER (WHERE u.status = 'DEAD_LETTER')
    FROM contexts AS c
    LEFT JOIN unfinished AS u ON u.context = c.context
    GROUP BY c.context
    ORDER BY c.context;
$$;
COMMENT ON FUNCTION outbox.backlog(text) IS
'Per context: unpublished count and oldest, due count and age of the oldest due, by status.';

DROP FUNCTION IF EXISTS outbox.oldest_snapshots(integer);
DROP FUNCTION IF EXISTS outbox._claim_floor();
DROP TRIGGER IF EXISTS _200_lower_claim_floor ON outbox.events;
DROP FUNCTION IF EXISTS outbox.tg_events__lower_claim_floor();
DROP SEQUENCE IF EXISTS outbox.claim_floor;
DROP SEQUENCE IF EXISTS outbox.claim_floor_next;
DROP SEQUENCE IF EXISTS outbox.claim_floor_wait;
DROP SEQUENCE IF EXISTS outbox.claim_floor_at;
DROP SEQUENCE IF EXISTS outbox.claim_floor_checked;
DROP SEQUENCE IF EXISTS outbox.claim_floor_checked_id;

-- ---- the console

DELETE FROM outbox.schema_migrations
WHERE version = 18;

COMMIT;
