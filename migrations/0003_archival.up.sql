-- Archival (up): audited archival of outbox.events partitions and
-- inbox.messages days (outbox.archive_audit, seal/record/drop/purge/void
-- functions, inbox retention floor, pgoutbox_archiver role).
--
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once: one transaction, serialised by an
-- advisory lock, made of idempotent DDL. Runs only on the schema version just
-- below its own (or on its own: a re-run); the guard names the numbers.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0003 needs 0001 and 0002 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (2, 3) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0003 applies on version 2 (or re-runs on 3) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

-- ---- from sql/95_archival.sql (as of this migration) ----
-- Archival: rows leave outbox.events and
-- inbox.messages only by export -> verify -> audit -> remove, one UTC day at a
-- time. The Spark job (spark/) does the export; every rule lives here.
--
-- A unit is one day of one source:
--   outbox.events    the day partition events_pYYYYMMDD (removed by DROP TABLE)
--   inbox.messages   the rows received that UTC day (the inbox is keyed by
--                    (message_id, handler) for dedup, which a partition key
--                    would break; removed by one audited set DELETE)
--
-- Lifecycle of a unit:
--   eligible  its day ended more than `retention` ago and every row is terminal
--             (outbox: COMPLETED or DEAD_LETTER; inbox: PROCESSED or DEAD_LETTER)
--   sealed    (outbox) read-only triggers on the partition: from here on no
--             path through the API can change it; the archiver may read it
--             (seal_partition)
--   exported  Parquet written, re-read and its count + checksum computed (Spark)
--   audited   an archive_audit row, recorded only when the exported figures
--             equal the live figures computed here (record_archive)
--   removed   drop_archived / purge_archived: the live figures are computed
--             again and must still equal the audit row, in the transaction
--             that removes the rows
--
-- DEAD_LETTER rule: a dead-lettered row is terminal for archival only once
-- its day ended more than `dead_letter_retention` ago (default 30 days, the
-- operator's window to requeue or replay it); until then it holds its whole
-- day back. Archived dead letters keep their status and last_error in the
-- archive, and the delivery report counts them.
--
-- Inbox retention: never below the streams' max_age (inbox.retention_policy,
-- default 7 days): a message the stream may still redeliver must
-- find its inbox row, or dedup has a hole. archivable_days refuses a shorter
-- retention, and record/purge refuse a day younger than the floor whatever
-- retention the caller used.
--
-- Checksum, computed identically here and in spark/checksum.py:
--   per row   the stored, non-generated columns in table order, each rendered
--             as text (timestamptz as epoch microseconds; text, json and
--             jsonb with '\' -> '\\' and '|' -> '\|'; NULL as '\N'), joined
--             with '|'; the row's value is the first 15 hex digits of the
--             md5 of that text, as an integer (60 bits, non-negative)
--   per unit  the exact (numeric) sum of the row values, with the row count
-- A sum does not depend on row order, so any number of parallel readers can
-- compute it. Generated columns (subject, context) are functions of the
-- others and are left out.

CREATE TABLE IF NOT EXISTS outbox.archive_audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source text NOT NULL,
    day date NOT NULL,
    relation text,
    row_count bigint NOT NULL,
    checksum numeric NOT NULL,
    archive_uri text NOT NULL,
    archived_at timestamptz NOT NULL DEFAULT now(),
    archived_by text NOT NULL DEFAULT session_user,
    removed_at timestamptz,
    removed_by text,
    voided_at timestamptz,
    voided_by text,
    void_reason text,
    CONSTRAINT source_is_known CHECK (source IN ('outbox.events', 'inbox.messages')),
    CONSTRAINT outbox_audit_names_its_partition CHECK (
        (source = 'outbox.events') = (relation IS NOT NULL)
    ),
    CONSTRAINT row_count_is_non_negative CHECK (row_count >= 0),
    CONSTRAINT checksum_is_a_non_negative_integer CHECK (
        checksum >= 0 AND checksum = trunc(checksum)
    ),
    CONSTRAINT archive_uri_is_given CHECK (btrim(archive_uri) <> ''),
    CONSTRAINT removed_says_by_whom CHECK ((removed_at IS NULL) = (removed_by IS NULL)),
    CONSTRAINT voided_says_by_whom_and_why CHECK (
        (voided_at IS NULL) = (voided_by IS NULL)
        AND (voided_at IS NULL) = (void_reason IS NULL)
    ),
    CONSTRAINT removed_or_voided_not_both CHECK (removed_at IS NULL OR voided_at IS NULL)
);
COMMENT ON TABLE outbox.archive_audit IS
'One row per archived day of outbox.events or inbox.messages: the figures the rows were removed against.';

