-- 0018_steady_under_faults (up): what a broker outage, a failing upcaster,
-- a snapshot held by another session and a hostile console input do to
-- pgoutbox: each delays work, none loses or dead-letters it.
--
-- (The sections below are filled by the changes of this release.)
--
-- Expand only: workers of the previous release run on it unchanged.
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 17 or 18.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0018 needs 0001 to 0017 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (17, 18) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0018 applies on version 17 (or re-runs on 18) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

-- ---- broker faults: the relay hands back what JetStream did not answer

-- ---- upcasters: any error of an upcaster is that message's own outcome

-- ---- held snapshots: the hot path does not grow with the oldest snapshot

-- ---- source rules: a caller's event id (retry-safe emit), a flow by its correlation id

-- Built while emit waits (a partitioned table's index cannot be built
-- CONCURRENTLY); partitions indexed beforehand (docs/upgrading.md) are
-- attached, not built again.
CREATE INDEX IF NOT EXISTS events_correlation_idx ON outbox.events (correlation_id, id)
WHERE correlation_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS outbox.event_keys (
    event_id uuid PRIMARY KEY,
    content_md5 uuid NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE outbox.event_keys IS
'Event ids given by callers (outbox.emit(event_id => ...)): one event per id, kept for good.';

-- generated from sql/20_outbox_guards.sql: outbox._event_fingerprint
-- What makes two events with one given id the same event: everything the
-- caller states about it, but not its headers (a retry carries a new trace)
-- nor its occurred_at (a retry that leaves it to the default gets a new one).
-- jsonb's text is canonical: key order and white space do not count; the
-- line breaks between the parts cannot occur in any of them (the policies
-- refuse them, and JSON text escapes them), nor can '' (refused where a
-- value is optional). No SET clause, so that emit's expression inlines it
-- (a SET makes each call save and restore the setting: about 10 µs).
CREATE OR REPLACE FUNCTION outbox._event_fingerprint(
    context text,
    aggregate_type text,
    aggregate_id text,
    event_type text,
    event_version integer,
    payload jsonb,
    correlation_id uuid,
    causation_id uuid,
    tenant_id text,
    ordering_key text
)
RETURNS uuid
LANGUAGE sql IMMUTABLE
AS $$
    SELECT pg_catalog.md5(
        context || E'\n' || aggregate_type || E'\n' || aggregate_id || E'\n' || event_type
        || E'\n' || event_version::text || E'\n' || payload::text
        || E'\n' || coalesce(correlation_id::text, '') || E'\n' || coalesce(causation_id::text, '')
        || E'\n' || coalesce(tenant_id, '') || E'\n' || coalesce(ordering_key, '')
    )::uuid;
$$;
-- end generated

-- generated from sql/20_outbox_guards.sql: outbox._register_event_id
-- Registers a given event id (outbox.event_keys): true when it is new (the
-- row is to be written), false when the same event holds it already (the
-- row is not written), EVENT_ID_CONFLICT when another event holds it. A
-- second session with the same id waits here for the first to end (ON
-- CONFLICT waits on the uncommitted key), so two at once write one row.
CREATE OR REPLACE FUNCTION outbox._register_event_id(event_id uuid, content_md5 uuid)
RETURNS boolean
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    held uuid;
BEGIN
    INSERT INTO outbox.event_keys (event_id, content_md5)
    VALUES (_register_event_id.event_id, _register_event_id.content_md5)
    ON CONFLICT DO NOTHING;
    IF FOUND THEN
        RETURN TRUE;
    END IF;
    SELECT k.content_md5 INTO held FROM outbox.event_keys AS k WHERE k.event_id = _register_event_id.event_id;
    IF held = _register_event_id.content_md5 THEN
        RETURN FALSE;
    END IF;
    RAISE EXCEPTION 'EVENT_ID_CONFLICT: event id % belongs to an event with other content', _register_event_id.event_id
        USING ERRCODE = 'OB018',
              HINT = 'An event id names one event: derive it from the business key of that one event.';
END;
$$;
-- end generated

-- generated from sql/20_outbox_guards.sql: outbox.tg_events__check_policies
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
        -- a drawn id (version 4), or one emit has just registered; any other
        -- was given to an INSERT, and is registered below
        AND (
            substr(NEW.event_id::text, 15, 1) = '4'
            OR NEW.event_id::text || '@' || statement_timestamp()::text = current_setting('pgoutbox.registered_event_id', true)
        )
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
            -- Not a rule broken: an id given to an INSERT, held to one event per id.
            WHEN substr(NEW.event_id::text, 15, 1) <> '4'
                AND NEW.event_id::text || '@' || statement_timestamp()::text
                IS DISTINCT FROM current_setting('pgoutbox.registered_event_id', true)
                THEN 'given id'
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
        ELSIF broken = 'given id' AND NOT outbox._register_event_id(
            NEW.event_id,
            outbox._event_fingerprint(
                NEW.context, NEW.aggregate_type, NEW.aggregate_id, NEW.event_type, NEW.event_version,
                NEW.payload, NEW.correlation_id, NEW.causation_id, NEW.tenant_id, NEW.ordering_key
            )
        ) THEN
            -- The same event again (a retry whose commit was not seen): it
            -- exists already, and nothing is written.
            RETURN NULL;
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
-- end generated

-- emit takes event_id: a new signature, so the old one goes (a call that
-- names fewer arguments finds the new one by its defaults).
DROP FUNCTION IF EXISTS outbox.emit(text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz);

-- generated from sql/30_outbox_api.sql: outbox.emit
-- Emits one event inside the caller's transaction and returns its event_id.
-- Rolled back with the business change, it never existed.
--
-- event_id: the caller's own id for the event, to retry safely (e.g. a
-- UUIDv5 of its business key, after a commit whose acknowledgement was
-- lost). Emitted again with the same content (outbox._event_fingerprint), it
-- returns the id and writes nothing; with other content, EVENT_ID_CONFLICT.
-- A version-4 id is refused (INVALID_EVENT_ID): those are the ids emit draws,
-- which are not registered (outbox.event_keys). emit registers a given id
-- itself and tells the INSERT policy trigger so (pgoutbox.registered_event_id),
-- which registers the id of any other INSERT: an owner's is held to the same
-- rule. (Registering here, not in the trigger, spares a given id the
-- trigger's slow path: about 25 µs.)
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
    occurred_at timestamptz DEFAULT NULL,
    event_id uuid DEFAULT NULL
)
RETURNS uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    new_id uuid := coalesce(emit.event_id, gen_random_uuid());
BEGIN
    -- One test for both options in the common case (plpgsql prepares each
    -- IF's expression anew in every transaction: about 0.5 µs each).
    IF emit.ordering_key IS NOT NULL OR emit.event_id IS NOT NULL THEN
        -- Per-key order is id order; holding a per-key lock until commit makes id
        -- order equal commit order, so a relay never sees a later event of a key
        -- while an earlier one is still uncommitted (and so invisible to claim).
        IF emit.ordering_key IS NOT NULL THEN
            PERFORM pg_advisory_xact_lock(hashtextextended('pgoutbox.key:' || emit.ordering_key, 0));
        END IF;
        IF emit.event_id IS NOT NULL THEN
            IF substr(emit.event_id::text, 15, 1) = '4' THEN
                RAISE EXCEPTION 'INVALID_EVENT_ID: % is a version-4 (random) UUID, the kind emit draws itself', emit.event_id
                    USING ERRCODE = 'OB019',
                          HINT = 'Derive the id from your business key, e.g. a UUIDv5 (uuid_generate_v5, Python''s uuid.uuid5).';
            END IF;
            -- outbox._register_event_id's first step, written out: a call of it
            -- costs about 10 µs; it decides only when the id is held already.
            INSERT INTO outbox.event_keys (event_id, content_md5)
            VALUES (new_id, outbox._event_fingerprint(
                coalesce(emit.context, nullif(current_setting('pgoutbox.context', true), '')),
                emit.aggregate_type, emit.aggregate_id, emit.event_type, emit.event_version,
                emit.payload, emit.correlation_id, emit.causation_id, emit.tenant_id, emit.ordering_key
            ))
            ON CONFLICT DO NOTHING;
            IF NOT FOUND AND NOT outbox._register_event_id(new_id, outbox._event_fingerprint(
                coalesce(emit.context, nullif(current_setting('pgoutbox.context', true), '')),
                emit.aggregate_type, emit.aggregate_id, emit.event_type, emit.event_version,
                emit.payload, emit.correlation_id, emit.causation_id, emit.tenant_id, emit.ordering_key
            )) THEN
                RETURN new_id;  -- the same event again: it exists, nothing is written
            END IF;
            -- For this statement only: a later INSERT of the same transaction
            -- (an owner's) has another statement_timestamp, and is checked.
            PERFORM set_config('pgoutbox.registered_event_id', new_id::text || '@' || statement_timestamp()::text, true);
        END IF;
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
    text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz, uuid
) IS 'Writes an event in the caller''s transaction; returns its event_id (the Nats-Msg-Id; the caller''s if given).';
-- end generated

-- generated from sql/69_flows.sql: outbox.flow
-- One row per event and handler (handler NULL: no handler has received the
-- event yet, or none consumes it). Events come in id order (emit order, which
-- is commit order per ordering key), their handlers in name order; at most
-- max_rows events (the first ones of the flow), served by
-- events_correlation_idx. A discarded dead letter shows as DEAD_LETTER with
-- discarded true, on either side.
CREATE OR REPLACE FUNCTION outbox.flow(correlation_id uuid, max_rows integer DEFAULT 1000)
RETURNS TABLE (
    id bigint,
    event_id uuid,
    created_at timestamptz,
    subject text,
    aggregate_type text,
    aggregate_id text,
    causation_id uuid,
    status text,
    attempts integer,
    published_at timestamptz,
    last_error text,
    handler text,
    inbox_status text,
    inbox_attempts integer,
    processed_at timestamptz,
    inbox_last_error text,
    discarded boolean
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF flow.correlation_id IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: correlation_id is required' USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_max_rows(max_rows);
    RETURN QUERY
    SELECT
        e.id, e.event_id, e.created_at, e.subject, e.aggregate_type, e.aggregate_id, e.causation_id,
        e.status, e.attempts, e.published_at, e.last_error,
        m.handler, m.status, m.attempts, m.processed_at, m.last_error,
        e.status = 'DISCARDED' OR coalesce(m.dlq_metadata ? 'discarded', FALSE)
    FROM (
        SELECT ev.*
        FROM outbox.events AS ev
        WHERE ev.correlation_id = flow.correlation_id
        ORDER BY ev.id
        LIMIT max_rows
    ) AS e
    LEFT JOIN inbox.messages AS m ON m.message_id = e.event_id
    ORDER BY e.id, m.handler;
END;
$$;
COMMENT ON FUNCTION outbox.flow(uuid, integer) IS
'The events of one correlation id in emit order, their publish state and each handler''s inbox outcome.';
-- end generated

-- A command key of white space only (a tab, a line break) is blank too.
-- generated from sql/65_inbox_commands.sql: inbox._check_command
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
-- end generated

REVOKE ALL ON FUNCTION
outbox.emit(text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz, uuid),
outbox.flow(uuid, integer),
outbox._event_fingerprint(text, text, text, text, integer, jsonb, uuid, uuid, text, text),
outbox._register_event_id(uuid, uuid)
FROM public;
GRANT EXECUTE ON FUNCTION
outbox.emit(text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz, uuid)
TO pgoutbox_writer;
GRANT EXECUTE ON FUNCTION outbox.flow(uuid, integer) TO pgoutbox_viewer, pgoutbox_admin;
-- An application upcasts in its own transaction too (docs/consumer.md).
GRANT EXECUTE ON FUNCTION inbox.upcast(text, integer, integer, jsonb) TO pgoutbox_writer;

-- ---- the console

INSERT INTO outbox.schema_migrations (version, name)
VALUES (18, '0018_steady_under_faults')
ON CONFLICT (version) DO NOTHING;

COMMIT;
