-- Archival (down): removes what the archival migration created.
--
-- What it cannot undo:
--   * archived data: it refuses to run while outbox.archive_audit holds any
--     row, because that table is the only record of which days were exported
--     and removed, and of the figures they were removed against;
--   * inbox.retention_policy: a changed stream max_age is forgotten (the
--     floor is back to the seed's 7 days if the migration is applied again);
--   * the role pgoutbox_archiver is cluster-wide and may serve other
--     databases, so it is left in place.
-- Partitions sealed for archival but not yet audited are unsealed (and the
-- archiver's read grant on them revoked).

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
DECLARE
    part text;
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 3) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
    IF to_regclass('outbox.archive_audit') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.archive_audit) THEN
            RAISE EXCEPTION 'DATA_WOULD_BE_LOST: outbox.archive_audit is not empty'
                USING ERRCODE = 'OB091',
                      HINT = 'The audit trail of archived days cannot be dropped; keep this migration applied.';
        END IF;
    END IF;
    FOR part IN
        SELECT c.relname FROM pg_trigger AS t INNER JOIN pg_class AS c ON t.tgrelid = c.oid
        WHERE t.tgname = '_050_archived_read_only'
            AND c.relnamespace = to_regnamespace('outbox')
    LOOP
        EXECUTE format('DROP TRIGGER IF EXISTS _050_archived_read_only ON outbox.%I', part);
        EXECUTE format('DROP TRIGGER IF EXISTS _050_archived_no_truncate ON outbox.%I', part);
        EXECUTE format('REVOKE SELECT ON outbox.%I FROM pgoutbox_archiver', part);
    END LOOP;
END;
$$;

DROP TRIGGER IF EXISTS _100_forbid_delete ON inbox.messages;
DROP TRIGGER IF EXISTS _100_forbid_truncate ON inbox.messages;
DROP INDEX IF EXISTS inbox.messages_received_at_idx;

DROP FUNCTION IF EXISTS outbox.checksum_columns(text);
DROP FUNCTION IF EXISTS outbox._row_hash_sql(text);
DROP FUNCTION IF EXISTS outbox.archive_figures(text, date);
DROP FUNCTION IF EXISTS outbox.archivable_partitions(interval, interval);
DROP FUNCTION IF EXISTS inbox.archivable_days(interval, interval);
DROP FUNCTION IF EXISTS inbox.stream_max_age();
DROP FUNCTION IF EXISTS inbox.set_stream_max_age(interval);
DROP FUNCTION IF EXISTS outbox.seal_partition(text, interval, interval, interval);
DROP FUNCTION IF EXISTS outbox.id_range();
DROP FUNCTION IF EXISTS inbox.received_range();
DROP FUNCTION IF EXISTS outbox.record_archive(text, date, bigint, numeric, text);
DROP FUNCTION IF EXISTS inbox._check_floor(date);
DROP FUNCTION IF EXISTS outbox.drop_archived(text, interval);
DROP FUNCTION IF EXISTS inbox.purge_archived(date);
DROP FUNCTION IF EXISTS outbox.void_archive(text, date, text, interval);
DROP FUNCTION IF EXISTS outbox.archive_audits(text);
DROP FUNCTION IF EXISTS outbox._standing_audit(text, date);
DROP FUNCTION IF EXISTS outbox.try_lock_archive(text, date);
DROP FUNCTION IF EXISTS outbox.unlock_archive(text, date);
DROP FUNCTION IF EXISTS outbox._archive_lock_key(text, date);
DROP FUNCTION IF EXISTS outbox._with_lock_timeout(text, interval);
DROP FUNCTION IF EXISTS outbox._is_sealed(text);
DROP FUNCTION IF EXISTS outbox._is_partition(text);
DROP FUNCTION IF EXISTS outbox._partition_day(text);
DROP FUNCTION IF EXISTS outbox._partition_name(date);
DROP FUNCTION IF EXISTS outbox._day_from(date);
DROP FUNCTION IF EXISTS outbox._archive_source(text);
DROP FUNCTION IF EXISTS outbox.tg_events__archived_read_only();
DROP FUNCTION IF EXISTS inbox.tg_messages__forbid_delete();
DROP TABLE IF EXISTS outbox.archive_audit;
DROP FUNCTION IF EXISTS outbox.tg_archive_audit__guard();
DROP TABLE IF EXISTS inbox.retention_policy;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgoutbox_archiver')
        AND to_regnamespace('outbox') IS NOT NULL THEN
        REVOKE SELECT ON outbox.events, inbox.messages FROM pgoutbox_archiver;
        REVOKE USAGE ON SCHEMA outbox, inbox FROM pgoutbox_archiver;
    END IF;
END;
$$;

DO $$
BEGIN
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        DELETE FROM outbox.schema_migrations WHERE version = 3;
    END IF;
END;
$$;

COMMIT;