-- One standing (not voided) audit per unit: a second archive of a day must
-- go through void_archive, and a removed day can never be archived again
-- (its archive would be overwritten).
CREATE UNIQUE INDEX IF NOT EXISTS archive_audit_one_standing_per_day
ON outbox.archive_audit (source, day) WHERE voided_at IS NULL;

-- Audit rows are evidence: inserted, then marked removed or voided once.
CREATE OR REPLACE FUNCTION outbox.tg_archive_audit__guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'UPDATE'
        AND (NEW.id, NEW.source, NEW.day, NEW.relation, NEW.row_count, NEW.checksum,
            NEW.archive_uri, NEW.archived_at, NEW.archived_by)
        IS NOT DISTINCT FROM
        (OLD.id, OLD.source, OLD.day, OLD.relation, OLD.row_count, OLD.checksum,
            OLD.archive_uri, OLD.archived_at, OLD.archived_by)
        AND OLD.removed_at IS NULL AND OLD.voided_at IS NULL THEN
        RETURN NEW;  -- marking a standing audit removed or voided
    END IF;
    RAISE EXCEPTION 'AUDIT_IMMUTABLE: archive audit rows are only marked removed or voided, once'
        USING ERRCODE = 'OB060';
END;
$$;

CREATE OR REPLACE TRIGGER _100_guard_update
BEFORE UPDATE ON outbox.archive_audit
FOR EACH ROW EXECUTE FUNCTION outbox.tg_archive_audit__guard();

CREATE OR REPLACE TRIGGER _100_forbid_delete
BEFORE DELETE ON outbox.archive_audit
FOR EACH ROW EXECUTE FUNCTION outbox.tg_archive_audit__guard();

CREATE OR REPLACE TRIGGER _100_forbid_truncate
BEFORE TRUNCATE ON outbox.archive_audit
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_archive_audit__guard();

-- The inbox retention floor. One row; only admins change it (set_stream_max_age),
-- so an archiver cannot lower it for its own session.
CREATE TABLE IF NOT EXISTS inbox.retention_policy (
    singleton boolean PRIMARY KEY DEFAULT TRUE,
    stream_max_age interval NOT NULL DEFAULT interval '7 days',
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL DEFAULT session_user,
    CONSTRAINT one_row_only CHECK (singleton),
    CONSTRAINT stream_max_age_is_positive CHECK (stream_max_age > interval '0')
);
COMMENT ON TABLE inbox.retention_policy IS
'Longest max_age of the streams feeding this inbox: inbox rows are never removed younger than that.';
INSERT INTO inbox.retention_policy (singleton) VALUES (TRUE) ON CONFLICT DO NOTHING;

-- Day ranges of the inbox (the archive reads, and purge deletes, by received_at).
CREATE INDEX IF NOT EXISTS messages_received_at_idx ON inbox.messages (received_at);

