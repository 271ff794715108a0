-- Archival helpers (the lifecycle is described in sql/91_archival_audit.sql):
-- units and their days, partition names and seals, the argument checks, the
-- per-unit advisory lock and statements run under lock_timeout.

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
    ELSIF source = 'inbox.commands' THEN
        RETURN 'inbox.commands'::regclass;
    END IF;
    RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: % is not an archived source', quote_literal(source)
        USING ERRCODE = 'OB050', HINT = 'Sources are outbox.events, inbox.messages and inbox.commands.';
END;
$$;

-- UTC day bounds.
CREATE OR REPLACE FUNCTION outbox._day_from(day date)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT day::timestamp AT TIME ZONE 'UTC';
$$;

-- The column that places a row of an inbox source in its UTC day, and
-- never changes: when inbox.messages received it, when inbox.commands first
-- claimed its key. (outbox.events: its day partition.)
CREATE OR REPLACE FUNCTION outbox._day_column(source text)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT CASE source WHEN 'inbox.messages' THEN 'received_at' WHEN 'inbox.commands' THEN 'first_claimed_at' END;
$$;

CREATE OR REPLACE FUNCTION outbox._partition_name(day date)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT 'events_p' || to_char(day, 'YYYYMMDD');
$$;

-- The day of a day partition of outbox.events; OB050 for anything else.
CREATE OR REPLACE FUNCTION outbox._partition_day(partition_name text)
RETURNS date
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    day date;
BEGIN
    IF partition_name !~ '^events_p[0-9]{8}$' THEN
        RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: % is not a day partition name (events_pYYYYMMDD)', quote_literal(partition_name)
            USING ERRCODE = 'OB050';
    END IF;
    BEGIN
        day := to_date(substr(partition_name, 9), 'YYYYMMDD');
    EXCEPTION WHEN datetime_field_overflow OR invalid_datetime_format THEN
        day := NULL;
    END;
    IF day IS NULL OR outbox._partition_name(day) <> partition_name THEN
        RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: % names no calendar day', quote_literal(partition_name)
            USING ERRCODE = 'OB050';
    END IF;
    RETURN day;
END;
$$;

CREATE OR REPLACE FUNCTION outbox._is_partition(partition_name text)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT EXISTS (
        SELECT 1
        FROM pg_inherits AS i
        INNER JOIN pg_class AS c ON i.inhrelid = c.oid
        WHERE i.inhparent = 'outbox.events'::regclass AND c.relname = partition_name
    );
$$;

CREATE OR REPLACE FUNCTION outbox._is_sealed(partition_name text)
RETURNS boolean
LANGUAGE sql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT EXISTS (
        SELECT 1 FROM pg_trigger AS t
        WHERE t.tgrelid = to_regclass(format('outbox.%I', partition_name))
            AND t.tgname = '_050_archived_read_only'
    );
$$;

-- A unit's day: given, and a day whose partition name has a four-digit year.
CREATE OR REPLACE FUNCTION outbox._check_day(day date)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF day IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: day is required' USING ERRCODE = 'OB006';
    END IF;
    IF NOT (day >= '1900-01-01' AND day <= '9999-12-30') THEN
        RAISE EXCEPTION 'TIMESTAMP_OUT_OF_RANGE: day % is not from 1900-01-01 to 9999-12-30', day
            USING ERRCODE = 'OB008';
    END IF;
END;
$$;

-- Retentions: from 0 to 100 years (now() - retention must stay a time).
CREATE OR REPLACE FUNCTION outbox._check_retention(retention interval, what text)
RETURNS void
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_range(what, retention, interval '0', interval '100 years', 'an interval from 0 to 100 years');
$$;

-- A lock_timeout argument: from 1 ms (PostgreSQL reads 0 as "wait for ever")
-- to 1 hour.
CREATE OR REPLACE FUNCTION outbox._check_lock_timeout(lock_timeout interval)
RETURNS void
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_range(
        'lock_timeout', lock_timeout, interval '1 millisecond', interval '1 hour', 'an interval from 1 ms to 1 hour'
    );
$$;

-- Serialises the archival steps of one unit across sessions. The Spark job
-- holds it at session level (try_lock_archive) for a whole unit; the SQL
-- steps take it per transaction, so an operator's void waits for a run.
CREATE OR REPLACE FUNCTION outbox._archive_lock_key(source text, day date)
RETURNS bigint
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT hashtextextended('pgoutbox.archive:' || source || ':' || day::text, 0);
$$;

-- Runs a lock-taking statement under lock_timeout (restored afterwards), so
-- a long transaction cannot make the archiver queue, and everyone behind it.
CREATE OR REPLACE FUNCTION outbox._with_lock_timeout(statement text, lock_timeout interval)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    saved text := current_setting('lock_timeout');
BEGIN
    PERFORM outbox._check_lock_timeout(lock_timeout);
    PERFORM set_config('lock_timeout', (extract(epoch FROM lock_timeout) * 1000)::bigint::text, true);
    BEGIN
        EXECUTE statement;
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION 'ARCHIVE_BUSY: could not lock within %: %', lock_timeout, statement
            USING ERRCODE = 'OB059', HINT = 'A long transaction holds the table; run the archiver again later.';
    END;
    PERFORM set_config('lock_timeout', saved, true);
END;
$$;

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
