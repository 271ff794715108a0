-- 0015_upcasters (down): back to version 14: no upcasters, no
-- inbox.receive_batch_as. Refuses (OB091) while an upcaster is registered:
-- unregister them first (the application's own migration registered them).
--
-- What it cannot undo: nothing is lost; a consumer of schema 15 whose
-- handlers declare a version stops at its schema check on 14.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 15) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
    IF to_regclass('inbox.upcasters') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM inbox.upcasters) THEN
            RAISE EXCEPTION 'DATA_WOULD_BE_LOST: inbox.upcasters holds registered upcasters; unregister them first'
                USING ERRCODE = 'OB091';
        END IF;
    END IF;
END;
$$;

DROP FUNCTION IF EXISTS inbox.receive_batch_as(text, uuid[], text[], jsonb[], integer);
DROP FUNCTION IF EXISTS inbox.upcast_gaps(text, integer);
DROP FUNCTION IF EXISTS inbox.upcast(text, integer, integer, jsonb);
DROP FUNCTION IF EXISTS inbox._upcast_all(integer[], text[], integer[], integer, jsonb[]);
DROP FUNCTION IF EXISTS inbox.unregister_upcaster(text, integer);
DROP FUNCTION IF EXISTS inbox.register_upcaster(text, integer, regprocedure);
DROP FUNCTION IF EXISTS inbox._upcaster_problem(regprocedure);
DROP TABLE IF EXISTS inbox.upcasters;

DELETE FROM outbox.schema_migrations
WHERE version = 15;

COMMIT;
