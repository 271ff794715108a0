-- 0009_inbox_batches (down): back to version 8. Consumers of this release
-- fall back to the per-message calls on versions 7 and 8.
--
-- What it cannot undo: nothing (the functions hold no data; the rows they
-- wrote are ordinary inbox rows).

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 9) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

DROP FUNCTION IF EXISTS inbox.receive_processed(text, uuid[], text[], jsonb[]);
DROP FUNCTION IF EXISTS inbox.settle(text, uuid[], uuid[], text[]);
DROP FUNCTION IF EXISTS inbox.receive_batch(text, uuid[], text[], jsonb[]);
DROP FUNCTION IF EXISTS inbox._check_receipts(text, uuid[], text[], jsonb[]);
DROP FUNCTION IF EXISTS inbox._check_batch(text, uuid[]);

DELETE FROM outbox.schema_migrations
WHERE version = 9;

COMMIT;
