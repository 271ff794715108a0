-- Replay of dead-lettered inbox messages and operator redrive.
--
-- A DEAD_LETTER row is parked, not lost: its stored envelope can be
-- re-published to the handler. Automated replay is on by default with a small
-- cap (the consumer schedules it through inbox.record_error(..., replay_after))
-- and can be switched off per handler here; an operator redrive, with a
-- recorded reason, is always possible (an operator analyses before a
-- redrive; automated replay needs no one: both hold).
--
-- dlq_metadata keys (written only by record_error and the functions below):
--   dead_lettered_at   when the row last turned DEAD_LETTER
--   dead_letters       how many times it turned DEAD_LETTER
--   replay_attempts    automated replays so far (the cap counts these)
--   next_replay_at     when the replayer may take it; null = parked
--   redrive_requested  true from inbox.redrive() until the replayer takes it
--   redrives           operator redrives so far
--   last_replay_at, last_replay_by   the last re-publication and its worker
--   failures           handler failures since the row was received or last
--                      replayed (record_error, settle; reset by claim_replays)
--   dlq_stream, dlq_stream_sequence   the DLQ stream message (notice)
--                      that announced the last dead letter
--                      (inbox.record_dlq_notice; dropped by record_error)
--   in_database        written by an in-database handler: never replayed or
--                      redriven here (its application re-runs it)
--   discarded          {at, by, reason}: parked for good by an operator
--                      (sql/67_dead_letters.sql); never replayed or redriven
--                      until restored

-- The operators' runtime switch. No row means automated replay is on.
CREATE TABLE IF NOT EXISTS inbox.replay_switches (
    handler text PRIMARY KEY,
    enabled boolean NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL DEFAULT session_user,
    reason text NOT NULL,
    CONSTRAINT handler_is_named CHECK (handler ~ '^[A-Za-z0-9_.-]{1,128}$'),
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);
COMMENT ON TABLE inbox.replay_switches IS
'Automated replay per handler (no row: on); changed through inbox.set_replay() with a reason.';

-- Audit of operator redrives. No foreign key: inbox rows may leave by
-- audited archival while their redrive history stays.
CREATE TABLE IF NOT EXISTS inbox.redrive_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id uuid NOT NULL,
    handler text NOT NULL,
    redriven_at timestamptz NOT NULL DEFAULT now(),
    redriven_by text NOT NULL,
    reason text NOT NULL,
    replay_attempts_before integer NOT NULL,
    last_error text,
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);
COMMENT ON TABLE inbox.redrive_log IS
'Who redrove which dead-lettered message, when and why (inbox.redrive()).';

-- Dead letters are rare (the target is below 0.1%): a partial index keeps the
-- replayer's scan proportional to them, not to the inbox.
CREATE INDEX IF NOT EXISTS messages_dead_letter_idx ON inbox.messages (handler)
WHERE status = 'DEAD_LETTER';

-- Takes up to batch_size dead letters whose replay is due and moves them back
-- to RECEIVED, counting the replay in dlq_metadata. The caller keeps its
-- transaction open until the replay messages are published, then commits:
--   * the consumer's inbox.receive() for a replayed message waits on these
--     row locks until the commit, so it cannot see the row still DEAD_LETTER
--     (and skip it as parked) by racing ahead of the commit;
--   * a replayer that dies before committing leaves the rows DEAD_LETTER and
--     due; whatever it had published is skipped as parked, and the next pass
--     publishes again (under new message ids, so JetStream does not drop it).
-- One statement: candidates are locked FOR UPDATE SKIP LOCKED in due order,
-- so two replayers walk past each other; messages_dead_letter_idx serves the
-- scan. A row is due when next_replay_at has passed and either an operator
-- asked for a redrive or automated replay is not switched off for its
-- handler. Rows without a stored envelope cannot be re-published.
CREATE OR REPLACE FUNCTION inbox.claim_replays(
    worker text,
    batch_size integer
)
RETURNS SETOF inbox.messages
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_text(worker, 'worker', 256);
    IF batch_size IS NULL OR batch_size < 1 OR batch_size > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: batch_size must be between 1 and 10000, got %', batch_size
            USING ERRCODE = 'OB006';
    END IF;
    RETURN QUERY
    WITH candidates AS (
        SELECT
            m.message_id,
            m.handler,
            coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE) AS redrive
        FROM inbox.messages AS m
        WHERE m.status = 'DEAD_LETTER'
            AND m.envelope IS NOT NULL
            AND NOT m.dlq_metadata ? 'in_database'
            AND NOT m.dlq_metadata ? 'discarded'
            AND (m.dlq_metadata ->> 'next_replay_at')::timestamptz <= now()
            AND (
                coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE)
                OR NOT EXISTS (
                    SELECT 1
                    FROM inbox.replay_switches AS s
                    WHERE s.handler = m.handler AND NOT s.enabled
                )
            )
        ORDER BY (m.dlq_metadata ->> 'next_replay_at')::timestamptz, m.message_id
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    )
    UPDATE inbox.messages AS m
    SET status = 'RECEIVED',
        dlq_metadata = m.dlq_metadata || jsonb_build_object(
            CASE WHEN c.redrive THEN 'redrives' ELSE 'replay_attempts' END,
            coalesce(
                (m.dlq_metadata ->> CASE WHEN c.redrive THEN 'redrives' ELSE 'replay_attempts' END)::integer,
                0
            ) + 1,
            'next_replay_at', NULL,
            'redrive_requested', FALSE,
            'failures', 0,
            'last_replay_at', now(),
            'last_replay_by', worker
        )
    FROM candidates AS c
    WHERE m.message_id = c.message_id AND m.handler = c.handler
    RETURNING m.*;
