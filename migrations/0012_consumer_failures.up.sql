-- 0012_consumer_failures (up): the consumer counts handler failures itself,
-- so that nothing but a handler's own answers can dead-letter a message.
--
--   * inbox.record_error() and inbox.settle() count each failure they record
--     in dlq_metadata.failures; inbox.claim_replays() resets it for the
--     replay's new round. The consumer dead-letters on the failure that
--     reaches the handler's max_deliver and lets JetStream redeliver without
--     a limit: a delivery cut short by a PostgreSQL outage or a consumer's
--     death records no failure and costs the message nothing.
--   * inbox.receive_batch() and inbox.receive_processed() plan the query
--     that reads the rows back for each call: a plan cached while
--     inbox.messages was small scanned the whole table for every batch
--     afterwards.
--   * inbox.record_in_database_error() records an in-database handler's
--     failure and marks the row in_database: such a dead letter is not
--     replayed automatically, and inbox.redrive() refuses it (OB031), since
--     its replay would go to a subject only the pgoutbox consumer reads.
--
-- Expand only: every function keeps its signature; workers of release 0.3.0
-- (schema 11) and 0.2.0 (schema 7) run on it unchanged.
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 11 or 12.
-- Catalog changes only: no row is read or rewritten.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0012 needs 0001 to 0011 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (11, 12) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0012 applies on version 11 (or re-runs on 12) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

-- Records a handler failure: FAILED (transient, will be redelivered) or,
-- with dead => true, DEAD_LETTER (poison, or the last allowed failure).
-- Either way dlq_metadata.failures counts it: the consumer dead-letters on
-- the failure that reaches the handler's max_deliver, so that deliveries
-- cut short by an outage or a crash (which record no failure) never do.
-- A dead letter gets its replay bookkeeping in dlq_metadata (keys listed in
-- sql/60_inbox_replay.sql): replay_after schedules the next automated replay
-- from now; NULL parks the row (replay off for the handler, or cap reached)
-- until an operator redrives it. The retry policy (backoff, jitter, cap) is
-- the consumer's configuration; the database only records its decision.
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
        dlq_metadata = m.dlq_metadata
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
COMMENT ON FUNCTION inbox.record_error(uuid, text, text, boolean, interval) IS
'RECEIVED/FAILED -> FAILED, or -> DEAD_LETTER with dead => true (and the next replay after replay_after).';

-- An in-database handler's failure (its business transaction rolled back,
-- the inbox row with it): records the delivery again and the error, in the
-- caller's new transaction, and marks the row dlq_metadata.in_database. Its
-- replays would go to a subject only the pgoutbox consumer reads, so such a
-- dead letter is neither replayed automatically nor redriven (OB031): its
-- application re-runs it.
CREATE OR REPLACE FUNCTION inbox.record_in_database_error(
    message_id uuid,
    handler text,
    subject text,
    envelope jsonb,
    error text,
    dead boolean DEFAULT FALSE
)
RETURNS inbox.messages
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.messages;
BEGIN
    row := inbox.receive(message_id, handler, subject, envelope);
    IF row.status NOT IN ('RECEIVED', 'FAILED') THEN
        RETURN row;  -- settled by another delivery meanwhile: its outcome stands
    END IF;
    PERFORM inbox.record_error(message_id, handler, error, dead);
    UPDATE inbox.messages AS m
    SET dlq_metadata = m.dlq_metadata || '{"in_database": true}'::jsonb
    WHERE m.message_id = record_in_database_error.message_id AND m.handler = record_in_database_error.handler
    RETURNING * INTO row;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.record_in_database_error(uuid, text, text, jsonb, text, boolean) IS
'In-database handlers: receive() and record_error() after a rolled-back attempt; the row is marked in_database.';

-- Records every delivery of a fetch, first or repeated, and returns each
-- row as it now stands, in the order given (ordinal: 1-based position in
-- message_ids; an id given twice is recorded once and returned twice).
-- Process only RECEIVED/FAILED. One value that receive() would refuse
-- refuses the whole call (OB020): receive the messages one by one to learn
-- which.
CREATE OR REPLACE FUNCTION inbox.receive_batch(
    handler text,
    message_ids uuid[],
    subjects text[],
    envelopes jsonb[]
)
RETURNS TABLE (
    ordinal integer,
    message_id uuid,
    status text,
    attempts integer,
    last_error text,
    dlq_metadata jsonb
)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_receipts(
        receive_batch.handler, receive_batch.message_ids, receive_batch.subjects, receive_batch.envelopes
    );
    -- In message_id order: two batches sharing ids lock them in one order.
    INSERT INTO inbox.messages AS m (message_id, handler, subject, envelope)
    SELECT DISTINCT ON (i.id) i.id, receive_batch.handler, i.subject, i.envelope
    FROM unnest(receive_batch.message_ids, receive_batch.subjects, receive_batch.envelopes)
        WITH ORDINALITY AS i (id, subject, envelope, n)
    ORDER BY i.id, i.n
    ON CONFLICT ON CONSTRAINT messages_pkey DO UPDATE
    SET attempts = m.attempts + 1
    WHERE m.status IN ('RECEIVED', 'FAILED');
    -- A new statement, a new snapshot: it sees the rows as they now stand,
    -- those another transaction settled since this call started included.
    -- EXECUTE: planned for this call. A plan cached while inbox.messages was
    -- small scans the whole table for every batch afterwards (measured: 9 ms
    -- a call at 2,000 rows, growing with the table).
    RETURN QUERY EXECUTE $q$
    SELECT i.n::integer, m.message_id, m.status, m.attempts, m.last_error, m.dlq_metadata
    FROM unnest($1) WITH ORDINALITY AS i (id, n)
    INNER JOIN inbox.messages AS m ON m.message_id = i.id AND m.handler = $2
    ORDER BY i.n
    $q$
    USING receive_batch.message_ids, receive_batch.handler;
