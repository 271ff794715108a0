-- 0016_dead_letter_operations (up): dead-letter operations over both sides,
-- for `pgoutbox dead-letters`, `pgoutbox redrive --match` and the console.
--
--   * outbox.dlq_groups / dlq_list / dlq_show / dlq_count read the dead
--     letters of both sides through one jsonb filter (OB100), grouped by
--     cause (error class and masked pattern: dlq_error_class,
--     dlq_error_pattern) or one by one (keyset pages, OB107), or one in
--     detail (OB105);
--   * outbox.dlq_replay / dlq_discard / dlq_restore act on what a filter
--     matches, max_rows per call, audited (outbox.requeue_log,
--     inbox.redrive_log, and the new append-only outbox.discard_log and
--     inbox.discard_log);
--   * discarded: outbox status DISCARDED (DEAD_LETTER <-> DISCARDED), inbox
--     dlq_metadata.discarded on a DEAD_LETTER row; the update guards allow
--     the moves only inside dlq_discard/dlq_restore (OB101..OB104);
--     claim_replays, redrive and dead_letters pass discarded rows by, and
--     inbox.backlog counts live dead letters only (outbox.dlq_summary counts
--     the discarded); archival counts discarded rows as dead letters;
--   * the role pgoutbox_viewer (NOLOGIN): the read functions, no table.
--
-- Expand only: workers of release 0.3.0 (schema 11) run on it unchanged
-- (an inbox discard keeps status DEAD_LETTER, which they treat as parked; a
-- relay never claims a DISCARDED event).
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 15 or 16.
-- Reads outbox.events once, to build the partial index events_discarded_idx
-- (empty: no row is DISCARDED yet), and the audit tables for their indexes.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0016 needs 0001 to 0015 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (15, 16) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0016 applies on version 15 (or re-runs on 16) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgoutbox_viewer') THEN
        CREATE ROLE pgoutbox_viewer NOLOGIN;
    END IF;
END;
$$;

-- Discard and restore, audited (append-only, like every audit table here:
-- no role may write them, the owner may not change them). No foreign key:
-- rows may leave by archival while their history stays.
CREATE TABLE IF NOT EXISTS outbox.discard_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id uuid NOT NULL,
    action text NOT NULL,
    acted_at timestamptz NOT NULL DEFAULT now(),
    acted_by text NOT NULL,
    reason text NOT NULL,
    last_error text,
    CONSTRAINT action_is_known CHECK (action IN ('discard', 'restore')),
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);
COMMENT ON TABLE outbox.discard_log IS
'Who discarded or restored which dead-lettered event, when and why (outbox.dlq_discard/dlq_restore).';

CREATE TABLE IF NOT EXISTS inbox.discard_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id uuid NOT NULL,
    handler text NOT NULL,
    action text NOT NULL,
    acted_at timestamptz NOT NULL DEFAULT now(),
    acted_by text NOT NULL,
    reason text NOT NULL,
    last_error text,
    CONSTRAINT action_is_known CHECK (action IN ('discard', 'restore')),
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);
COMMENT ON TABLE inbox.discard_log IS
'Who discarded or restored which dead-lettered message, when and why (outbox.dlq_discard/dlq_restore).';

CREATE INDEX IF NOT EXISTS discard_log_event_idx ON outbox.discard_log (event_id);
CREATE INDEX IF NOT EXISTS discard_log_message_idx ON inbox.discard_log (message_id, handler);
-- A dead letter's history (dlq_show) and its re-failures (dlq_groups).
CREATE INDEX IF NOT EXISTS requeue_log_event_idx ON outbox.requeue_log (event_id);
CREATE INDEX IF NOT EXISTS redrive_log_message_idx ON inbox.redrive_log (message_id, handler);
-- Discarded events, as events_dead_letter_idx serves the dead letters.
CREATE INDEX IF NOT EXISTS events_discarded_idx ON outbox.events (context)
WHERE status = 'DISCARDED';

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

