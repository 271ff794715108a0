-- 0011_emit_path (up): what a business transaction pays for outbox.emit(),
-- measured by bench/emit_bench.py; docs/relay.md, "What emit costs", has the
-- figures. Every policy, code and guarantee stays.
--
--   * the INSERT policy trigger first tests a row with one small expression
--     (plpgsql prepares each expression anew in every transaction), and only
--     a row that fails it goes rule by rule, in one CASE, to name the error;
--     its two bounded regular expressions ({1,64}, {1,128}: up to 5 µs a
--     match) are written as + and a length test; plainly fine headers skip
--     _check_headers' query (_headers_pass);
--   * the wake-up is decided at the end of that trigger (_wakeup_is_due,
--     inlined; _wake_relays when due) instead of by a trigger of its own
--     (_900_wakeup, dropped), and no longer plans outbox.notify_throttle()
--     at every wake-up;
--   * the five lifecycle CHECK constraints of outbox.events, which
--     PostgreSQL parses and compiles at every INSERT statement, become the
--     WHEN clause of a BEFORE UPDATE trigger (_500_check_state): the same
--     invariants at every UPDATE, refused with ILLEGAL_TRANSITION (OB010)
--     instead of 23514; at INSERT the policy trigger already makes every row
--     born PENDING, unclaimed and unpublished.
--
-- Expand only: emit, claim, mark_* and requeue keep their signatures and
-- behaviour; workers of release 0.2.0 (schema 7) run on it unchanged.
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 10 or 11.
-- Catalog changes only: no row is read or rewritten.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0011 needs 0001 to 0010 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (10, 11) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0011 applies on version 10 (or re-runs on 11) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

-- Whether the next wake-up is due. Not due while the due time lies ahead, by
-- at most the largest throttle (1 minute): a clock set back further cannot
-- mute wake-ups for long. A sequence never set (fresh, or reset by a crash)
-- reads NULL: due. No SET clause and no SECURITY DEFINER, so that it is
-- inlined (it runs inside the policy trigger, under its search_path). A
-- range rather than BETWEEN, which would read the sequence and the clock twice.
CREATE OR REPLACE FUNCTION outbox._wakeup_is_due()
RETURNS boolean
LANGUAGE sql VOLATILE
AS $$
    SELECT NOT pg_catalog.int8range(1, 60000000, '[]') @> (
        coalesce(pg_catalog.pg_sequence_last_value('outbox.wakeup_due_at'), 0)
        - (extract(epoch FROM pg_catalog.clock_timestamp()) * 1000000)::bigint
    );
$$;

-- Sends the wake-up for an event of context (delivered at commit) and sets
-- the next one due one throttle interval from now: one statement.
CREATE OR REPLACE FUNCTION outbox._wake_relays(context text)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM
        setval('outbox.wakeup_due_at', (extract(epoch FROM clock_timestamp() + coalesce(
            (SELECT p.notify_throttle FROM outbox.wakeup_policy AS p), interval '5 milliseconds'
        )) * 1000000)::bigint),
        pg_notify('outbox_v1', context);
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

REVOKE ALL ON FUNCTION
outbox._wakeup_is_due(), outbox._wake_relays(text), outbox._headers_pass(jsonb),
outbox.tg_events__refuse_bad_state()
FROM public;

-- The wake-up now ends the policy trigger.
DROP TRIGGER IF EXISTS _900_wakeup ON outbox.events;
DROP FUNCTION IF EXISTS outbox.tg_events__wakeup();

-- The lifecycle invariants move from CHECK constraints to an UPDATE trigger.
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

ALTER TABLE outbox.events
DROP CONSTRAINT IF EXISTS status_is_known,
DROP CONSTRAINT IF EXISTS attempts_is_non_negative,
DROP CONSTRAINT IF EXISTS published_iff_completed,
DROP CONSTRAINT IF EXISTS processing_has_a_claim,
DROP CONSTRAINT IF EXISTS failed_or_dead_has_an_error;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (11, '0011_emit_path')
ON CONFLICT (version) DO NOTHING;

COMMIT;
