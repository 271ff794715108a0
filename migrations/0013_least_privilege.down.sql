-- 0013_least_privilege (down): back to version 12: pgoutbox_archiver may no
-- longer call outbox.schema_version() and outbox.serves_workers_from(), so
-- `pgoutbox archive` and `report` run as pgoutbox_archiver stop at their
-- schema check again (42501).
--
-- What it cannot undo: nothing is lost; only grants change.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 13) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

REVOKE EXECUTE ON FUNCTION outbox.schema_version(), outbox.serves_workers_from() FROM pgoutbox_archiver;

DELETE FROM outbox.schema_migrations
WHERE version = 13;

COMMIT;