CREATE OR REPLACE FUNCTION inbox.tg_messages__guard_update()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF (NEW.message_id, NEW.handler, NEW.subject, NEW.envelope, NEW.received_at)
        IS DISTINCT FROM
       (OLD.message_id, OLD.handler, OLD.subject, OLD.envelope, OLD.received_at) THEN
        RAISE EXCEPTION 'IMMUTABLE_MESSAGE: message % for handler % is immutable once received', OLD.message_id, OLD.handler
            USING ERRCODE = 'OB011';
    END IF;
    -- Column by column: the generated context is still NULL in NEW here.
    IF (NEW.status, NEW.processed_at, NEW.attempts, NEW.last_error, NEW.dlq_metadata)
        IS NOT DISTINCT FROM
       (OLD.status, OLD.processed_at, OLD.attempts, OLD.last_error, OLD.dlq_metadata) THEN
        RETURN NEW;
    END IF;
    -- Discard and restore, or any change of a discarded row: checked and
    -- audited apart (rare; the hot path pays two key tests and a setting).
    IF OLD.dlq_metadata ? 'discarded' OR NEW.dlq_metadata ? 'discarded'
        OR coalesce(current_setting('pgoutbox.dlq_action', true), '') <> '' THEN
        PERFORM outbox._check_discard_move(
            OLD.message_id,
            CASE WHEN OLD.dlq_metadata ? 'discarded' THEN 'DISCARDED' ELSE OLD.status END,
            CASE WHEN NEW.dlq_metadata ? 'discarded' THEN 'DISCARDED' ELSE NEW.status END,
            -- what a discard or restore may change: the key, and a pending replay
            (NEW.status, NEW.processed_at, NEW.attempts, NEW.last_error,
                NEW.dlq_metadata - ARRAY['discarded', 'next_replay_at', 'redrive_requested'])
            IS NOT DISTINCT FROM
            (OLD.status, OLD.processed_at, OLD.attempts, OLD.last_error,
                OLD.dlq_metadata - ARRAY['discarded', 'next_replay_at', 'redrive_requested'])
        );
        INSERT INTO inbox.discard_log (message_id, handler, action, acted_by, reason, last_error)
        VALUES (
            OLD.message_id, OLD.handler, current_setting('pgoutbox.dlq_action', true), session_user,
            current_setting('pgoutbox.dlq_reason', true), OLD.last_error
        );
        RETURN NEW;
    END IF;
    IF (OLD.status, NEW.status) IN (
            ('RECEIVED', 'RECEIVED'), ('RECEIVED', 'PROCESSED'), ('RECEIVED', 'FAILED'),
            ('RECEIVED', 'DEAD_LETTER'), ('FAILED', 'FAILED'), ('FAILED', 'PROCESSED'),
            ('FAILED', 'DEAD_LETTER'), ('DEAD_LETTER', 'DEAD_LETTER'),
            ('DEAD_LETTER', 'RECEIVED')
        ) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'ILLEGAL_TRANSITION: message % for handler % cannot move from % to %', OLD.message_id, OLD.handler, OLD.status, NEW.status
        USING ERRCODE = 'OB010';
END;
$$;

-- QRY-051: unprocessed messages per context and handler.
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

CREATE OR REPLACE FUNCTION outbox.tg_discard_log__append_only()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'AUDIT_IMMUTABLE: % is append-only', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME
        USING ERRCODE = 'OB060';
END;
$$;

CREATE OR REPLACE TRIGGER _100_append_only
BEFORE UPDATE OR DELETE ON outbox.discard_log
FOR EACH ROW EXECUTE FUNCTION outbox.tg_discard_log__append_only();
CREATE OR REPLACE TRIGGER _100_append_only_truncate
BEFORE TRUNCATE ON outbox.discard_log
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_discard_log__append_only();
CREATE OR REPLACE TRIGGER _100_append_only
BEFORE UPDATE OR DELETE ON inbox.discard_log
FOR EACH ROW EXECUTE FUNCTION outbox.tg_discard_log__append_only();
CREATE OR REPLACE TRIGGER _100_append_only_truncate
BEFORE TRUNCATE ON inbox.discard_log
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_discard_log__append_only();

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

