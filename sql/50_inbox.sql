-- inbox.messages: one row per (message, handler). The key makes
-- processing idempotent per handler: a redelivered message finds its row.
--
-- Lifecycle (status), enforced for every UPDATE by tg_messages__guard_update:
--   RECEIVED     recorded, handler not done yet      -> RECEIVED (redelivery) | PROCESSED
--                                                      | FAILED | DEAD_LETTER
--   FAILED       handler failed transiently          -> FAILED (redelivery, error) | PROCESSED
--                                                      | DEAD_LETTER
--   PROCESSED    handled exactly once (terminal)
--   DEAD_LETTER  poison, or deliveries exhausted     -> DEAD_LETTER (replay bookkeeping)
--                                                      | RECEIVED (replay / redrive)
--
-- A discarded dead letter (parked for good by an operator, still kept) stays
-- DEAD_LETTER with dlq_metadata.discarded = {at, by, reason}: workers of
-- every version treat it as parked, and the status CHECK is unchanged. Only
-- inbox.dlq_discard/dlq_restore (sql/67_dead_letters.sql) set or clear the
-- key, audited in inbox.discard_log by the guard below; a discarded row
-- moves nowhere else (no replay, redrive or bookkeeping) until restored.
--
-- Two ways to use it:
--   * a worker calling a handler elsewhere: receive() and commit, call the
--     handler, mark_processed() and commit, then ack the broker;
--   * an app processing in its own database: receive(), the business change
--     and mark_processed() in ONE transaction (logical exactly-once). A second
--     delivery blocks on the first's uncommitted row, then sees PROCESSED.

CREATE TABLE IF NOT EXISTS inbox.messages (
    message_id uuid NOT NULL,
    handler text NOT NULL,
    subject text NOT NULL,
    context text GENERATED ALWAYS AS (split_part(subject, '.', 1)) STORED,
    envelope jsonb,
    status text NOT NULL DEFAULT 'RECEIVED',
    received_at timestamptz NOT NULL DEFAULT now(),
    processed_at timestamptz,
    attempts integer NOT NULL DEFAULT 1,
    last_error text,
    dlq_metadata jsonb NOT NULL DEFAULT '{}'::jsonb,
    PRIMARY KEY (message_id, handler),
    CONSTRAINT status_is_known CHECK (
        status IN ('RECEIVED', 'PROCESSED', 'FAILED', 'DEAD_LETTER')
    ),
    CONSTRAINT handler_is_named CHECK (handler ~ '^[A-Za-z0-9_.-]{1,128}$'),
    CONSTRAINT subject_is_given CHECK (subject <> ''),
    -- POL-047-004 (INVALID_TIMESTAMP)
    CONSTRAINT processed_not_before_received CHECK (
        processed_at IS NULL OR processed_at >= received_at
    ),
    CONSTRAINT processed_iff_processed_at CHECK (
        (status = 'PROCESSED') = (processed_at IS NOT NULL)
    ),
    CONSTRAINT attempts_is_positive CHECK (attempts >= 1),
    CONSTRAINT failed_or_dead_has_an_error CHECK (
        status NOT IN ('FAILED', 'DEAD_LETTER') OR last_error IS NOT NULL
    ),
    CONSTRAINT dlq_metadata_is_an_object CHECK (jsonb_typeof(dlq_metadata) = 'object')
);
COMMENT ON TABLE inbox.messages IS
'Idempotent inbox keyed by (message_id, handler); message_id is the Nats-Msg-Id.';

CREATE INDEX IF NOT EXISTS messages_unprocessed_idx ON inbox.messages (received_at)
WHERE status <> 'PROCESSED';

-- The backlog floor (inbox._backlog_floor, below): no RECEIVED or FAILED row
-- was received before it. In microseconds since the epoch, in unlogged
-- sequences like the claim floor's (10_outbox_events.sql): unset after a
-- crash or a promotion, and inbox.backlog() then walks from the bottom.
CREATE UNLOGGED SEQUENCE IF NOT EXISTS inbox.backlog_floor AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS inbox.backlog_floor_next AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS inbox.backlog_floor_wait AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
COMMENT ON SEQUENCE inbox.backlog_floor IS
'No RECEIVED/FAILED row has an earlier received_at (inbox._backlog_floor), in microseconds since the epoch.';

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