-- Rows leave inbox.messages only through inbox.purge_archived(), which sets
-- pgoutbox.inbox_purge for its own transaction. TRUNCATE never.
CREATE OR REPLACE FUNCTION inbox.tg_messages__forbid_delete()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'TRUNCATE'
        OR current_setting('pgoutbox.inbox_purge', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'DELETE_FORBIDDEN: rows leave inbox.messages only by audited archival (inbox.purge_archived)'
            USING ERRCODE = 'OB012';
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER _100_forbid_delete
BEFORE DELETE ON inbox.messages
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_messages__forbid_delete();

CREATE OR REPLACE TRIGGER _100_forbid_truncate
BEFORE TRUNCATE ON inbox.messages
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_messages__forbid_delete();

-- Installed on a partition by seal_partition (not on the parent: the hot
-- partitions pay nothing). Fires before the inherited _100 guards.
CREATE OR REPLACE FUNCTION outbox.tg_events__archived_read_only()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'ARCHIVED_READ_ONLY: partition outbox.% is sealed for archival', TG_TABLE_NAME
        USING ERRCODE = 'OB056',
              HINT = 'To change its rows, void the archive first: outbox.void_archive(source, day, reason).';
END;
$$;

-- ---------------------------------------------------------------- helpers

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

-- UTC day bounds.
CREATE OR REPLACE FUNCTION outbox._day_from(day date)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT day::timestamp AT TIME ZONE 'UTC';
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

-- ------------------------------------------------------------- checksum

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
    ORDER BY a.attnum;
END;
$$;
COMMENT ON FUNCTION outbox.checksum_columns(text) IS
'Columns of outbox.events or inbox.messages that enter the archive checksum, in order, with their rendering.';

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
-- or the rows inbox.messages received that UTC day.
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

-- ------------------------------------------------------------ listing

-- Day partitions of outbox.events whose day ended more than `retention` ago,
-- each with what holds it back, if anything. The default partition is never
-- listed: it is not a day, and sealing it would make the rows it exists to
-- catch fail instead.
CREATE OR REPLACE FUNCTION outbox.archivable_partitions(
    retention interval DEFAULT interval '7 days',
    dead_letter_retention interval DEFAULT interval '30 days'
)
RETURNS TABLE (
    partition_name text,
    day date,
    row_count bigint,
    open_rows bigint,
    dead_letters bigint,
    sealed boolean,
    eligible boolean,
    blocked_by text,
    audit_id bigint
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    part text;
BEGIN
    IF retention IS NULL OR retention < interval '0'
        OR dead_letter_retention IS NULL OR dead_letter_retention < interval '0' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: retention and dead_letter_retention must be >= 0'
            USING ERRCODE = 'OB006';
    END IF;
    FOR part IN
        SELECT c.relname::text
        FROM pg_inherits AS i
        INNER JOIN pg_class AS c ON i.inhrelid = c.oid
        WHERE i.inhparent = 'outbox.events'::regclass AND c.relname ~ '^events_p[0-9]{8}$'
        ORDER BY c.relname
    LOOP
        day := outbox._partition_day(part);
        CONTINUE WHEN outbox._day_from(day + 1) > now() - retention;
        partition_name := part;
        EXECUTE format(
            'SELECT count(*),'
            ' count(*) FILTER (WHERE status IN (''PENDING'', ''PROCESSING'', ''FAILED'')),'
            ' count(*) FILTER (WHERE status = ''DEAD_LETTER'') FROM outbox.%I', part
        ) INTO row_count, open_rows, dead_letters;
        sealed := outbox._is_sealed(part);
        blocked_by := CASE
            WHEN open_rows > 0 THEN 'open rows (PENDING, PROCESSING or FAILED)'
            WHEN dead_letters > 0 AND outbox._day_from(day + 1) > now() - dead_letter_retention
                THEN 'dead letters younger than dead_letter_retention'
        END;
        eligible := blocked_by IS NULL;
        SELECT a.id INTO audit_id FROM outbox.archive_audit AS a
        WHERE a.source = 'outbox.events' AND a.day = archivable_partitions.day AND a.voided_at IS NULL;
        RETURN NEXT;
    END LOOP;
END;
$$;
COMMENT ON FUNCTION outbox.archivable_partitions(interval, interval) IS
'Day partitions old enough to archive, with row, open and dead-letter counts and what blocks each.';

-- UTC days of inbox.messages that ended more than `retention` ago. Refuses a
-- retention shorter than the streams' max_age (inbox.retention_policy).
CREATE OR REPLACE FUNCTION inbox.archivable_days(
    retention interval DEFAULT interval '14 days',
    dead_letter_retention interval DEFAULT interval '30 days'
)
RETURNS TABLE (
    day date,
    row_count bigint,
    open_rows bigint,
    dead_letters bigint,
    eligible boolean,
    blocked_by text,
    audit_id bigint
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF dead_letter_retention IS NULL OR dead_letter_retention < interval '0' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: dead_letter_retention must be >= 0'
            USING ERRCODE = 'OB006';
    END IF;
    IF retention IS NULL OR retention < inbox.stream_max_age() THEN
        RAISE EXCEPTION 'RETENTION_BELOW_MAX_AGE: inbox retention % is shorter than the streams'' max_age %', retention, inbox.stream_max_age()
            USING ERRCODE = 'OB057',
                  HINT = 'A redelivered message must find its inbox row; keep inbox rows at least as long as the streams keep messages.';
    END IF;
    RETURN QUERY
    WITH days AS (
        SELECT
            (m.received_at AT TIME ZONE 'UTC')::date AS d,
            count(*) AS n,
            count(*) FILTER (WHERE m.status IN ('RECEIVED', 'FAILED')) AS open_n,
            count(*) FILTER (WHERE m.status = 'DEAD_LETTER') AS dead_n
        FROM inbox.messages AS m
        WHERE m.received_at < now() - retention
        GROUP BY 1
    )
    SELECT
        days.d,
        days.n,
        days.open_n,
        days.dead_n,
        b.why IS NULL,
        b.why,
        a.id
    FROM days
    CROSS JOIN LATERAL (
        SELECT CASE
            WHEN outbox._day_from(days.d + 1) > now() - retention THEN 'day not over by retention yet'
            WHEN days.open_n > 0 THEN 'open rows (RECEIVED or FAILED)'
            WHEN days.dead_n > 0 AND outbox._day_from(days.d + 1) > now() - dead_letter_retention
                THEN 'dead letters younger than dead_letter_retention'
        END AS why
    ) AS b
    LEFT JOIN outbox.archive_audit AS a
        ON a.source = 'inbox.messages' AND a.day = days.d AND a.voided_at IS NULL
    ORDER BY days.d;
END;
$$;
COMMENT ON FUNCTION inbox.archivable_days(interval, interval) IS
'UTC days of inbox.messages old enough to archive (never younger than the streams'' max_age), and what blocks each.';

CREATE OR REPLACE FUNCTION inbox.stream_max_age()
RETURNS interval
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT p.stream_max_age FROM inbox.retention_policy AS p), interval '7 days');
$$;
COMMENT ON FUNCTION inbox.stream_max_age() IS
'The inbox retention floor: the longest max_age of the streams feeding this inbox.';

CREATE OR REPLACE FUNCTION inbox.set_stream_max_age(max_age interval)
RETURNS interval
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF max_age IS NULL OR max_age <= interval '0' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: max_age must be positive' USING ERRCODE = 'OB006';
    END IF;
    INSERT INTO inbox.retention_policy AS p (singleton, stream_max_age)
    VALUES (TRUE, max_age)
    ON CONFLICT (singleton) DO UPDATE
    SET stream_max_age = excluded.stream_max_age, changed_at = now(), changed_by = session_user;
    RETURN max_age;
END;
$$;
COMMENT ON FUNCTION inbox.set_stream_max_age(interval) IS
'Sets the inbox retention floor to the longest max_age of the streams feeding this inbox (admins).';

-- ------------------------------------------------------------ the steps

-- Seals an eligible partition: checks it under a lock that keeps writers
-- out, then installs read-only triggers on it, so nothing can change between
-- the export and the drop (a requeue of one of its dead letters now fails
-- with ARCHIVED_READ_ONLY instead of being lost with the partition), and
-- lets pgoutbox_archiver read it. Idempotent. Returns what the export needs.
CREATE OR REPLACE FUNCTION outbox.seal_partition(
    partition_name text,
    retention interval DEFAULT interval '7 days',
    dead_letter_retention interval DEFAULT interval '30 days',
    lock_timeout interval DEFAULT interval '5 seconds'
)
RETURNS TABLE (
    day date,
    range_from timestamptz,
    range_to timestamptz,
    min_id bigint,
    max_id bigint
)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    has_open boolean;
    has_dead boolean;
BEGIN
    day := outbox._partition_day(partition_name);
    range_from := outbox._day_from(day);
    range_to := outbox._day_from(day + 1);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key('outbox.events', day));
    IF NOT outbox._is_partition(partition_name) THEN
        RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: outbox.events has no partition %', partition_name
            USING ERRCODE = 'OB050';
    END IF;
    IF retention IS NULL OR range_to > now() - retention THEN
        RAISE EXCEPTION 'RETENTION_NOT_REACHED: partition % (day %) is younger than the retention %', partition_name, day, retention
            USING ERRCODE = 'OB052';
    END IF;
    IF NOT outbox._is_sealed(partition_name) THEN
        -- SHARE ROW EXCLUSIVE (what CREATE TRIGGER takes anyway) keeps writers
        -- out from the check to the commit of the triggers.
        PERFORM outbox._with_lock_timeout(
            format('LOCK TABLE outbox.%I IN SHARE ROW EXCLUSIVE MODE', partition_name), lock_timeout
        );
    END IF;
    -- Index lookups only (events_claimable_idx, events_dead_letter_idx, the
    -- primary key): claims and marks lock every partition, so they wait for
    -- as long as this transaction holds the lock. No count here.
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM outbox.%1$I WHERE status IN (''PENDING'', ''FAILED'', ''PROCESSING'')),'
        ' EXISTS (SELECT 1 FROM outbox.%1$I WHERE status = ''DEAD_LETTER''),'
        ' (SELECT min(id) FROM outbox.%1$I), (SELECT max(id) FROM outbox.%1$I)',
        partition_name
    ) INTO has_open, has_dead, min_id, max_id;
    IF has_open THEN
        RAISE EXCEPTION 'NOT_CLOSED: partition % has rows still PENDING, PROCESSING or FAILED', partition_name
            USING ERRCODE = 'OB051', HINT = 'Only partitions whose rows are all terminal are archived.';
    END IF;
    IF has_dead AND (dead_letter_retention IS NULL OR range_to > now() - dead_letter_retention) THEN
        RAISE EXCEPTION 'RETENTION_NOT_REACHED: partition % holds dead letters younger than %', partition_name, dead_letter_retention
            USING ERRCODE = 'OB052', HINT = 'Requeue them (outbox.requeue) or wait for dead_letter_retention.';
    END IF;
    IF NOT outbox._is_sealed(partition_name) THEN
        EXECUTE format(
            'CREATE TRIGGER _050_archived_read_only BEFORE INSERT OR UPDATE OR DELETE ON outbox.%I'
            ' FOR EACH ROW EXECUTE FUNCTION outbox.tg_events__archived_read_only()', partition_name
        );
        EXECUTE format(
            'CREATE TRIGGER _050_archived_no_truncate BEFORE TRUNCATE ON outbox.%I'
            ' FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_events__archived_read_only()', partition_name
        );
        -- The archiver exports the partition itself, the very relation that
        -- is verified and dropped; it may read no other partition directly.
        EXECUTE format('GRANT SELECT ON outbox.%I TO pgoutbox_archiver', partition_name);
    END IF;
    RETURN NEXT;
