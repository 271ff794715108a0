-- Checks and helpers that both sides call (outbox and inbox, their APIs and
-- their guards): defined before every file that calls them, so that no file
-- calls forward into a later one.
--
-- Every function checks all its arguments before it acts and refuses bad
-- ones with a code (docs/reference.md, "Error codes" and "Limits"), never
-- with one of PostgreSQL's own error classes.

-- An array of ids: given, one-dimensional, 1 to 10,000 distinct ids, no NULL.
CREATE OR REPLACE FUNCTION outbox._check_ids(ids uuid[], what text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 OR array_ndims(ids) > 1 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % must be a non-empty, one-dimensional array', what
            USING ERRCODE = 'OB006';
    END IF;
    IF cardinality(ids) > 10000 THEN
        RAISE EXCEPTION 'VALUE_TOO_LARGE: % has % elements, more than 10000', what, cardinality(ids)
            USING ERRCODE = 'OB009';
    END IF;
    IF array_position(ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % has a NULL element', what
            USING ERRCODE = 'OB006';
    END IF;
    IF (SELECT count(DISTINCT x.id) FROM unnest(ids) AS x (id)) <> cardinality(ids) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % names an id more than once', what
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

-- A name or reason: given, not blank, at most max_chars characters. A missing
-- reason is REASON_REQUIRED, anything else missing INVALID_ARGUMENT.
CREATE OR REPLACE FUNCTION outbox._check_text(
    value text, what text, max_chars integer, is_reason boolean DEFAULT FALSE
)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF nullif(btrim(value), '') IS NULL THEN
        IF is_reason THEN
            RAISE EXCEPTION 'REASON_REQUIRED: % is required', what USING ERRCODE = 'OB014';
        END IF;
        RAISE EXCEPTION 'INVALID_ARGUMENT: % is required and may not be blank', what USING ERRCODE = 'OB006';
    END IF;
    IF length(value) > max_chars THEN
        RAISE EXCEPTION 'VALUE_TOO_LARGE: % is % characters, more than %', what, length(value), max_chars
            USING ERRCODE = 'OB009';
    END IF;
END;
$$;

-- An optional filter on a context: NULL (all) or a subject token.
CREATE OR REPLACE FUNCTION outbox._check_context(context text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF context !~ '^[A-Za-z0-9_-]{1,64}$' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: context % is not a subject token ([A-Za-z0-9_-], 1-64 chars)', quote_literal(left(context, 100))
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

-- A bounded argument (a row limit, a page size, a retention, a lock
-- timeout): given, and from low to high, both included; `range` says so in
-- the error.
CREATE OR REPLACE FUNCTION outbox._check_range(
    what text, value anycompatible, low anycompatible, high anycompatible, range text
)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL OR value < low OR value > high THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % must be %, got %', what, range, value
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

-- A listing's row limit.
CREATE OR REPLACE FUNCTION outbox._check_max_rows(max_rows integer)
RETURNS void
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_range('max_rows', max_rows, 1, 10000, 'between 1 and 10000');
$$;

-- Error texts are kept, not refused, when too long: they come from libraries
-- and brokers, and a refused mark would leave its whole batch PROCESSING
-- until the lease expires, to be refused again. Their start says what failed.
CREATE OR REPLACE FUNCTION outbox._clip_error(error text)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN length(error) > 4000 THEN left(error, 3988) || ' (truncated)' ELSE error END;
$$;

-- Called by both update guards for a move from or to discarded (inbox: the
-- dlq_metadata.discarded key), or any move while pgoutbox.dlq_action is
-- set: passes only the move the action names, on a row whose other columns
-- stay as they were, with a reason; raises otherwise. The guard then writes
-- the audit row.
CREATE OR REPLACE FUNCTION outbox._check_discard_move(
    id uuid,
    from_status text,
    to_status text,
    rest_unchanged boolean
)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    action text := coalesce(current_setting('pgoutbox.dlq_action', true), '');
BEGIN
    IF action = 'discard' THEN
        IF from_status <> 'DEAD_LETTER' OR to_status <> 'DISCARDED' OR NOT rest_unchanged THEN
            RAISE EXCEPTION 'NOT_DISCARDABLE: % is % and cannot be discarded (only a dead letter can, and only that changes)', id, from_status
                USING ERRCODE = 'OB103';
        END IF;
    ELSIF action = 'restore' THEN
        IF from_status <> 'DISCARDED' OR to_status <> 'DEAD_LETTER' OR NOT rest_unchanged THEN
            RAISE EXCEPTION 'NOT_DISCARDED: % is % and cannot be restored (only a discarded dead letter can, and only that changes)', id, from_status
                USING ERRCODE = 'OB104';
        END IF;
    ELSIF action <> '' THEN
        RAISE EXCEPTION 'UNAUDITED_DISCARD: pgoutbox.dlq_action % is not discard or restore', quote_literal(left(action, 50))
            USING ERRCODE = 'OB102';
    ELSIF from_status = 'DISCARDED' AND to_status <> 'DEAD_LETTER' THEN
        RAISE EXCEPTION 'DISCARDED: % is discarded; it moves nowhere until restored', id
            USING ERRCODE = 'OB101', HINT = 'Restore it first (outbox.dlq_restore).';
    ELSIF to_status = 'DISCARDED' AND from_status <> 'DEAD_LETTER' THEN
        RAISE EXCEPTION 'NOT_DISCARDABLE: % is % and cannot be discarded', id, from_status
            USING ERRCODE = 'OB103';
    ELSE
        RAISE EXCEPTION 'UNAUDITED_DISCARD: % may be discarded or restored only by outbox.dlq_discard or outbox.dlq_restore', id
            USING ERRCODE = 'OB102';
    END IF;
    IF nullif(btrim(current_setting('pgoutbox.dlq_reason', true)), '') IS NULL THEN
        RAISE EXCEPTION 'REASON_REQUIRED: a % needs a reason', action USING ERRCODE = 'OB014';
    END IF;
END;
$$;

-- Sets the one value `setting` of a singleton policy table
-- (outbox.wakeup_policy, inbox.retention_policy, inbox.command_policy: one
-- row, keyed by `singleton`, with a named CHECK on the value) and records
-- who changed it when. The admins' setter checks the value first, with its
-- own code; the table's CHECK stands behind it. Returns the value.
CREATE OR REPLACE FUNCTION outbox._set_policy(policy text, setting text, value interval)
RETURNS interval
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    EXECUTE format(
        'INSERT INTO %s AS p (singleton, %I) VALUES (TRUE, $1)'
        ' ON CONFLICT (singleton) DO UPDATE'
        ' SET %I = excluded.%I, changed_at = now(), changed_by = session_user',
        policy, setting, setting, setting
    ) USING value;
    RETURN value;
END;
$$;

-- Attaches the guard triggers that keep rows in a table, one set written
-- once here rather than as CREATE TRIGGER statements repeated per table
-- (outbox.events and its default partition, the archive's audit and seal
-- tables, inbox.messages, inbox.commands):
--   _100_guard_update     BEFORE UPDATE, each row: update_guard, if given;
--   _100_forbid_delete    BEFORE DELETE, each ROW or once per STATEMENT
--                         (delete_per): delete_guard; none when delete_per
--                         is NULL (a partition has its parent's row trigger);
--   _100_forbid_truncate  BEFORE TRUNCATE: delete_guard.
-- A guard is a trigger function's call, with its arguments. CREATE OR
-- REPLACE: a re-run of the install leaves one set.
CREATE OR REPLACE FUNCTION outbox._attach_guards(
    tbl regclass,
    delete_guard text,
    delete_per text,
    update_guard text DEFAULT NULL
)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF update_guard IS NOT NULL THEN
        EXECUTE format(
            'CREATE OR REPLACE TRIGGER _100_guard_update BEFORE UPDATE ON %s FOR EACH ROW EXECUTE FUNCTION %s',
            tbl, update_guard
        );
    END IF;
    IF delete_per IS NOT NULL THEN
        EXECUTE format(
            'CREATE OR REPLACE TRIGGER _100_forbid_delete BEFORE DELETE ON %s FOR EACH %s EXECUTE FUNCTION %s',
            tbl, delete_per, delete_guard
        );
    END IF;
    EXECUTE format(
        'CREATE OR REPLACE TRIGGER _100_forbid_truncate BEFORE TRUNCATE ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s',
        tbl, delete_guard
    );
END;
$$;

-- Lowers a floor (a sequence below whose value no row waits: the claim
-- floor of outbox.events by id, the backlog floor of inbox.messages by
-- received_at in µs) to pos, and cancels its candidate (the sequence
-- floor || '_next'). Under the floor's advisory lock (lock_key, the one its
-- mover takes), held to the end of the transaction, so that no mover takes
-- the floor past pos before the row is committed and seen. Its callers are
-- SECURITY DEFINER: only the owner moves the sequences.
CREATE OR REPLACE FUNCTION outbox._lower_floor(lock_key text, floor text, pos bigint)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(lock_key, 0));
    IF pos < pg_sequence_last_value(floor::regclass) THEN
        PERFORM setval(floor::regclass, pos);
    END IF;
    PERFORM setval((floor || '_next')::regclass, 1, FALSE);
END;
$$;
