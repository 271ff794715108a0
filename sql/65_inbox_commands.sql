-- inbox.commands: the command inbox. One row per (handler, command_key): an
-- API that receives the same command twice (a client's retry, a proxy's
-- resend) claims the key in its own transaction; the first claim does the
-- work and stores its result, every later claim gets that result back.
-- The key is the command id or the client's idempotency key.
--
-- Lifecycle (status), enforced for every UPDATE by tg_commands__guard_update:
--   IN_PROGRESS  claimed, result not stored yet      -> DONE | FAILED
--   DONE         result stored (terminal)
--   FAILED       the work failed                     -> IN_PROGRESS (claimed again)
--
-- Concurrency (claim_command): a claim inserts the key. A second claim of a
-- key whose first claim is not committed yet waits for that transaction:
-- committed, it sees the row as committed (DONE with the result, when the
-- work and complete_command() ran in the claim's own transaction); rolled
-- back, the second claim becomes the first. Two identical claims therefore
-- never both come back claimed. Commit the claim on its own before slow work
-- (two transactions), and a duplicate sees IN_PROGRESS instead of waiting.
--
-- Keys expire only by the audited archival of everything else (sql/91 to
-- sql/95): a day of keys, by first_claimed_at, is exported, audited and then
-- purged by inbox.purge_archived_commands(), once none of its keys is
-- IN_PROGRESS and every one settled longer ago than the retention, never
-- less than the clients' retry window (inbox.command_retry_window()). A key
-- claimed again after its day was purged is a new key: claimed afresh.

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

-- No ad-hoc removal: a key that disappears lets its command run twice.
-- Rows leave only through inbox.purge_archived_commands(), which sets
-- pgoutbox.command_purge for its own transaction. TRUNCATE never.
SELECT outbox._attach_guards(
    'inbox.commands',
    'inbox.tg_forbid_delete(''pgoutbox.command_purge'', ''inbox.purge_archived_commands'')', 'STATEMENT',
    'inbox.tg_commands__guard_update()'
);

-- The command a call is about: a handler name like the message inbox's, and
-- a key of 1-256 characters that is not blank: not white space only, tabs
-- and line breaks included (btrim takes only spaces away).
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
    IF command_key IS NULL OR command_key !~ '[^[:space:]]' OR length(command_key) > 256 THEN
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

-- Settles a claimed command: IN_PROGRESS -> DONE with its result, or FAILED
-- with its error (clipped like every recorded error), and returns the row;
-- any other move is refused (_refuse_command_move). The one writer of a
-- command's outcome, under complete_command and fail_command.
CREATE OR REPLACE FUNCTION inbox._settle_command(
    handler text, command_key text, status text, result jsonb, error text
)
RETURNS inbox.commands
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.commands;
BEGIN
    UPDATE inbox.commands AS c
    SET status = _settle_command.status,
        result = CASE WHEN _settle_command.status = 'DONE' THEN _settle_command.result ELSE c.result END,
        last_error = CASE
            WHEN _settle_command.status = 'FAILED' THEN outbox._clip_error(_settle_command.error) ELSE c.last_error
        END,
        settled_at = greatest(now(), c.claimed_at)
    WHERE c.handler = _settle_command.handler AND c.command_key = _settle_command.command_key
        AND c.status = 'IN_PROGRESS'
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_command_move(handler, command_key, status);
    END IF;
    RETURN row;
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
BEGIN
    PERFORM inbox._check_command(handler, command_key);
    IF result IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: a result is required (JSON null is one)' USING ERRCODE = 'OB006';
    END IF;
    IF octet_length(result::text) > 1048576 THEN
        RAISE EXCEPTION 'VALUE_TOO_LARGE: result is % bytes of JSON, more than 1048576 (1 MiB)', octet_length(result::text)
            USING ERRCODE = 'OB009';
    END IF;
    RETURN inbox._settle_command(handler, command_key, 'DONE', result, NULL);
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
BEGIN
    PERFORM inbox._check_command(handler, command_key);
    IF nullif(btrim(error), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: an error text is required' USING ERRCODE = 'OB006';
    END IF;
    RETURN inbox._settle_command(handler, command_key, 'FAILED', NULL, error);
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
