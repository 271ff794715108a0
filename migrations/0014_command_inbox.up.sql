-- 0014_command_inbox (up): the command inbox (sql/65_inbox_commands.sql).
--
--   * inbox.commands: one row per (handler, command_key), IN_PROGRESS ->
--     DONE | FAILED, FAILED -> IN_PROGRESS (claimed again); guarded updates,
--     no DELETE or TRUNCATE (keys leave only by audited archival).
--   * inbox.claim_command(), complete_command(), fail_command() and
--     lookup_command(), called by applications inside their own
--     transactions: granted to pgoutbox_writer; admins may read the table.
--   * keys expire only by audited archival: inbox.commands becomes an
--     archival source (archive_audit.source_is_known swapped), days of keys
--     by first_claimed_at (index), inbox.command_policy (the clients' retry
--     window, the retention floor), archivable_command_days(),
--     purge_archived_commands(); _archive_source, archive_figures and
--     record_archive learn the source. The archiver reads inbox.commands.
--
-- Expand only: new tables, a wider CHECK and new functions; workers of
-- release 0.3.0 (schema 11) run on it unchanged.
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 13 or 14.
-- Catalog changes only: no row is rewritten (the new CHECK reads the
-- archive audit rows, a few per day).

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0014 needs 0001 to 0013 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (13, 14) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0014 applies on version 13 (or re-runs on 14) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

CREATE TABLE IF NOT EXISTS inbox.commands (
    handler text NOT NULL,
    command_key text NOT NULL,
    status text NOT NULL DEFAULT 'IN_PROGRESS',
    result jsonb,
    last_error text,
    attempts integer NOT NULL DEFAULT 1,
    first_claimed_at timestamptz NOT NULL DEFAULT now(),
    claimed_at timestamptz NOT NULL DEFAULT now(),
    claimed_by text NOT NULL DEFAULT session_user,
    settled_at timestamptz,
    PRIMARY KEY (handler, command_key),
    CONSTRAINT command_status_is_known CHECK (status IN ('IN_PROGRESS', 'DONE', 'FAILED')),
    CONSTRAINT command_handler_is_named CHECK (handler ~ '^[A-Za-z0-9_.-]{1,128}$'),
    CONSTRAINT command_key_is_given CHECK (
        btrim(command_key) <> '' AND length(command_key) <= 256
    ),
    CONSTRAINT command_attempts_is_positive CHECK (attempts >= 1),
    CONSTRAINT command_claimed_not_before_first CHECK (claimed_at >= first_claimed_at),
    CONSTRAINT command_settled_iff_not_in_progress CHECK (
        (status = 'IN_PROGRESS') = (settled_at IS NULL)
    ),
    CONSTRAINT command_settled_not_before_claimed CHECK (
        settled_at IS NULL OR settled_at >= claimed_at
    ),
    CONSTRAINT command_result_iff_done CHECK ((status = 'DONE') = (result IS NOT NULL)),
    CONSTRAINT command_failed_has_an_error CHECK (status <> 'FAILED' OR last_error IS NOT NULL)
);
COMMENT ON TABLE inbox.commands IS
'Command inbox keyed by (handler, command_key): the first claim does the work, later claims get its result.';

CREATE OR REPLACE FUNCTION inbox.tg_commands__guard_update()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF (NEW.handler, NEW.command_key, NEW.first_claimed_at)
        IS DISTINCT FROM (OLD.handler, OLD.command_key, OLD.first_claimed_at) THEN
        RAISE EXCEPTION 'IMMUTABLE_COMMAND: command % for handler % keeps its key and first claim', OLD.command_key, OLD.handler
            USING ERRCODE = 'OB011';
    END IF;
    IF NEW IS NOT DISTINCT FROM OLD
        OR (OLD.status, NEW.status) IN (
            ('IN_PROGRESS', 'DONE'), ('IN_PROGRESS', 'FAILED'), ('FAILED', 'IN_PROGRESS')
        ) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'ILLEGAL_TRANSITION: command % for handler % cannot move from % to %', OLD.command_key, OLD.handler, OLD.status, NEW.status
        USING ERRCODE = 'OB010';
