-- 0018_steady_under_faults (down): back to version 17.
--
-- What it cannot undo: the console's bulk actions of 0018 (outbox.dlq_actions and
-- their targets: bookkeeping, not events or messages) are dropped; nothing else is lost.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 18) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

-- ---- one home for each SQL shape

-- The definitions of version 17, each written out again, then the shared
-- helpers go.

CREATE OR REPLACE FUNCTION outbox.set_notify_throttle(throttle interval)
RETURNS interval
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF throttle IS NULL OR throttle < interval '0' OR throttle > interval '1 minute' THEN
        RAISE EXCEPTION 'INVALID_SETTING: notify_throttle % is not an interval from 0 to 1 minute', coalesce(throttle::text, 'NULL')
            USING ERRCODE = 'OB007';
    END IF;
    INSERT INTO outbox.wakeup_policy AS p (singleton, notify_throttle)
    VALUES (TRUE, throttle)
    ON CONFLICT (singleton) DO UPDATE
    SET notify_throttle = excluded.notify_throttle, changed_at = now(), changed_by = session_user;
    RETURN throttle;
END;
$$;
COMMENT ON FUNCTION outbox.set_notify_throttle(interval) IS
'Sets the minimum gap between two wake-ups for every writer (admins); relays read it at start-up.';

CREATE OR REPLACE FUNCTION inbox.set_stream_max_age(max_age interval)
RETURNS interval
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF max_age IS NULL OR max_age <= interval '0' OR max_age > interval '100 years' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: max_age must be positive and at most 100 years, got %', max_age
            USING ERRCODE = 'OB006';
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
    PERFORM outbox._check_day(day);
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

-- The exact number of rows an action would touch now, over all its batches.
CREATE OR REPLACE FUNCTION outbox.dlq_count(
    filter jsonb DEFAULT '{}'::jsonb,
    action text DEFAULT 'replay'
)
RETURNS bigint
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_dlq_filter(filter);
    IF action IS NULL OR action NOT IN ('replay', 'discard', 'restore') THEN
        RAISE EXCEPTION 'INVALID_ACTION: action must be replay, discard or restore, got %', quote_literal(left(coalesce(action, 'NULL'), 50))
            USING ERRCODE = 'OB106';
    END IF;
    RETURN (SELECT count(*) FROM outbox._dlq_targets(filter, action));
END;
$$;
COMMENT ON FUNCTION outbox.dlq_count(jsonb, text) IS
'How many dead letters outbox.dlq_replay / dlq_discard / dlq_restore would touch for this filter (all batches).';

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
BEFORE DELETE ON inbox.messages
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_messages__forbid_delete();

CREATE OR REPLACE TRIGGER _100_forbid_truncate
BEFORE TRUNCATE ON inbox.messages
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_messages__forbid_delete();

CREATE OR REPLACE TRIGGER _100_forbid_delete
BEFORE DELETE ON inbox.commands
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_commands__forbid_delete();

CREATE OR REPLACE TRIGGER _100_forbid_truncate
BEFORE TRUNCATE ON inbox.commands
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_commands__forbid_delete();

REVOKE ALL ON FUNCTION inbox.tg_messages__forbid_delete(), inbox.tg_commands__forbid_delete() FROM public;

DROP FUNCTION IF EXISTS inbox.tg_forbid_delete();
DROP FUNCTION IF EXISTS inbox._purge_audited(text, date);
DROP FUNCTION IF EXISTS outbox._day_column(text);
DROP FUNCTION IF EXISTS outbox._set_policy(text, text, interval);
DROP FUNCTION IF EXISTS outbox._check_dlq_action(text, boolean);
DROP FUNCTION IF EXISTS outbox._stale_claim(uuid, uuid[], boolean);
DROP FUNCTION IF EXISTS outbox._check_claim(uuid, uuid[]);
DROP FUNCTION IF EXISTS inbox._settle_command(text, text, text, jsonb, text);

-- ---- one home for each SQL shape, outbox and archival side

-- The checks of version 17, each with its own range test, then the shared
-- range check and the guard triggers' attacher go (the triggers stay).

