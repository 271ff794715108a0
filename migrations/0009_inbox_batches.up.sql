-- 0009_inbox_batches (up): the consumer records a whole fetch in the inbox,
-- and settles its outcomes, with one call each instead of one call per
-- message (so that the inbox costs far below the HTTP call).
--
--   * inbox.receive_batch(handler, message_ids, subjects, envelopes):
--     inbox.receive() for every message of a fetch, one row back for each;
--   * inbox.settle(handler, processed, failed, errors): mark_processed()
--     and record_error() (FAILED) for a batch of outcomes, returning the rows
--     it moved;
--   * inbox.receive_processed(handler, message_ids, subjects, envelopes):
--     for in-database handlers, records a fetch already PROCESSED in the
--     caller's transaction (each row written once), returning the messages
--     it did not record (duplicates, parked).
--
-- Expand only: receive(), mark_processed() and record_error() stay as they
-- were, for the consumers of release 0.2.0 and for in-database handlers.
--
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 8 or 9.
-- Catalog changes only: no row is read or rewritten.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0009 needs 0001 to 0008 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (8, 9) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0009 applies on version 8 (or re-runs on 9) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

-- A batch's handler and ids: a well-formed name, ids given and none NULL,
-- at most 10,000 of them.
CREATE OR REPLACE FUNCTION inbox._check_batch(handler text, message_ids uuid[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF handler IS NULL OR handler !~ '^[A-Za-z0-9_.-]{1,128}$' THEN
        RAISE EXCEPTION 'INVALID_MESSAGE: handler % is not a name of 1-128 letters, digits, _ . -', quote_literal(left(coalesce(handler, 'NULL'), 150))
            USING ERRCODE = 'OB020';
    END IF;
    IF message_ids IS NULL OR array_position(message_ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_MESSAGE: message ids are required'
            USING ERRCODE = 'OB020';
    END IF;
    IF cardinality(message_ids) > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: at most 10000 messages in one call, got %', cardinality(message_ids)
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

-- A fetch to record: _check_batch(), one subject and one envelope per id,
-- and each as receive() takes it (one refused value refuses the call).
CREATE OR REPLACE FUNCTION inbox._check_receipts(
    handler text,
    message_ids uuid[],
    subjects text[],
    envelopes jsonb[]
)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_batch(handler, message_ids);
    IF cardinality(subjects) IS DISTINCT FROM cardinality(message_ids)
        OR cardinality(envelopes) IS DISTINCT FROM cardinality(message_ids) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: message_ids, subjects and envelopes must have the same length'
            USING ERRCODE = 'OB006';
    END IF;
    IF EXISTS (
        SELECT FROM unnest(subjects, envelopes) AS i (subject, envelope)
        WHERE nullif(btrim(i.subject), '') IS NULL OR i.subject ~ '\s' OR length(i.subject) > 1024
            OR jsonb_typeof(i.envelope) IS DISTINCT FROM 'object' AND i.envelope IS NOT NULL
            OR octet_length(i.envelope::text) > 67108864
    ) THEN
        RAISE EXCEPTION 'INVALID_MESSAGE: a subject or envelope of this batch is refused; inbox.receive() tells which and why'
            USING ERRCODE = 'OB020';
    END IF;
END;
$$;

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
    RETURN QUERY
    SELECT i.n::integer, m.message_id, m.status, m.attempts, m.last_error, m.dlq_metadata
    FROM unnest(receive_batch.message_ids) WITH ORDINALITY AS i (id, n)
    INNER JOIN inbox.messages AS m ON m.message_id = i.id AND m.handler = receive_batch.handler
    ORDER BY i.n;
END;
$$;
COMMENT ON FUNCTION inbox.receive_batch(text, uuid[], text[], jsonb[]) IS
'inbox.receive() for a whole fetch of one handler: one row per message, in order; process only RECEIVED/FAILED.';

-- Settles a batch of one handler's outcomes: `processed` -> PROCESSED,
-- `failed` -> FAILED with the error of the same position. Returns the rows
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
    RETURN QUERY
    WITH wanted AS (
        SELECT p.id, NULL::text AS error FROM unnest(settle.processed) AS p (id)
        UNION ALL
        SELECT f.id, f.error FROM unnest(settle.failed, settle.errors) AS f (id, error)
    ),
    moved AS (
        UPDATE inbox.messages AS m
        SET status = CASE WHEN w.error IS NULL THEN 'PROCESSED' ELSE 'FAILED' END,
            processed_at = CASE WHEN w.error IS NULL THEN greatest(now(), m.received_at) END,
            last_error = outbox._clip_error(w.error)
        FROM wanted AS w
        WHERE m.message_id = w.id AND m.handler = settle.handler
            AND m.status IN ('RECEIVED', 'FAILED')
        RETURNING m.message_id, m.status
    )
    SELECT mv.message_id, mv.status FROM moved AS mv;
END;
$$;
COMMENT ON FUNCTION inbox.settle(text, uuid[], uuid[], text[]) IS
'Batch of outcomes for one handler: processed -> PROCESSED, failed -> FAILED (errors); returns the rows moved.';

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
    RETURN QUERY
    SELECT i.n::integer, i.id, m.status
    FROM (
        SELECT u.id, u.n, row_number() OVER (PARTITION BY u.id ORDER BY u.n) AS k
        FROM unnest(receive_processed.message_ids) WITH ORDINALITY AS u (id, n)
    ) AS i
    LEFT JOIN inbox.messages AS m ON m.message_id = i.id AND m.handler = receive_processed.handler
    WHERE i.k > 1 OR NOT EXISTS (SELECT FROM unnest(recorded) AS r (id) WHERE r.id = i.id)
    ORDER BY i.n;
END;
$$;
COMMENT ON FUNCTION inbox.receive_processed(text, uuid[], text[], jsonb[]) IS
'In-database handlers: a fetch recorded PROCESSED in the caller''s transaction; returns what it did not record.';

REVOKE ALL ON FUNCTION inbox._check_batch(text, uuid[]) FROM public;
REVOKE ALL ON FUNCTION inbox._check_receipts(text, uuid[], text[], jsonb[]) FROM public;
REVOKE ALL ON FUNCTION inbox.receive_batch(text, uuid[], text[], jsonb[]) FROM public;
REVOKE ALL ON FUNCTION inbox.settle(text, uuid[], uuid[], text[]) FROM public;
REVOKE ALL ON FUNCTION inbox.receive_processed(text, uuid[], text[], jsonb[]) FROM public;
GRANT EXECUTE ON FUNCTION
inbox.receive_batch(text, uuid[], text[], jsonb[]),
inbox.settle(text, uuid[], uuid[], text[]),
inbox.receive_processed(text, uuid[], text[], jsonb[])
TO pgoutbox_consumer;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (9, '0009_inbox_batches')
ON CONFLICT (version) DO NOTHING;

COMMIT;
