-- Guards on outbox.events that hold for every writer, whatever path it takes:
-- policies on INSERT, legal moves and immutability on UPDATE, no DELETE.
-- Trigger names carry their firing order (_100 before _500).

-- What makes two events with one given id the same event: everything the
-- caller states about it, but not its headers (a retry carries a new trace),
-- its occurred_at (a retry that leaves it to the default gets a new one) nor
-- its delivery time (deliver_after counts from each retry). jsonb's text is
-- canonical: key order and white space do not count; the line breaks between
-- the parts cannot occur in any of them (the policies refuse them, and JSON
-- text escapes them), nor can '' (refused where a value is optional). No SET
-- clause, so that a caller's expression inlines it.
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
--
-- No SET clause: a function's SET saves, sets and restores the setting at
-- every call, which cost every emit about 5 µs of backend CPU (bench/emit_bench.py).
-- Only the owner inserts into outbox.events: through emit, whose search_path
-- is pinned, or by hand, under a search_path of its own choosing, and a
-- trigger function runs with the rights of the role that inserts: a path
-- can lend it nothing. The outbox objects it names carry their schema.
CREATE OR REPLACE FUNCTION outbox.tg_events__check_policies()
RETURNS trigger
LANGUAGE plpgsql
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
        -- ten digits, or a NULL that a NOT NULL constraint refuses next. Tested
        -- first: NULL AND NOT _register_event_id(...) (the last branch) would
        -- call it, and register a drawn id.
        IF broken IS NULL THEN
            NULL;
        ELSIF broken = 'required' THEN
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
    -- The claim floor (outbox._claim_floor, 30_outbox_api.sql): a row below it
    -- or below its candidate lowers them (a restore, an owner's INSERT with an
    -- id of its own, an INSERT that took its id before a candidate was taken).
    -- This transaction's id first, then the candidate, then the floor: the
    -- order the floor's argument needs (a CASE evaluates its conditions in
    -- order; read the other way round, a floor read before a step 2 and a
    -- candidate read after it would miss both). Here, not in a trigger of its
    -- own: a second BEFORE INSERT trigger with this test as its WHEN cost
    -- every emit about 16 µs of backend CPU, the test here a few.
    IF (
        CASE
            WHEN pg_current_xact_id() IS NULL THEN FALSE
            WHEN NEW.id < pg_sequence_last_value('outbox.claim_floor_next') THEN TRUE
            ELSE NEW.id < pg_sequence_last_value('outbox.claim_floor')
        END
    ) THEN
        PERFORM outbox._lower_claim_floor(NEW.id);
    END IF;
    -- The row passed: wake the relays if a wake-up is due (15_outbox_wakeup.sql).
    IF outbox._wakeup_is_due() THEN
        PERFORM outbox._wake_relays(NEW.context);
    END IF;
    RETURN NEW;
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

-- Raised by _100_guard_content, whose WHEN clause has found a content change.
CREATE OR REPLACE FUNCTION outbox.tg_events__forbid_content_change()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'IMMUTABLE_EVENT: event % is immutable once emitted; only its delivery state changes', OLD.event_id
        USING ERRCODE = 'OB011';
END;
$$;

-- Every status move the trigger's WHEN clause (below) lets through: a no-op,
-- an operator requeue (of a dead letter, or of a COMPLETED event whose
-- message the broker lost), a relay's hand-back, or an illegal move.
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

    -- A discarded dead letter (a row in outbox.discarded_events, written by
    -- outbox.dlq_discard and audited there; sql/67_dead_letters.sql) moves
    -- nowhere: it is never requeued until outbox.dlq_restore takes the mark
    -- away. Its status stays DEAD_LETTER, so only such a row pays the lookup.
    IF OLD.status = 'DEAD_LETTER'
        AND EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = OLD.event_id) THEN
        RAISE EXCEPTION 'DISCARDED: % is discarded; it moves nowhere until restored', OLD.event_id
            USING ERRCODE = 'OB101', HINT = 'Restore it first (outbox.dlq_restore).';
    END IF;

    -- PROCESSING -> PENDING only inside outbox.hand_back() (sql/30_outbox_api.sql),
    -- which sets pgoutbox.hand_back to the claim's token: the broker did not
    -- answer, so the event is due now with the claim's attempt undone. Its
    -- claim (token, time, worker) stays as it was, for the record.
    IF OLD.status = 'PROCESSING' AND NEW.status = 'PENDING'
        AND OLD.claim_token::text = current_setting('pgoutbox.hand_back', true)
        AND NEW.attempts = OLD.attempts - 1
        AND NEW.available_at <= now()
        AND (NEW.claimed_at, NEW.claimed_by, NEW.claim_token, NEW.published_at)
        IS NOT DISTINCT FROM (OLD.claimed_at, OLD.claimed_by, OLD.claim_token, OLD.published_at) THEN
        RETURN NEW;
    END IF;

    -- PENDING -> DEAD_LETTER only inside outbox.cancel() (sql/36_outbox_schedules.sql),
    -- which sets pgoutbox.cancel_reason: a scheduled event cancelled before
    -- it fell due, written to outbox.cancel_log here. Without the setting, the
    -- move is illegal like any other (below).
    reason := nullif(btrim(current_setting('pgoutbox.cancel_reason', true)), '');
    IF OLD.status = 'PENDING' AND NEW.status = 'DEAD_LETTER' AND reason IS NOT NULL THEN
        IF OLD.available_at <= now()
            OR (NEW.attempts, NEW.available_at, NEW.claimed_at, NEW.claimed_by, NEW.claim_token, NEW.published_at)
            IS DISTINCT FROM
            (OLD.attempts, OLD.available_at, OLD.claimed_at, OLD.claimed_by, OLD.claim_token, OLD.published_at) THEN
            RAISE EXCEPTION 'NOT_CANCELLABLE: event % is cancelled only before it falls due, with nothing else changed', OLD.event_id
                USING ERRCODE = 'OB024';
        END IF;
        INSERT INTO outbox.cancel_log (event_id, cancelled_by, reason, deliver_at)
        VALUES (OLD.event_id, session_user, reason, OLD.available_at);
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

