-- 0013_least_privilege (up): every role holds the functions its documented
-- commands call, start-up checks included (docs/reference.md, "Roles";
-- tests/cli/test_role_matrix.py runs each command as a login holding only
-- its role, and checks each SQL function the command's code calls).
--
--   * pgoutbox_archiver may call outbox.schema_version() and
--     outbox.serves_workers_from(): every command checks the schema version
--     when it connects (release 0.3.0), and `pgoutbox archive` and
--     `pgoutbox report` run as pgoutbox_archiver stopped there with 42501.
--
-- Expand only: grants are added, none is revoked; workers of release 0.3.0
-- (schema 11) run on it unchanged.
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent GRANT). Refuses to run unless the schema is at version 12 or 13.
-- Catalog changes only: no row is read or rewritten.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0013 needs 0001 to 0012 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (12, 13) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0013 applies on version 12 (or re-runs on 13) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

GRANT EXECUTE ON FUNCTION outbox.schema_version(), outbox.serves_workers_from() TO pgoutbox_archiver;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (13, '0013_least_privilege')
ON CONFLICT (version) DO NOTHING;

COMMIT;
