-- 0018_steady_under_faults (up): what a broker outage, a failing upcaster,
-- a snapshot held by another session and a hostile console input do to
-- pgoutbox: each delays work, none loses or dead-letters it.
--
-- (The sections below are filled by the changes of this release.)
--
-- Expand only: workers of the previous release run on it unchanged.
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 17 or 18.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0018 needs 0001 to 0017 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (17, 18) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0018 applies on version 17 (or re-runs on 18) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

-- ---- broker faults: the relay hands back what JetStream did not answer

-- ---- upcasters: any error of an upcaster is that message's own outcome

-- ---- held snapshots: the hot path does not grow with the oldest snapshot

-- ---- the console

INSERT INTO outbox.schema_migrations (version, name)
VALUES (18, '0018_steady_under_faults')
ON CONFLICT (version) DO NOTHING;

COMMIT;
