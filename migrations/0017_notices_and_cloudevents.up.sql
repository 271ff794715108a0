-- 0017_notices_and_cloudevents (up): a dead letter names its DLQ notice.
--
--   * inbox.record_dlq_notice(message_id, handler, stream, stream_sequence),
--     granted to pgoutbox_consumer: records which DLQ stream message
--     announced a dead letter (dlq_metadata.dlq_stream, dlq_stream_sequence);
--     the consumer calls it after record_error(..., dead => true);
--   * inbox.record_error(..., dead => true) drops the previous dead letter's
--     notice keys (same signature: older consumers call it unchanged);
--   * outbox.dlq_show reports dlq_stream next to dlq_stream_sequence;
--   * outbox.emit refuses (OB017) the emitter ce-* headers and Content-Type
--     the relay would refuse (BAD_HEADER) after the fact:
--     outbox._check_cloudevents_headers, behind _headers_pass's fast path.
--
-- Expand only: workers of the previous release run on it unchanged (they
-- never call the new function; their dead letters simply name no notice).
-- An application whose emits carry such headers gets OB017 at emit instead
-- of a dead letter at publish.
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 16 or 17.
-- Reads no table.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0017 needs 0001 to 0016 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (16, 17) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0017 applies on version 16 (or re-runs on 17) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

-- True when the headers are plainly fine, which is one expression instead
-- of _check_headers' query (about 10 µs); otherwise that query decides, and
-- raises the error (the result is then true too). Plainly fine is only ever
-- said where the query would raise nothing. Names that are HTTP tokens need
-- no escape in JSON text, so a list of them reads ["name", "name", ...].
CREATE OR REPLACE FUNCTION outbox._headers_pass(headers jsonb)
RETURNS boolean
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    names jsonb := jsonb_path_query_array(headers, '$.keyvalue().key');
BEGIN
    IF NOT (
        octet_length(headers::text) <= 16384
        AND octet_length(names::text) <= 260
        AND names::text ~ '^\["[-!#$%&''*+.^_`|~0-9A-Za-z]+"(, "[-!#$%&''*+.^_`|~0-9A-Za-z]+")*\]$'
        AND names::text !~* '"(nats-|pgoutbox-|status"|description")'
        -- CloudEvents attributes and a Content-Type: the query checks them
        AND names::text !~* '"(ce-|content-type")'
        -- no name twice in any letter case: as many names once lowered
        AND (
            names::text !~ '[A-Z]'
            OR jsonb_array_length(jsonb_path_query_array(lower(headers::text)::jsonb, '$.keyvalue()'))
            = jsonb_array_length(names)
        )
        AND NOT jsonb_path_exists(
            headers,
            '$.keyvalue() ? (@.value.type() == "string" && (@.value like_regex "[\\r\\n]|^\\s|\\s$"'
            ' || (@.key like_regex "^trace(parent|state)$" flag "i" && !(@.value like_regex "^[\\t\\x20-\\x7e]*$"))))'
        )
    ) THEN
        PERFORM outbox._check_headers(headers);
    END IF;
    RETURN TRUE;
END;
$$;

-- The emitter's headers become NATS headers next to pgoutbox's own. Names
-- are HTTP tokens, compared in any letter case (as NATS and HTTP do): none
-- may claim a name NATS or JetStream interpret (Nats-*; Status and
-- Description mark a status reply, and a "Status: 404" message would end a
-- consumer's fetch) or pgoutbox writes (Pgoutbox-*), nor appear twice. String values are sent as they are (no
-- line break, no white space at either end: clients trim it); other JSON
-- values as their JSON text; null ones not at all.
CREATE OR REPLACE FUNCTION outbox._check_headers(headers jsonb)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    reserved text;
    bad_name text;
    bad_value text;
    twice boolean;
