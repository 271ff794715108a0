-- 0010_archival_operations (up): archival as operators run it.
--
--   * outbox.archive_seal and outbox.seal_figures(): the row count and
--     checksum of a sealed partition, taken once right after its seal and
--     before any export. record_archive and drop_archived compare the live
--     rows with them, so a change made after the seal by an owner who
--     bypasses the read-only triggers (session_replication_role = replica,
--     or the triggers disabled) fails with SEAL_BROKEN (OB062) instead of
--     being archived and dropped; disabled seal triggers fail the same way.
--     void_archive voids the seal figures with the audit.
--   * Expand only: seal_partition, record_archive, drop_archived and
--     void_archive keep their signatures and meaning; an archiver of the
--     previous release, which takes no seal figures, archives as before.
--
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 9 or 10.
-- Catalog changes only: no row is read or rewritten.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0010 needs 0001 to 0009 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (9, 10) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0010 applies on version 9 (or re-runs on 10) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

CREATE TABLE IF NOT EXISTS outbox.archive_seal (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    day date NOT NULL,
    relation text NOT NULL,
    row_count bigint NOT NULL,
    checksum numeric NOT NULL,
    sealed_at timestamptz NOT NULL DEFAULT now(),
    sealed_by text NOT NULL DEFAULT session_user,
    voided_at timestamptz,
    CONSTRAINT seal_row_count_is_non_negative CHECK (row_count >= 0),
    CONSTRAINT seal_checksum_is_a_non_negative_integer CHECK (
        checksum >= 0 AND checksum = trunc(checksum)
    )
);
COMMENT ON TABLE outbox.archive_seal IS
'Row count and checksum of each sealed outbox day partition, taken right after the seal.';

CREATE UNIQUE INDEX IF NOT EXISTS archive_seal_one_standing_per_day
ON outbox.archive_seal (day) WHERE voided_at IS NULL;

-- Seal figures are evidence too: inserted, then voided once.
CREATE OR REPLACE FUNCTION outbox.tg_archive_seal__guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'UPDATE'
        AND (NEW.id, NEW.day, NEW.relation, NEW.row_count, NEW.checksum, NEW.sealed_at, NEW.sealed_by)
        IS NOT DISTINCT FROM
        (OLD.id, OLD.day, OLD.relation, OLD.row_count, OLD.checksum, OLD.sealed_at, OLD.sealed_by)
        AND OLD.voided_at IS NULL THEN
        RETURN NEW;  -- voiding a standing seal
    END IF;
    RAISE EXCEPTION 'AUDIT_IMMUTABLE: seal figures are only voided, once'
        USING ERRCODE = 'OB060';
END;
$$;

CREATE OR REPLACE TRIGGER _100_guard_update
BEFORE UPDATE ON outbox.archive_seal
FOR EACH ROW EXECUTE FUNCTION outbox.tg_archive_seal__guard();

CREATE OR REPLACE TRIGGER _100_forbid_delete
BEFORE DELETE ON outbox.archive_seal
FOR EACH ROW EXECUTE FUNCTION outbox.tg_archive_seal__guard();

CREATE OR REPLACE TRIGGER _100_forbid_truncate
BEFORE TRUNCATE ON outbox.archive_seal
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_archive_seal__guard();

-- Whether the seal of a partition still holds: its read-only triggers are
-- enabled (an owner may disable them: ALTER TABLE ... DISABLE TRIGGER), and
-- the given figures (the live rows', or an archive's) equal the figures
-- taken right after the seal (outbox.seal_figures), when there are any.
-- SEAL_BROKEN otherwise: the partition changed behind the seal.
CREATE OR REPLACE FUNCTION outbox._check_seal(partition_name text, row_count bigint, checksum numeric)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    sealed outbox.archive_seal;
BEGIN
    IF EXISTS (
        SELECT 1 FROM pg_trigger AS t
        WHERE t.tgrelid = to_regclass(format('outbox.%I', partition_name))
            AND t.tgname IN ('_050_archived_read_only', '_050_archived_no_truncate')
            AND t.tgenabled = 'D'
    ) THEN
        RAISE EXCEPTION 'SEAL_BROKEN: the read-only triggers of partition % are disabled', partition_name
            USING ERRCODE = 'OB062',
                  HINT = 'Nothing was removed. Find out who disabled them; void the archive to archive the day again.';
    END IF;
    SELECT * INTO sealed FROM outbox.archive_seal AS s
    WHERE s.day = outbox._partition_day(partition_name) AND s.voided_at IS NULL;
    IF FOUND AND (sealed.row_count, sealed.checksum) IS DISTINCT FROM (row_count, checksum) THEN
        RAISE EXCEPTION 'SEAL_BROKEN: partition % changed since it was sealed', partition_name
            USING ERRCODE = 'OB062',
                  DETAIL = format('sealed: %s rows, checksum %s; now: %s rows, checksum %s',
                      sealed.row_count, sealed.checksum, row_count, checksum),
                  HINT = 'Nothing was removed. Only a trigger-bypassing owner can change a sealed partition; '
                      'find out who did, then void the archive to archive the day again.';
    END IF;
