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

-- ---- the console

DELETE FROM outbox.schema_migrations WHERE version = 18;

COMMIT;
