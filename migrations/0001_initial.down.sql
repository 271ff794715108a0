-- 0001_initial (down): removes everything 0001 created, in this database.
--
-- What it cannot undo:
--   * data: it refuses to run while outbox.events or inbox.messages hold any
--     row, because dropping them would lose events (archive them first);
--   * roles: pgoutbox_writer, _relay, _consumer and _admin are cluster-wide
--     and may serve other databases, so they are left in place.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 1) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
        IF EXISTS (SELECT 1 FROM outbox.events) THEN
            RAISE EXCEPTION 'DATA_WOULD_BE_LOST: outbox.events is not empty'
                USING ERRCODE = 'OB091', HINT = 'Archive and drop its partitions first.';
        END IF;
        IF EXISTS (SELECT 1 FROM inbox.messages) THEN
            RAISE EXCEPTION 'DATA_WOULD_BE_LOST: inbox.messages is not empty'
                USING ERRCODE = 'OB091';
        END IF;
    END IF;
END;
$$;

DROP SCHEMA IF EXISTS inbox CASCADE;
DROP SCHEMA IF EXISTS outbox CASCADE;

COMMIT;