CREATE OR REPLACE TRIGGER _100_check_policies
BEFORE INSERT ON outbox.events
FOR EACH ROW EXECUTE FUNCTION outbox.tg_events__check_policies();

-- The event's content never changes. A trigger limited to UPDATEs that name
-- a content column (UPDATE OF), so that claim and mark, which set only
-- delivery columns, neither fire it nor pay for comparing 16 columns.
-- One exception, the id (the row's place in the claim order, not the
-- event's content): a scheduled event (events_scheduled_idx's rows) takes
-- a higher one as it is first claimed, PENDING -> PROCESSING (outbox.claim).
CREATE OR REPLACE TRIGGER _100_guard_content
BEFORE UPDATE OF
id, event_id, context, aggregate_type, aggregate_id, event_type, event_version, subject,
payload, headers, correlation_id, causation_id, tenant_id, ordering_key, occurred_at, created_at
ON outbox.events
FOR EACH ROW
WHEN (
    (
        new.event_id, new.context, new.aggregate_type, new.aggregate_id,
        new.event_type, new.event_version, new.subject, new.payload, new.headers,
        new.correlation_id, new.causation_id, new.tenant_id, new.ordering_key,
        new.occurred_at, new.created_at
    )
    IS DISTINCT FROM
    (
        old.event_id, old.context, old.aggregate_type, old.aggregate_id,
        old.event_type, old.event_version, old.subject, old.payload, old.headers,
        old.correlation_id, old.causation_id, old.tenant_id, old.ordering_key,
        old.occurred_at, old.created_at
    )
    OR new.id IS DISTINCT FROM old.id AND NOT (
        new.id > old.id AND new.status = 'PROCESSING'
        AND old.status = 'PENDING' AND old.claimed_at IS NULL AND old.ordering_key IS NULL
        AND old.available_at > old.created_at
    )
)
EXECUTE FUNCTION outbox.tg_events__forbid_content_change();

-- The legal moves made by claim and mark_* (thousands a second) are told
-- apart here, in the WHEN clause, which runs without entering PL/pgSQL:
--   PENDING | FAILED -> PROCESSING   once due (available_at <= now())
--   PROCESSING -> PROCESSING         once the lease expired, under a new token
--   PROCESSING -> COMPLETED | FAILED | DEAD_LETTER   under the same token
-- Every other UPDATE goes to the function (DEAD_LETTER -> PENDING, and
-- COMPLETED -> PENDING through outbox.requeue_completed, with a reason, and
-- PROCESSING -> PENDING through outbox.hand_back, are the other legal moves).
CREATE OR REPLACE TRIGGER _100_guard_update
BEFORE UPDATE ON outbox.events
FOR EACH ROW
WHEN (
    NOT (
        (
            old.status IN ('PENDING', 'FAILED') AND new.status = 'PROCESSING'
            AND old.available_at <= now()
        )
        OR (
            old.status = 'PROCESSING' AND new.status = 'PROCESSING'
            AND old.available_at <= now()
            AND new.claim_token IS DISTINCT FROM old.claim_token
        )
        OR (
            old.status = 'PROCESSING' AND new.status IN ('COMPLETED', 'FAILED', 'DEAD_LETTER')
            AND new.claim_token IS NOT DISTINCT FROM old.claim_token
        )
    )
)
EXECUTE FUNCTION outbox.tg_events__guard_update();