END;
$$;
COMMENT ON FUNCTION inbox.claim_replays(text, integer) IS
'DEAD_LETTER -> RECEIVED for due replays and redrives; commit only after re-publishing them.';

-- Asks the replayer for the named dead letters (parallel arrays: message id
-- and handler) now: due at once, redrive_requested, each audited in
-- inbox.redrive_log with session_user and reason. A row that is no longer a
-- live dead letter (settled meanwhile, or discarded) is passed by, and so,
-- unless again, is one already asked for. Returns how many it asked for.
-- The one writer of a redrive: inbox.redrive (checked beforehand, all or
-- nothing) and outbox.dlq_replay / dlq_act (sql/67_dead_letters.sql).
CREATE OR REPLACE FUNCTION inbox._redrive(message_ids uuid[], handlers text[], reason text, again boolean)
RETURNS integer
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    moved integer;
BEGIN
    WITH marked AS (
        UPDATE inbox.messages AS m
        SET dlq_metadata = m.dlq_metadata
            || jsonb_build_object('redrive_requested', TRUE, 'next_replay_at', now())
        FROM unnest(message_ids, handlers) AS p (message_id, handler)
        WHERE m.message_id = p.message_id AND m.handler = p.handler
            AND m.status = 'DEAD_LETTER'
            AND NOT m.dlq_metadata ? 'discarded'
            AND (again OR NOT coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE))
        RETURNING m.message_id, m.handler, m.dlq_metadata, m.last_error
    )
    INSERT INTO inbox.redrive_log (
        message_id, handler, redriven_by, reason, replay_attempts_before, last_error
    )
    SELECT
        k.message_id, k.handler, session_user, _redrive.reason,
        coalesce((k.dlq_metadata ->> 'replay_attempts')::integer, 0), k.last_error
    FROM marked AS k;
    GET DIAGNOSTICS moved = ROW_COUNT;
    RETURN moved;
END;
$$;

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
    live_ids uuid [];
    live_handlers text [];
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
    -- Every live dead letter named (NULL ids: of the handler), asked for
    -- again if it already was.
    SELECT array_agg(m.message_id), array_agg(m.handler) INTO live_ids, live_handlers
    FROM inbox.messages AS m
    WHERE m.handler = redrive.handler
        AND m.status = 'DEAD_LETTER'
        AND NOT m.dlq_metadata ? 'discarded'
        AND (redrive.message_ids IS NULL OR m.message_id = ANY(redrive.message_ids));
    RETURN inbox._redrive(live_ids, live_handlers, reason, TRUE);
END;
$$;
COMMENT ON FUNCTION inbox.redrive(text, uuid[], text) IS
'Makes dead letters of a handler due for re-publication now (NULL ids: all), audited in inbox.redrive_log.';

-- Switches automated replay of a handler's dead letters on or off (no row:
-- on). Operator redrives are not affected.
CREATE OR REPLACE FUNCTION inbox.set_replay(
    handler text,
    enabled boolean,
    reason text
)
RETURNS inbox.replay_switches
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.replay_switches;
BEGIN
    PERFORM outbox._check_text(reason, 'switching replay''s reason', 1000, TRUE);
    IF handler IS NULL OR handler !~ '^[A-Za-z0-9_.-]{1,128}$' OR enabled IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: a handler name ([A-Za-z0-9_.-], 1-128 chars) and on/off are required'
            USING ERRCODE = 'OB006';
    END IF;
    INSERT INTO inbox.replay_switches AS s (handler, enabled, changed_by, reason)
    VALUES (set_replay.handler, set_replay.enabled, session_user, set_replay.reason)
    ON CONFLICT ON CONSTRAINT replay_switches_pkey DO UPDATE
    SET enabled = excluded.enabled, changed_at = now(), changed_by = excluded.changed_by,
        reason = excluded.reason
    RETURNING * INTO row;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.set_replay(text, boolean, text) IS
'Automated replay on/off for one handler, with who and why.';

-- Dead letters (newest first) with their replay state, for operators; the
-- discarded ones are listed by outbox.dlq_list (sql/67_dead_letters.sql).
CREATE OR REPLACE FUNCTION inbox.dead_letters(
    handler text DEFAULT NULL,
    max_rows integer DEFAULT 100
)
RETURNS TABLE (
    message_id uuid,
    handler text,
    subject text,
    attempts integer,
    last_error text,
    dead_lettered_at timestamptz,
    replay_attempts integer,
    redrives integer,
    next_replay_at timestamptz,
    replay_enabled boolean
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_max_rows(dead_letters.max_rows);
    SELECT outbox._check_text(dead_letters.handler, 'handler', 128) WHERE dead_letters.handler IS NOT NULL;
    SELECT
        m.message_id,
        m.handler,
        m.subject,
        m.attempts,
        m.last_error,
        (m.dlq_metadata ->> 'dead_lettered_at')::timestamptz,
        coalesce((m.dlq_metadata ->> 'replay_attempts')::integer, 0),
        coalesce((m.dlq_metadata ->> 'redrives')::integer, 0),
        (m.dlq_metadata ->> 'next_replay_at')::timestamptz,
        coalesce(s.enabled, TRUE)
    FROM inbox.messages AS m
    LEFT JOIN inbox.replay_switches AS s ON s.handler = m.handler
    WHERE m.status = 'DEAD_LETTER'
        AND NOT m.dlq_metadata ? 'discarded'
        AND (dead_letters.handler IS NULL OR m.handler = dead_letters.handler)
    ORDER BY (m.dlq_metadata ->> 'dead_lettered_at')::timestamptz DESC NULLS LAST, m.message_id
    LIMIT dead_letters.max_rows;
$$;
COMMENT ON FUNCTION inbox.dead_letters(text, integer) IS
'Dead-lettered inbox messages with their replay state; redrive them with inbox.redrive().';