-- No ad-hoc removal from an inbox table: rows leave only through its audited
-- purge (TG_ARGV[1]), which sets the flag TG_ARGV[0] to 'on' for its own
-- transaction. TRUNCATE never. One guard for inbox.messages (below)
-- and inbox.commands (sql/65_inbox_commands.sql).
CREATE OR REPLACE FUNCTION inbox.tg_forbid_delete()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'TRUNCATE'
        OR current_setting(TG_ARGV[0], true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'DELETE_FORBIDDEN: rows leave %.% only by audited archival (%)', TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_ARGV[1]
            USING ERRCODE = 'OB012';
    END IF;
    RETURN NULL;
END;
$$;

-- Rows leave inbox.messages only through inbox.purge_archived(), which sets
-- pgoutbox.inbox_purge for its own transaction. TRUNCATE never.
SELECT outbox._attach_guards(
    'inbox.messages',
    'inbox.tg_forbid_delete(''pgoutbox.inbox_purge'', ''inbox.purge_archived'')', 'STATEMENT',
    'inbox.tg_messages__guard_update()'
);

-- The message a call is about: an id and a well-formed handler name (the
-- table's own rule, refused here with a code rather than by the CHECK).
CREATE OR REPLACE FUNCTION inbox._check_message(message_id uuid, handler text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF message_id IS NULL OR handler IS NULL THEN
        RAISE EXCEPTION 'INVALID_MESSAGE: message_id and handler are required'
            USING ERRCODE = 'OB020';
    END IF;
    IF handler !~ '^[A-Za-z0-9_.-]{1,128}$' THEN
        RAISE EXCEPTION 'INVALID_MESSAGE: handler % is not a name of 1-128 letters, digits, _ . -', quote_literal(left(handler, 150))
            USING ERRCODE = 'OB020';
    END IF;
END;
$$;

-- Records a delivery and returns the row as it now stands. Process the
-- message only when the returned status is RECEIVED or FAILED; PROCESSED
-- means a duplicate (skip and ack), DEAD_LETTER means it is parked.
CREATE OR REPLACE FUNCTION inbox.receive(
    message_id uuid,
    handler text,
    subject text,
    envelope jsonb DEFAULT NULL
)
RETURNS inbox.messages
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.messages;
BEGIN
    IF receive.message_id IS NULL OR nullif(btrim(receive.handler), '') IS NULL
        OR nullif(btrim(receive.subject), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_MESSAGE: message_id, handler and subject are required'
            USING ERRCODE = 'OB020';
    END IF;
    PERFORM inbox._check_message(receive.message_id, receive.handler);
    -- A NATS subject: no white space; 1,024 characters is far beyond any
    -- subject pgoutbox writes.
    IF receive.subject ~ '\s' OR length(receive.subject) > 1024 THEN
        RAISE EXCEPTION 'INVALID_MESSAGE: subject % is not a NATS subject of at most 1024 characters', quote_literal(left(receive.subject, 150))
            USING ERRCODE = 'OB020';
    END IF;
    IF jsonb_typeof(receive.envelope) IS DISTINCT FROM 'object' AND receive.envelope IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_MESSAGE: envelope must be a JSON object or NULL, got %', jsonb_typeof(receive.envelope)
            USING ERRCODE = 'OB020';
    END IF;
    -- 64 MiB: the largest message a NATS server can be configured to carry.
    IF octet_length(receive.envelope::text) > 67108864 THEN
        RAISE EXCEPTION 'VALUE_TOO_LARGE: envelope is % bytes of JSON, more than 67108864 (64 MiB)', octet_length(receive.envelope::text)
            USING ERRCODE = 'OB009';
    END IF;
    INSERT INTO inbox.messages AS m (message_id, handler, subject, envelope)
    VALUES (receive.message_id, receive.handler, receive.subject, receive.envelope)
    ON CONFLICT ON CONSTRAINT messages_pkey DO UPDATE
    SET attempts = m.attempts + 1
    WHERE m.status IN ('RECEIVED', 'FAILED')
    RETURNING * INTO row;
    IF NOT FOUND THEN
        -- Already PROCESSED or DEAD_LETTER: nothing to count, report it.
        SELECT * INTO row FROM inbox.messages AS m
        WHERE m.message_id = receive.message_id AND m.handler = receive.handler;
    END IF;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.receive(uuid, text, text, jsonb) IS
'Records a delivery (first or repeated) and returns the inbox row; process only RECEIVED/FAILED.';

-- Why a guarded inbox move matched no row: unknown message, or wrong state.
CREATE OR REPLACE FUNCTION inbox._refuse_move(message_id uuid, handler text, target text)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    current_status text;
BEGIN
    SELECT m.status INTO current_status FROM inbox.messages AS m
    WHERE m.message_id = _refuse_move.message_id AND m.handler = _refuse_move.handler;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'UNKNOWN_MESSAGE: no inbox row for message % and handler %', message_id, handler
            USING ERRCODE = 'OB021', HINT = 'Call inbox.receive() first.';
    END IF;
    RAISE EXCEPTION 'ILLEGAL_TRANSITION: message % for handler % cannot move from % to %', message_id, handler, current_status, target
        USING ERRCODE = 'OB010';
END;
$$;

-- The status test is written in collation "C" (for text equality the same
-- test) so that no partial index's predicate can be proved from it and the
-- plan probes the primary key whatever the statistics say. Written plainly it
-- proves messages_unprocessed_idx's (status <> 'PROCESSED'), and an ANALYZE
-- that saw no unsettled row prices a walk of that whole index at one page:
-- under a snapshot held by another session, every settled message's RECEIVED
-- entry (inbox.settle keeps out of it another way).
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
        AND m.status COLLATE "C" IN ('RECEIVED', 'FAILED')
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_move(message_id, handler, 'PROCESSED');
    END IF;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.mark_processed(uuid, text) IS
'RECEIVED/FAILED -> PROCESSED; in the handler''s own transaction for in-database handlers.';

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
        AND m.status COLLATE "C" IN ('RECEIVED', 'FAILED')  -- the primary key only: see mark_processed
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_move(message_id, handler, CASE WHEN dead THEN 'DEAD_LETTER' ELSE 'FAILED' END);
    END IF;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.record_error(uuid, text, text, boolean, interval) IS
'RECEIVED/FAILED -> FAILED, or -> DEAD_LETTER with dead => true (and the next replay after replay_after).';

-- Names the DLQ stream message that announced a dead letter: the consumer
-- calls it after record_error(..., dead => true), with the stream and
-- sequence of the notice's PubAck, so that outbox.dlq_show can point at it.
-- A separate function, not an argument of record_error: older consumers call
-- record_error during a rolling upgrade, and a defaulted argument added to it
-- would make their calls ambiguous. Best-effort by design: FALSE, changing
-- nothing, when the row is no longer a live dead letter (a replay took it,
-- an operator discarded it) or already names a later notice of that stream.
CREATE OR REPLACE FUNCTION inbox.record_dlq_notice(
    message_id uuid,
    handler text,
    stream text,
    stream_sequence bigint
)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_message(message_id, handler);
    -- A JetStream stream name: no whitespace, no subject tokens (. * >).
    IF stream IS NULL OR stream !~ '^[^\s.*>/\\]{1,255}$' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: stream must be a JetStream stream name, got %', stream
            USING ERRCODE = 'OB006';
    END IF;
    IF stream_sequence IS NULL OR stream_sequence < 1 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: stream_sequence must be 1 or more, got %', stream_sequence
            USING ERRCODE = 'OB006';
    END IF;
    UPDATE inbox.messages AS m
    SET dlq_metadata = m.dlq_metadata
        || jsonb_build_object('dlq_stream', record_dlq_notice.stream,
            'dlq_stream_sequence', record_dlq_notice.stream_sequence)
    WHERE m.message_id = record_dlq_notice.message_id AND m.handler = record_dlq_notice.handler
        AND m.status = 'DEAD_LETTER'
        AND NOT m.dlq_metadata ? 'discarded'
        AND NOT m.dlq_metadata ? 'in_database'
        AND (m.dlq_metadata ->> 'dlq_stream' IS DISTINCT FROM record_dlq_notice.stream
            OR (m.dlq_metadata ->> 'dlq_stream_sequence')::bigint < record_dlq_notice.stream_sequence);
    IF FOUND THEN
        RETURN TRUE;
    END IF;
    PERFORM 1 FROM inbox.messages AS m
    WHERE m.message_id = record_dlq_notice.message_id AND m.handler = record_dlq_notice.handler;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'UNKNOWN_MESSAGE: no inbox row for message % and handler %', message_id, handler
            USING ERRCODE = 'OB021';
    END IF;
    RETURN FALSE;
END;
$$;
COMMENT ON FUNCTION inbox.record_dlq_notice(uuid, text, text, bigint) IS
'Names the DLQ stream and sequence of a dead letter''s notice in dlq_metadata; FALSE unless a live dead letter.';

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

-- A received_at as the backlog floor's sequences hold it (microseconds since
-- the epoch; -infinity as the lowest bigint, which also stands for unset,
-- infinity as the highest), and back. Exact both ways: extract() gives a
-- numeric, and the way back multiplies intervals by whole seconds and
-- microseconds, each exact in a float8.
CREATE OR REPLACE FUNCTION inbox._backlog_micros(at timestamptz)
RETURNS bigint
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN at = '-infinity' THEN -9223372036854775807 - 1
        WHEN at = 'infinity' THEN 9223372036854775807
        ELSE (extract(epoch FROM at) * 1000000)::bigint END;
$$;

CREATE OR REPLACE FUNCTION inbox._backlog_time(micros bigint)
RETURNS timestamptz
LANGUAGE sql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN micros IS NULL OR micros = -9223372036854775807 - 1 THEN timestamptz '-infinity'
        WHEN micros = 9223372036854775807 THEN timestamptz 'infinity'
        ELSE timestamptz 'epoch' + (micros / 1000000) * interval '1 second'
            + (micros % 1000000) * interval '1 microsecond' END;
$$;

-- A RECEIVED or FAILED row received before the backlog floor or its
-- candidate (inbox._backlog_floor) lowers the floor to its received_at and
-- cancels the candidate: a row inserted by a transaction that began before
-- the candidate was taken (received_at is the transaction's start), one
-- with a received_at of its own, and a dead letter replayed or redriven
-- (DEAD_LETTER -> RECEIVED keeps its old received_at). The claim floor's
-- rule (outbox._lower_floor: under the floor's lock, so that no step moves
-- the floor past it before it is committed and seen).
CREATE OR REPLACE FUNCTION inbox._lower_backlog_floor(received_at timestamptz)
RETURNS void
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._lower_floor('pgoutbox.backlog_floor', 'inbox.backlog_floor', inbox._backlog_micros(received_at));
$$;

-- Every INSERT statement, once (a statement trigger: a batch of a hundred
-- rows pays one test, not a hundred): this transaction's id first, then the
-- candidate, then the floor, the order inbox._backlog_floor's argument needs
-- (a CASE evaluates its conditions in order).
CREATE OR REPLACE FUNCTION inbox.tg_messages__lower_backlog_floor_on_insert()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    lowest timestamptz;
BEGIN
    SELECT min(a.received_at) INTO lowest FROM added AS a WHERE a.status IN ('RECEIVED', 'FAILED');
    IF (
        CASE
            WHEN lowest IS NULL OR pg_current_xact_id() IS NULL THEN FALSE
            WHEN inbox._backlog_micros(lowest) < pg_sequence_last_value('inbox.backlog_floor_next') THEN TRUE
            ELSE inbox._backlog_micros(lowest) < pg_sequence_last_value('inbox.backlog_floor')
        END
    ) THEN
        PERFORM inbox._lower_backlog_floor(lowest);
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER _200_lower_backlog_floor_on_insert
AFTER INSERT ON inbox.messages
REFERENCING NEW TABLE AS added
FOR EACH STATEMENT
EXECUTE FUNCTION inbox.tg_messages__lower_backlog_floor_on_insert();

-- A settled row made RECEIVED or FAILED again (the WHEN of _200_lower_backlog_floor).
CREATE OR REPLACE FUNCTION inbox.tg_messages__lower_backlog_floor()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._lower_backlog_floor(NEW.received_at);
    RETURN NEW;
END;
$$;

-- Only a move back to RECEIVED/FAILED fires (the WHEN runs without entering
-- PL/pgSQL): receive and settle pay nothing.
CREATE OR REPLACE TRIGGER _200_lower_backlog_floor
BEFORE UPDATE ON inbox.messages
FOR EACH ROW
WHEN (
    old.status NOT IN ('RECEIVED', 'FAILED')
    AND new.status IN ('RECEIVED', 'FAILED')
)
EXECUTE FUNCTION inbox.tg_messages__lower_backlog_floor();

-- Moves the backlog floor up behind the RECEIVED/FAILED rows and returns
-- it; inbox.backlog() calls it first. The claim floor's two steps
-- (outbox._claim_floor, 30_outbox_api.sql), on received_at instead of the
-- id, by one caller at a time (the floor's advisory lock), under READ
-- COMMITTED, in a transaction that may write:
--   1. a candidate C: the earliest received_at of a RECEIVED/FAILED row at or
--      above the floor, at most this transaction's start (a row received by
--      a transaction that begins later has a later received_at). It is
--      published (backlog_floor_next), and only then does this transaction
--      take its own transaction id X (backlog_floor_wait);
--   2. at a later call, once no transaction with an id up to X is running
--      (the snapshot's xmin > X): the floor becomes the earliest received_at
--      below C of a RECEIVED/FAILED row, read in a snapshot taken after
--      that, or C.
-- Why no RECEIVED/FAILED row ends below the floor: every INSERT takes its
-- transaction id, then reads the candidate, then the floor
-- (_200_lower_backlog_floor_on_insert), and a row below either lowers them
-- under the floor's lock; a row that read the candidate before it was
-- published belongs to a transaction whose id came before X, which ended
-- before step 2, whose snapshot then sees its row. A settled row made
-- RECEIVED/FAILED again lowers the floor (_200_lower_backlog_floor). A
-- standby, a read-only transaction, or a caller whose transaction already
-- has an id (step 1) leaves the floor as it stands.
CREATE OR REPLACE FUNCTION inbox._backlog_floor()
RETURNS timestamptz
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
SET enable_seqscan TO off
AS $$
DECLARE
    floor_us bigint;
    next_us bigint;
    wait_xid bigint;
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN timestamptz '-infinity';  -- a standby cannot read an unlogged sequence
    END IF;
    floor_us := coalesce(pg_sequence_last_value('inbox.backlog_floor'), -9223372036854775807 - 1);
    IF current_setting('transaction_isolation') <> 'read committed'
        OR current_setting('transaction_read_only') = 'on'
        OR NOT pg_try_advisory_xact_lock(hashtextextended('pgoutbox.backlog_floor', 0)) THEN
        RETURN inbox._backlog_time(floor_us);
    END IF;
    floor_us := coalesce(pg_sequence_last_value('inbox.backlog_floor'), floor_us);
    next_us := pg_sequence_last_value('inbox.backlog_floor_next');
    IF next_us IS NULL THEN
        IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
            RETURN inbox._backlog_time(floor_us);
        END IF;
        SELECT inbox._backlog_micros(least(min(m.received_at), now())) INTO next_us
        FROM inbox.messages AS m
        WHERE m.status IN ('RECEIVED', 'FAILED') AND m.received_at >= inbox._backlog_time(floor_us);
        IF next_us > floor_us THEN
            -- An abort between these leaves the wait at its maximum: step 2
            -- then drops the candidate.
            PERFORM setval('inbox.backlog_floor_wait', 9223372036854775807);
            PERFORM setval('inbox.backlog_floor_next', next_us);
            PERFORM setval('inbox.backlog_floor_wait', pg_current_xact_id()::text::bigint);
        END IF;
        RETURN inbox._backlog_time(floor_us);
    END IF;
    wait_xid := pg_sequence_last_value('inbox.backlog_floor_wait');
    IF wait_xid IS NULL OR wait_xid = 9223372036854775807 THEN
        PERFORM setval('inbox.backlog_floor_next', 1, FALSE);
        RETURN inbox._backlog_time(floor_us);
    END IF;
    IF pg_snapshot_xmin(pg_current_snapshot())::text::bigint <= wait_xid THEN
        RETURN inbox._backlog_time(floor_us);
    END IF;
    SELECT coalesce(inbox._backlog_micros(min(m.received_at)), next_us) INTO floor_us
    FROM inbox.messages AS m
    WHERE m.status IN ('RECEIVED', 'FAILED')
        AND m.received_at >= inbox._backlog_time(floor_us) AND m.received_at < inbox._backlog_time(next_us);
    PERFORM setval('inbox.backlog_floor', floor_us), setval('inbox.backlog_floor_next', 1, FALSE);
    RETURN inbox._backlog_time(floor_us);
END;
$$;

-- QRY-051: unprocessed messages per context and handler. Two branches, each
-- served by its own partial index: the RECEIVED/FAILED rows from the backlog
-- floor up (inbox._backlog_floor, moved up first; below it only the index
-- entries of settled messages, which a snapshot held by another session
-- keeps from vacuum), the dead letters through messages_dead_letter_idx
-- (rare, and kept apart from the floor: a dead letter kept for months would
-- hold it down). VOLATILE: the floor's step writes its sequences.
CREATE OR REPLACE FUNCTION inbox.backlog(context text DEFAULT NULL)
RETURNS TABLE (
    context text,
    handler text,
    unprocessed bigint,
    oldest_unprocessed_at timestamptz,
    failed bigint,
    dead_letter bigint
)
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET enable_seqscan TO off
AS $$
    SELECT outbox._check_context(backlog.context);
    SELECT
        m.context,
        m.handler,
        count(*) FILTER (WHERE m.status IN ('RECEIVED', 'FAILED')),
        min(m.received_at) FILTER (WHERE m.status IN ('RECEIVED', 'FAILED')),
        count(*) FILTER (WHERE m.status = 'FAILED'),
        -- live dead letters: the discarded ones are counted by outbox.dlq_summary()
        count(*) FILTER (WHERE m.status = 'DEAD_LETTER' AND NOT m.discarded)
    FROM (
        SELECT u.context, u.handler, u.status, u.received_at, FALSE AS discarded
        FROM inbox.messages AS u
        WHERE u.status IN ('RECEIVED', 'FAILED')
            AND u.received_at >= (SELECT inbox._backlog_floor())
            AND (backlog.context IS NULL OR u.context = backlog.context)
        UNION ALL
        SELECT d.context, d.handler, d.status, d.received_at, d.dlq_metadata ? 'discarded'
        FROM inbox.messages AS d
        WHERE d.status = 'DEAD_LETTER'
            AND (backlog.context IS NULL OR d.context = backlog.context)
    ) AS m
    GROUP BY m.context, m.handler
    ORDER BY m.context, m.handler;
$$;
COMMENT ON FUNCTION inbox.backlog(text) IS
'Per context and handler: unprocessed count and oldest, failed and (live) dead-lettered counts.';

-- The batched path (a consumer records a whole fetch, then settles its
-- outcomes, in one call each). Same rules as receive(), mark_processed() and
-- record_error(), for one handler's messages at once.

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

-- Settles a batch of one handler's outcomes: `processed` -> PROCESSED,
-- `failed` -> FAILED with the error of the same position, counted in
-- dlq_metadata.failures as record_error() counts it. Returns the rows
-- it moved; a message it does not return was not RECEIVED/FAILED (another
-- delivery settled it first: its outcome stands) or has no inbox row.
-- Dead letters go through record_error(), after their DLQ notice.
-- A probe of the primary key per message, whatever the table holds. Left to
-- choose, the planner joined the batch to a scan of messages_unprocessed_idx
-- (the status test implies its predicate), which it takes for small: a walk
-- over every unsettled message (a consumer behind) and every entry a held
-- snapshot keeps (a settled message's RECEIVED version), at each batch
-- (measured: 7.8 shared buffers a message before a hold, 82 three minutes
-- into it, at 400 messages/s). So the statuses a row may move from come
-- with the batch (w.movable, a materialized CTE's column): a join
-- condition, which no partial index's predicate can be proved from; and no
-- hash or merge join, which would scan the table instead.
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
SET enable_hashjoin TO off
SET enable_mergejoin TO off
SET enable_seqscan TO off
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
    WITH wanted AS MATERIALIZED (
        SELECT p.id, NULL::text AS error, ARRAY['RECEIVED', 'FAILED'] AS movable FROM unnest($2) AS p (id)
        UNION ALL
        SELECT f.id, f.error, ARRAY['RECEIVED', 'FAILED'] FROM unnest($3, $4) AS f (id, error)
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
            AND m.status = ANY (w.movable)
        RETURNING m.message_id, m.status
    )
    SELECT mv.message_id, mv.status FROM moved AS mv
    $q$
    USING settle.handler, settle.processed, settle.failed, settle.errors;
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