-- The class of an error text: the status class of `HTTP nnn` (4xx, 5xx),
-- the code of `CODE: ...` (BAD_PAYLOAD, UPCAST_MISSING, REPLAY_UNPUBLISHABLE),
-- the exception's name of `NameError: ...`, else OTHER. No SET clause, every
-- name qualified: so that _dlq_rows inlines it (a function with SET runs as
-- a query of its own per row, which made a group listing 5 times slower).
CREATE OR REPLACE FUNCTION outbox._dlq_error_class(error text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN error OPERATOR(pg_catalog.~) '^HTTP [1-5][0-9][0-9]($|[^0-9])'
            THEN pg_catalog.substr(error, 6, 1) OPERATOR(pg_catalog.||) 'xx'
        WHEN error OPERATOR(pg_catalog.~) '^[A-Z][A-Z0-9_]{1,63}:'
            THEN pg_catalog.substring(error, '^([A-Z][A-Z0-9_]{1,63}):')
        WHEN error OPERATOR(pg_catalog.~) '^[A-Za-z_][A-Za-z0-9_.]{0,127}(Error|Exception|Timeout|Failure)[A-Za-z0-9_]*:'
            THEN pg_catalog.substring(
                error, '^([A-Za-z_][A-Za-z0-9_.]{0,127}(Error|Exception|Timeout|Failure)[A-Za-z0-9_]*):'
            )
        ELSE 'OTHER'
    END;
$$;

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

CREATE OR REPLACE FUNCTION outbox.dlq_error_class(error text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._dlq_error_class(error);
$$;
COMMENT ON FUNCTION outbox.dlq_error_class(text) IS
'An error''s class: 4xx/5xx for HTTP nnn, CODE for "CODE: ...", the exception name for "NameError: ...", else OTHER.';

CREATE OR REPLACE FUNCTION outbox.dlq_error_pattern(error text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._dlq_error_pattern(error);
$$;
COMMENT ON FUNCTION outbox.dlq_error_pattern(text) IS
'An error with uuids, quoted values and numbers masked (<uuid>, <q>, <n>): the cause part of a dead-letter group.';

-- The filter's checks (OB100), all of them before anything is read.
CREATE OR REPLACE FUNCTION outbox._check_dlq_filter(filter jsonb)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    bad text;
    value jsonb;
BEGIN
    IF jsonb_typeof(filter) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'INVALID_FILTER: the filter must be a JSON object, got %', coalesce(jsonb_typeof(filter), 'NULL')
            USING ERRCODE = 'OB100';
    END IF;
    SELECT string_agg(quote_literal(left(k, 64)), ', ') INTO bad
    FROM jsonb_object_keys(filter) AS k
    WHERE k NOT IN ('side', 'owner', 'subject', 'error', 'tenant', 'since', 'until', 'group', 'ids', 'discarded');
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_FILTER: unknown key %', bad
            USING ERRCODE = 'OB100',
                  HINT = 'Keys: side, owner, subject, error, tenant, since, until, group, ids, discarded.';
    END IF;
    -- null stands for "any" everywhere; every other value must be a string
    -- but discarded (a boolean) and ids (an array).
    SELECT string_agg(f.key, ', ') INTO bad
    FROM jsonb_each(filter) AS f (key, value)
    WHERE jsonb_typeof(f.value) <> 'null'
        AND jsonb_typeof(f.value) <> CASE f.key WHEN 'discarded' THEN 'boolean' WHEN 'ids' THEN 'array' ELSE 'string' END;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_FILTER: wrong JSON type for %', bad
            USING ERRCODE = 'OB100', HINT = 'discarded is a boolean, ids an array of uuids, every other key a string.';
    END IF;
    IF filter ->> 'side' NOT IN ('outbox', 'inbox') THEN
        RAISE EXCEPTION 'INVALID_FILTER: side must be outbox or inbox, got %', quote_literal(left(filter ->> 'side', 50))
            USING ERRCODE = 'OB100';
    END IF;
    IF filter ->> 'owner' !~ '^[A-Za-z0-9_.-]{1,128}$' THEN
        RAISE EXCEPTION 'INVALID_FILTER: owner % is not a context or handler name ([A-Za-z0-9_.-], 1-128 chars)', quote_literal(left(filter ->> 'owner', 150))
            USING ERRCODE = 'OB100';
    END IF;
    IF filter ->> 'subject' ~ '\s' OR length(filter ->> 'subject') NOT BETWEEN 1 AND 1024 THEN
        RAISE EXCEPTION 'INVALID_FILTER: subject is not a NATS subject of 1-1024 characters'
            USING ERRCODE = 'OB100';
    END IF;
    IF length(filter ->> 'error') NOT BETWEEN 1 AND 1000 OR length(filter ->> 'tenant') NOT BETWEEN 1 AND 255 THEN
        RAISE EXCEPTION 'INVALID_FILTER: error (1-1000 characters) or tenant (1-255) is empty or too long'
            USING ERRCODE = 'OB100';
    END IF;
    IF filter ->> 'group' !~ '^[0-9a-f]{32}$' THEN
        RAISE EXCEPTION 'INVALID_FILTER: group % is not a group id (32 hex digits)', quote_literal(left(filter ->> 'group', 50))
            USING ERRCODE = 'OB100';
    END IF;
    BEGIN
        IF NOT (coalesce((filter ->> 'since')::timestamptz, now()) BETWEEN '1900-01-01 00:00:00+00' AND '10000-01-01 00:00:00+00'
            AND coalesce((filter ->> 'until')::timestamptz, now()) BETWEEN '1900-01-01 00:00:00+00' AND '10000-01-01 00:00:00+00') THEN
            RAISE EXCEPTION 'since or until out of range' USING ERRCODE = '22008';
        END IF;
    EXCEPTION WHEN data_exception THEN
        RAISE EXCEPTION 'INVALID_FILTER: since and until must be times from 1900 to 9999 (ISO 8601 with an offset)'
            USING ERRCODE = 'OB100';
    END;
    value := filter -> 'ids';
    IF jsonb_typeof(value) = 'array' THEN
        IF jsonb_array_length(value) NOT BETWEEN 1 AND 10000 THEN
            RAISE EXCEPTION 'INVALID_FILTER: ids must hold 1 to 10000 ids, got %', jsonb_array_length(value)
                USING ERRCODE = 'OB100';
        END IF;
        IF EXISTS (
            SELECT FROM jsonb_array_elements(value) AS i (id)
            WHERE jsonb_typeof(i.id) <> 'string'
                OR (i.id #>> '{}') !~* '^\{?[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}\}?$'
        ) THEN
            RAISE EXCEPTION 'INVALID_FILTER: ids must be uuids as strings'
                USING ERRCODE = 'OB100';
        END IF;
    END IF;
END;
$$;

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

-- Per side, context and owner: live and discarded dead letters, re-failures,
-- replays asked for and not yet taken, and (inbox) whether automated replay is
-- on. The backlog functions keep their columns (workers of older releases
-- read them) and count live dead letters only; the discarded are counted here.
CREATE OR REPLACE FUNCTION outbox.dlq_summary()
RETURNS TABLE (
    side text,
    context text,
    owner text,
    dead_letters bigint,
    discarded bigint,
    refailed bigint,
    redrive_pending bigint,
    replay_enabled boolean
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT
        r.side,
        split_part(r.subject, '.', 1),
        r.owner,
        count(*) FILTER (WHERE NOT r.discarded),
        count(*) FILTER (WHERE r.discarded),
        count(*) FILTER (WHERE r.refailed AND NOT r.discarded),
        count(*) FILTER (WHERE r.redrive_pending),
        CASE WHEN r.side = 'inbox' THEN coalesce(bool_and(s.enabled), TRUE) END
    FROM outbox._dlq_rows('{"discarded": null}'::jsonb) AS r
    LEFT JOIN inbox.replay_switches AS s ON r.side = 'inbox' AND s.handler = r.owner
    GROUP BY r.side, split_part(r.subject, '.', 1), r.owner
    ORDER BY r.side, 2, r.owner;
$$;
COMMENT ON FUNCTION outbox.dlq_summary() IS
'Per side, context and owner: live and discarded dead letters, re-failures, pending replays, replay switch.';

-- Dead letters one by one, newest first, a page at a time: pass the last
-- row's cursor as `after` for the next page (OB107: not such a cursor).
CREATE OR REPLACE FUNCTION outbox.dlq_list(
    filter jsonb DEFAULT '{}'::jsonb,
    max_rows integer DEFAULT 100,
    after text DEFAULT NULL
)
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
    group_id text,
    seen_at timestamptz,
    discarded boolean,
    refailed boolean,
    replays integer,
    redrive_pending boolean,
    cursor text
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    c_seen timestamptz;
    c_side text;
    c_id uuid;
    c_handler text;
BEGIN
    PERFORM outbox._check_dlq_filter(filter);
    PERFORM outbox._check_max_rows(max_rows);
    IF after IS NOT NULL THEN
        BEGIN
            SELECT (a ->> 0)::timestamptz, a ->> 1, (a ->> 2)::uuid, a ->> 3
            INTO STRICT c_seen, c_side, c_id, c_handler
            FROM (SELECT after::jsonb AS a) AS x
            WHERE jsonb_typeof(x.a) = 'array' AND jsonb_array_length(x.a) = 4
                AND x.a ->> 0 IS NOT NULL AND x.a ->> 1 IS NOT NULL AND x.a ->> 2 IS NOT NULL AND x.a ->> 3 IS NOT NULL;
        EXCEPTION WHEN data_exception OR no_data_found THEN
            RAISE EXCEPTION 'INVALID_CURSOR: after must be the cursor of a row of outbox.dlq_list'
                USING ERRCODE = 'OB107';
        END;
    END IF;
    RETURN QUERY
    SELECT
        r.side, r.owner, r.id, r.handler, r.subject, r.tenant, r.attempts, r.last_error,
        r.error_class, r.group_id, r.seen_at, r.discarded, r.refailed, r.replays, r.redrive_pending,
        jsonb_build_array(r.seen_at, r.side, r.id, coalesce(r.handler, ''))::text
    FROM outbox._dlq_rows(filter) AS r
    WHERE after IS NULL
        OR r.seen_at < c_seen
        OR (r.seen_at = c_seen AND (r.side, r.id, coalesce(r.handler, '')) > (c_side, c_id, c_handler))
    ORDER BY r.seen_at DESC, r.side, r.id, coalesce(r.handler, '')
    LIMIT max_rows;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_list(jsonb, integer, text) IS
'Dead letters of both sides matching a filter, newest first, with keyset pagination (cursor -> after).';

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
            'dlq_metadata', NULL, 'replay_enabled', NULL, 'dlq_stream_sequence', NULL
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

-- The rows an action takes in this call: the oldest first, at most max_rows.
CREATE OR REPLACE FUNCTION outbox._dlq_batch(filter jsonb, action text, reason text, max_rows integer)
RETURNS TABLE (side text, id uuid, handler text, row_id bigint, created_at timestamptz)
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_text(reason, format('a %s''s reason', action), 1000, TRUE);
    PERFORM outbox._check_dlq_filter(filter);
    PERFORM outbox._check_max_rows(max_rows);
    RETURN QUERY
    SELECT t.side, t.id, t.handler, t.row_id, t.created_at
    FROM outbox._dlq_targets(filter, action) AS t
    ORDER BY t.seen_at, t.side, t.id, t.handler
    LIMIT max_rows;
END;
$$;

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

REVOKE ALL ON FUNCTION
outbox.tg_discard_log__append_only(),
outbox._check_discard_move(uuid, text, text, boolean),
outbox._dlq_error_class(text),
outbox._dlq_error_pattern(text),
outbox.dlq_error_class(text),
outbox.dlq_error_pattern(text),
outbox._check_dlq_filter(jsonb),
outbox._dlq_rows(jsonb),
outbox.dlq_groups(jsonb, integer),
outbox.dlq_summary(),
outbox.dlq_list(jsonb, integer, text),
outbox.dlq_show(text, uuid, text),
outbox._dlq_targets(jsonb, text),
outbox.dlq_count(jsonb, text),
outbox._dlq_batch(jsonb, text, text, integer),
outbox.dlq_replay(jsonb, text, integer),
outbox.dlq_discard(jsonb, text, integer),
outbox.dlq_restore(jsonb, text, integer)
FROM public;
-- pgoutbox_viewer: the read-only operator (the console's viewers). It reads
-- through functions only, no table: so it sees dead letters, never payloads
-- (outbox.dlq_show shows one only to a role that may read the table).
GRANT USAGE ON SCHEMA outbox, inbox TO pgoutbox_viewer;
GRANT EXECUTE ON FUNCTION
outbox.schema_version(), outbox.serves_workers_from(),
outbox.backlog(text), outbox.dead_letters(text, integer),
inbox.backlog(text), inbox.dead_letters(text, integer)
TO pgoutbox_viewer;
-- Dead-letter operations (sql/67_dead_letters.sql): the viewer and the admin
-- read, only the admin acts.
GRANT EXECUTE ON FUNCTION
outbox.dlq_groups(jsonb, integer),
outbox.dlq_summary(),
outbox.dlq_list(jsonb, integer, text),
outbox.dlq_show(text, uuid, text),
outbox.dlq_count(jsonb, text),
outbox.dlq_error_class(text),
outbox.dlq_error_pattern(text)
TO pgoutbox_viewer, pgoutbox_admin;
GRANT EXECUTE ON FUNCTION
outbox.dlq_replay(jsonb, text, integer),
outbox.dlq_discard(jsonb, text, integer),
outbox.dlq_restore(jsonb, text, integer)
TO pgoutbox_admin;
GRANT SELECT ON outbox.discard_log, inbox.discard_log TO pgoutbox_admin;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (16, '0016_dead_letter_operations')
ON CONFLICT (version) DO NOTHING;

COMMIT;