-- A listing's row limit.
CREATE OR REPLACE FUNCTION outbox._check_max_rows(max_rows integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF max_rows IS NULL OR max_rows < 1 OR max_rows > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: max_rows must be between 1 and 10000, got %', max_rows
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

-- Retentions: from 0 to 100 years (now() - retention must stay a time).
CREATE OR REPLACE FUNCTION outbox._check_retention(retention interval, what text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF retention IS NULL OR retention < interval '0' OR retention > interval '100 years' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % must be an interval from 0 to 100 years, got %', what, retention
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

-- A lock_timeout argument: from 1 ms (PostgreSQL reads 0 as "wait for ever")
-- to 1 hour.
CREATE OR REPLACE FUNCTION outbox._check_lock_timeout(lock_timeout interval)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF lock_timeout IS NULL OR lock_timeout < interval '1 millisecond' OR lock_timeout > interval '1 hour' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: lock_timeout must be an interval from 1 ms to 1 hour, got %', lock_timeout
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

DROP FUNCTION IF EXISTS outbox._attach_guards(regclass, text, text, text);
DROP FUNCTION IF EXISTS outbox._check_range(text, anycompatible, anycompatible, anycompatible, text);

-- ---- one home for each SQL shape, the inbox side

-- inbox.redrive of version 17 (it wrote its redrive itself), then the one
-- writer of a redrive goes.
-- Operator redrive: the given dead letters of handler (all of them but the
-- discarded when message_ids is NULL; a discarded one named is refused,
-- OB101) become due now, whatever the replay switch and cap
-- say; the replayer re-publishes them. All or nothing, with a reason,
-- written to inbox.redrive_log.
CREATE OR REPLACE FUNCTION inbox.redrive(
    handler text,
    message_ids uuid[],
    reason text
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    bad uuid [];
    moved integer;
BEGIN
    PERFORM outbox._check_text(reason, 'a redrive''s reason', 1000, TRUE);
    IF handler IS NULL OR handler !~ '^[A-Za-z0-9_.-]{1,128}$' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: a handler name ([A-Za-z0-9_.-], 1-128 chars) is required'
            USING ERRCODE = 'OB006';
    END IF;
    -- NULL means every dead letter of the handler; an array names some.
    IF message_ids IS NOT NULL THEN
        PERFORM outbox._check_ids(message_ids, 'message_ids');
    END IF;
    -- Lock first, so that the checks below still hold when the rows move.
    PERFORM 1 FROM inbox.messages AS m
    WHERE m.handler = redrive.handler
        AND (redrive.message_ids IS NULL OR m.message_id = ANY(redrive.message_ids))
    FOR UPDATE;
    SELECT array_agg(x.id) INTO bad
    FROM unnest(message_ids) AS x (id)
    WHERE NOT EXISTS (
        SELECT 1 FROM inbox.messages AS m
        WHERE m.message_id = x.id AND m.handler = redrive.handler AND m.status = 'DEAD_LETTER'
    );
    -- A discarded dead letter is redriven only once restored (NULL ids pass it by).
    IF bad IS NULL THEN
        SELECT array_agg(x.id) INTO bad
        FROM unnest(message_ids) AS x (id)
        INNER JOIN inbox.messages AS m ON m.message_id = x.id AND m.handler = redrive.handler
        WHERE m.dlq_metadata ? 'discarded';
        IF bad IS NOT NULL THEN
            RAISE EXCEPTION 'DISCARDED: % of the given messages are discarded for handler %', cardinality(bad), handler
                USING ERRCODE = 'OB101', DETAIL = array_to_string(bad, ', '),
                      HINT = 'Restore them first (outbox.dlq_restore).';
        END IF;
    END IF;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'MESSAGE_NOT_DEAD_LETTER: % of the given messages are unknown or not DEAD_LETTER for handler %', cardinality(bad), handler
            USING ERRCODE = 'OB030', DETAIL = array_to_string(bad, ', ');
    END IF;
    SELECT array_agg(m.message_id) INTO bad
    FROM inbox.messages AS m
    WHERE m.handler = redrive.handler AND m.status = 'DEAD_LETTER'
        AND NOT m.dlq_metadata ? 'discarded'
        AND (m.envelope IS NULL OR m.dlq_metadata ? 'in_database')
        AND (redrive.message_ids IS NULL OR m.message_id = ANY(redrive.message_ids));
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'MESSAGE_NOT_REPLAYABLE: % of the messages were written by an in-database handler or have no stored envelope to re-publish', cardinality(bad)
            USING ERRCODE = 'OB031', DETAIL = array_to_string(bad, ', '),
                  HINT = 'Rows written by in-database handlers are redriven by their own application.';
    END IF;
    WITH marked AS (
        UPDATE inbox.messages AS m
        SET dlq_metadata = m.dlq_metadata
            || jsonb_build_object('redrive_requested', TRUE, 'next_replay_at', now())
        WHERE m.handler = redrive.handler
            AND m.status = 'DEAD_LETTER'
            AND NOT m.dlq_metadata ? 'discarded'
            AND (redrive.message_ids IS NULL OR m.message_id = ANY(redrive.message_ids))
        RETURNING m.message_id, m.handler, m.dlq_metadata, m.last_error
    )
    INSERT INTO inbox.redrive_log (
        message_id, handler, redriven_by, reason, replay_attempts_before, last_error
    )
    SELECT
        k.message_id, k.handler, session_user, redrive.reason,
        coalesce((k.dlq_metadata ->> 'replay_attempts')::integer, 0), k.last_error
    FROM marked AS k;
    GET DIAGNOSTICS moved = ROW_COUNT;
    RETURN moved;
END;
$$;
COMMENT ON FUNCTION inbox.redrive(text, uuid[], text) IS
'Makes dead letters of a handler due for re-publication now (NULL ids: all), audited in inbox.redrive_log.';

DROP FUNCTION IF EXISTS inbox._redrive(uuid[], text[], text, boolean);

-- ---- broker faults

DROP FUNCTION IF EXISTS outbox.hand_back(uuid, uuid[], text);

-- The update guard of version 17, without the hand-back branch.
-- Every status move the trigger's WHEN clause (below) lets through: a no-op,
-- an operator requeue (of a dead letter, or of a COMPLETED event whose
-- message the broker lost), or an illegal move.
CREATE OR REPLACE FUNCTION outbox.tg_events__guard_update()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    reason text;
BEGIN
    -- A no-op update is not a move.
    IF (NEW.status, NEW.attempts, NEW.last_error, NEW.available_at, NEW.claimed_at,
        NEW.claimed_by, NEW.claim_token, NEW.published_at)
        IS NOT DISTINCT FROM
       (OLD.status, OLD.attempts, OLD.last_error, OLD.available_at, OLD.claimed_at,
        OLD.claimed_by, OLD.claim_token, OLD.published_at) THEN
        RETURN NEW;
    END IF;

    -- DEAD_LETTER <-> DISCARDED only inside outbox.dlq_discard() and
    -- outbox.dlq_restore() (sql/67_dead_letters.sql), which set
    -- pgoutbox.dlq_action and pgoutbox.dlq_reason; written to
    -- outbox.discard_log here, so that no path around them escapes the audit.
    -- A discarded event moves nowhere else: it is never requeued until restored.
    IF 'DISCARDED' IN (OLD.status, NEW.status)
        OR coalesce(current_setting('pgoutbox.dlq_action', true), '') <> '' THEN
        PERFORM outbox._check_discard_move(
            OLD.event_id, OLD.status, NEW.status,
            (NEW.attempts, NEW.last_error, NEW.available_at, NEW.claimed_at, NEW.claimed_by,
                NEW.claim_token, NEW.published_at)
            IS NOT DISTINCT FROM
            (OLD.attempts, OLD.last_error, OLD.available_at, OLD.claimed_at, OLD.claimed_by,
                OLD.claim_token, OLD.published_at)
        );
        INSERT INTO outbox.discard_log (event_id, action, acted_by, reason, last_error)
        VALUES (
            OLD.event_id, current_setting('pgoutbox.dlq_action', true), session_user,
            current_setting('pgoutbox.dlq_reason', true), OLD.last_error
        );
        RETURN NEW;
    END IF;

    -- COMPLETED -> PENDING only inside outbox.requeue_completed(), which sets
    -- pgoutbox.requeue_from (sql/35_outbox_repair.sql): the broker lost it.
    IF NEW.status = 'PENDING' AND (
        OLD.status = 'DEAD_LETTER'
        OR (OLD.status = 'COMPLETED' AND current_setting('pgoutbox.requeue_from', true) = 'COMPLETED')
    ) THEN
        reason := nullif(btrim(current_setting('pgoutbox.requeue_reason', true)), '');
        IF reason IS NULL THEN
            RAISE EXCEPTION 'REASON_REQUIRED: requeueing event % needs a reason', OLD.event_id
                USING ERRCODE = 'OB014',
                      HINT = 'Use outbox.requeue(event_ids, reason) or outbox.requeue_completed(event_ids, reason).';
        END IF;
        INSERT INTO outbox.requeue_log (
            event_id, requeued_by, reason, attempts_before, last_error, from_status, published_at_before
        )
        VALUES (OLD.event_id, session_user, reason, OLD.attempts, OLD.last_error, OLD.status, OLD.published_at);
        RETURN NEW;
    END IF;

    RAISE EXCEPTION 'ILLEGAL_TRANSITION: event % cannot move from % to %', OLD.event_id, OLD.status, NEW.status
        USING ERRCODE = 'OB010',
              DETAIL = format('available_at=%s, now=%s', OLD.available_at, now()),
              HINT = 'Legal moves are listed in the README (Lifecycle).';
END;
$$;

-- ---- upcasters

-- inbox._upcast_all as 0017 has it (OTHERS only).
-- The chains of several payloads (event_types[k] v versions[k] ->
-- to_version, payloads[k]; ords[k] names them in the result), without
-- raising: (ordinal, payload, NULL), or (ordinal, NULL, why) for a missing
-- step, a step that raised or returned no JSON object, or an upcaster no
-- longer valid. The why starts with the code's name and number: it becomes
-- the dead letter's last_error. Step by step, each step applied to every
-- payload that needs it in one statement (one subtransaction); when that
-- statement raises, the step is applied one payload at a time, so that only
-- the payloads it raises on fail.
CREATE OR REPLACE FUNCTION inbox._upcast_all(
    ords integer[],
    event_types text[],
    versions integer[],
    to_version integer,
    payloads jsonb[]
)
RETURNS TABLE (ordinal integer, result jsonb, error text)
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    cur integer[] := versions;
    done jsonb[] := payloads;
    errs text[] := array_fill(NULL::text, ARRAY[cardinality(ords)]);
    step record;
    fn regprocedure;
    problem text;
    idx integer[];
    results jsonb[];
    one jsonb;
    j integer;
    k integer;
BEGIN
    FOR k IN 1..coalesce(cardinality(ords), 0) LOOP
        IF cur[k] IS NULL OR event_types[k] IS NULL THEN
            errs[k] := 'UPCAST_MISSING [OB071]: the subject names no event type and version';
        ELSIF cur[k] > to_version THEN
            errs[k] := format('UPCAST_MISSING [OB071]: %s v%s is newer than v%s; upcasters only go up', event_types[k], cur[k], to_version);
        END IF;
    END LOOP;
    LOOP
        -- The lowest step still to take, and every payload waiting for it.
        SELECT t.et, t.v INTO step
        FROM unnest(event_types, cur, errs) AS t (et, v, e)
        WHERE t.e IS NULL AND t.v < to_version
        ORDER BY t.v, t.et
        LIMIT 1;
        EXIT WHEN NOT FOUND;
        SELECT array_agg(t.k ORDER BY t.k) INTO idx
        FROM unnest(event_types, cur, errs) WITH ORDINALITY AS t (et, v, e, k)
        WHERE t.e IS NULL AND t.et = step.et AND t.v = step.v;
        SELECT u.upcaster, inbox._upcaster_problem(u.upcaster) INTO fn, problem
        FROM inbox.upcasters AS u
        WHERE u.event_type = step.et AND u.from_version = step.v;
        IF NOT FOUND OR problem IS NOT NULL THEN
            FOREACH k IN ARRAY idx LOOP
                errs[k] := CASE WHEN problem IS NULL
                    THEN format('UPCAST_MISSING [OB071]: no upcaster for %s v%s -> v%s (chain v%s -> v%s)', step.et, step.v, step.v + 1, versions[k], to_version)
                    ELSE format('UPCAST_FAILED [OB072]: %s v%s -> v%s: %s cannot be used: %s', step.et, step.v, step.v + 1, fn, problem)
                END;
            END LOOP;
            CONTINUE;
        END IF;
        BEGIN
            EXECUTE format('SELECT array_agg(%s(t.p) ORDER BY t.i) FROM unnest($1) WITH ORDINALITY AS t (p, i)', fn::oid::regproc)
            INTO results
            USING (SELECT array_agg(done[i.k] ORDER BY i.n) FROM unnest(idx) WITH ORDINALITY AS i (k, n));
        EXCEPTION WHEN OTHERS THEN
            results := NULL;
        END;
        IF results IS NULL THEN
            results := '{}';
            FOREACH k IN ARRAY idx LOOP
                BEGIN
                    EXECUTE format('SELECT %s($1)', fn::oid::regproc) INTO one USING done[k];
                EXCEPTION WHEN OTHERS THEN
                    one := NULL;
                    errs[k] := format('UPCAST_FAILED [OB072]: %s v%s -> v%s: %s raised [%s] %s', step.et, step.v, step.v + 1, fn, SQLSTATE, left(SQLERRM, 500));
                END;
                results := array_append(results, one);
            END LOOP;
        END IF;
        FOR j IN 1..cardinality(idx) LOOP
            k := idx[j];
            CONTINUE WHEN errs[k] IS NOT NULL;
            IF jsonb_typeof(results[j]) IS DISTINCT FROM 'object' THEN
                errs[k] := format('UPCAST_FAILED [OB072]: %s v%s -> v%s: %s returned %s, not a JSON object', step.et, step.v, step.v + 1, fn, coalesce(jsonb_typeof(results[j]), 'NULL'));
            ELSE
                done[k] := results[j];
                cur[k] := cur[k] + 1;
            END IF;
        END LOOP;
    END LOOP;
    RETURN QUERY
    SELECT ords[i.k], CASE WHEN errs[i.k] IS NULL THEN done[i.k] END, errs[i.k]
    FROM generate_subscripts(ords, 1) AS i (k);
END;
$$;

-- ---- held snapshots

-- The marks' token index, the marks and the inbox's per-message moves as
-- 0017 had them (status tests in the database's collation).
DROP INDEX IF EXISTS outbox.events_claim_token_idx;
CREATE INDEX IF NOT EXISTS events_claim_token_idx ON outbox.events (claim_token)
WHERE status = 'PROCESSING';

CREATE OR REPLACE FUNCTION outbox.mark_published(
    claim_token uuid,
    event_ids uuid[]
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    marked integer;
BEGIN
    IF claim_token IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: claim_token is required' USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_ids(event_ids, 'event_ids');
    UPDATE outbox.events AS e
    SET status = 'COMPLETED', published_at = now(), last_error = NULL
    WHERE e.claim_token = mark_published.claim_token
        AND e.status = 'PROCESSING'
        AND e.event_id = ANY(mark_published.event_ids);
    GET DIAGNOSTICS marked = ROW_COUNT;
    IF marked = 0 THEN
        RAISE EXCEPTION 'STALE_CLAIM: claim % holds none of the % given events', claim_token, cardinality(event_ids)
            USING ERRCODE = 'OB013',
                  HINT = 'The lease expired and another relay re-claimed them; it will publish them (deduplicated by Nats-Msg-Id).';
    END IF;
    RETURN marked;
END;
$$;

CREATE OR REPLACE FUNCTION outbox.mark_failed(
    claim_token uuid,
    event_ids uuid[],
    errors text[],
    retry_at timestamptz[]
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    marked integer;
BEGIN
    IF claim_token IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: claim_token is required' USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_ids(event_ids, 'event_ids');
    IF cardinality(event_ids) IS DISTINCT FROM cardinality(errors)
        OR cardinality(event_ids) IS DISTINCT FROM cardinality(retry_at)
        OR array_ndims(errors) > 1 OR array_ndims(retry_at) > 1 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_ids, errors and retry_at must be one-dimensional and of the same length'
            USING ERRCODE = 'OB006';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(errors) AS x (err) WHERE nullif(btrim(x.err), '') IS NULL) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: every failure needs an error text'
            USING ERRCODE = 'OB006';
    END IF;
    IF EXISTS (
        SELECT 1 FROM unnest(retry_at) AS r (at)
        WHERE NOT (r.at >= '1900-01-01 00:00:00+00' AND r.at <= now() + interval '30 days')
    ) THEN
        RAISE EXCEPTION 'TIMESTAMP_OUT_OF_RANGE: every retry_at must be NULL (dead letter) or a finite time at most 30 days ahead'
            USING ERRCODE = 'OB008';
    END IF;
    UPDATE outbox.events AS e
    SET status = CASE WHEN f.retry_at IS NULL THEN 'DEAD_LETTER' ELSE 'FAILED' END,
        last_error = outbox._clip_error(f.error),
        available_at = coalesce(f.retry_at, e.available_at)
    FROM unnest(event_ids, errors, retry_at) AS f (event_id, error, retry_at)
    WHERE e.claim_token = mark_failed.claim_token
        AND e.status = 'PROCESSING'
        AND e.event_id = f.event_id;
    GET DIAGNOSTICS marked = ROW_COUNT;
    IF marked = 0 THEN
        RAISE EXCEPTION 'STALE_CLAIM: claim % holds none of the % given events', claim_token, cardinality(event_ids)
            USING ERRCODE = 'OB013';
    END IF;
    RETURN marked;
END;
$$;

CREATE OR REPLACE FUNCTION inbox.mark_processed(message_id uuid, handler text)
RETURNS inbox.messages
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.messages;
BEGIN
    PERFORM inbox._check_message(message_id, handler);
    UPDATE inbox.messages AS m
    SET status = 'PROCESSED', processed_at = greatest(now(), m.received_at), last_error = NULL
    WHERE m.message_id = mark_processed.message_id AND m.handler = mark_processed.handler
        AND m.status IN ('RECEIVED', 'FAILED')
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_move(message_id, handler, 'PROCESSED');
    END IF;
    RETURN row;
END;
$$;

CREATE OR REPLACE FUNCTION inbox.record_error(
    message_id uuid,
    handler text,
    error text,
    dead boolean DEFAULT FALSE,
    replay_after interval DEFAULT NULL
)
RETURNS inbox.messages
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.messages;
BEGIN
    PERFORM inbox._check_message(message_id, handler);
    IF nullif(btrim(error), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: an error text is required' USING ERRCODE = 'OB006';
    END IF;
    IF dead IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: dead must be true or false' USING ERRCODE = 'OB006';
    END IF;
    IF replay_after IS NOT NULL
        AND (NOT dead OR replay_after < interval '0' OR replay_after > interval '366 days') THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: replay_after needs dead => true and an interval from 0 to 366 days, got %', replay_after
            USING ERRCODE = 'OB006';
    END IF;
    UPDATE inbox.messages AS m
    SET status = CASE WHEN dead THEN 'DEAD_LETTER' ELSE 'FAILED' END,
        last_error = outbox._clip_error(record_error.error),
        -- A new dead letter drops the previous one's notice (dlq_stream,
        -- dlq_stream_sequence): inbox.record_dlq_notice() names the new one.
        dlq_metadata = CASE WHEN dead THEN m.dlq_metadata - ARRAY['dlq_stream', 'dlq_stream_sequence']
            ELSE m.dlq_metadata END
        || jsonb_build_object('failures', coalesce((m.dlq_metadata ->> 'failures')::integer, 0) + 1)
        || CASE WHEN NOT dead THEN '{}'::jsonb ELSE
            jsonb_build_object(
                'dead_lettered_at', now(),
                'dead_letters', coalesce((m.dlq_metadata ->> 'dead_letters')::integer, 0) + 1,
                'replay_attempts', coalesce((m.dlq_metadata ->> 'replay_attempts')::integer, 0),
                'next_replay_at', now() + replay_after
            )
        END
    WHERE m.message_id = record_error.message_id AND m.handler = record_error.handler
        AND m.status IN ('RECEIVED', 'FAILED')
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_move(message_id, handler, CASE WHEN dead THEN 'DEAD_LETTER' ELSE 'FAILED' END);
    END IF;
    RETURN row;
END;
$$;

-- claim and backlog as 0017 defined them (from the bottom of the index).
CREATE OR REPLACE FUNCTION outbox.claim(
    worker text,
    batch_size integer,
    lease interval
)
RETURNS SETOF outbox.events
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    token uuid := gen_random_uuid();
BEGIN
    PERFORM outbox._check_text(worker, 'worker', 256);
    IF batch_size IS NULL OR batch_size < 1 OR batch_size > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: batch_size must be between 1 and 10000, got %', batch_size
            USING ERRCODE = 'OB006';
    END IF;
    IF lease IS NULL OR lease <= interval '0' OR lease > interval '1 day' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: lease must be positive and at most 1 day, got %', lease
            USING ERRCODE = 'OB006';
    END IF;
    RETURN QUERY
    WITH candidates AS (
        SELECT e.id, e.created_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND e.available_at <= now()
            AND (
                e.ordering_key IS NULL
                OR NOT EXISTS (
                    SELECT 1
                    FROM outbox.events AS earlier
                    WHERE earlier.ordering_key = e.ordering_key
                        AND earlier.id < e.id
                        AND earlier.status <> 'COMPLETED'
                )
            )
        ORDER BY e.id
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox.events AS e
    SET status = 'PROCESSING',
        attempts = e.attempts + 1,
        claimed_at = now(),
        claimed_by = worker,
        claim_token = token,
        available_at = now() + lease
    WHERE e.id = ANY(ARRAY(SELECT c.id FROM candidates AS c))
        AND e.created_at = ANY(ARRAY(SELECT c.created_at FROM candidates AS c))
        AND e.created_at >= (SELECT min(c.created_at) FROM candidates AS c)
        AND e.created_at <= (SELECT max(c.created_at) FROM candidates AS c)
    RETURNING e.*;
END;
$$;
COMMENT ON FUNCTION outbox.claim(text, integer, interval) IS
'Claims up to batch_size due events (new, retry due, or lease expired) under a lease.';

CREATE OR REPLACE FUNCTION outbox.backlog(context text DEFAULT NULL)
RETURNS TABLE (
    context text,
    unpublished bigint,
    oldest_unpublished_at timestamptz,
    due bigint,
    oldest_due_age interval,
    processing bigint,
    failed bigint,
    dead_letter bigint
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(backlog.context);
    -- Two branches so that each is served by its own partial index.
    WITH unfinished AS (
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND (backlog.context IS NULL OR e.context = backlog.context)
        UNION ALL
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status = 'DEAD_LETTER'
            AND (backlog.context IS NULL OR e.context = backlog.context)
    ),
    contexts AS (
        SELECT DISTINCT u.context FROM unfinished AS u
        UNION
        SELECT backlog.context WHERE backlog.context IS NOT NULL
    )
    SELECT
        c.context,
        count(u.status) FILTER (WHERE u.status <> 'DEAD_LETTER'),
        min(u.created_at) FILTER (WHERE u.status <> 'DEAD_LETTER'),
        count(u.status) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now()),
        -- greatest(): a row stored by an older version with available_at
        -- -infinity is due and very old, not an error (interval has no infinity).
        now() - greatest(
            min(u.available_at) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now()),
            timestamptz '0001-01-01 00:00:00+00'
        ),
        count(u.status) FILTER (WHERE u.status = 'PROCESSING'),
        count(u.status) FILTER (WHERE u.status = 'FAILED'),
        count(u.status) FILTER (WHERE u.status = 'DEAD_LETTER')
    FROM contexts AS c
    LEFT JOIN unfinished AS u ON u.context = c.context
    GROUP BY c.context
    ORDER BY c.context;
$$;
COMMENT ON FUNCTION outbox.backlog(text) IS
'Per context: unpublished count and oldest, due count and age of the oldest due, by status.';

DROP FUNCTION IF EXISTS outbox.oldest_snapshots(integer);
DROP FUNCTION IF EXISTS outbox._claim_floor();
DROP TRIGGER IF EXISTS _200_lower_claim_floor ON outbox.events;
DROP TRIGGER IF EXISTS _200_lower_claim_floor_on_insert ON outbox.events;
DROP FUNCTION IF EXISTS outbox.tg_events__lower_claim_floor();
DROP FUNCTION IF EXISTS outbox._lower_claim_floor(bigint);
DROP SEQUENCE IF EXISTS outbox.claim_floor;
DROP SEQUENCE IF EXISTS outbox.claim_floor_next;
DROP SEQUENCE IF EXISTS outbox.claim_floor_wait;

-- inbox.backlog as 0016 defined it (the whole of messages_unprocessed_idx),
-- then the backlog floor goes.
CREATE OR REPLACE FUNCTION inbox.backlog(context text DEFAULT NULL)
RETURNS TABLE (
    context text,
    handler text,
    unprocessed bigint,
    oldest_unprocessed_at timestamptz,
    failed bigint,
    dead_letter bigint
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(backlog.context);
    SELECT
        m.context,
        m.handler,
        count(*) FILTER (WHERE m.status IN ('RECEIVED', 'FAILED')),
        min(m.received_at) FILTER (WHERE m.status IN ('RECEIVED', 'FAILED')),
        count(*) FILTER (WHERE m.status = 'FAILED'),
        -- live dead letters: the discarded ones are counted by outbox.dlq_summary()
        count(*) FILTER (WHERE m.status = 'DEAD_LETTER' AND NOT m.dlq_metadata ? 'discarded')
    FROM inbox.messages AS m
    WHERE m.status <> 'PROCESSED'
        AND (backlog.context IS NULL OR m.context = backlog.context)
    GROUP BY m.context, m.handler
    ORDER BY m.context, m.handler;
$$;
COMMENT ON FUNCTION inbox.backlog(text) IS
'Per context and handler: unprocessed count and oldest, failed and (live) dead-lettered counts.';
-- inbox.settle as 0012 defined it (the planner's choice of join).
CREATE OR REPLACE FUNCTION inbox.settle(
    handler text,
    processed uuid[],
    failed uuid[] DEFAULT '{}',
    errors text[] DEFAULT '{}'
)
RETURNS TABLE (message_id uuid, status text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_batch(settle.handler, settle.processed || settle.failed);
    IF cardinality(settle.errors) IS DISTINCT FROM cardinality(settle.failed) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: failed and errors must have the same length'
            USING ERRCODE = 'OB006';
    END IF;
    IF EXISTS (SELECT FROM unnest(settle.errors) AS e (error) WHERE nullif(btrim(e.error), '') IS NULL) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: an error text is required for every failed message'
            USING ERRCODE = 'OB006';
    END IF;
    -- EXECUTE: planned for this call. A plan cached while inbox.messages was
    -- small scans the whole table for every batch afterwards (measured: 40 ms
    -- a call at 50,000 rows).
    RETURN QUERY EXECUTE $q$
    WITH wanted AS (
        SELECT p.id, NULL::text AS error FROM unnest($2) AS p (id)
        UNION ALL
        SELECT f.id, f.error FROM unnest($3, $4) AS f (id, error)
    ),
    moved AS (
        UPDATE inbox.messages AS m
        SET status = CASE WHEN w.error IS NULL THEN 'PROCESSED' ELSE 'FAILED' END,
            processed_at = CASE WHEN w.error IS NULL THEN greatest(now(), m.received_at) END,
            last_error = outbox._clip_error(w.error),
            dlq_metadata = CASE WHEN w.error IS NULL THEN m.dlq_metadata ELSE
                m.dlq_metadata || jsonb_build_object(
                    'failures', coalesce((m.dlq_metadata ->> 'failures')::integer, 0) + 1
                )
            END
        FROM wanted AS w
        WHERE m.message_id = w.id AND m.handler = $1
            AND m.status IN ('RECEIVED', 'FAILED')
        RETURNING m.message_id, m.status
    )
    SELECT mv.message_id, mv.status FROM moved AS mv
    $q$
    USING settle.handler, settle.processed, settle.failed, settle.errors;
END;
$$;
COMMENT ON FUNCTION inbox.settle(text, uuid[], uuid[], text[]) IS
'Batch of outcomes for one handler: processed -> PROCESSED, failed -> FAILED (errors); returns the rows moved.';
DROP TRIGGER IF EXISTS _200_lower_backlog_floor ON inbox.messages;
DROP TRIGGER IF EXISTS _200_lower_backlog_floor_on_insert ON inbox.messages;
DROP FUNCTION IF EXISTS inbox._backlog_floor();
DROP FUNCTION IF EXISTS inbox.tg_messages__lower_backlog_floor();
DROP FUNCTION IF EXISTS inbox.tg_messages__lower_backlog_floor_on_insert();
DROP FUNCTION IF EXISTS inbox._lower_backlog_floor(timestamptz);
-- The floors' shared step goes with both its callers.
DROP FUNCTION IF EXISTS outbox._lower_floor(text, text, bigint);
DROP FUNCTION IF EXISTS inbox._backlog_time(bigint);
DROP FUNCTION IF EXISTS inbox._backlog_micros(timestamptz);
DROP SEQUENCE IF EXISTS inbox.backlog_floor;
DROP SEQUENCE IF EXISTS inbox.backlog_floor_next;
DROP SEQUENCE IF EXISTS inbox.backlog_floor_wait;

-- ---- backfill
-- The role pgoutbox_backfiller stays (roles are cluster-wide: other
-- databases of the cluster may use it); it loses what it was granted here.

DROP FUNCTION IF EXISTS outbox.backfill_span(text[], timestamptz, timestamptz);
DROP FUNCTION IF EXISTS outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer);
DROP FUNCTION IF EXISTS outbox._check_backfill(text[], timestamptz, timestamptz, integer);
DROP FUNCTION IF EXISTS outbox._check_backfill_range(timestamptz, timestamptz);
DROP FUNCTION IF EXISTS outbox.backfill_archived_days(timestamptz, timestamptz);
DROP FUNCTION IF EXISTS outbox.backfill_verify_archived_day(date, bigint, numeric);
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgoutbox_backfiller') THEN
        REVOKE EXECUTE ON FUNCTION
        outbox.schema_version(), outbox.serves_workers_from(),
        inbox.receive(uuid, text, text, jsonb),
        inbox.mark_processed(uuid, text),
        inbox.record_error(uuid, text, text, boolean, interval),
        outbox.checksum_columns(text)
        FROM pgoutbox_backfiller;
        REVOKE USAGE ON SCHEMA outbox, inbox FROM pgoutbox_backfiller;
    END IF;
END;
$$;

-- ---- source rules: five statuses, flows, small gaps

REVOKE EXECUTE ON FUNCTION inbox.upcast(text, integer, integer, jsonb) FROM pgoutbox_writer;
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

DROP FUNCTION IF EXISTS outbox.flow(uuid, integer);
DROP INDEX IF EXISTS outbox.events_correlation_idx;

-- Backlog per context (QRY-050). "due" is what a relay could take right now;
-- oldest_due_age growing while due > 0 means no relay is making progress,
-- whereas a large unpublished count with nothing due is just parked retries.
CREATE OR REPLACE FUNCTION outbox.backlog(context text DEFAULT NULL)
RETURNS TABLE (
    context text,
    unpublished bigint,
    oldest_unpublished_at timestamptz,
    due bigint,
    oldest_due_age interval,
    processing bigint,
    failed bigint,
    dead_letter bigint
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(backlog.context);
    -- Two branches so that each is served by its own partial index.
    WITH unfinished AS (
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND (backlog.context IS NULL OR e.context = backlog.context)
        UNION ALL
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status = 'DEAD_LETTER'
            AND (backlog.context IS NULL OR e.context = backlog.context)
    ),
    contexts AS (
        SELECT DISTINCT u.context FROM unfinished AS u
        UNION
        SELECT backlog.context WHERE backlog.context IS NOT NULL
    )
    SELECT
        c.context,
        count(u.status) FILTER (WHERE u.status <> 'DEAD_LETTER'),
        min(u.created_at) FILTER (WHERE u.status <> 'DEAD_LETTER'),
        count(u.status) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now()),
        -- greatest(): a row stored by an older version with available_at
        -- -infinity is due and very old, not an error (interval has no infinity).
        now() - greatest(
            min(u.available_at) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now()),
            timestamptz '0001-01-01 00:00:00+00'
        ),
        count(u.status) FILTER (WHERE u.status = 'PROCESSING'),
        count(u.status) FILTER (WHERE u.status = 'FAILED'),
        count(u.status) FILTER (WHERE u.status = 'DEAD_LETTER')
    FROM contexts AS c
    LEFT JOIN unfinished AS u ON u.context = c.context
    GROUP BY c.context
    ORDER BY c.context;
$$;
COMMENT ON FUNCTION outbox.backlog(text) IS
'Per context: unpublished count and oldest, due count and age of the oldest due, by status.';

-- Dead-lettered events, newest first, for operators deciding what to requeue.
CREATE OR REPLACE FUNCTION outbox.dead_letters(
    context text DEFAULT NULL,
    max_rows integer DEFAULT 100
)
RETURNS TABLE (
    event_id uuid,
    context text,
    subject text,
    ordering_key text,
    attempts integer,
    last_error text,
    created_at timestamptz
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(dead_letters.context), outbox._check_max_rows(dead_letters.max_rows);
    SELECT e.event_id, e.context, e.subject, e.ordering_key, e.attempts, e.last_error, e.created_at
    FROM outbox.events AS e
    WHERE e.status = 'DEAD_LETTER'
        AND (dead_letters.context IS NULL OR e.context = dead_letters.context)
    ORDER BY e.id DESC
    LIMIT dead_letters.max_rows;
$$;
COMMENT ON FUNCTION outbox.dead_letters(text, integer) IS
'Dead-lettered events (newest first) with their last error; requeue them with outbox.requeue().';

-- One dead letter (live or discarded) as a JSON document: its envelope,
-- headers, payload (only for a session_user that may read the table, i.e.
-- not pgoutbox_viewer), recorded attempts and replay state, and its history
-- (requeues, redrives, discards and restores, newest first; seq is the
-- audit row's id in its own log, which orders entries of one transaction).
CREATE OR REPLACE FUNCTION outbox.dlq_show(
    side text,
    id uuid,
    handler text DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    r record;
    doc jsonb;
    visible boolean;
    history jsonb;
BEGIN
    IF side IS NULL OR side NOT IN ('outbox', 'inbox') OR id IS NULL THEN
        RAISE EXCEPTION 'INVALID_FILTER: side (outbox or inbox) and id are required'
            USING ERRCODE = 'OB100';
    END IF;
    IF side = 'inbox' AND (handler IS NULL OR handler !~ '^[A-Za-z0-9_.-]{1,128}$') THEN
        RAISE EXCEPTION 'INVALID_FILTER: an inbox dead letter is named by its message id and handler'
            USING ERRCODE = 'OB100';
    END IF;
    SELECT x.* INTO r
    FROM outbox._dlq_rows(
        jsonb_build_object(
            'side', dlq_show.side, 'ids', jsonb_build_array(dlq_show.id), 'discarded', NULL, 'owner', dlq_show.handler
        )
    ) AS x;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'DEAD_LETTER_NOT_FOUND: no % dead letter % %', dlq_show.side, dlq_show.id, coalesce('for handler ' || dlq_show.handler, '')
            USING ERRCODE = 'OB105';
    END IF;
    doc := jsonb_build_object(
        'side', r.side, 'owner', r.owner, 'id', r.id, 'handler', r.handler, 'subject', r.subject,
        'status', CASE WHEN r.discarded THEN 'DISCARDED' ELSE 'DEAD_LETTER' END, 'discarded', r.discarded,
        'tenant', r.tenant, 'attempts', r.attempts, 'last_error', r.last_error,
        'error_class', r.error_class, 'error_pattern', r.error_pattern, 'group_id', r.group_id,
        'seen_at', r.seen_at, 'created_at', r.created_at, 'refailed', r.refailed, 'replays', r.replays,
        'redrive_pending', r.redrive_pending
    );
    IF side = 'outbox' THEN
        visible := has_table_privilege(session_user, 'outbox.events', 'SELECT');
        SELECT doc || jsonb_build_object(
            'envelope', to_jsonb(e) - 'payload' - 'headers',
            'headers', e.headers,
            'payload', CASE WHEN visible THEN e.payload END,
            'dlq_metadata', NULL, 'replay_enabled', NULL, 'dlq_stream', NULL, 'dlq_stream_sequence', NULL
        ) INTO doc
        FROM outbox.events AS e
        WHERE e.id = r.row_id AND e.created_at = r.created_at;
        SELECT coalesce(jsonb_agg(h ORDER BY h.at DESC, h.seq DESC), '[]') INTO history
        FROM (
            SELECT q.id AS seq, q.requeued_at AS at, 'requeue' AS action, q.requeued_by AS by, q.reason,
                jsonb_build_object('from_status', q.from_status, 'attempts_before', q.attempts_before,
                    'last_error', q.last_error) AS detail
            FROM outbox.requeue_log AS q WHERE q.event_id = r.id
            UNION ALL
            SELECT d.id, d.acted_at, d.action, d.acted_by, d.reason, jsonb_build_object('last_error', d.last_error)
            FROM outbox.discard_log AS d WHERE d.event_id = r.id
        ) AS h;
    ELSE
        visible := has_table_privilege(session_user, 'inbox.messages', 'SELECT');
        SELECT doc || jsonb_build_object(
            'envelope', m.envelope - 'payload',
            'headers', m.envelope -> 'headers',
            'payload', CASE WHEN visible THEN m.envelope -> 'payload' END,
            'dlq_metadata', m.dlq_metadata,
            'replay_enabled', coalesce(s.enabled, TRUE),
            -- the notice's place in the DLQ stream (inbox.record_dlq_notice)
            'dlq_stream', m.dlq_metadata -> 'dlq_stream',
            'dlq_stream_sequence', m.dlq_metadata -> 'dlq_stream_sequence'
        ) INTO doc
        FROM inbox.messages AS m
        LEFT JOIN inbox.replay_switches AS s ON s.handler = m.handler
        WHERE m.message_id = r.id AND m.handler = r.handler;
        SELECT coalesce(jsonb_agg(h ORDER BY h.at DESC, h.seq DESC), '[]') INTO history
        FROM (
            SELECT q.id AS seq, q.redriven_at AS at, 'redrive' AS action, q.redriven_by AS by, q.reason,
                jsonb_build_object('replay_attempts_before', q.replay_attempts_before,
                    'last_error', q.last_error) AS detail
            FROM inbox.redrive_log AS q WHERE q.message_id = r.id AND q.handler = r.handler
            UNION ALL
            SELECT d.id, d.acted_at, d.action, d.acted_by, d.reason, jsonb_build_object('last_error', d.last_error)
            FROM inbox.discard_log AS d WHERE d.message_id = r.id AND d.handler = r.handler
        ) AS h;
    END IF;
    RETURN doc || jsonb_build_object('payload_visible', visible, 'history', history);
END;
$$;
COMMENT ON FUNCTION outbox.dlq_show(text, uuid, text) IS
'One dead letter: envelope, headers, payload (for roles that may read the table), attempts, replay state, history.';

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
    PERFORM outbox._check_retention(retention, 'retention');
    PERFORM outbox._check_retention(dead_letter_retention, 'dead_letter_retention');
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
            -- discarded events count as dead letters: kept, and restorable
            ' count(*) FILTER (WHERE status IN (''DEAD_LETTER'', ''DISCARDED'')) FROM outbox.%I', part
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
    PERFORM outbox._check_retention(retention, 'retention');
    PERFORM outbox._check_retention(dead_letter_retention, 'dead_letter_retention');
    PERFORM outbox._check_lock_timeout(lock_timeout);
    range_from := outbox._day_from(day);
    range_to := outbox._day_from(day + 1);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key('outbox.events', day));
    IF NOT outbox._is_partition(partition_name) THEN
        RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: outbox.events has no partition %', partition_name
            USING ERRCODE = 'OB050';
    END IF;
    IF range_to > now() - retention THEN
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
    -- Index lookups only (events_claimable_idx, events_dead_letter_idx,
    -- events_discarded_idx, the primary key): claims and marks lock every partition, so they wait for
    -- as long as this transaction holds the lock. No count here.
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM outbox.%1$I WHERE status IN (''PENDING'', ''FAILED'', ''PROCESSING'')),'
        ' EXISTS (SELECT 1 FROM outbox.%1$I WHERE status IN (''DEAD_LETTER'', ''DISCARDED'')),'
        ' (SELECT min(id) FROM outbox.%1$I), (SELECT max(id) FROM outbox.%1$I)',
        partition_name
    ) INTO has_open, has_dead, min_id, max_id;
    IF has_open THEN
        RAISE EXCEPTION 'NOT_CLOSED: partition % has rows still PENDING, PROCESSING or FAILED', partition_name
            USING ERRCODE = 'OB051', HINT = 'Only partitions whose rows are all terminal are archived.';
    END IF;
    IF has_dead AND range_to > now() - dead_letter_retention THEN
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

-- The lifecycle invariants, at every UPDATE (a row is born in a state that
-- holds them: _100_check_policies): a known status, attempts >= 0,
-- published_at set exactly when COMPLETED, a claim (token, time, worker)
-- while PROCESSING, an error text when FAILED or DEAD_LETTER. They were
-- CHECK constraints until version 8; PostgreSQL compiles those at every
-- INSERT statement too, which cost emit about 8 µs (10_outbox_events.sql).
-- A trigger's WHEN clause holds the same test, runs on UPDATE only, and
-- costs claim and mark what the CHECKs cost them; only a row that breaks
-- an invariant enters the function. A NULL test passes, as in a CHECK.
CREATE OR REPLACE FUNCTION outbox.tg_events__refuse_bad_state()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'ILLEGAL_TRANSITION: event % would be left % with attempts %, published_at %, claim % (% at %) and error %',
        OLD.event_id, NEW.status, NEW.attempts, coalesce(NEW.published_at::text, 'NULL'),
        coalesce(NEW.claim_token::text, 'NULL'), coalesce(NEW.claimed_by, 'NULL'),
        coalesce(NEW.claimed_at::text, 'NULL'), coalesce(left(NEW.last_error, 100), 'NULL')
        USING ERRCODE = 'OB010',
              HINT = 'PROCESSING needs a claim, COMPLETED exactly a published_at, FAILED, DEAD_LETTER and DISCARDED an error.';
END;
$$;

CREATE OR REPLACE TRIGGER _500_check_state
BEFORE UPDATE ON outbox.events
FOR EACH ROW
WHEN (
    NOT (
        new.status IN ('PENDING', 'PROCESSING', 'COMPLETED', 'FAILED', 'DEAD_LETTER', 'DISCARDED')
        AND new.attempts >= 0
        AND (new.status = 'COMPLETED') = (new.published_at IS NOT NULL)
        AND (
            new.status <> 'PROCESSING'
            OR (new.claim_token IS NOT NULL AND new.claimed_at IS NOT NULL AND new.claimed_by IS NOT NULL)
        )
        AND (new.status NOT IN ('FAILED', 'DEAD_LETTER', 'DISCARDED') OR new.last_error IS NOT NULL)
    )
)
EXECUTE FUNCTION outbox.tg_events__refuse_bad_state();

-- Back to version 17's status DISCARDED: each marked dead letter, with the
-- update guard off for this one statement (the audit has the discard).
ALTER TABLE outbox.events DISABLE TRIGGER _100_guard_update;
UPDATE outbox.events AS e SET status = 'DISCARDED'
FROM outbox.discarded_events AS d
WHERE e.id = d.row_id AND e.created_at = d.created_at AND e.status = 'DEAD_LETTER';
ALTER TABLE outbox.events ENABLE TRIGGER _100_guard_update;
-- Discarded events, as events_dead_letter_idx serves the dead letters.
CREATE INDEX IF NOT EXISTS events_discarded_idx ON outbox.events (context)
WHERE status = 'DISCARDED';
DROP TABLE IF EXISTS outbox.discarded_events;
DROP FUNCTION IF EXISTS outbox.tg_discarded_events__guard();
DROP FUNCTION IF EXISTS outbox.tg_discarded_events__audit();


-- ---- fairness: fair claims across tenants

DROP FUNCTION IF EXISTS outbox.set_tenant_weight(text, integer, text);
DROP TABLE IF EXISTS outbox.tenant_weight_log;
DROP TABLE IF EXISTS outbox.tenant_weights;
DROP INDEX IF EXISTS outbox.events_tenant_waiting_idx;

-- ---- emit: a caller's id, a delivery time, a cheap common case

-- Scheduled events go back into the claim's id-ordered walk (where schema
-- 17's claim passes them by until due); their ids stay as claims left them.
DROP INDEX IF EXISTS outbox.events_scheduled_idx;
DROP INDEX IF EXISTS outbox.events_claimable_idx;
CREATE INDEX IF NOT EXISTS events_claimable_idx ON outbox.events (id)
WHERE status IN ('PENDING', 'FAILED', 'PROCESSING');

CREATE OR REPLACE TRIGGER _100_guard_content
BEFORE UPDATE OF
id, event_id, context, aggregate_type, aggregate_id, event_type, event_version, subject,
payload, headers, correlation_id, causation_id, tenant_id, ordering_key, occurred_at, created_at
ON outbox.events
FOR EACH ROW
WHEN (
    (
        new.id, new.event_id, new.context, new.aggregate_type, new.aggregate_id,
        new.event_type, new.event_version, new.subject, new.payload, new.headers,
        new.correlation_id, new.causation_id, new.tenant_id, new.ordering_key,
        new.occurred_at, new.created_at
    )
    IS DISTINCT FROM
    (
        old.id, old.event_id, old.context, old.aggregate_type, old.aggregate_id,
        old.event_type, old.event_version, old.subject, old.payload, old.headers,
        old.correlation_id, old.causation_id, old.tenant_id, old.ordering_key,
        old.occurred_at, old.created_at
    )
)
EXECUTE FUNCTION outbox.tg_events__forbid_content_change();

-- Scheduled events keep their available_at and are published when due by
-- the relays of version 17 (their fallback poll); outbox.schedules,
-- outbox.event_keys and outbox.cancel_log go. Callers of emit's options
-- (event_id, deliver_at, deliver_after) must be gone first.
DROP FUNCTION IF EXISTS outbox.next_scheduled();
DROP FUNCTION IF EXISTS outbox.scheduled(text);
DROP FUNCTION IF EXISTS outbox.cancel(uuid, text);
DROP FUNCTION IF EXISTS outbox.emit(
    character varying, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz,
    uuid, timestamptz, interval
);
DROP FUNCTION IF EXISTS outbox._delivery_time(timestamptz, interval);
-- Policies, checked once per row at INSERT whoever inserts, and raised with
-- the codes of the error table (docs/reference.md); then the subject is
-- derived from the parts just checked, and the relays are woken when due.
-- Besides the content rules, they refuse what no relay could deliver
-- (docs/reference.md, "Limits"): times the wire format cannot express, values
-- a NATS header cannot carry, sizes over the maximums, which keep the payload
-- and every header together well under NATS's default max_payload (1 MiB).
-- Limits live here, not in CHECK constraints: rows written before them must
-- stay valid, and CHECKs would run at every UPDATE.
--
-- Shaped for emit, which every business transaction pays (docs/relay.md,
-- "What emit costs"). plpgsql prepares each expression of a function anew
-- in every transaction, and with one IF per rule that cost more than the
-- tests themselves. So a row is first tested by one small expression that is
-- true only when it breaks no rule (most of the string rules as one regular
-- expression over the parts joined by line breaks, which no valid part
-- holds); only a row it does not pass goes through the CASE below, whose
-- first broken rule names the error, in the order of the error table.
CREATE OR REPLACE FUNCTION outbox.tg_events__check_policies()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    broken text;
BEGIN
    IF (
        (
            NEW.event_id IS NOT NULL
            AND (
                NEW.context || E'\n' || NEW.event_type || E'\n' || NEW.event_version::text || E'\n'
                || NEW.aggregate_type || E'\n' || NEW.aggregate_id || E'\n' || coalesce(NEW.tenant_id, '-')
                || E'\n' || coalesce(NEW.ordering_key, '-') || E'\n' || (NEW.payload -> 'schema_version')::text
            ) ~ '^[A-Za-z0-9_-]+\n[A-Za-z0-9_-]+\n[1-9][0-9]*\n\S([^\r\n]*\S)?\n\S([^\r\n]*\S)?\n\S([^\r\n]*\S)?\n\S([^\r\n]*\S)?\n[1-9][0-9]{0,8}$'
            AND length(NEW.context) <= 64 AND length(NEW.event_type) <= 128
            AND length(NEW.aggregate_type) <= 255 AND length(NEW.aggregate_id) <= 1024
            AND length(coalesce(NEW.tenant_id, '')) <= 255 AND length(coalesce(NEW.ordering_key, '')) <= 512
            AND least(NEW.occurred_at, NEW.created_at, NEW.available_at) >= '1900-01-01 00:00:00+00'
            AND greatest(NEW.occurred_at, NEW.created_at, NEW.available_at) < '10000-01-01 00:00:00+00'
            AND NEW.occurred_at <= now() + interval '1 minute'
            AND octet_length(NEW.payload::text) <= 524288
        ) IS TRUE
        -- only once every rule before it holds: _headers_pass raises a header's error
        AND (NEW.headers = '{}'::jsonb OR (jsonb_typeof(NEW.headers) = 'object' AND outbox._headers_pass(NEW.headers)))
        AND NEW.status = 'PENDING' AND NEW.attempts = 0 AND NEW.claim_token IS NULL AND NEW.published_at IS NULL
    ) IS NOT TRUE THEN
        broken := CASE
            WHEN nullif(btrim(NEW.context), '') IS NULL
                OR nullif(btrim(NEW.aggregate_type), '') IS NULL
                OR nullif(btrim(NEW.aggregate_id), '') IS NULL
                OR nullif(btrim(NEW.event_type), '') IS NULL
                OR NEW.event_id IS NULL THEN 'required'
            -- Finite and within what ISO 8601 and every client's date type carry.
            WHEN NOT (NEW.occurred_at >= '1900-01-01 00:00:00+00' AND NEW.occurred_at < '10000-01-01 00:00:00+00'
                AND NEW.created_at >= '1900-01-01 00:00:00+00' AND NEW.created_at < '10000-01-01 00:00:00+00'
                AND NEW.available_at >= '1900-01-01 00:00:00+00' AND NEW.available_at < '10000-01-01 00:00:00+00')
                THEN 'time range'
            WHEN NEW.occurred_at > now() + interval '1 minute' THEN 'future'
            -- A bounded repetition ({1,128}) costs PostgreSQL's regex engine up
            -- to 5 µs a match here; a + and a length test, a tenth of it.
            WHEN NEW.context !~ '^[A-Za-z0-9_-]+$' OR length(NEW.context) > 64 THEN 'context'
            WHEN NEW.event_type !~ '^[A-Za-z0-9_-]+$' OR length(NEW.event_type) > 128 THEN 'event_type'
            WHEN NEW.event_version IS NULL OR NEW.event_version < 1 THEN 'event_version'
            WHEN length(NEW.aggregate_type) > 255 THEN 'aggregate_type (255)'
            WHEN length(NEW.aggregate_id) > 1024 THEN 'aggregate_id (1024)'
            WHEN length(NEW.tenant_id) > 255 THEN 'tenant_id (255)'
            WHEN length(NEW.ordering_key) > 512 THEN 'ordering_key (512)'
            -- The metadata travels as NATS header values (Pgoutbox-*): no line
            -- breaks, and no leading or trailing white space (clients trim it).
            WHEN NEW.aggregate_type ~ '[\r\n]|^\s|\s$' THEN 'aggregate_type'
            WHEN NEW.aggregate_id ~ '[\r\n]|^\s|\s$' THEN 'aggregate_id'
            WHEN NEW.tenant_id ~ '[\r\n]|^\s|\s$|^$' THEN 'tenant_id'
            WHEN NEW.ordering_key ~ '[\r\n]|^\s|\s$|^$' THEN 'ordering_key'
            WHEN NEW.payload IS NULL OR jsonb_typeof(NEW.payload) <> 'object' THEN 'payload'
            -- Its digits, not its value: 1.0 or 1e0 would reach consumers as a float.
            WHEN jsonb_typeof(NEW.payload -> 'schema_version') IS DISTINCT FROM 'number'
                OR (NEW.payload -> 'schema_version')::text !~ '^[1-9][0-9]{0,9}$'
                OR (NEW.payload -> 'schema_version')::text::bigint > 2147483647 THEN 'schema_version'
            -- The payload is the message body, as this very text.
            WHEN octet_length(NEW.payload::text) > 524288 THEN 'payload size'
            WHEN NEW.headers IS NULL OR jsonb_typeof(NEW.headers) <> 'object' THEN 'headers'
            -- _headers_pass raises a header's error itself, or says true.
            WHEN NEW.headers <> '{}'::jsonb AND NOT outbox._headers_pass(NEW.headers) THEN 'headers'
            WHEN NEW.status <> 'PENDING' OR NEW.attempts <> 0 OR NEW.claim_token IS NOT NULL
                OR NEW.published_at IS NOT NULL THEN 'state'
        END;
        -- NULL: what the first test could not tell, such as a schema_version of
        -- ten digits, or a NULL that a NOT NULL constraint refuses next.
        IF broken = 'required' THEN
            RAISE EXCEPTION 'INVALID_OUTBOX: context, aggregate_type, aggregate_id, event_type and event_id are required'
                USING ERRCODE = 'OB001',
                      HINT = 'Pass context => ... or set pgoutbox.context for the database or role.';
        ELSIF broken = 'time range' THEN
            RAISE EXCEPTION 'TIMESTAMP_OUT_OF_RANGE: occurred_at, created_at and available_at must be finite times from 1900 to 9999 (UTC)'
                USING ERRCODE = 'OB008',
                      DETAIL = format('occurred_at=%s, created_at=%s, available_at=%s',
                          NEW.occurred_at, NEW.created_at, NEW.available_at);
        ELSIF broken = 'future' THEN
            RAISE EXCEPTION 'FUTURE_EVENT: occurred_at % is more than a minute ahead of the database clock', NEW.occurred_at
                USING ERRCODE = 'OB002';
        ELSIF broken = 'context' THEN
            RAISE EXCEPTION 'INVALID_SUBJECT_PART: context % is not a subject token ([A-Za-z0-9_-], 1-64 chars)', quote_literal(left(NEW.context, 100))
                USING ERRCODE = 'OB003';
        ELSIF broken = 'event_type' THEN
            RAISE EXCEPTION 'INVALID_SUBJECT_PART: event_type % is not a subject token ([A-Za-z0-9_-], 1-128 chars)', quote_literal(left(NEW.event_type, 150))
                USING ERRCODE = 'OB003';
        ELSIF broken = 'event_version' THEN
            RAISE EXCEPTION 'INVALID_SUBJECT_PART: event_version must be a positive integer, got %', NEW.event_version
                USING ERRCODE = 'OB003';
        ELSIF broken LIKE '%)' THEN
            RAISE EXCEPTION 'VALUE_TOO_LARGE: % is longer than its maximum (characters)', broken
                USING ERRCODE = 'OB009';
        ELSIF broken IN ('aggregate_type', 'aggregate_id', 'tenant_id', 'ordering_key') THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: % is empty, has a line break, or starts or ends with white space', broken
                USING ERRCODE = 'OB006', HINT = 'It travels as a NATS header value, which cannot carry these.';
        ELSIF broken = 'payload' THEN
            RAISE EXCEPTION 'INVALID_PAYLOAD: payload must be a JSON object, got %', coalesce(jsonb_typeof(NEW.payload), 'NULL')
                USING ERRCODE = 'OB004';
        ELSIF broken = 'schema_version' THEN
            RAISE EXCEPTION 'INVALID_SCHEMA_VERSION: payload.schema_version must be an integer from 1 to 2147483647, got %', left(coalesce(NEW.payload -> 'schema_version', 'null'::jsonb)::text, 100)
                USING ERRCODE = 'OB005';
        ELSIF broken = 'payload size' THEN
            RAISE EXCEPTION 'VALUE_TOO_LARGE: payload is % bytes of JSON, more than 524288 (512 KiB)', octet_length(NEW.payload::text)
                USING ERRCODE = 'OB009';
        ELSIF broken = 'headers' THEN
            RAISE EXCEPTION 'INVALID_ARGUMENT: headers must be a JSON object'
                USING ERRCODE = 'OB006';
        ELSIF broken = 'state' THEN
            RAISE EXCEPTION 'ILLEGAL_TRANSITION: an event is born PENDING with no attempts and no claim'
                USING ERRCODE = 'OB010';
        END IF;
    END IF;
    NEW.subject := NEW.context || '.event.' || NEW.event_type || '.v' || NEW.event_version::text;
    -- The row passed: wake the relays if a wake-up is due (40_outbox_wakeup.sql).
    IF outbox._wakeup_is_due() THEN
        PERFORM outbox._wake_relays(NEW.context);
    END IF;
    RETURN NEW;
END;
$$;
DROP FUNCTION IF EXISTS outbox._register_event_id(uuid, uuid);
DROP FUNCTION IF EXISTS outbox._event_fingerprint(text, text, text, text, integer, jsonb, uuid, uuid, text, text);
DROP TABLE IF EXISTS outbox.cancel_log;
DROP TABLE IF EXISTS outbox.schedules;
DROP TABLE IF EXISTS outbox.event_keys;
-- The wake-up test as 0011 defined it (extract's numeric arithmetic).
CREATE OR REPLACE FUNCTION outbox._wakeup_is_due()
RETURNS boolean
LANGUAGE sql VOLATILE
AS $$
    SELECT NOT pg_catalog.int8range(1, 60000000, '[]') @> (
        coalesce(pg_catalog.pg_sequence_last_value('outbox.wakeup_due_at'), 0)
        - (extract(epoch FROM pg_catalog.clock_timestamp()) * 1000000)::bigint
    );
$$;

-- ---- the console

-- The dead-letter reads and outbox.drop_archived as 0017 defined them, then
-- outbox.dlq_entries and its triggers go.
-- An error text with what differs between occurrences of one cause masked:
-- uuids (<uuid>), double- or single-quoted values (<q>), numbers (<n>);
-- white space runs become one space; at most 500 characters. Inlined like
-- _dlq_error_class.
CREATE OR REPLACE FUNCTION outbox._dlq_error_pattern(error text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pg_catalog.left(pg_catalog.btrim(pg_catalog.regexp_replace(pg_catalog.regexp_replace(
        pg_catalog.regexp_replace(pg_catalog.regexp_replace(pg_catalog.regexp_replace(
            coalesce(error, ''),
            '[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}', '<uuid>', 'g'),
            '"([^"\\]|\\.)*"', '<q>', 'g'),
            '''([^'']|'''')*''', '<q>', 'g'),
        '[0-9]+([.][0-9]+)?', '<n>', 'g'),
        '\s+', ' ', 'g')), 500);
$$;

-- (0018's _dlq_rows returns rows of outbox.dlq_entries: dropped, then
-- made again with its own columns, granted to no one.)
DROP FUNCTION IF EXISTS outbox._dlq_rows(jsonb);
-- Every dead letter the filter matches, both sides, with its group and
-- state. Called by the functions below (already checked filter); granted
-- to no one. A branch per partial index (events_dead_letter_idx,
-- events_discarded_idx, messages_dead_letter_idx). No SET clause: so that
-- the planner inlines it into its callers (whose search_path is pinned) and
-- computes the error class and pattern only where a caller uses them (an
-- action's batch does not, unless it filters by group): a discard of 6,000
-- rows in batches of 100 took 11 s with every row classified at every call.
CREATE OR REPLACE FUNCTION outbox._dlq_rows(filter jsonb)
RETURNS TABLE (
    side text,
    owner text,
    id uuid,
    handler text,
    subject text,
    tenant text,
    attempts integer,
    last_error text,
    error_class text,
    error_pattern text,
    group_id text,
    seen_at timestamptz,
    discarded boolean,
    refailed boolean,
    replays integer,
    redrive_pending boolean,
    replayable boolean,
    row_id bigint,
    created_at timestamptz
)
LANGUAGE sql STABLE
AS $$
    WITH f AS (
        SELECT
            filter ->> 'side' AS side,
            filter ->> 'owner' AS owner,
            filter ->> 'subject' AS subject,
            lower(filter ->> 'error') AS error,
            filter ->> 'tenant' AS tenant,
            (filter ->> 'since')::timestamptz AS since,
            (filter ->> 'until')::timestamptz AS until,
            filter ->> 'group' AS grp,
            CASE WHEN jsonb_typeof(filter -> 'ids') = 'array' THEN
                ARRAY(SELECT (jsonb_array_elements_text(filter -> 'ids'))::uuid)
            END AS ids,
            coalesce(filter -> 'discarded', 'false') IN ('false', 'null') AS live,
            coalesce(filter -> 'discarded', 'false') IN ('true', 'null') AS gone
    ),
    dl AS (
        SELECT
            'outbox'::text AS side, e.context AS owner, e.event_id AS id, NULL::text AS handler,
            e.subject, e.tenant_id AS tenant, e.attempts, e.last_error,
            coalesce(e.claimed_at, e.created_at) AS seen_at,
            e.status = 'DISCARDED' AS discarded,
            r.n > 0 AS refailed, r.n::integer AS replays, FALSE AS redrive_pending,
            e.status = 'DEAD_LETTER' AS replayable, e.id AS row_id, e.created_at
        FROM f
        INNER JOIN outbox.events AS e
            ON (f.live AND e.status = 'DEAD_LETTER') OR (f.gone AND e.status = 'DISCARDED')
        CROSS JOIN LATERAL (
            SELECT count(*) AS n FROM outbox.requeue_log AS q
            WHERE q.event_id = e.event_id AND q.from_status = 'DEAD_LETTER'
        ) AS r
        WHERE e.status IN ('DEAD_LETTER', 'DISCARDED')
            AND coalesce(f.side, 'outbox') = 'outbox'
            AND (f.owner IS NULL OR e.context = f.owner)
            AND (f.ids IS NULL OR e.event_id = ANY(f.ids))
        UNION ALL
        SELECT
            'inbox', m.handler, m.message_id, m.handler,
            m.subject, m.envelope ->> 'tenant_id', m.attempts, m.last_error,
            coalesce((m.dlq_metadata ->> 'dead_lettered_at')::timestamptz, m.received_at),
            m.dlq_metadata ? 'discarded',
            coalesce((m.dlq_metadata ->> 'dead_letters')::integer, 1) > 1,
            coalesce((m.dlq_metadata ->> 'replay_attempts')::integer, 0)
            + coalesce((m.dlq_metadata ->> 'redrives')::integer, 0),
            coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE),
            NOT m.dlq_metadata ? 'discarded' AND m.envelope IS NOT NULL
            AND NOT m.dlq_metadata ? 'in_database'
            AND NOT coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE),
            NULL::bigint, m.received_at
        FROM f
        INNER JOIN inbox.messages AS m ON m.status = 'DEAD_LETTER'
        WHERE coalesce(f.side, 'inbox') = 'inbox'
            AND CASE WHEN m.dlq_metadata ? 'discarded' THEN f.gone ELSE f.live END
            AND (f.owner IS NULL OR m.handler = f.owner)
            AND (f.ids IS NULL OR m.message_id = ANY(f.ids))
    ),
    classed AS (
        SELECT
            dl.*,
            outbox._dlq_error_class(dl.last_error) AS error_class,
            outbox._dlq_error_pattern(dl.last_error) AS error_pattern
        FROM dl
    ),
    grouped AS (
        SELECT
            c.*,
            md5(concat_ws(E'\n', c.side, c.owner, c.subject, c.error_class, c.error_pattern)) AS group_id
        FROM classed AS c
    )
    SELECT
        g.side, g.owner, g.id, g.handler, g.subject, g.tenant, g.attempts, g.last_error,
        g.error_class, g.error_pattern, g.group_id, g.seen_at, g.discarded, g.refailed,
        g.replays, g.redrive_pending, g.replayable, g.row_id, g.created_at
    FROM grouped AS g, f
    WHERE (f.subject IS NULL OR g.subject = f.subject)
        AND (f.error IS NULL OR strpos(lower(g.last_error), f.error) > 0)
        AND (f.tenant IS NULL OR g.tenant = f.tenant)
        AND (f.since IS NULL OR g.seen_at >= f.since)
        AND (f.until IS NULL OR g.seen_at < f.until)
        AND (f.grp IS NULL OR g.group_id = f.grp);
$$;
REVOKE ALL ON FUNCTION outbox._dlq_rows(jsonb) FROM public;

-- The rows an action may take now: replay the live replayable ones, discard
-- the live ones, restore the discarded ones; never an event of a sealed
-- (archived, read-only) partition, which refuses every UPDATE (OB056): one
-- such row would refuse its whole batch, at every run. They stay listed.
CREATE OR REPLACE FUNCTION outbox._dlq_targets(filter jsonb, action text)
RETURNS TABLE (side text, id uuid, handler text, row_id bigint, created_at timestamptz, seen_at timestamptz)
LANGUAGE sql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    WITH sealed AS (
        SELECT to_date(right(c.relname::text, 8), 'YYYYMMDD') AS day
        FROM pg_trigger AS t
        INNER JOIN pg_class AS c ON t.tgrelid = c.oid
        INNER JOIN pg_inherits AS i ON c.oid = i.inhrelid
        WHERE i.inhparent = 'outbox.events'::regclass
            AND t.tgname = '_050_archived_read_only'
            AND c.relname ~ '^events_p[0-9]{8}$'
    )
    SELECT r.side, r.id, r.handler, r.row_id, r.created_at, r.seen_at
    FROM outbox._dlq_rows(filter || jsonb_build_object('discarded', action = 'restore')) AS r
    WHERE (action <> 'replay' OR r.replayable)
        AND (
            r.side = 'inbox'
            OR NOT EXISTS (SELECT 1 FROM sealed AS s WHERE s.day = (r.created_at AT TIME ZONE 'UTC')::date)
        );
$$;

-- Dead letters grouped by cause, newest group first.
CREATE OR REPLACE FUNCTION outbox.dlq_groups(
    filter jsonb DEFAULT '{}'::jsonb,
    max_rows integer DEFAULT 100
)
RETURNS TABLE (
    group_id text,
    side text,
    owner text,
    subject text,
    error_class text,
    error_pattern text,
    sample_error text,
    dead_letters bigint,
    discarded bigint,
    refailed bigint,
    replayable bigint,
    first_seen timestamptz,
    last_seen timestamptz
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_dlq_filter(filter);
    PERFORM outbox._check_max_rows(max_rows);
    RETURN QUERY
    SELECT
        r.group_id, r.side, r.owner, r.subject, r.error_class, r.error_pattern,
        (array_agg(r.last_error ORDER BY r.seen_at DESC, r.id))[1],
        count(*) FILTER (WHERE NOT r.discarded),
        count(*) FILTER (WHERE r.discarded),
        count(*) FILTER (WHERE r.refailed),
        count(*) FILTER (WHERE r.replayable),
        min(r.seen_at),
        max(r.seen_at)
    FROM outbox._dlq_rows(filter) AS r
    GROUP BY r.group_id, r.side, r.owner, r.subject, r.error_class, r.error_pattern
    ORDER BY max(r.seen_at) DESC, r.group_id
    LIMIT max_rows;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_groups(jsonb, integer) IS
'Dead letters of both sides grouped by side, owner, subject and normalised error, with counts and first/last seen.';

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

DROP TRIGGER IF EXISTS _600_dlq_entry ON outbox.events;
DROP TRIGGER IF EXISTS _600_dlq_entry ON inbox.messages;
DROP TRIGGER IF EXISTS _600_dlq_entry_insert ON inbox.messages;
DROP TRIGGER IF EXISTS _600_dlq_entry_delete ON inbox.messages;
DROP FUNCTION IF EXISTS outbox.tg_events__dlq_entry();
DROP FUNCTION IF EXISTS outbox.tg_messages__dlq_entry();
DROP FUNCTION IF EXISTS outbox._dlq_enter_event(outbox.events);
DROP FUNCTION IF EXISTS outbox._dlq_enter_message(inbox.messages);
DROP FUNCTION IF EXISTS outbox._dlq_enter(
    text, text, uuid, text, text, text, integer, text, timestamptz, boolean, boolean, integer, boolean, boolean,
    bigint, timestamptz
);
DROP TABLE IF EXISTS outbox.dlq_entries;

-- The three actions by filter as 0017 defined them, then what 0018 added.
-- Replays the dead letters matching the filter, max_rows per call, and
-- returns how many it took; call again until 0 (each call its own
-- transaction). Outbox: DEAD_LETTER -> PENDING as outbox.requeue does,
-- audited in outbox.requeue_log. Inbox: due now for the replayer, as
-- inbox.redrive does, audited in inbox.redrive_log; rows already asked for,
-- without an envelope or of an in-database handler are not taken.
CREATE OR REPLACE FUNCTION outbox.dlq_replay(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    picked record;
    outbox_moved integer;
    inbox_moved integer;
BEGIN
    SELECT
        coalesce(array_agg(b.row_id) FILTER (WHERE b.side = 'outbox'), '{}') AS row_ids,
        coalesce(array_agg(b.created_at) FILTER (WHERE b.side = 'outbox'), '{}') AS created,
        coalesce(array_agg(b.id) FILTER (WHERE b.side = 'inbox'), '{}') AS message_ids,
        coalesce(array_agg(b.handler) FILTER (WHERE b.side = 'inbox'), '{}') AS handlers
    INTO picked
    FROM outbox._dlq_batch(filter, 'replay', reason, max_rows) AS b;
    PERFORM set_config('pgoutbox.requeue_reason', reason, true);
    UPDATE outbox.events AS e
    SET status = 'PENDING', attempts = 0, available_at = now()
    FROM unnest(picked.row_ids, picked.created) AS p (row_id, created_at)
    WHERE e.id = p.row_id AND e.created_at = p.created_at AND e.status = 'DEAD_LETTER';
    GET DIAGNOSTICS outbox_moved = ROW_COUNT;
    PERFORM set_config('pgoutbox.requeue_reason', '', true);
    WITH marked AS (
        UPDATE inbox.messages AS m
        SET dlq_metadata = m.dlq_metadata
            || jsonb_build_object('redrive_requested', TRUE, 'next_replay_at', now())
        FROM unnest(picked.message_ids, picked.handlers) AS p (message_id, handler)
        WHERE m.message_id = p.message_id AND m.handler = p.handler
            AND m.status = 'DEAD_LETTER'
            AND NOT m.dlq_metadata ? 'discarded'
            AND NOT coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE)
        RETURNING m.message_id, m.handler, m.dlq_metadata, m.last_error
    )
    INSERT INTO inbox.redrive_log (
        message_id, handler, redriven_by, reason, replay_attempts_before, last_error
    )
    SELECT
        k.message_id, k.handler, session_user, dlq_replay.reason,
        coalesce((k.dlq_metadata ->> 'replay_attempts')::integer, 0), k.last_error
    FROM marked AS k;
    GET DIAGNOSTICS inbox_moved = ROW_COUNT;
    RETURN outbox_moved + inbox_moved;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_replay(jsonb, text, integer) IS
'Requeues (outbox) or redrives (inbox) up to max_rows dead letters matching a filter, audited; call until 0.';

-- Discards the live dead letters matching the filter, max_rows per call
-- (call until 0): parked for good, kept, reversible by dlq_restore; an inbox
-- row's pending replay is cancelled. Audited in outbox/inbox.discard_log.
CREATE OR REPLACE FUNCTION outbox.dlq_discard(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    picked record;
    outbox_moved integer;
    inbox_moved integer;
BEGIN
    SELECT
        coalesce(array_agg(b.row_id) FILTER (WHERE b.side = 'outbox'), '{}') AS row_ids,
        coalesce(array_agg(b.created_at) FILTER (WHERE b.side = 'outbox'), '{}') AS created,
        coalesce(array_agg(b.id) FILTER (WHERE b.side = 'inbox'), '{}') AS message_ids,
        coalesce(array_agg(b.handler) FILTER (WHERE b.side = 'inbox'), '{}') AS handlers
    INTO picked
    FROM outbox._dlq_batch(filter, 'discard', reason, max_rows) AS b;
    PERFORM set_config('pgoutbox.dlq_action', 'discard', true);
    PERFORM set_config('pgoutbox.dlq_reason', reason, true);
    UPDATE outbox.events AS e
    SET status = 'DISCARDED'
    FROM unnest(picked.row_ids, picked.created) AS p (row_id, created_at)
    WHERE e.id = p.row_id AND e.created_at = p.created_at AND e.status = 'DEAD_LETTER';
    GET DIAGNOSTICS outbox_moved = ROW_COUNT;
    UPDATE inbox.messages AS m
    SET dlq_metadata = m.dlq_metadata || jsonb_build_object(
        'discarded', jsonb_build_object('at', now(), 'by', session_user, 'reason', dlq_discard.reason),
        'next_replay_at', NULL,
        'redrive_requested', FALSE
    )
    FROM unnest(picked.message_ids, picked.handlers) AS p (message_id, handler)
    WHERE m.message_id = p.message_id AND m.handler = p.handler
        AND m.status = 'DEAD_LETTER' AND NOT m.dlq_metadata ? 'discarded';
    GET DIAGNOSTICS inbox_moved = ROW_COUNT;
    PERFORM set_config('pgoutbox.dlq_action', '', true);
    PERFORM set_config('pgoutbox.dlq_reason', '', true);
    RETURN outbox_moved + inbox_moved;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_discard(jsonb, text, integer) IS
'Discards up to max_rows live dead letters matching a filter (kept, restorable), audited; call until 0.';

-- Restores the discarded dead letters matching the filter, max_rows per
-- call (call until 0): back to DEAD_LETTER, parked (no replay scheduled).
CREATE OR REPLACE FUNCTION outbox.dlq_restore(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    picked record;
    outbox_moved integer;
    inbox_moved integer;
BEGIN
    SELECT
        coalesce(array_agg(b.row_id) FILTER (WHERE b.side = 'outbox'), '{}') AS row_ids,
        coalesce(array_agg(b.created_at) FILTER (WHERE b.side = 'outbox'), '{}') AS created,
        coalesce(array_agg(b.id) FILTER (WHERE b.side = 'inbox'), '{}') AS message_ids,
        coalesce(array_agg(b.handler) FILTER (WHERE b.side = 'inbox'), '{}') AS handlers
    INTO picked
    FROM outbox._dlq_batch(filter, 'restore', reason, max_rows) AS b;
    PERFORM set_config('pgoutbox.dlq_action', 'restore', true);
    PERFORM set_config('pgoutbox.dlq_reason', reason, true);
    UPDATE outbox.events AS e
    SET status = 'DEAD_LETTER'
    FROM unnest(picked.row_ids, picked.created) AS p (row_id, created_at)
    WHERE e.id = p.row_id AND e.created_at = p.created_at AND e.status = 'DISCARDED';
    GET DIAGNOSTICS outbox_moved = ROW_COUNT;
    UPDATE inbox.messages AS m
    SET dlq_metadata = m.dlq_metadata - 'discarded'
    FROM unnest(picked.message_ids, picked.handlers) AS p (message_id, handler)
    WHERE m.message_id = p.message_id AND m.handler = p.handler
        AND m.status = 'DEAD_LETTER' AND m.dlq_metadata ? 'discarded';
    GET DIAGNOSTICS inbox_moved = ROW_COUNT;
    PERFORM set_config('pgoutbox.dlq_action', '', true);
    PERFORM set_config('pgoutbox.dlq_reason', '', true);
    RETURN outbox_moved + inbox_moved;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_restore(jsonb, text, integer) IS
'Restores up to max_rows discarded dead letters matching a filter to DEAD_LETTER, audited; call until 0.';

DROP FUNCTION IF EXISTS outbox.dlq_action_progress(bigint);
DROP FUNCTION IF EXISTS outbox.dlq_stop(bigint);
DROP FUNCTION IF EXISTS outbox.dlq_act(bigint, text, integer);
DROP FUNCTION IF EXISTS outbox._dlq_action(bigint);
DROP FUNCTION IF EXISTS outbox.dlq_prepare(jsonb, text);
DROP FUNCTION IF EXISTS outbox._dlq_action_function(text);
DROP FUNCTION IF EXISTS outbox._dlq_act_on(jsonb, text, text, integer);
DROP FUNCTION IF EXISTS outbox._dlq_apply(text, text, bigint[], timestamptz[], uuid[], text[]);
DROP TABLE IF EXISTS outbox.dlq_action_targets;
DROP TABLE IF EXISTS outbox.dlq_actions;

DELETE FROM outbox.schema_migrations
WHERE version = 18;

COMMIT;
