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

-- ---- backfill
-- The role pgoutbox_backfiller stays (roles are cluster-wide: other
-- databases of the cluster may use it); it loses what it was granted here.

DROP FUNCTION IF EXISTS outbox.backfill_span(text[], timestamptz, timestamptz);
DROP FUNCTION IF EXISTS outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer);
DROP FUNCTION IF EXISTS outbox._check_backfill(text[], timestamptz, timestamptz, integer);
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgoutbox_backfiller') THEN
        REVOKE EXECUTE ON FUNCTION
        outbox.schema_version(), outbox.serves_workers_from(),
        inbox.receive(uuid, text, text, jsonb),
        inbox.mark_processed(uuid, text),
        inbox.record_error(uuid, text, text, boolean, interval)
        FROM pgoutbox_backfiller;
        REVOKE USAGE ON SCHEMA outbox, inbox FROM pgoutbox_backfiller;
    END IF;
END;
$$;

-- ---- the console

DELETE FROM outbox.schema_migrations WHERE version = 18;

COMMIT;