END;
$$;
COMMENT ON FUNCTION outbox.seal_partition(text, interval, interval, interval) IS
'Checks a day partition is archivable and makes it read-only; returns its range and id bounds.';

-- Bounds for the report's parallel reads of the live tables (index lookups).
CREATE OR REPLACE FUNCTION outbox.id_range()
RETURNS TABLE (min_id bigint, max_id bigint)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT min(e.id), max(e.id) FROM outbox.events AS e;
$$;

CREATE OR REPLACE FUNCTION inbox.received_range()
RETURNS TABLE (min_received_at timestamptz, max_received_at timestamptz)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT min(m.received_at), max(m.received_at) FROM inbox.messages AS m;
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

CREATE OR REPLACE FUNCTION inbox._check_floor(day date)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF outbox._day_from(day + 1) > now() - inbox.stream_max_age() THEN
        RAISE EXCEPTION 'RETENTION_BELOW_MAX_AGE: inbox day % is younger than the streams'' max_age %', day, inbox.stream_max_age()
            USING ERRCODE = 'OB057';
    END IF;
END;
$$;

-- The audit row that a removal is checked against; OB054 without one.
CREATE OR REPLACE FUNCTION outbox._standing_audit(source text, day date)
RETURNS outbox.archive_audit
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    standing outbox.archive_audit;
    live record;