END;
$$;
COMMENT ON FUNCTION inbox.receive_batch(text, uuid[], text[], jsonb[]) IS
'inbox.receive() for a whole fetch of one handler: one row per message, in order; process only RECEIVED/FAILED.';

-- The in-database batched path: a handler whose work commits in the same
-- transaction as the inbox rows records a whole fetch as PROCESSED at once,
-- each row written once. New ids are inserted PROCESSED; RECEIVED/FAILED
-- rows (an earlier delivery failed) move to PROCESSED. Returns only the
-- messages it did NOT record, by ordinal (1-based position in message_ids):
-- status PROCESSED is a duplicate (an id given twice comes back from its
-- second position on), DEAD_LETTER is parked. Do the handler's work for
-- every other message in the same transaction, or roll back: then nothing of
-- the call is kept. A delivery running at the same time waits on the other
-- transaction's uncommitted rows, then finds them PROCESSED. Same arguments
-- and refusals as receive_batch().
CREATE OR REPLACE FUNCTION inbox.receive_processed(
    handler text,
    message_ids uuid[],
    subjects text[],
    envelopes jsonb[]
)
RETURNS TABLE (ordinal integer, message_id uuid, status text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    recorded uuid[];
BEGIN
    PERFORM inbox._check_receipts(
        receive_processed.handler, receive_processed.message_ids, receive_processed.subjects,
        receive_processed.envelopes
    );
    -- In message_id order: two batches sharing ids lock them in one order.
    WITH written AS (
        INSERT INTO inbox.messages AS m (message_id, handler, subject, envelope, status, processed_at)
        SELECT DISTINCT ON (i.id) i.id, receive_processed.handler, i.subject, i.envelope, 'PROCESSED', now()
        FROM unnest(receive_processed.message_ids, receive_processed.subjects, receive_processed.envelopes)
            WITH ORDINALITY AS i (id, subject, envelope, n)
        ORDER BY i.id, i.n
        ON CONFLICT ON CONSTRAINT messages_pkey DO UPDATE
        SET status = 'PROCESSED', processed_at = greatest(now(), m.received_at), last_error = NULL,
            attempts = m.attempts + 1
        WHERE m.status IN ('RECEIVED', 'FAILED')
        RETURNING m.message_id
    )
    SELECT coalesce(array_agg(w.message_id), '{}') INTO recorded FROM written AS w;
    IF cardinality(recorded) = cardinality(receive_processed.message_ids) THEN
        RETURN;  -- every message recorded (so no id was given twice)
    END IF;
    -- A new statement, a new snapshot: it sees the rows another transaction
    -- settled while this call waited on them. No row at all (purged since):
    -- status NULL, not recorded either.
    -- EXECUTE: planned for this call (see receive_batch).
    RETURN QUERY EXECUTE $q$
    SELECT i.n::integer, i.id, m.status
    FROM (
        SELECT u.id, u.n, row_number() OVER (PARTITION BY u.id ORDER BY u.n) AS k
        FROM unnest($1) WITH ORDINALITY AS u (id, n)
    ) AS i
    LEFT JOIN inbox.messages AS m ON m.message_id = i.id AND m.handler = $2
    WHERE i.k > 1 OR NOT EXISTS (SELECT FROM unnest($3) AS r (id) WHERE r.id = i.id)
    ORDER BY i.n
    $q$
    USING receive_processed.message_ids, receive_processed.handler, recorded;
END;
$$;
COMMENT ON FUNCTION inbox.receive_processed(text, uuid[], text[], jsonb[]) IS
'In-database handlers: a fetch recorded PROCESSED in the caller''s transaction; returns what it did not record.';

-- Settles a batch of one handler's outcomes: `processed` -> PROCESSED,
-- `failed` -> FAILED with the error of the same position, counted in
-- dlq_metadata.failures as record_error() counts it. Returns the rows
-- it moved; a message it does not return was not RECEIVED/FAILED (another
-- delivery settled it first: its outcome stands) or has no inbox row.
-- Dead letters go through record_error(), after their DLQ notice.
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

-- Operator redrive: the given dead letters of handler (all of them when
-- message_ids is NULL) become due now, whatever the replay switch and cap
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
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'MESSAGE_NOT_DEAD_LETTER: % of the given messages are unknown or not DEAD_LETTER for handler %', cardinality(bad), handler
            USING ERRCODE = 'OB030', DETAIL = array_to_string(bad, ', ');
    END IF;
    SELECT array_agg(m.message_id) INTO bad
    FROM inbox.messages AS m
    WHERE m.handler = redrive.handler AND m.status = 'DEAD_LETTER'
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

REVOKE ALL ON FUNCTION inbox.record_in_database_error(uuid, text, text, jsonb, text, boolean) FROM public;
GRANT EXECUTE ON FUNCTION inbox.record_in_database_error(uuid, text, text, jsonb, text, boolean)
TO pgoutbox_consumer;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (12, '0012_consumer_failures')
ON CONFLICT (version) DO NOTHING;

COMMIT;
