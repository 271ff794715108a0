-- 0018_steady_under_faults (down): back to version 17.
--
-- What it cannot undo: the register of the event ids callers gave emit
-- (outbox.event_keys) is dropped; the events keep their ids, but a retry of
-- one emitted before would then write a second event. No event is lost.

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

-- ---- broker faults

-- ---- upcasters

-- ---- held snapshots

-- ---- source rules

DROP FUNCTION IF EXISTS outbox.flow(uuid, integer);

REVOKE EXECUTE ON FUNCTION inbox.upcast(text, integer, integer, jsonb) FROM pgoutbox_writer;

DROP FUNCTION IF EXISTS outbox.emit(
    text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz, uuid
);

-- Emits one event inside the caller's transaction and returns its event_id.
-- Rolled back with the business change, it never existed.
CREATE OR REPLACE FUNCTION outbox.emit(
    aggregate_type text,
    aggregate_id text,
    event_type text,
    payload jsonb,
    context text DEFAULT NULL,
    event_version integer DEFAULT 1,
    headers jsonb DEFAULT '{}'::jsonb,
    correlation_id uuid DEFAULT NULL,
    causation_id uuid DEFAULT NULL,
    tenant_id text DEFAULT NULL,
    ordering_key text DEFAULT NULL,
    occurred_at timestamptz DEFAULT NULL
)
RETURNS uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    new_id uuid := gen_random_uuid();
BEGIN
    -- Per-key order is id order; holding a per-key lock until commit makes id
    -- order equal commit order, so a relay never sees a later event of a key
    -- while an earlier one is still uncommitted (and so invisible to claim).
    IF emit.ordering_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('pgoutbox.key:' || emit.ordering_key, 0));
    END IF;
    INSERT INTO outbox.events (
        event_id, context, aggregate_type, aggregate_id, event_type, event_version,
        payload, headers, correlation_id, causation_id, tenant_id, ordering_key,
        occurred_at
    ) VALUES (
        new_id,
        coalesce(emit.context, nullif(current_setting('pgoutbox.context', true), '')),
        emit.aggregate_type, emit.aggregate_id, emit.event_type, emit.event_version,
        emit.payload, emit.headers, emit.correlation_id, emit.causation_id,
        emit.tenant_id, emit.ordering_key, coalesce(emit.occurred_at, now())
    );
    RETURN new_id;
END;
$$;
COMMENT ON FUNCTION outbox.emit(
    text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz
) IS 'Writes an event in the caller''s transaction; returns its event_id (the Nats-Msg-Id).';
REVOKE ALL ON FUNCTION
outbox.emit(text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz)
FROM public;
GRANT EXECUTE ON FUNCTION
outbox.emit(text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz)
TO pgoutbox_writer;

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

-- The given ids' register goes: their events keep their ids, but a retry of
-- one after this would write a second event (see "What it cannot undo").
DROP TABLE IF EXISTS outbox.event_keys;

DROP INDEX IF EXISTS outbox.events_correlation_idx;

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

-- ---- the console

DELETE FROM outbox.schema_migrations
WHERE version = 18;

COMMIT;