BEGIN
    SELECT * INTO standing FROM outbox.archive_audit AS a
    WHERE a.source = _standing_audit.source AND a.day = _standing_audit.day AND a.voided_at IS NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'NOT_ARCHIVED: % % has no audit row', source, day
            USING ERRCODE = 'OB054', HINT = 'Rows are removed only after an audited export.';
    END IF;
    IF standing.removed_at IS NULL THEN
        SELECT * INTO live FROM outbox.archive_figures(source, day);
        IF (live.row_count, live.checksum) IS DISTINCT FROM (standing.row_count, standing.checksum) THEN
            RAISE EXCEPTION 'ARCHIVE_MISMATCH: % % changed since audit %', source, day, standing.id
                USING ERRCODE = 'OB053',
                      DETAIL = format('audit: %s rows, checksum %s; live: %s rows, checksum %s',
                          standing.row_count, standing.checksum, live.row_count, live.checksum),
                      HINT = 'Nothing was removed. Find out who changed it; void the audit to archive it again.';
        END IF;
    END IF;
    RETURN standing;
END;
$$;

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

-- Deletes an audited inbox day in one statement, hashing exactly the rows
-- it deletes (DELETE ... RETURNING), and rolls back unless they match the
-- audit row: a row changed, added or removed since the audit aborts it.
-- Already purged: returns 0.
CREATE OR REPLACE FUNCTION inbox.purge_archived(day date)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    standing outbox.archive_audit;
    n bigint;
    sum_hash numeric;