END;
$$;

CREATE OR REPLACE TRIGGER _100_guard_update
BEFORE UPDATE ON inbox.commands
FOR EACH ROW EXECUTE FUNCTION inbox.tg_commands__guard_update();

-- No ad-hoc removal: a key that disappears lets its command run twice.
-- Rows leave only through inbox.purge_archived_commands(), which sets
-- pgoutbox.command_purge for its own transaction. TRUNCATE never.
CREATE OR REPLACE FUNCTION inbox.tg_commands__forbid_delete()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'TRUNCATE'
        OR current_setting('pgoutbox.command_purge', true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'DELETE_FORBIDDEN: rows leave inbox.commands only by audited archival (inbox.purge_archived_commands)'
            USING ERRCODE = 'OB012';
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER _100_forbid_delete
BEFORE DELETE ON inbox.commands
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_commands__forbid_delete();

CREATE OR REPLACE TRIGGER _100_forbid_truncate
BEFORE TRUNCATE ON inbox.commands
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_commands__forbid_delete();

-- The command a call is about: a handler name like the message inbox's, and
-- a key of 1-256 characters that is not blank.
CREATE OR REPLACE FUNCTION inbox._check_command(handler text, command_key text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF handler IS NULL OR handler !~ '^[A-Za-z0-9_.-]{1,128}$' THEN
        RAISE EXCEPTION 'INVALID_COMMAND: handler % is not a name of 1-128 letters, digits, _ . -', quote_literal(left(coalesce(handler, 'NULL'), 150))
            USING ERRCODE = 'OB080';
    END IF;
    IF nullif(btrim(command_key), '') IS NULL OR length(command_key) > 256 THEN
        RAISE EXCEPTION 'INVALID_COMMAND: command_key % is not a key of 1-256 characters', quote_literal(left(coalesce(command_key, 'NULL'), 150))
            USING ERRCODE = 'OB080';
    END IF;
END;
$$;

-- Claims a command key for a handler, in the caller's transaction. claimed
-- is true when this call holds the command: the first claim, or a claim
-- after the command FAILED (a client's retry is expected to run it again;
-- attempts counts the claims). Otherwise the row as committed comes back:
-- IN_PROGRESS (the first claim committed before its result), or DONE with
-- its result. A claim of a key whose first claim is still uncommitted waits
-- for it (see the top of this file). Call it in READ COMMITTED, the default:
-- under REPEATABLE READ or SERIALIZABLE the waiting claim fails with a
-- serialization error (40001), and a retry of the transaction sees the row.
CREATE OR REPLACE FUNCTION inbox.claim_command(handler text, command_key text)
RETURNS TABLE (
    claimed boolean,
    status text,
    result jsonb,
    last_error text,
    attempts integer,
    first_claimed_at timestamptz,
    settled_at timestamptz
)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.commands;
BEGIN
    PERFORM inbox._check_command(handler, command_key);
    claimed := TRUE;
    LOOP
        INSERT INTO inbox.commands AS c (handler, command_key)
        VALUES (claim_command.handler, claim_command.command_key)
        ON CONFLICT ON CONSTRAINT commands_pkey DO NOTHING
        RETURNING * INTO row;
        EXIT WHEN FOUND;
        -- Waits on a concurrent re-claim's row lock, then re-reads the row:
        -- only one of two retries of a FAILED command claims it.
        UPDATE inbox.commands AS c
        SET status = 'IN_PROGRESS', attempts = c.attempts + 1, claimed_at = greatest(now(), c.claimed_at),
            claimed_by = session_user, settled_at = NULL
        WHERE c.handler = claim_command.handler AND c.command_key = claim_command.command_key
            AND c.status = 'FAILED'
        RETURNING * INTO row;
        EXIT WHEN FOUND;
        SELECT * INTO row FROM inbox.commands AS c
        WHERE c.handler = claim_command.handler AND c.command_key = claim_command.command_key;
        IF FOUND THEN
            claimed := FALSE;
            EXIT;
        END IF;
        -- The key's day was purged (audited archival) after the INSERT met
        -- its row: the key is new again, so claim it afresh.
    END LOOP;
    status := row.status;
    result := row.result;
    last_error := row.last_error;
    attempts := row.attempts;
    first_claimed_at := row.first_claimed_at;
    settled_at := row.settled_at;
    RETURN NEXT;
END;
$$;
COMMENT ON FUNCTION inbox.claim_command(text, text) IS
'Claims a command key: claimed = true for the first claim (or one after FAILED), else the stored status and result.';

-- Why a guarded command move matched no row: unknown key, or wrong state.
CREATE OR REPLACE FUNCTION inbox._refuse_command_move(handler text, command_key text, target text)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    current_status text;
BEGIN
    SELECT c.status INTO current_status FROM inbox.commands AS c
    WHERE c.handler = _refuse_command_move.handler AND c.command_key = _refuse_command_move.command_key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'UNKNOWN_COMMAND: no command % for handler %', quote_literal(left(command_key, 150)), handler
            USING ERRCODE = 'OB081', HINT = 'Call inbox.claim_command() first.';
    END IF;
    RAISE EXCEPTION 'ILLEGAL_TRANSITION: command % for handler % cannot move from % to %', quote_literal(left(command_key, 150)), handler, current_status, target
        USING ERRCODE = 'OB010';
END;
$$;

-- Stores a claimed command's result: IN_PROGRESS -> DONE. Every later claim
-- returns this result. At most 1 MiB of JSON: it is an answer, not a store.
CREATE OR REPLACE FUNCTION inbox.complete_command(handler text, command_key text, result jsonb)
RETURNS inbox.commands
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.commands;
BEGIN
    PERFORM inbox._check_command(handler, command_key);
    IF result IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: a result is required (JSON null is one)' USING ERRCODE = 'OB006';
    END IF;
    IF octet_length(result::text) > 1048576 THEN
        RAISE EXCEPTION 'VALUE_TOO_LARGE: result is % bytes of JSON, more than 1048576 (1 MiB)', octet_length(result::text)
            USING ERRCODE = 'OB009';
    END IF;
    UPDATE inbox.commands AS c
    SET status = 'DONE', result = complete_command.result, settled_at = greatest(now(), c.claimed_at)
    WHERE c.handler = complete_command.handler AND c.command_key = complete_command.command_key
        AND c.status = 'IN_PROGRESS'
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_command_move(handler, command_key, 'DONE');
    END IF;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.complete_command(text, text, jsonb) IS
'IN_PROGRESS -> DONE with the command''s result, which every later claim returns.';

-- Records that a claimed command's work failed: IN_PROGRESS -> FAILED. The
-- next claim of the key claims it again (a retry runs the command again).
-- Also the way out for a command left IN_PROGRESS by a crash between two
-- transactions (claim committed, work never finished).
CREATE OR REPLACE FUNCTION inbox.fail_command(handler text, command_key text, error text)
RETURNS inbox.commands
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.commands;
BEGIN
    PERFORM inbox._check_command(handler, command_key);
    IF nullif(btrim(error), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: an error text is required' USING ERRCODE = 'OB006';
    END IF;
    UPDATE inbox.commands AS c
    SET status = 'FAILED', last_error = outbox._clip_error(fail_command.error),
        settled_at = greatest(now(), c.claimed_at)
    WHERE c.handler = fail_command.handler AND c.command_key = fail_command.command_key
        AND c.status = 'IN_PROGRESS'
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_command_move(handler, command_key, 'FAILED');
    END IF;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.fail_command(text, text, text) IS
'IN_PROGRESS -> FAILED with an error; the next claim of the key claims it again.';

-- The command as committed (no row for an unknown key); does not wait.
CREATE OR REPLACE FUNCTION inbox.lookup_command(handler text, command_key text)
RETURNS SETOF inbox.commands
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_command(handler, command_key);
    RETURN QUERY
    SELECT * FROM inbox.commands AS c
    WHERE c.handler = lookup_command.handler AND c.command_key = lookup_command.command_key;
END;
$$;
COMMENT ON FUNCTION inbox.lookup_command(text, text) IS
'The command row for a handler and key as committed; no row when the key was never claimed.';

-- ---- Keys leave only by audited archival: inbox.commands becomes a source.

ALTER TABLE outbox.archive_audit DROP CONSTRAINT IF EXISTS source_is_known;
ALTER TABLE outbox.archive_audit ADD CONSTRAINT source_is_known CHECK (
    source IN ('outbox.events', 'inbox.messages', 'inbox.commands')
);
COMMENT ON TABLE outbox.archive_audit IS
'One row per archived day of outbox.events, inbox.messages or inbox.commands: the figures its rows left against.';

CREATE TABLE IF NOT EXISTS inbox.command_policy (
    singleton boolean PRIMARY KEY DEFAULT TRUE,
    retry_window interval NOT NULL DEFAULT interval '7 days',
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL DEFAULT session_user,
    CONSTRAINT one_row_only CHECK (singleton),
    CONSTRAINT retry_window_is_positive CHECK (retry_window > interval '0')
);
COMMENT ON TABLE inbox.command_policy IS
'Longest time a client may retry a command: command keys are never removed sooner after they settled.';
INSERT INTO inbox.command_policy (singleton) VALUES (TRUE) ON CONFLICT DO NOTHING;

CREATE INDEX IF NOT EXISTS commands_first_claimed_at_idx ON inbox.commands (first_claimed_at);

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
    ELSIF source = 'inbox.messages' THEN
        RETURN QUERY EXECUTE format(
            'SELECT count(*), coalesce(sum(%s), 0)::numeric FROM inbox.messages AS r'
            ' WHERE r.received_at >= $1 AND r.received_at < $2',
            outbox._row_hash_sql(source)
        ) USING outbox._day_from(day), outbox._day_from(day + 1);
    ELSE
        RETURN QUERY EXECUTE format(
            'SELECT count(*), coalesce(sum(%s), 0)::numeric FROM inbox.commands AS r'
            ' WHERE r.first_claimed_at >= $1 AND r.first_claimed_at < $2',
            outbox._row_hash_sql(source)
        ) USING outbox._day_from(day), outbox._day_from(day + 1);
    END IF;
END;
$$;
COMMENT ON FUNCTION outbox.archive_figures(text, date) IS
'Live row count and checksum of one day of outbox.events (its partition), inbox.messages or inbox.commands.';

-- UTC days of inbox.commands (by first_claimed_at) that ended more than
-- `retention` ago. A day is eligible once none of its keys is IN_PROGRESS
-- and every key settled (DONE or FAILED) more than `retention` ago: a key
-- answers a client's retry for at least that long after its last outcome.
-- Refuses a retention shorter than the clients' retry window
-- (inbox.command_policy).
CREATE OR REPLACE FUNCTION inbox.archivable_command_days(retention interval DEFAULT interval '30 days')
RETURNS TABLE (
    day date,
    row_count bigint,
    open_rows bigint,
    failed_rows bigint,
    eligible boolean,
    blocked_by text,
    audit_id bigint
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF retention > interval '100 years' THEN
        PERFORM outbox._check_retention(retention, 'retention');
    END IF;
    IF retention IS NULL OR retention < inbox.command_retry_window() THEN
        RAISE EXCEPTION 'RETENTION_BELOW_MAX_AGE: command retention % is shorter than the clients'' retry window %', retention, inbox.command_retry_window()
            USING ERRCODE = 'OB057',
                  HINT = 'A retried command must find its key; keep keys at least as long as clients retry (inbox.set_command_retry_window).';
    END IF;
    RETURN QUERY
    WITH days AS (
        SELECT
            (c.first_claimed_at AT TIME ZONE 'UTC')::date AS d,
            count(*) AS n,
            count(*) FILTER (WHERE c.status = 'IN_PROGRESS') AS open_n,
            count(*) FILTER (WHERE c.status = 'FAILED') AS failed_n,
            max(c.settled_at) AS last_settled
        FROM inbox.commands AS c
        WHERE c.first_claimed_at < now() - retention
        GROUP BY 1
    )
    SELECT
        days.d,
        days.n,
        days.open_n,
        days.failed_n,
        b.why IS NULL,
        b.why,
        a.id
    FROM days
    CROSS JOIN LATERAL (
        SELECT CASE
            WHEN outbox._day_from(days.d + 1) > now() - retention THEN 'day not over by retention yet'
            WHEN days.open_n > 0 THEN 'open rows (IN_PROGRESS)'
            WHEN days.last_settled > now() - retention THEN 'keys settled within the retention'
        END AS why
    ) AS b
    LEFT JOIN outbox.archive_audit AS a
        ON a.source = 'inbox.commands' AND a.day = days.d AND a.voided_at IS NULL
    ORDER BY days.d;
END;
$$;
COMMENT ON FUNCTION inbox.archivable_command_days(interval) IS
'UTC days of inbox.commands old enough to archive (keys settled longer ago than the retention), and what blocks each.';

CREATE OR REPLACE FUNCTION inbox.command_retry_window()
RETURNS interval
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT p.retry_window FROM inbox.command_policy AS p), interval '7 days');
$$;
COMMENT ON FUNCTION inbox.command_retry_window() IS
'The command retention floor: the longest time a client may retry a command.';

CREATE OR REPLACE FUNCTION inbox.set_command_retry_window(retry_window interval)
RETURNS interval
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF retry_window IS NULL OR retry_window <= interval '0' OR retry_window > interval '100 years' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: retry_window must be positive and at most 100 years, got %', retry_window
            USING ERRCODE = 'OB006';
    END IF;
    INSERT INTO inbox.command_policy AS p (singleton, retry_window)
    VALUES (TRUE, set_command_retry_window.retry_window)
    ON CONFLICT (singleton) DO UPDATE
    SET retry_window = excluded.retry_window, changed_at = now(), changed_by = session_user;
    RETURN retry_window;
END;
$$;
COMMENT ON FUNCTION inbox.set_command_retry_window(interval) IS
'Sets the command retention floor to the longest time a client may retry a command (admins).';

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
    IF source = 'inbox.commands' THEN
        PERFORM inbox._check_command_floor(day);
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

-- A day of command keys may leave only once none is IN_PROGRESS (OB051)
-- and every one settled longer ago than the clients' retry window (OB057),
-- whatever retention the caller listed with.
CREATE OR REPLACE FUNCTION inbox._check_command_floor(day date)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    open_rows bigint;
    last_settled timestamptz;
BEGIN
    IF outbox._day_from(day + 1) > now() - inbox.command_retry_window() THEN
        RAISE EXCEPTION 'RETENTION_BELOW_MAX_AGE: command day % is younger than the clients'' retry window %', day, inbox.command_retry_window()
            USING ERRCODE = 'OB057';
    END IF;
    SELECT count(*) FILTER (WHERE c.status = 'IN_PROGRESS'), max(c.settled_at)
    INTO open_rows, last_settled
    FROM inbox.commands AS c
    WHERE c.first_claimed_at >= outbox._day_from(day) AND c.first_claimed_at < outbox._day_from(day + 1);
    IF open_rows > 0 THEN
        RAISE EXCEPTION 'NOT_CLOSED: command day % has % key(s) still IN_PROGRESS', day, open_rows
            USING ERRCODE = 'OB051', HINT = 'Settle them: inbox.complete_command() or inbox.fail_command().';
    END IF;
    IF last_settled > now() - inbox.command_retry_window() THEN
        RAISE EXCEPTION 'RETENTION_BELOW_MAX_AGE: command day % has keys settled within the clients'' retry window %', day, inbox.command_retry_window()
            USING ERRCODE = 'OB057';
    END IF;
END;
$$;

-- Deletes an audited day of command keys like purge_archived does an inbox
-- day: one statement, hashing exactly the rows it deletes, rolled back
-- unless they match the audit row (a key claimed again since the audit
-- aborts it). A claim waiting on a deleted key claims it afresh
-- (claim_command). Already purged: returns 0.
CREATE OR REPLACE FUNCTION inbox.purge_archived_commands(day date)
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
    PERFORM outbox._check_day(day);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key('inbox.commands', day));
    standing := outbox._standing_audit('inbox.commands', day);
    IF standing.removed_at IS NOT NULL THEN
        RETURN 0;
    END IF;
    PERFORM inbox._check_command_floor(day);
    PERFORM set_config('pgoutbox.command_purge', 'on', true);
    EXECUTE format(
        'WITH gone AS (DELETE FROM inbox.commands AS c'
        ' WHERE c.first_claimed_at >= $1 AND c.first_claimed_at < $2 RETURNING c.*)'
        ' SELECT count(*), coalesce(sum(%s), 0)::numeric FROM gone AS r',
        outbox._row_hash_sql('inbox.commands')
    ) INTO n, sum_hash USING outbox._day_from(day), outbox._day_from(day + 1);
    PERFORM set_config('pgoutbox.command_purge', '', true);
    IF (n, sum_hash) IS DISTINCT FROM (standing.row_count, standing.checksum) THEN
        RAISE EXCEPTION 'ARCHIVE_MISMATCH: command day % changed since audit %', day, standing.id
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
COMMENT ON FUNCTION inbox.purge_archived_commands(date) IS
'Deletes an audited day of command keys whose deleted rows hash exactly to its audit row; all or nothing.';

REVOKE ALL ON FUNCTION inbox.tg_commands__guard_update() FROM public;
REVOKE ALL ON FUNCTION inbox.tg_commands__forbid_delete() FROM public;
REVOKE ALL ON FUNCTION inbox._check_command(text, text) FROM public;
REVOKE ALL ON FUNCTION inbox._refuse_command_move(text, text, text) FROM public;
REVOKE ALL ON FUNCTION inbox.claim_command(text, text) FROM public;
REVOKE ALL ON FUNCTION inbox.complete_command(text, text, jsonb) FROM public;
REVOKE ALL ON FUNCTION inbox.fail_command(text, text, text) FROM public;
REVOKE ALL ON FUNCTION inbox.lookup_command(text, text) FROM public;
GRANT EXECUTE ON FUNCTION
inbox.claim_command(text, text),
inbox.complete_command(text, text, jsonb),
inbox.fail_command(text, text, text),
inbox.lookup_command(text, text)
TO pgoutbox_writer;
GRANT SELECT ON inbox.commands TO pgoutbox_admin;
REVOKE ALL ON FUNCTION inbox.archivable_command_days(interval) FROM public;
REVOKE ALL ON FUNCTION inbox.command_retry_window() FROM public;
REVOKE ALL ON FUNCTION inbox.set_command_retry_window(interval) FROM public;
REVOKE ALL ON FUNCTION inbox._check_command_floor(date) FROM public;
REVOKE ALL ON FUNCTION inbox.purge_archived_commands(date) FROM public;
GRANT SELECT ON inbox.commands TO pgoutbox_archiver;
GRANT SELECT ON inbox.command_policy TO pgoutbox_admin;
GRANT EXECUTE ON FUNCTION
inbox.archivable_command_days(interval),
inbox.command_retry_window(),
inbox.purge_archived_commands(date)
TO pgoutbox_archiver, pgoutbox_admin;
GRANT EXECUTE ON FUNCTION inbox.set_command_retry_window(interval) TO pgoutbox_admin;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (14, '0014_command_inbox')
ON CONFLICT (version) DO NOTHING;

COMMIT;