-- An event below the claim floor or its candidate (outbox._claim_floor,
-- sql/30_outbox_api.sql) that is, or becomes, claimable lowers the floor to
-- its id and cancels the candidate: a finished event made claimable again
-- (requeue, requeue_completed), and a row inserted with an id of its own
-- (a restore, an owner's INSERT ... OVERRIDING SYSTEM VALUE) or one whose id
-- the sequence gave out before a candidate was taken (outbox._lower_floor:
-- under the floor's lock, so that no claimer moves the floor past it before
-- it is committed and seen).
CREATE OR REPLACE FUNCTION outbox._lower_claim_floor(row_id bigint)
RETURNS void
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._lower_floor('pgoutbox.claim_floor', 'outbox.claim_floor', row_id);
$$;

-- A finished event made claimable again (the WHEN of _200_lower_claim_floor).
CREATE OR REPLACE FUNCTION outbox.tg_events__lower_claim_floor()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._lower_claim_floor(NEW.id);
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER _200_lower_claim_floor
BEFORE UPDATE ON outbox.events
FOR EACH ROW
WHEN (
    old.status NOT IN ('PENDING', 'FAILED', 'PROCESSING')
    AND new.status IN ('PENDING', 'FAILED', 'PROCESSING')
)
EXECUTE FUNCTION outbox.tg_events__lower_claim_floor();

SELECT outbox._attach_guards('outbox.events', 'outbox.tg_events__forbid_delete()', 'ROW');

-- PostgreSQL clones row triggers to partitions, not statement ones: TRUNCATE
-- of a partition by name fires only that partition's triggers. So every
-- partition carries its own guard (create_partitions adds it to each new day).
SELECT outbox._attach_guards('outbox.events_default', 'outbox.tg_events__forbid_delete()', NULL);

-- Rows leave outbox.events only with a whole archived partition, dropped by
-- outbox.drop_archived. DETACH PARTITION would take a day of events out of
-- every relay's sight with no audit, so it is refused, for the owner too:
-- the end of every ALTER TABLE in the schema checks that no table carrying
-- the partitions' TRUNCATE guard has left outbox.events. Partitions created
-- or attached by hand get that guard here. (DETACH ... CONCURRENTLY cannot
-- run at all while outbox.events has its default partition.)
CREATE OR REPLACE FUNCTION outbox.tg_events__guard_partitions()
RETURNS event_trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    part regclass;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_event_trigger_ddl_commands() AS c WHERE c.schema_name = 'outbox') THEN
        RETURN;
    END IF;
    SELECT c.oid::regclass INTO part
    FROM pg_trigger AS t
    INNER JOIN pg_class AS c ON t.tgrelid = c.oid
    WHERE t.tgname = '_100_forbid_truncate'
        AND t.tgfoid = 'outbox.tg_events__forbid_delete()'::regprocedure
        AND c.oid <> 'outbox.events'::regclass
        AND NOT c.relispartition
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'DELETE_FORBIDDEN: partition % may not be detached from outbox.events', part
            USING ERRCODE = 'OB012',
                  HINT = 'Rows leave outbox.events only by audited archival (outbox.drop_archived).';
    END IF;
    FOR part IN
        SELECT i.inhrelid::regclass FROM pg_inherits AS i
        WHERE i.inhparent = 'outbox.events'::regclass
            AND NOT EXISTS (
                SELECT 1 FROM pg_trigger AS t WHERE t.tgrelid = i.inhrelid AND t.tgname = '_100_forbid_truncate'
            )
    LOOP
        EXECUTE format(
            'CREATE TRIGGER _100_forbid_truncate BEFORE TRUNCATE ON %s'
            ' FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_events__forbid_delete()', part
        );
    END LOOP;
END;
$$;

-- Only a superuser may create an event trigger (and disable it). Installed by
-- anyone else, the schema works without it: DETACH is then not refused.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = 'pgoutbox_guard_partitions') THEN
        CREATE EVENT TRIGGER pgoutbox_guard_partitions ON ddl_command_end
        WHEN TAG IN ('ALTER TABLE', 'CREATE TABLE')
        EXECUTE FUNCTION outbox.tg_events__guard_partitions();
    END IF;
EXCEPTION WHEN insufficient_privilege THEN
    RAISE WARNING 'outbox: installed without the DETACH PARTITION guard (creating an event trigger needs a superuser)'
        USING HINT = 'Have a superuser run this migration again to install it.';
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
              HINT = 'PROCESSING needs a claim, COMPLETED exactly a published_at, FAILED and DEAD_LETTER an error.';
END;
$$;

CREATE OR REPLACE TRIGGER _500_check_state
BEFORE UPDATE ON outbox.events
FOR EACH ROW
WHEN (
    NOT (
        new.status IN ('PENDING', 'PROCESSING', 'COMPLETED', 'FAILED', 'DEAD_LETTER')
        AND new.attempts >= 0
        AND (new.status = 'COMPLETED') = (new.published_at IS NOT NULL)
        AND (
            new.status <> 'PROCESSING'
            OR (new.claim_token IS NOT NULL AND new.claimed_at IS NOT NULL AND new.claimed_by IS NOT NULL)
        )
        AND (new.status NOT IN ('FAILED', 'DEAD_LETTER') OR new.last_error IS NOT NULL)
    )
)
EXECUTE FUNCTION outbox.tg_events__refuse_bad_state();
