-- 0010_archival_operations (down): back to version 9. record_archive,
-- drop_archived and void_archive go back to their version 9 definitions,
-- which know nothing of seal figures.
--
-- What it cannot undo: the seal figures taken while it was applied are
-- evidence; the table is dropped only when empty (DATA_WOULD_BE_LOST
-- otherwise: keep this migration applied).

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 10) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
    IF to_regclass('outbox.archive_seal') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.archive_seal) THEN
            RAISE EXCEPTION 'DATA_WOULD_BE_LOST: outbox.archive_seal is not empty'
                USING ERRCODE = 'OB091',
                      HINT = 'The seal figures of archived days cannot be dropped; keep this migration applied.';
        END IF;
    END IF;
END;
$$;

-- Records the audit row of an exported unit, once the figures the archiver
-- read back from its archive equal the live figures computed here. Same
-- figures and URI again: returns the same row (a re-run after a crash).
CREATE OR REPLACE FUNCTION outbox.record_archive(
    source text,
    day date,
    row_count bigint,
    checksum numeric,
    archive_uri text
)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    live record;
    standing outbox.archive_audit;
    open_rows bigint;
    new_id bigint;
BEGIN
    PERFORM outbox._archive_source(source);
    IF day IS NULL OR row_count IS NULL OR checksum IS NULL OR nullif(btrim(archive_uri), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: day, row_count, checksum and archive_uri are required'
            USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_day(day);
    PERFORM outbox._check_text(archive_uri, 'archive_uri', 2048);
    IF row_count < 0 OR checksum < 0 OR checksum <> trunc(checksum) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: row_count and checksum must be non-negative integers, got % and %', row_count, checksum
            USING ERRCODE = 'OB006';
    END IF;
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key(source, day));
    IF source = 'outbox.events' AND NOT outbox._is_sealed(outbox._partition_name(day)) THEN
        RAISE EXCEPTION 'NOT_SEALED: partition % must be sealed before its archive is recorded', outbox._partition_name(day)
            USING ERRCODE = 'OB061', HINT = 'Call outbox.seal_partition() before exporting it.';
    END IF;
    IF source = 'inbox.messages' THEN
        PERFORM inbox._check_floor(day);
        SELECT count(*) INTO open_rows FROM inbox.messages AS m
        WHERE m.received_at >= outbox._day_from(day) AND m.received_at < outbox._day_from(day + 1)
            AND m.status IN ('RECEIVED', 'FAILED');
        IF open_rows > 0 THEN
            RAISE EXCEPTION 'NOT_CLOSED: inbox day % has % row(s) still RECEIVED or FAILED', day, open_rows
                USING ERRCODE = 'OB051';
        END IF;
    END IF;
    SELECT * INTO live FROM outbox.archive_figures(source, day);
    IF (live.row_count, live.checksum) IS DISTINCT FROM (record_archive.row_count, record_archive.checksum) THEN
        RAISE EXCEPTION 'ARCHIVE_MISMATCH: the archive of % % does not match the live rows', source, day
            USING ERRCODE = 'OB053',
                  DETAIL = format('archive: %s rows, checksum %s; live: %s rows, checksum %s',
                      row_count, checksum, live.row_count, live.checksum);
    END IF;
    SELECT * INTO standing FROM outbox.archive_audit AS a
    WHERE a.source = record_archive.source AND a.day = record_archive.day AND a.voided_at IS NULL;
    IF FOUND THEN
        IF standing.removed_at IS NULL
            AND (standing.row_count, standing.checksum, standing.archive_uri)
            = (record_archive.row_count, record_archive.checksum, record_archive.archive_uri) THEN
            RETURN standing.id;
        END IF;
        RAISE EXCEPTION 'ARCHIVE_CONFLICT: % % already has audit %', source, day, standing.id
            USING ERRCODE = 'OB055',
                  DETAIL = format('audit: %s rows, checksum %s, %s%s; given: %s rows, checksum %s, %s',
                      standing.row_count, standing.checksum, standing.archive_uri,
                      CASE WHEN standing.removed_at IS NULL THEN '' ELSE ', removed' END,
                      row_count, checksum, archive_uri),
                  HINT = 'If the standing audit is wrong and its rows are still live, void it: outbox.void_archive().';
    END IF;
    INSERT INTO outbox.archive_audit (source, day, relation, row_count, checksum, archive_uri)
    VALUES (
        source, day,
        CASE WHEN source = 'outbox.events' THEN outbox._partition_name(day) END,
        row_count, checksum, archive_uri
    )
    RETURNING id INTO new_id;
    RETURN new_id;
