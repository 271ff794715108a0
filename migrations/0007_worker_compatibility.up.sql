-- 0007_worker_compatibility (up): the schema says which workers it serves,
-- so that upgrades roll instead of stopping every worker.
--
--   * outbox.serves_workers_from(): the oldest schema version a worker may
--     be built for and still run here. Workers accept a schema from the
--     oldest they support up to the one they were built for, and a newer one
--     while this function says it still serves them. Migrations that only
--     add (expand) leave the number alone; one that removes or changes what
--     older workers call (contract) raises it, in a release of its own.
--
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 6 or 7.
-- Catalog changes only: no row is read or rewritten.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0007 needs 0001 to 0006 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (6, 7) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0007 applies on version 6 (or re-runs on 7) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

-- Expand-then-contract: a migration that only adds leaves this number alone,
-- so workers built for an older schema keep running after it; a contract
-- migration (one that removes or changes what older workers call) raises it.
CREATE OR REPLACE FUNCTION outbox.serves_workers_from()
RETURNS integer
LANGUAGE sql IMMUTABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT 6;
$$;
COMMENT ON FUNCTION outbox.serves_workers_from() IS
'Oldest schema version a worker may be built for and still run on this schema (raised only by contract migrations).';

REVOKE ALL ON FUNCTION outbox.serves_workers_from() FROM public;
GRANT EXECUTE ON FUNCTION outbox.serves_workers_from() TO pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (7, '0007_worker_compatibility')
ON CONFLICT (version) DO NOTHING;

COMMIT;
