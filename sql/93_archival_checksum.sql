-- Archival checksum (the form is described in sql/91_archival_audit.sql and
-- computed identically in spark/pgoutbox_spark/checksum.py): the columns that enter it, the
-- per-row expression, and a unit's live row count and checksum.

-- The columns that enter the checksum, in order, and how each is rendered:
-- plain (integers, uuid, boolean: text form as is), text (text, json, jsonb:
-- escaped) or timestamp (timestamptz: epoch microseconds). Any other type
-- raises UNSUPPORTED_COLUMN, so a future column cannot be hashed differently
-- on the two sides without anyone noticing.
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
'Columns of an archived source (outbox.events, inbox.messages, inbox.commands) in its checksum, in order.';

-- The per-row checksum expression over alias r (E'' literals: the same text
-- whatever standard_conforming_strings says).
CREATE OR REPLACE FUNCTION outbox._row_hash_sql(source text)
RETURNS text
LANGUAGE sql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT format(
        $f$('x' || substr(md5(concat_ws('|', %s)), 1, 15))::bit(60)::bigint$f$,
        string_agg(
            format(
                CASE c.kind
                    WHEN 'plain' THEN $f$coalesce(r.%1$I::text, E'\\N')$f$
                    WHEN 'text' THEN $f$coalesce(replace(replace(r.%1$I::text, E'\\', E'\\\\'), '|', E'\\|'), E'\\N')$f$
                    ELSE $f$coalesce((extract(epoch FROM r.%1$I) * 1000000)::bigint::text, E'\\N')$f$
                END,
                c.column_name
            ),
            ', ' ORDER BY c.ordinal
        )
    )
    FROM outbox.checksum_columns(source) AS c;
$$;

-- Live row count and checksum of a unit: the day partition of outbox.events,
-- the rows inbox.messages received that UTC day, or the keys inbox.commands
-- first claimed that UTC day.
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
            'SELECT count(*), coalesce(sum(%s), 0)::numeric FROM %s AS r'
            ' WHERE r.%I >= $1 AND r.%I < $2',
            outbox._row_hash_sql(source), outbox._archive_source(source),
            outbox._day_column(source), outbox._day_column(source)
        ) USING outbox._day_from(day), outbox._day_from(day + 1);
    END IF;
END;
$$;
COMMENT ON FUNCTION outbox.archive_figures(text, date) IS
'Live row count and checksum of one day of outbox.events (its partition), inbox.messages or inbox.commands.';
