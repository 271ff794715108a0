-- 0007_worker_compatibility (down): back to version 6. Workers built for
-- version 7 accept version 6 too; older ones need exactly 6.
--
-- What it cannot undo: nothing (the function holds no data).

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 7) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

DROP FUNCTION IF EXISTS outbox.serves_workers_from();

DELETE FROM outbox.schema_migrations
WHERE version = 7;

COMMIT;