END;
$$;

-- The figures of a sealed partition, taken once, right after its seal and
-- before any export, then returned as taken: the rows its archive must hold.
-- From then on a change behind the seal (by an owner who bypasses the
-- triggers) makes record_archive and drop_archived fail with SEAL_BROKEN.
-- (Not in seal_partition's transaction: counting and hashing the day there
-- would hold the lock that keeps writers out, and every relay's claim, for
-- as long as the hash takes.)
CREATE OR REPLACE FUNCTION outbox.seal_figures(partition_name text)
RETURNS TABLE (row_count bigint, checksum numeric)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    part_day date := outbox._partition_day(partition_name);
    sealed outbox.archive_seal;
BEGIN
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key('outbox.events', part_day));
    IF NOT outbox._is_partition(partition_name) THEN
        RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: outbox.events has no partition %', partition_name
            USING ERRCODE = 'OB050';
    END IF;
    IF NOT outbox._is_sealed(partition_name) THEN
        RAISE EXCEPTION 'NOT_SEALED: partition % must be sealed before its figures are taken', partition_name
            USING ERRCODE = 'OB061', HINT = 'Call outbox.seal_partition() first.';
    END IF;
    SELECT * INTO sealed FROM outbox.archive_seal AS s WHERE s.day = part_day AND s.voided_at IS NULL;
    IF FOUND THEN
        row_count := sealed.row_count;
        checksum := sealed.checksum;
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT f.row_count, f.checksum INTO row_count, checksum FROM outbox.archive_figures('outbox.events', part_day) AS f;
    PERFORM outbox._check_seal(partition_name, row_count, checksum);
    INSERT INTO outbox.archive_seal (day, relation, row_count, checksum)
    VALUES (part_day, partition_name, seal_figures.row_count, seal_figures.checksum);
    RETURN NEXT;
END;
$$;
COMMENT ON FUNCTION outbox.seal_figures(text) IS
'Row count and checksum of a sealed day partition, taken once right after the seal: what its archive must match.';

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
    IF source = 'outbox.events' THEN
        -- The live rows must still be the sealed ones (the archive is compared
        -- with them next): a change since the seal is not archived.
        PERFORM outbox._check_seal(outbox._partition_name(day), live.row_count, live.checksum);
    END IF;
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
-- the audit and the seal figures. The partition is sealed, so only a
-- trigger-bypassing owner could change it between the check and the DROP.
-- Already dropped: returns 0.
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
    -- The live rows equal the audit (just checked); they must equal the seal too.
    PERFORM outbox._check_seal(partition_name, standing.row_count, standing.checksum);
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
    IF source = 'outbox.events' THEN
        UPDATE outbox.archive_seal AS s SET voided_at = now()
        WHERE s.day = void_archive.day AND s.voided_at IS NULL;
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

REVOKE ALL ON FUNCTION
outbox.tg_archive_seal__guard(),
outbox._check_seal(text, bigint, numeric),
outbox.seal_figures(text)
FROM public;
GRANT EXECUTE ON FUNCTION outbox.seal_figures(text) TO pgoutbox_archiver, pgoutbox_admin;
GRANT SELECT ON outbox.archive_seal TO pgoutbox_admin;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (10, '0010_archival_operations')
ON CONFLICT (version) DO NOTHING;

COMMIT;