END;
$$;
COMMENT ON FUNCTION outbox.record_archive(text, date, bigint, numeric, text) IS
'Records the audit row of an exported day once its archived figures equal the live ones; idempotent.';

-- Drops an audited partition after re-checking its live figures against
-- the audit. The partition is sealed, so only a trigger-bypassing owner could
-- change it between the check and the DROP. Already dropped: returns 0.
CREATE OR REPLACE FUNCTION outbox.drop_archived(
    partition_name text,
    lock_timeout interval DEFAULT interval '5 seconds'
)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    part_day date := outbox._partition_day(partition_name);
    standing outbox.archive_audit;
BEGIN
    PERFORM outbox._check_lock_timeout(lock_timeout);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key('outbox.events', part_day));
    IF NOT outbox._is_partition(partition_name) THEN
        IF EXISTS (
            SELECT 1 FROM outbox.archive_audit AS a
            WHERE a.source = 'outbox.events' AND a.day = part_day
                AND a.voided_at IS NULL AND a.removed_at IS NOT NULL
        ) THEN
            RETURN 0;
        END IF;
        RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: outbox.events has no partition %', partition_name
            USING ERRCODE = 'OB050';
    END IF;
    standing := outbox._standing_audit('outbox.events', part_day);
    IF NOT outbox._is_sealed(partition_name) THEN
        RAISE EXCEPTION 'NOT_SEALED: partition % lost its seal after audit %', partition_name, standing.id
            USING ERRCODE = 'OB061';
    END IF;
    -- DROP takes ACCESS EXCLUSIVE on outbox.events for the rest of this short
    -- transaction; lock_timeout keeps emitters from queueing behind us.
    PERFORM outbox._with_lock_timeout(format('DROP TABLE outbox.%I', partition_name), lock_timeout);
    UPDATE outbox.archive_audit SET removed_at = now(), removed_by = session_user
    WHERE id = standing.id;
    RETURN standing.row_count;
END;
$$;
COMMENT ON FUNCTION outbox.drop_archived(text, interval) IS
'Drops a sealed, audited day partition whose live count and checksum still match its audit row.';

-- Voids the standing audit of a unit whose rows are still live, and unseals
-- an outbox partition, so it can change again and be archived afresh.
-- Refused once the rows are removed: then the archive is all there is.
CREATE OR REPLACE FUNCTION outbox.void_archive(
    source text,
    day date,
    reason text,
    lock_timeout interval DEFAULT interval '5 seconds'
)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    standing outbox.archive_audit;
    part text := outbox._partition_name(day);
BEGIN
    PERFORM outbox._archive_source(source);
    PERFORM outbox._check_day(day);
    PERFORM outbox._check_text(reason, 'voiding an archive''s reason', 1000, TRUE);
    PERFORM outbox._check_lock_timeout(lock_timeout);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key(source, day));
    SELECT * INTO standing FROM outbox.archive_audit AS a
    WHERE a.source = void_archive.source AND a.day = void_archive.day AND a.voided_at IS NULL;
    IF FOUND AND standing.removed_at IS NOT NULL THEN
        RAISE EXCEPTION 'ARCHIVE_CONFLICT: % % was removed after audit %; its archive is the only copy', source, day, standing.id
            USING ERRCODE = 'OB055';
    END IF;
    IF FOUND THEN
        UPDATE outbox.archive_audit
        SET voided_at = now(), voided_by = session_user, void_reason = reason
        WHERE id = standing.id;
    END IF;
    IF source = 'outbox.events' AND outbox._is_sealed(part) THEN
        PERFORM outbox._with_lock_timeout(
            format('DROP TRIGGER _050_archived_read_only ON outbox.%I', part), lock_timeout
        );
        EXECUTE format('DROP TRIGGER _050_archived_no_truncate ON outbox.%I', part);
        EXECUTE format('REVOKE SELECT ON outbox.%I FROM pgoutbox_archiver', part);
    END IF;
    RETURN standing.id;
END;
$$;
COMMENT ON FUNCTION outbox.void_archive(text, date, text, interval) IS
'Voids the standing audit of a day whose rows are still live and unseals it (admins; reason required).';

DROP FUNCTION IF EXISTS outbox.seal_figures(text);
DROP FUNCTION IF EXISTS outbox._check_seal(text, bigint, numeric);
DROP TABLE IF EXISTS outbox.archive_seal;
DROP FUNCTION IF EXISTS outbox.tg_archive_seal__guard();

DELETE FROM outbox.schema_migrations
WHERE version = 10;

COMMIT;