BEGIN
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key('inbox.messages', day));
    standing := outbox._standing_audit('inbox.messages', day);
    IF standing.removed_at IS NOT NULL THEN
        RETURN 0;
    END IF;
    PERFORM inbox._check_floor(day);
    PERFORM set_config('pgoutbox.inbox_purge', 'on', true);
    EXECUTE format(
        'WITH gone AS (DELETE FROM inbox.messages AS m'
        ' WHERE m.received_at >= $1 AND m.received_at < $2 RETURNING m.*)'
        ' SELECT count(*), coalesce(sum(%s), 0)::numeric FROM gone AS r',
        outbox._row_hash_sql('inbox.messages')
    ) INTO n, sum_hash USING outbox._day_from(day), outbox._day_from(day + 1);
    PERFORM set_config('pgoutbox.inbox_purge', '', true);
    IF (n, sum_hash) IS DISTINCT FROM (standing.row_count, standing.checksum) THEN
        RAISE EXCEPTION 'ARCHIVE_MISMATCH: inbox day % changed since audit %', day, standing.id
            USING ERRCODE = 'OB053',
                  DETAIL = format('audit: %s rows, checksum %s; deleting: %s rows, checksum %s',
                      standing.row_count, standing.checksum, n, sum_hash),
                  HINT = 'Nothing was removed (the delete is rolled back).';
    END IF;
    UPDATE outbox.archive_audit SET removed_at = now(), removed_by = session_user
    WHERE id = standing.id;
    RETURN n;
END;
$$;
COMMENT ON FUNCTION inbox.purge_archived(date) IS
'Deletes an audited inbox day whose deleted rows hash exactly to its audit row; all or nothing.';

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
    IF nullif(btrim(reason), '') IS NULL THEN
        RAISE EXCEPTION 'REASON_REQUIRED: voiding an archive needs a reason' USING ERRCODE = 'OB014';
    END IF;
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

CREATE OR REPLACE FUNCTION outbox.archive_audits(source text DEFAULT NULL)
RETURNS SETOF outbox.archive_audit
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT * FROM outbox.archive_audit AS a
    WHERE archive_audits.source IS NULL OR a.source = archive_audits.source
    ORDER BY a.source, a.day, a.id;
$$;
COMMENT ON FUNCTION outbox.archive_audits(text) IS
'Every archive audit row (standing, removed and voided), by source and day.';

-- Session-level: held by one archiver for a whole unit; released by
-- unlock_archive or when its connection ends (a crash frees it).
CREATE OR REPLACE FUNCTION outbox.try_lock_archive(source text, day date)
RETURNS boolean
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT pg_try_advisory_lock(outbox._archive_lock_key(source, day));
$$;

CREATE OR REPLACE FUNCTION outbox.unlock_archive(source text, day date)
RETURNS boolean
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT pg_advisory_unlock(outbox._archive_lock_key(source, day));
$$;

-- ------------------------------------------------------------ roles

-- pgoutbox_archiver: what the archival job and the report need, nothing more.
-- It reads the two tables and the partitions it sealed (Spark reads them over
-- JDBC) and calls the archival steps; it cannot write or delete rows, nor
-- void an audit.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgoutbox_archiver') THEN
        CREATE ROLE pgoutbox_archiver NOLOGIN;
    END IF;
END;
$$;

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox, inbox FROM public;

GRANT USAGE ON SCHEMA outbox, inbox TO pgoutbox_archiver;
GRANT SELECT ON outbox.events, inbox.messages TO pgoutbox_archiver;
GRANT SELECT ON outbox.archive_audit, inbox.retention_policy TO pgoutbox_admin;

GRANT EXECUTE ON FUNCTION
outbox.checksum_columns(text),
outbox.archive_figures(text, date),
outbox.archivable_partitions(interval, interval),
inbox.archivable_days(interval, interval),
inbox.stream_max_age(),
outbox.seal_partition(text, interval, interval, interval),
outbox.id_range(),
inbox.received_range(),
outbox.record_archive(text, date, bigint, numeric, text),
outbox.drop_archived(text, interval),
inbox.purge_archived(date),
outbox.archive_audits(text),
outbox.try_lock_archive(text, date),
outbox.unlock_archive(text, date)
TO pgoutbox_archiver, pgoutbox_admin;

GRANT EXECUTE ON FUNCTION
outbox.void_archive(text, date, text, interval),
inbox.set_stream_max_age(interval)
TO pgoutbox_admin;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (3, '0003_archival')
ON CONFLICT (version) DO NOTHING;

COMMIT;