BEGIN
    IF octet_length(headers::text) > 16384 THEN
        RAISE EXCEPTION 'VALUE_TOO_LARGE: headers are % bytes of JSON, more than 16384 (16 KiB)', octet_length(headers::text)
            USING ERRCODE = 'OB009';
    END IF;
    -- One pass (emit's hot path): the first offender of each kind.
    SELECT
        min(h.key) FILTER (
            WHERE lower(h.key) LIKE 'nats-%' OR lower(h.key) LIKE 'pgoutbox-%' OR lower(h.key) IN ('status', 'description')
        ),
        min(h.key) FILTER (WHERE h.key !~ '^[-!#$%&''*+.^_`|~0-9A-Za-z]+$' OR length(h.key) > 256),
        min(h.key) FILTER (
            WHERE jsonb_typeof(h.value) = 'string' AND (
                (h.value #>> '{}') ~ '[\r\n]|^\s|\s$'
                -- the trace context becomes an HTTP header of the handler call
                OR (lower(h.key) IN ('traceparent', 'tracestate') AND (h.value #>> '{}') !~ '^[\t\x20-\x7e]*$')
            )
        ),
        count(DISTINCT lower(h.key)) < count(*)
    INTO reserved, bad_name, bad_value, twice
    FROM jsonb_each(headers) AS h (key, value);
    IF reserved IS NOT NULL THEN
        RAISE EXCEPTION 'RESERVED_HEADER: header % is reserved (Nats-*, Pgoutbox-*, Status and Description, in any letter case)', quote_literal(reserved)
            USING ERRCODE = 'OB016';
    END IF;
    IF bad_name IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_HEADER: header name % is not a token of 1-256 letters, digits and !#$%%&''*+-.^_`|~', quote_literal(left(bad_name, 64))
            USING ERRCODE = 'OB017', HINT = 'No colon, white space, control or non-ASCII character.';
    END IF;
    IF twice THEN
        RAISE EXCEPTION 'INVALID_HEADER: a header name is given twice (names are compared in any letter case)'
            USING ERRCODE = 'OB017';
    END IF;
    IF bad_value IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_HEADER: the value of header % has a line break or starts or ends with white space (traceparent, tracestate: visible ASCII only)', quote_literal(bad_value)
            USING ERRCODE = 'OB017';
    END IF;
    PERFORM outbox._check_cloudevents_headers(headers);
END;
$$;

-- The relay's CloudEvents rules for emitter headers (docs/cloudevents.md),
-- checked at emit: the relay would refuse such an event (BAD_HEADER) and
-- dead-letter it after it was accepted. A ce-* name is ce- then 1-64
-- lower-case letters and digits; specversion and datacontenttype are
-- pgoutbox's (1.0, application/json): a copy must agree; no ce-* value is
-- empty; ce-time is an RFC 3339 timestamp; no Content-Type claims
-- structured mode (application/cloudevents...). Not checked here: ce-id,
-- which must equal the event id (the relay still refuses a different one).
CREATE OR REPLACE FUNCTION outbox._check_cloudevents_headers(headers jsonb)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    h record;
    attribute text;
    value text;
BEGIN
    FOR h IN SELECT e.key, e.value FROM jsonb_each(headers) AS e (key, value) ORDER BY e.key LOOP
        CONTINUE WHEN jsonb_typeof(h.value) = 'null';
        value := CASE WHEN jsonb_typeof(h.value) = 'string' THEN h.value #>> '{}' ELSE h.value::text END;
        IF lower(h.key) = 'content-type' AND lower(value) LIKE 'application/cloudevents%' THEN
            RAISE EXCEPTION 'INVALID_HEADER: header Content-Type says structured mode (application/cloudevents...); the body is the payload'
                USING ERRCODE = 'OB017';
        END IF;
        CONTINUE WHEN lower(left(h.key, 3)) <> 'ce-';
        attribute := lower(substr(h.key, 4));
        IF attribute !~ '^[a-z0-9]{1,64}$' THEN
            RAISE EXCEPTION 'INVALID_HEADER: header name % does not name a CloudEvents attribute (ce- then a-z, 0-9)', quote_literal(left(h.key, 80))
                USING ERRCODE = 'OB017';
        END IF;
        IF attribute = 'specversion' AND value <> '1.0'
            OR attribute = 'datacontenttype' AND value <> 'application/json' THEN
            RAISE EXCEPTION 'INVALID_HEADER: header % % differs from pgoutbox''s %', h.key, quote_literal(left(value, 80)),
                CASE attribute WHEN 'specversion' THEN '1.0' ELSE 'application/json' END
                USING ERRCODE = 'OB017';
        END IF;
        IF value = '' THEN
            RAISE EXCEPTION 'INVALID_HEADER: header % is empty (an attribute has a value, or is absent)', h.key
                USING ERRCODE = 'OB017';
        END IF;
        IF attribute = 'time' AND NOT outbox._is_rfc3339(value) THEN
            RAISE EXCEPTION 'INVALID_HEADER: header % % is not an RFC 3339 timestamp', h.key, quote_literal(left(value, 80))
                USING ERRCODE = 'OB017';
        END IF;
    END LOOP;
END;
$$;

-- An RFC 3339 date-time (upper-case T and Z, or a space) that is a real
-- instant: stricter than what the relay's reader accepts, never looser.
CREATE OR REPLACE FUNCTION outbox._is_rfc3339(value text)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF value !~ '^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d{1,6})?(Z|[+-]\d{2}:\d{2})$' THEN
        RETURN FALSE;
    END IF;
    -- the fields in range (no 2024-13-01, no 25:00): the cast decides
    PERFORM value::timestamptz;
    RETURN substr(value, 12, 2)::integer < 24 AND substr(value, 18, 2)::integer < 60 AND left(value, 4) <> '0000';
EXCEPTION
    WHEN datetime_field_overflow OR invalid_datetime_format OR invalid_time_zone_displacement_value THEN
        RETURN FALSE;
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

REVOKE ALL ON FUNCTION inbox.record_dlq_notice(uuid, text, text, bigint) FROM public;
REVOKE ALL ON FUNCTION outbox._check_cloudevents_headers(jsonb), outbox._is_rfc3339(text) FROM public;
GRANT EXECUTE ON FUNCTION inbox.record_dlq_notice(uuid, text, text, bigint) TO pgoutbox_consumer;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (17, '0017_notices_and_cloudevents')
ON CONFLICT (version) DO NOTHING;

COMMIT;
