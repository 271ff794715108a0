-- 0017_notices_and_cloudevents (down): back to version 16: no
-- inbox.record_dlq_notice, no CloudEvents header rules at emit;
-- record_error, dlq_show and the header checks as 0016 left them.
--
-- What it cannot undo: nothing is lost. Recorded notice keys (dlq_stream,
-- dlq_stream_sequence) stay in dlq_metadata; version 16 ignores dlq_stream
-- and its dlq_show still reports dlq_stream_sequence.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 17) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

DROP FUNCTION IF EXISTS inbox.record_dlq_notice(uuid, text, text, bigint);

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
END;
$$;

DROP FUNCTION IF EXISTS outbox._check_cloudevents_headers(jsonb);
DROP FUNCTION IF EXISTS outbox._is_rfc3339(text);

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

DELETE FROM outbox.schema_migrations
WHERE version = 17;

COMMIT;
