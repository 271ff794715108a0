-- 0014_command_inbox (down): back to version 13, without the command inbox.
--
-- What it cannot undo: it refuses to run while inbox.commands holds any row
-- (DATA_WOULD_BE_LOST): without its keys, every stored command could run
-- again; and while outbox.archive_audit holds an audit of inbox.commands
-- (version 13 knows no such source, and audits are evidence). Nothing else
-- is lost. The archival functions get back their version 13 definitions.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 14) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
    IF to_regclass('inbox.commands') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM inbox.commands) THEN
            RAISE EXCEPTION 'DATA_WOULD_BE_LOST: inbox.commands is not empty'
                USING ERRCODE = 'OB091',
                      HINT = 'Its keys keep commands from running twice; they leave only by audited archival.';
        END IF;
    END IF;
    IF EXISTS (SELECT 1 FROM outbox.archive_audit WHERE source = 'inbox.commands') THEN
        RAISE EXCEPTION 'DATA_WOULD_BE_LOST: outbox.archive_audit holds audits of inbox.commands'
            USING ERRCODE = 'OB091',
                  HINT = 'They record where archived command keys went; version 13 has no place for them.';
    END IF;
END;
$$;

DROP FUNCTION IF EXISTS inbox.purge_archived_commands(date);
DROP FUNCTION IF EXISTS inbox._check_command_floor(date);
DROP FUNCTION IF EXISTS inbox.set_command_retry_window(interval);
DROP FUNCTION IF EXISTS inbox.archivable_command_days(interval);
DROP FUNCTION IF EXISTS inbox.command_retry_window();
DROP TABLE IF EXISTS inbox.command_policy;

ALTER TABLE outbox.archive_audit DROP CONSTRAINT IF EXISTS source_is_known;
ALTER TABLE outbox.archive_audit ADD CONSTRAINT source_is_known CHECK (
    source IN ('outbox.events', 'inbox.messages')
);
COMMENT ON TABLE outbox.archive_audit IS
'One row per archived day of outbox.events or inbox.messages: the figures the rows were removed against.';

-- The archival functions as of version 13.
CREATE OR REPLACE FUNCTION outbox._archive_source(source text)
RETURNS regclass
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF source = 'outbox.events' THEN
        RETURN 'outbox.events'::regclass;
    ELSIF source = 'inbox.messages' THEN
        RETURN 'inbox.messages'::regclass;
    END IF;
    RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: % is not an archived source', quote_literal(source)
        USING ERRCODE = 'OB050', HINT = 'Sources are outbox.events and inbox.messages.';
END;
$$;

CREATE OR REPLACE FUNCTION outbox.checksum_columns(source text)
RETURNS TABLE (ordinal integer, column_name text, kind text)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    rel regclass := outbox._archive_source(source);
    bad text;
BEGIN
    SELECT string_agg(format('%s (%s)', a.attname, format_type(a.atttypid, a.atttypmod)), ', ')
    INTO bad
    FROM pg_attribute AS a
    WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
        AND (rel, a.attname) IS DISTINCT FROM ('outbox.events'::regclass, 'subject'::name)
        AND a.atttypid NOT IN (
            'int2'::regtype, 'int4'::regtype, 'int8'::regtype, 'uuid'::regtype, 'bool'::regtype,
            'text'::regtype, 'varchar'::regtype, 'json'::regtype, 'jsonb'::regtype,
            'timestamptz'::regtype
        );
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'UNSUPPORTED_COLUMN: the archive checksum has no rendering for %', bad
            USING ERRCODE = 'OB058', HINT = 'Teach outbox.checksum_columns and spark/checksum.py the type.';
    END IF;
    RETURN QUERY
    SELECT
        (row_number() OVER (ORDER BY a.attnum))::integer,
        a.attname::text,
        CASE
            WHEN a.atttypid = 'timestamptz'::regtype THEN 'timestamp'
            WHEN a.atttypid IN ('text'::regtype, 'varchar'::regtype, 'json'::regtype, 'jsonb'::regtype)
                THEN 'text'
            ELSE 'plain'
        END
    FROM pg_attribute AS a
    WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
        AND (rel, a.attname) IS DISTINCT FROM ('outbox.events'::regclass, 'subject'::name)
    ORDER BY a.attnum;
END;
$$;
COMMENT ON FUNCTION outbox.checksum_columns(text) IS
'Columns of outbox.events or inbox.messages that enter the archive checksum, in order, with their rendering.';

CREATE OR REPLACE FUNCTION outbox.archive_figures(source text, day date)
RETURNS TABLE (row_count bigint, checksum numeric)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    part text := outbox._partition_name(day);
BEGIN
    PERFORM outbox._archive_source(source);
    PERFORM outbox._check_day(day);
    IF source = 'outbox.events' THEN
        IF NOT outbox._is_partition(part) THEN
            RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: outbox.events has no partition %', part
                USING ERRCODE = 'OB050';
        END IF;
        RETURN QUERY EXECUTE format(
            'SELECT count(*), coalesce(sum(%s), 0)::numeric FROM outbox.%I AS r',
            outbox._row_hash_sql(source), part
        );
    ELSE
        RETURN QUERY EXECUTE format(
            'SELECT count(*), coalesce(sum(%s), 0)::numeric FROM inbox.messages AS r'
            ' WHERE r.received_at >= $1 AND r.received_at < $2',
            outbox._row_hash_sql(source)
        ) USING outbox._day_from(day), outbox._day_from(day + 1);
    END IF;
END;
$$;
COMMENT ON FUNCTION outbox.archive_figures(text, date) IS
'Live row count and checksum of one day of outbox.events (its partition) or inbox.messages.';

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


DROP FUNCTION IF EXISTS inbox.lookup_command(text, text);
DROP FUNCTION IF EXISTS inbox.fail_command(text, text, text);
DROP FUNCTION IF EXISTS inbox.complete_command(text, text, jsonb);
DROP FUNCTION IF EXISTS inbox._refuse_command_move(text, text, text);
DROP FUNCTION IF EXISTS inbox.claim_command(text, text);
DROP FUNCTION IF EXISTS inbox._check_command(text, text);
DROP TABLE IF EXISTS inbox.commands;
DROP FUNCTION IF EXISTS inbox.tg_commands__forbid_delete();
DROP FUNCTION IF EXISTS inbox.tg_commands__guard_update();

DELETE FROM outbox.schema_migrations
WHERE version = 14;

COMMIT;
