-- 0006_poison_proof (up): bad input is refused with a code, and the outbox's
-- invariants hold for its owner too.
--
--   * emit (the INSERT policy trigger) refuses what no relay could deliver:
--     times outside 1900-9999 or infinite (TIMESTAMP_OUT_OF_RANGE), header
--     names NATS or pgoutbox reserve (RESERVED_HEADER) or cannot carry, and
--     values with line breaks (INVALID_HEADER), sizes over the maximums of
--     the README's "Limits" (VALUE_TOO_LARGE), a schema_version that is not
--     an integer from 1 to 2^31-1. Rows already stored are left as they are:
--     the limits are not CHECK constraints, so this migration succeeds
--     whatever the table holds;
--   * every API function checks each argument before it acts (NULL, empty or
--     duplicate ids, non-finite or absurd times, lengths); error texts over
--     4,000 characters are truncated rather than refused;
--   * TRUNCATE of a partition by name is refused like DELETE: a guard on
--     every partition (PostgreSQL fires only the partition's own statement
--     triggers), added to the existing ones here and to new ones by
--     create_partitions; DETACH PARTITION is refused by an event trigger
--     (installed only when a superuser runs this file);
--   * the wake-up throttle moves from a session setting (which any writer
--     could change for all) to outbox.wakeup_policy, changed by admins with
--     outbox.set_notify_throttle(); a valid pgoutbox.notify_throttle seen by
--     this migration's session is carried over.
--
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 5 or 6.
-- Catalog changes only: no row is read or rewritten.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0006 needs 0001 to 0005 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (5, 6) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0006 applies on version 5 (or re-runs on 6) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

-- ---- from sql/ (as of this migration): the argument checks first, which
-- ---- the SQL-language functions below call ----
-- An array of ids: given, one-dimensional, 1 to 10,000 distinct ids, no NULL.
CREATE OR REPLACE FUNCTION outbox._check_ids(ids uuid[], what text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF ids IS NULL OR cardinality(ids) = 0 OR array_ndims(ids) > 1 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % must be a non-empty, one-dimensional array', what
            USING ERRCODE = 'OB006';
    END IF;
    IF cardinality(ids) > 10000 THEN
        RAISE EXCEPTION 'VALUE_TOO_LARGE: % has % elements, more than 10000', what, cardinality(ids)
            USING ERRCODE = 'OB009';
    END IF;
    IF array_position(ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % has a NULL element', what
            USING ERRCODE = 'OB006';
    END IF;
    IF (SELECT count(DISTINCT x.id) FROM unnest(ids) AS x (id)) <> cardinality(ids) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % names an id more than once', what
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

-- A name or reason: given, not blank, at most max_chars characters. A missing
-- reason is REASON_REQUIRED, anything else missing INVALID_ARGUMENT.
CREATE OR REPLACE FUNCTION outbox._check_text(
    value text, what text, max_chars integer, is_reason boolean DEFAULT FALSE
)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF nullif(btrim(value), '') IS NULL THEN
        IF is_reason THEN
            RAISE EXCEPTION 'REASON_REQUIRED: % is required', what USING ERRCODE = 'OB014';
        END IF;
        RAISE EXCEPTION 'INVALID_ARGUMENT: % is required and may not be blank', what USING ERRCODE = 'OB006';
    END IF;
    IF length(value) > max_chars THEN
        RAISE EXCEPTION 'VALUE_TOO_LARGE: % is % characters, more than %', what, length(value), max_chars
            USING ERRCODE = 'OB009';
    END IF;
END;
$$;

-- An optional filter on a context: NULL (all) or a subject token.
CREATE OR REPLACE FUNCTION outbox._check_context(context text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF context !~ '^[A-Za-z0-9_-]{1,64}$' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: context % is not a subject token ([A-Za-z0-9_-], 1-64 chars)', quote_literal(left(context, 100))
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

-- A listing's row limit.
CREATE OR REPLACE FUNCTION outbox._check_max_rows(max_rows integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF max_rows IS NULL OR max_rows < 1 OR max_rows > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: max_rows must be between 1 and 10000, got %', max_rows
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

-- Error texts are kept, not refused, when too long: they come from libraries
-- and brokers, and a refused mark would leave its whole batch PROCESSING
-- until the lease expires, to be refused again. Their start says what failed.
CREATE OR REPLACE FUNCTION outbox._clip_error(error text)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN length(error) > 4000 THEN left(error, 3988) || ' (truncated)' ELSE error END;
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
END;
$$;

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

-- A unit's day: given, and a day whose partition name has a four-digit year.
CREATE OR REPLACE FUNCTION outbox._check_day(day date)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF day IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: day is required' USING ERRCODE = 'OB006';
    END IF;
    IF NOT (day >= '1900-01-01' AND day <= '9999-12-30') THEN
        RAISE EXCEPTION 'TIMESTAMP_OUT_OF_RANGE: day % is not from 1900-01-01 to 9999-12-30', day
            USING ERRCODE = 'OB008';
    END IF;
END;
$$;

-- Retentions: from 0 to 100 years (now() - retention must stay a time).
CREATE OR REPLACE FUNCTION outbox._check_retention(retention interval, what text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF retention IS NULL OR retention < interval '0' OR retention > interval '100 years' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % must be an interval from 0 to 100 years, got %', what, retention
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

-- A lock_timeout argument: from 1 ms (PostgreSQL reads 0 as "wait for ever")
-- to 1 hour.
CREATE OR REPLACE FUNCTION outbox._check_lock_timeout(lock_timeout interval)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF lock_timeout IS NULL OR lock_timeout < interval '1 millisecond' OR lock_timeout > interval '1 hour' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: lock_timeout must be an interval from 1 ms to 1 hour, got %', lock_timeout
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

-- ---- the wake-up throttle (sql/40_outbox_wakeup.sql) ----
-- The throttle is shared by every writer, so no writer may set it for the
-- others (a session setting would let one silence everyone's wake-ups): one
-- row, changed only through outbox.set_notify_throttle (admins), whose CHECK
-- makes an invalid value impossible. Read once per wake-up, not per insert.
CREATE TABLE IF NOT EXISTS outbox.wakeup_policy (
    singleton boolean PRIMARY KEY DEFAULT TRUE,
    notify_throttle interval NOT NULL DEFAULT interval '5 milliseconds',
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL DEFAULT session_user,
    CONSTRAINT one_row_only CHECK (singleton),
    -- The upper bound is also tg_events__wakeup's guard against a clock set
    -- back: keep the two equal.
    CONSTRAINT notify_throttle_is_in_range CHECK (
        notify_throttle >= interval '0' AND notify_throttle <= interval '1 minute'
    )
);
COMMENT ON TABLE outbox.wakeup_policy IS
'Minimum gap between two wake-up NOTIFYs, for all writers; changed with outbox.set_notify_throttle().';

-- A throttle that version 5 read from pgoutbox.notify_throttle (set for the
-- database or role) is kept, when valid.
DO $$
DECLARE
    setting text := nullif(current_setting('pgoutbox.notify_throttle', true), '');
    gap interval;
BEGIN
    IF setting IS NOT NULL THEN
        BEGIN
            gap := setting::interval;
        EXCEPTION WHEN invalid_datetime_format OR datetime_field_overflow OR interval_field_overflow THEN
            gap := NULL;
        END;
        IF gap >= interval '0' AND gap <= interval '1 minute' THEN
            INSERT INTO outbox.wakeup_policy (singleton, notify_throttle) VALUES (TRUE, gap)
            ON CONFLICT DO NOTHING;
        END IF;
    END IF;
END;
$$;
INSERT INTO outbox.wakeup_policy (singleton) VALUES (TRUE) ON CONFLICT DO NOTHING;

CREATE OR REPLACE FUNCTION outbox.set_notify_throttle(throttle interval)
RETURNS interval
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF throttle IS NULL OR throttle < interval '0' OR throttle > interval '1 minute' THEN
        RAISE EXCEPTION 'INVALID_SETTING: notify_throttle % is not an interval from 0 to 1 minute', coalesce(throttle::text, 'NULL')
            USING ERRCODE = 'OB007';
    END IF;
    INSERT INTO outbox.wakeup_policy AS p (singleton, notify_throttle)
    VALUES (TRUE, throttle)
    ON CONFLICT (singleton) DO UPDATE
    SET notify_throttle = excluded.notify_throttle, changed_at = now(), changed_by = session_user;
    RETURN throttle;
END;
$$;
COMMENT ON FUNCTION outbox.set_notify_throttle(interval) IS
'Sets the minimum gap between two wake-ups for every writer (admins); relays read it at start-up.';

-- ---- functions changed by this migration ----
-- Creates the daily partitions from from_day to from_day + days_ahead
-- (UTC days), returning the names it created. Idempotent and serialised.
CREATE OR REPLACE FUNCTION outbox.create_partitions(
    days_ahead integer DEFAULT 7,
    from_day date DEFAULT (now() AT TIME ZONE 'UTC')::date
)
RETURNS SETOF text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    d date;
    part text;
    lo timestamptz;
    hi timestamptz;
BEGIN
    IF days_ahead IS NULL OR days_ahead < 0 OR days_ahead > 366 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: days_ahead must be between 0 and 366, got %', days_ahead
            USING ERRCODE = 'OB006';
    END IF;
    -- Partition names carry a four-digit year.
    IF from_day IS NULL OR NOT (from_day >= '1900-01-01' AND from_day + days_ahead <= '9999-12-30') THEN
        RAISE EXCEPTION 'TIMESTAMP_OUT_OF_RANGE: from_day must be a day from 1900-01-01 to 9999-12-30 - days_ahead, got %', from_day
            USING ERRCODE = 'OB008';
    END IF;
    -- Two callers at once would race on CREATE TABLE.
    PERFORM pg_advisory_xact_lock(hashtextextended('pgoutbox.create_partitions', 0));
    FOR d IN SELECT generate_series(from_day, from_day + days_ahead, interval '1 day')::date LOOP
        part := 'events_p' || to_char(d, 'YYYYMMDD');
        CONTINUE WHEN to_regclass(format('outbox.%I', part)) IS NOT NULL;
        lo := d::timestamp AT TIME ZONE 'UTC';
        hi := (d + 1)::timestamp AT TIME ZONE 'UTC';
        IF EXISTS (
            SELECT 1 FROM outbox.events_default
            WHERE created_at >= lo AND created_at < hi
        ) THEN
            RAISE WARNING 'outbox: rows for % are in outbox.events_default; partition % not created', d, part
                USING HINT = 'Archive the default partition, then call outbox.create_partitions() again.';
            CONTINUE;
        END IF;
        EXECUTE format(
            'CREATE TABLE outbox.%I PARTITION OF outbox.events FOR VALUES FROM (%L) TO (%L)'
            -- Each event leaves two dead row versions (claim, mark) and dead
            -- entries in events_claimable_idx that every claim walks past:
            -- vacuum a day partition every 10,000 dead rows, not at 20 %.
            -- fillfactor 50: claim and mark each write a new version of the
            -- row; with room on its page it stays there, logged as a diff
            -- against the old one (a third less WAL, and a quarter less heap
            -- after the drain, measured), and pruning frees the dead ones.
            -- The price: a backlog waiting unclaimed takes twice the pages.
            || ' WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,'
            || ' autovacuum_vacuum_cost_delay = 0, fillfactor = 50)',
            part, lo, hi
        );
        -- TRUNCATE of a partition by name fires only its own triggers.
        EXECUTE format(
            'CREATE OR REPLACE TRIGGER _100_forbid_truncate BEFORE TRUNCATE ON outbox.%I'
            ' FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_events__forbid_delete()', part
        );
        RETURN NEXT part;
    END LOOP;
END;
$$;
COMMENT ON FUNCTION outbox.create_partitions(integer, date) IS
'Creates daily partitions of outbox.events ahead of time; safe to call any number of times.';

-- Policies, checked once per row at INSERT whoever inserts, and raised with
-- the codes of the error table (docs/reference.md); then the subject is
-- derived from the parts just checked. Besides the content rules, they refuse
-- what no relay could deliver (docs/reference.md, "Limits"): times the wire
-- format cannot express, values a NATS header cannot carry, sizes over the maximums, which
-- keep the payload and every header together well under NATS's default
-- max_payload (1 MiB). Limits live here, not in CHECK constraints: rows
-- written before them must stay valid, and CHECKs would run at every UPDATE.
CREATE OR REPLACE FUNCTION outbox.tg_events__check_policies()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    field text;
BEGIN
    IF nullif(btrim(NEW.context), '') IS NULL
        OR nullif(btrim(NEW.aggregate_type), '') IS NULL
        OR nullif(btrim(NEW.aggregate_id), '') IS NULL
        OR nullif(btrim(NEW.event_type), '') IS NULL
        OR NEW.event_id IS NULL THEN
        RAISE EXCEPTION 'INVALID_OUTBOX: context, aggregate_type, aggregate_id, event_type and event_id are required'
            USING ERRCODE = 'OB001',
                  HINT = 'Pass context => ... or set pgoutbox.context for the database or role.';
    END IF;
    -- Finite and within what ISO 8601 and every client's date type carry.
    IF NOT (NEW.occurred_at >= '1900-01-01 00:00:00+00' AND NEW.occurred_at < '10000-01-01 00:00:00+00'
        AND NEW.created_at >= '1900-01-01 00:00:00+00' AND NEW.created_at < '10000-01-01 00:00:00+00'
        AND NEW.available_at >= '1900-01-01 00:00:00+00' AND NEW.available_at < '10000-01-01 00:00:00+00') THEN
        RAISE EXCEPTION 'TIMESTAMP_OUT_OF_RANGE: occurred_at, created_at and available_at must be finite times from 1900 to 9999 (UTC)'
            USING ERRCODE = 'OB008',
                  DETAIL = format('occurred_at=%s, created_at=%s, available_at=%s',
                      NEW.occurred_at, NEW.created_at, NEW.available_at);
    END IF;
    IF NEW.occurred_at > now() + interval '1 minute' THEN
        RAISE EXCEPTION 'FUTURE_EVENT: occurred_at % is more than a minute ahead of the database clock', NEW.occurred_at
            USING ERRCODE = 'OB002';
    END IF;
    IF NEW.context !~ '^[A-Za-z0-9_-]{1,64}$' THEN
        RAISE EXCEPTION 'INVALID_SUBJECT_PART: context % is not a subject token ([A-Za-z0-9_-], 1-64 chars)', quote_literal(left(NEW.context, 100))
            USING ERRCODE = 'OB003';
    END IF;
    IF NEW.event_type !~ '^[A-Za-z0-9_-]{1,128}$' THEN
        RAISE EXCEPTION 'INVALID_SUBJECT_PART: event_type % is not a subject token ([A-Za-z0-9_-], 1-128 chars)', quote_literal(left(NEW.event_type, 150))
            USING ERRCODE = 'OB003';
    END IF;
    IF NEW.event_version IS NULL OR NEW.event_version < 1 THEN
        RAISE EXCEPTION 'INVALID_SUBJECT_PART: event_version must be a positive integer, got %', NEW.event_version
            USING ERRCODE = 'OB003';
    END IF;
    -- The metadata travels as NATS header values (Pgoutbox-*): no line
    -- breaks, and no leading or trailing white space (clients trim it).
    field := CASE
        WHEN length(NEW.aggregate_type) > 255 THEN 'aggregate_type (255)'
        WHEN length(NEW.aggregate_id) > 1024 THEN 'aggregate_id (1024)'
        WHEN length(NEW.tenant_id) > 255 THEN 'tenant_id (255)'
        WHEN length(NEW.ordering_key) > 512 THEN 'ordering_key (512)'
    END;
    IF field IS NOT NULL THEN
        RAISE EXCEPTION 'VALUE_TOO_LARGE: % is longer than its maximum (characters)', field
            USING ERRCODE = 'OB009';
    END IF;
    field := CASE
        WHEN NEW.aggregate_type ~ '[\r\n]|^\s|\s$' THEN 'aggregate_type'
        WHEN NEW.aggregate_id ~ '[\r\n]|^\s|\s$' THEN 'aggregate_id'
        WHEN NEW.tenant_id ~ '[\r\n]|^\s|\s$|^$' THEN 'tenant_id'
        WHEN NEW.ordering_key ~ '[\r\n]|^\s|\s$|^$' THEN 'ordering_key'
    END;
    IF field IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % is empty, has a line break, or starts or ends with white space', field
            USING ERRCODE = 'OB006', HINT = 'It travels as a NATS header value, which cannot carry these.';
    END IF;
    IF NEW.payload IS NULL OR jsonb_typeof(NEW.payload) <> 'object' THEN
        RAISE EXCEPTION 'INVALID_PAYLOAD: payload must be a JSON object, got %', coalesce(jsonb_typeof(NEW.payload), 'NULL')
            USING ERRCODE = 'OB004';
    END IF;
    -- Its digits, not its value: 1.0 or 1e0 would reach consumers as a float.
    IF jsonb_typeof(NEW.payload -> 'schema_version') IS DISTINCT FROM 'number'
        OR (NEW.payload -> 'schema_version')::text !~ '^[1-9][0-9]{0,9}$'
        OR (NEW.payload -> 'schema_version')::text::bigint > 2147483647 THEN
        RAISE EXCEPTION 'INVALID_SCHEMA_VERSION: payload.schema_version must be an integer from 1 to 2147483647, got %', left(coalesce(NEW.payload -> 'schema_version', 'null'::jsonb)::text, 100)
            USING ERRCODE = 'OB005';
    END IF;
    -- The payload is the message body, as this very text.
    IF octet_length(NEW.payload::text) > 524288 THEN
        RAISE EXCEPTION 'VALUE_TOO_LARGE: payload is % bytes of JSON, more than 524288 (512 KiB)', octet_length(NEW.payload::text)
            USING ERRCODE = 'OB009';
    END IF;
    IF NEW.headers IS NULL OR jsonb_typeof(NEW.headers) <> 'object' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: headers must be a JSON object'
            USING ERRCODE = 'OB006';
    END IF;
    IF NEW.headers <> '{}'::jsonb THEN
        PERFORM outbox._check_headers(NEW.headers);
    END IF;
    IF NEW.status <> 'PENDING' OR NEW.attempts <> 0 OR NEW.claim_token IS NOT NULL
        OR NEW.published_at IS NOT NULL THEN
        RAISE EXCEPTION 'ILLEGAL_TRANSITION: an event is born PENDING with no attempts and no claim'
            USING ERRCODE = 'OB010';
    END IF;
    NEW.subject := NEW.context || '.event.' || NEW.event_type || '.v' || NEW.event_version::text;
    RETURN NEW;
END;
$$;

-- Claims up to batch_size due events for worker, under a lease, and returns
-- them with a fresh claim token. One statement:
--   * the CTE picks candidates in id order from events_claimable_idx and locks
--     them FOR UPDATE SKIP LOCKED, so concurrent claimers walk past each
--     other's rows instead of queueing on them, and LIMIT bounds the batch;
--   * available_at <= now() covers all three sources at once: new events,
--     failed events whose retry time has come, and expired leases;
--   * an event with an ordering_key is taken only when no earlier event of
--     its key is unfinished (not COMPLETED), so at most one event per key is
--     in flight and a FAILED or DEAD_LETTER event holds its successors back;
--   * the UPDATE moves the locked rows to PROCESSING and RETURNING hands them
--     out, with no window in which another claimer could see them as due;
--   * plans are generic (planned once per session): planning an UPDATE over
--     every partition costs more than executing it. The locked keys reach
--     the UPDATE as arrays (= ANY) so that the generic plan probes the
--     primary key instead of hash-joining the whole table;
--   * enable_seqscan is off because a generic plan lives as long as the
--     relay's session: made while tomorrow's partition is empty, a plan
--     with a sequential scan of it would scan the whole growing partition
--     at every claim of the next day (until an ANALYZE re-plans). The
--     created_at range of the locked rows lets the executor skip (prune)
--     the partitions that hold none of them, which array conditions
--     cannot do; without it every empty partition's primary key would be
--     probed once per id.
CREATE OR REPLACE FUNCTION outbox.claim(
    worker text,
    batch_size integer,
    lease interval
)
RETURNS SETOF outbox.events
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    token uuid := gen_random_uuid();
BEGIN
    PERFORM outbox._check_text(worker, 'worker', 256);
    IF batch_size IS NULL OR batch_size < 1 OR batch_size > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: batch_size must be between 1 and 10000, got %', batch_size
            USING ERRCODE = 'OB006';
    END IF;
    IF lease IS NULL OR lease <= interval '0' OR lease > interval '1 day' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: lease must be positive and at most 1 day, got %', lease
            USING ERRCODE = 'OB006';
    END IF;
    RETURN QUERY
    WITH candidates AS (
        SELECT e.id, e.created_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND e.available_at <= now()
            AND (
                e.ordering_key IS NULL
                OR NOT EXISTS (
                    SELECT 1
                    FROM outbox.events AS earlier
                    WHERE earlier.ordering_key = e.ordering_key
                        AND earlier.id < e.id
                        AND earlier.status <> 'COMPLETED'
                )
            )
        ORDER BY e.id
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox.events AS e
    SET status = 'PROCESSING',
        attempts = e.attempts + 1,
        claimed_at = now(),
        claimed_by = worker,
        claim_token = token,
        available_at = now() + lease
    WHERE e.id = ANY(ARRAY(SELECT c.id FROM candidates AS c))
        AND e.created_at = ANY(ARRAY(SELECT c.created_at FROM candidates AS c))
        AND e.created_at >= (SELECT min(c.created_at) FROM candidates AS c)
        AND e.created_at <= (SELECT max(c.created_at) FROM candidates AS c)
    RETURNING e.*;
END;
$$;
COMMENT ON FUNCTION outbox.claim(text, integer, interval) IS
'Claims up to batch_size due events (new, retry due, or lease expired) under a lease.';

-- Marks the claim's events COMPLETED. Rows no longer held by claim_token (the
-- lease expired and another relay took them) are left alone: fencing. Returns
-- how many were marked; raises STALE_CLAIM when it could mark none of them.
-- (enable_seqscan off: see claim; the token's index probe in an empty
-- partition costs next to nothing.)
CREATE OR REPLACE FUNCTION outbox.mark_published(
    claim_token uuid,
    event_ids uuid[]
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    marked integer;
BEGIN
    IF claim_token IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: claim_token is required' USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_ids(event_ids, 'event_ids');
    UPDATE outbox.events AS e
    SET status = 'COMPLETED', published_at = now(), last_error = NULL
    WHERE e.claim_token = mark_published.claim_token
        AND e.status = 'PROCESSING'
        AND e.event_id = ANY(mark_published.event_ids);
    GET DIAGNOSTICS marked = ROW_COUNT;
    IF marked = 0 THEN
        RAISE EXCEPTION 'STALE_CLAIM: claim % holds none of the % given events', claim_token, cardinality(event_ids)
            USING ERRCODE = 'OB013',
                  HINT = 'The lease expired and another relay re-claimed them; it will publish them (deduplicated by Nats-Msg-Id).';
    END IF;
    RETURN marked;
END;
$$;
COMMENT ON FUNCTION outbox.mark_published(uuid, uuid[]) IS
'PROCESSING -> COMPLETED for the events still held by claim_token; returns the count.';

-- Records failed publishes. Parallel arrays: event_ids[i] failed with
-- errors[i]; it becomes FAILED, due again at retry_at[i], or DEAD_LETTER when
-- retry_at[i] is NULL (the relay's retry policy decided to give up). A retry
-- time lies at most 30 days ahead: further is a parked event nobody sees.
CREATE OR REPLACE FUNCTION outbox.mark_failed(
    claim_token uuid,
    event_ids uuid[],
    errors text[],
    retry_at timestamptz[]
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    marked integer;
BEGIN
    IF claim_token IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: claim_token is required' USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_ids(event_ids, 'event_ids');
    IF cardinality(event_ids) IS DISTINCT FROM cardinality(errors)
        OR cardinality(event_ids) IS DISTINCT FROM cardinality(retry_at)
        OR array_ndims(errors) > 1 OR array_ndims(retry_at) > 1 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_ids, errors and retry_at must be one-dimensional and of the same length'
            USING ERRCODE = 'OB006';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(errors) AS x (err) WHERE nullif(btrim(x.err), '') IS NULL) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: every failure needs an error text'
            USING ERRCODE = 'OB006';
    END IF;
    IF EXISTS (
        SELECT 1 FROM unnest(retry_at) AS r (at)
        WHERE NOT (r.at >= '1900-01-01 00:00:00+00' AND r.at <= now() + interval '30 days')
    ) THEN
        RAISE EXCEPTION 'TIMESTAMP_OUT_OF_RANGE: every retry_at must be NULL (dead letter) or a finite time at most 30 days ahead'
            USING ERRCODE = 'OB008';
    END IF;
    UPDATE outbox.events AS e
    SET status = CASE WHEN f.retry_at IS NULL THEN 'DEAD_LETTER' ELSE 'FAILED' END,
        last_error = outbox._clip_error(f.error),
        available_at = coalesce(f.retry_at, e.available_at)
    FROM unnest(event_ids, errors, retry_at) AS f (event_id, error, retry_at)
    WHERE e.claim_token = mark_failed.claim_token
        AND e.status = 'PROCESSING'
        AND e.event_id = f.event_id;
    GET DIAGNOSTICS marked = ROW_COUNT;
    IF marked = 0 THEN
        RAISE EXCEPTION 'STALE_CLAIM: claim % holds none of the % given events', claim_token, cardinality(event_ids)
            USING ERRCODE = 'OB013';
    END IF;
    RETURN marked;
END;
$$;
COMMENT ON FUNCTION outbox.mark_failed(uuid, uuid[], text[], timestamptz[]) IS
'PROCESSING -> FAILED (retry at retry_at[i]) or DEAD_LETTER (retry_at[i] NULL); returns the count.';

-- Operator redrive: DEAD_LETTER -> PENDING with attempts reset, recorded in
-- outbox.requeue_log by the update guard. All or nothing.
CREATE OR REPLACE FUNCTION outbox.requeue(
    event_ids uuid[],
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
    PERFORM outbox._check_text(reason, 'a requeue''s reason', 1000, TRUE);
    PERFORM outbox._check_ids(event_ids, 'event_ids');
    SELECT array_agg(x.id) INTO bad
    FROM unnest(event_ids) AS x (id)
    WHERE NOT EXISTS (
        SELECT 1 FROM outbox.events AS e
        WHERE e.event_id = x.id AND e.status = 'DEAD_LETTER'
    );
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'NOT_DEAD_LETTER: % of the given events are unknown or not DEAD_LETTER', cardinality(bad)
            USING ERRCODE = 'OB015', DETAIL = array_to_string(bad, ', ');
    END IF;
    PERFORM set_config('pgoutbox.requeue_reason', reason, true);
    UPDATE outbox.events AS e
    SET status = 'PENDING', attempts = 0, available_at = now()
    WHERE e.event_id = ANY(requeue.event_ids) AND e.status = 'DEAD_LETTER';
    GET DIAGNOSTICS moved = ROW_COUNT;
    PERFORM set_config('pgoutbox.requeue_reason', '', true);
    RETURN moved;
END;
$$;
COMMENT ON FUNCTION outbox.requeue(uuid[], text) IS
'DEAD_LETTER -> PENDING for the given events (all or nothing), audited in outbox.requeue_log.';

-- Backlog per context (QRY-050). "due" is what a relay could take right now;
-- oldest_due_age growing while due > 0 means no relay is making progress,
-- whereas a large unpublished count with nothing due is just parked retries.
CREATE OR REPLACE FUNCTION outbox.backlog(context text DEFAULT NULL)
RETURNS TABLE (
    context text,
    unpublished bigint,
    oldest_unpublished_at timestamptz,
    due bigint,
    oldest_due_age interval,
    processing bigint,
    failed bigint,
    dead_letter bigint
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(backlog.context);
    -- Two branches so that each is served by its own partial index.
    WITH unfinished AS (
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND (backlog.context IS NULL OR e.context = backlog.context)
        UNION ALL
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status = 'DEAD_LETTER'
            AND (backlog.context IS NULL OR e.context = backlog.context)
    ),
    contexts AS (
        SELECT DISTINCT u.context FROM unfinished AS u
        UNION
        SELECT backlog.context WHERE backlog.context IS NOT NULL
    )
    SELECT
        c.context,
        count(u.status) FILTER (WHERE u.status <> 'DEAD_LETTER'),
        min(u.created_at) FILTER (WHERE u.status <> 'DEAD_LETTER'),
        count(u.status) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now()),
        -- greatest(): a row stored by an older version with available_at
        -- -infinity is due and very old, not an error (interval has no infinity).
        now() - greatest(
            min(u.available_at) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now()),
            timestamptz '0001-01-01 00:00:00+00'
        ),
        count(u.status) FILTER (WHERE u.status = 'PROCESSING'),
        count(u.status) FILTER (WHERE u.status = 'FAILED'),
        count(u.status) FILTER (WHERE u.status = 'DEAD_LETTER')
    FROM contexts AS c
    LEFT JOIN unfinished AS u ON u.context = c.context
    GROUP BY c.context
    ORDER BY c.context;
$$;
COMMENT ON FUNCTION outbox.backlog(text) IS
'Per context: unpublished count and oldest, due count and age of the oldest due, by status.';

-- Dead-lettered events, newest first, for operators deciding what to requeue.
CREATE OR REPLACE FUNCTION outbox.dead_letters(
    context text DEFAULT NULL,
    max_rows integer DEFAULT 100
)
RETURNS TABLE (
    event_id uuid,
    context text,
    subject text,
    ordering_key text,
    attempts integer,
    last_error text,
    created_at timestamptz
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(dead_letters.context), outbox._check_max_rows(dead_letters.max_rows);
    SELECT e.event_id, e.context, e.subject, e.ordering_key, e.attempts, e.last_error, e.created_at
    FROM outbox.events AS e
    WHERE e.status = 'DEAD_LETTER'
        AND (dead_letters.context IS NULL OR e.context = dead_letters.context)
    ORDER BY e.id DESC
    LIMIT dead_letters.max_rows;
$$;
COMMENT ON FUNCTION outbox.dead_letters(text, integer) IS
'Dead-lettered events (newest first) with their last error; requeue them with outbox.requeue().';

CREATE OR REPLACE FUNCTION outbox.notify_throttle()
RETURNS interval
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT p.notify_throttle FROM outbox.wakeup_policy AS p), interval '5 milliseconds');
$$;
COMMENT ON FUNCTION outbox.notify_throttle() IS
'Minimum gap between two wake-ups (outbox.wakeup_policy, default 5 ms, at most 1 minute).';

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
        AND m.status IN ('RECEIVED', 'FAILED')
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
-- with dead => true, DEAD_LETTER (poison, or the last allowed delivery).
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
        dlq_metadata = CASE WHEN NOT dead THEN m.dlq_metadata ELSE
            m.dlq_metadata || jsonb_build_object(
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
        count(*) FILTER (WHERE m.status = 'DEAD_LETTER')
    FROM inbox.messages AS m
    WHERE m.status <> 'PROCESSED'
        AND (backlog.context IS NULL OR m.context = backlog.context)
    GROUP BY m.context, m.handler
    ORDER BY m.context, m.handler;
$$;
COMMENT ON FUNCTION inbox.backlog(text) IS
'Per context and handler: unprocessed count and oldest, failed and dead-lettered counts.';

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
    WHERE m.handler = redrive.handler AND m.status = 'DEAD_LETTER' AND m.envelope IS NULL
        AND (redrive.message_ids IS NULL OR m.message_id = ANY(redrive.message_ids));
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'MESSAGE_NOT_REPLAYABLE: % of the messages have no stored envelope to re-publish', cardinality(bad)
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

-- Switches automated replay of a handler's dead letters on or off (no row:
-- on). Operator redrives are not affected.
CREATE OR REPLACE FUNCTION inbox.set_replay(
    handler text,
    enabled boolean,
    reason text
)
RETURNS inbox.replay_switches
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.replay_switches;
BEGIN
    PERFORM outbox._check_text(reason, 'switching replay''s reason', 1000, TRUE);
    IF handler IS NULL OR handler !~ '^[A-Za-z0-9_.-]{1,128}$' OR enabled IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: a handler name ([A-Za-z0-9_.-], 1-128 chars) and on/off are required'
            USING ERRCODE = 'OB006';
    END IF;
    INSERT INTO inbox.replay_switches AS s (handler, enabled, changed_by, reason)
    VALUES (set_replay.handler, set_replay.enabled, session_user, set_replay.reason)
    ON CONFLICT ON CONSTRAINT replay_switches_pkey DO UPDATE
    SET enabled = excluded.enabled, changed_at = now(), changed_by = excluded.changed_by,
        reason = excluded.reason
    RETURNING * INTO row;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.set_replay(text, boolean, text) IS
'Automated replay on/off for one handler, with who and why.';

-- Dead letters (newest first) with their replay state, for operators.
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
        AND (dead_letters.handler IS NULL OR m.handler = dead_letters.handler)
    ORDER BY (m.dlq_metadata ->> 'dead_lettered_at')::timestamptz DESC NULLS LAST, m.message_id
    LIMIT dead_letters.max_rows;
$$;
COMMENT ON FUNCTION inbox.dead_letters(text, integer) IS
'Dead-lettered inbox messages with their replay state; redrive them with inbox.redrive().';

-- Runs a lock-taking statement under lock_timeout (restored afterwards), so
-- a long transaction cannot make the archiver queue, and everyone behind it.
CREATE OR REPLACE FUNCTION outbox._with_lock_timeout(statement text, lock_timeout interval)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    saved text := current_setting('lock_timeout');
BEGIN
    PERFORM outbox._check_lock_timeout(lock_timeout);
    PERFORM set_config('lock_timeout', (extract(epoch FROM lock_timeout) * 1000)::bigint::text, true);
    BEGIN
        EXECUTE statement;
    EXCEPTION WHEN lock_not_available THEN
        RAISE EXCEPTION 'ARCHIVE_BUSY: could not lock within %: %', lock_timeout, statement
            USING ERRCODE = 'OB059', HINT = 'A long transaction holds the table; run the archiver again later.';
    END;
    PERFORM set_config('lock_timeout', saved, true);
END;
$$;

-- Live row count and checksum of a unit: the day partition of outbox.events,
-- or the rows inbox.messages received that UTC day.
CREATE OR REPLACE FUNCTION outbox.archive_figures(source text, day date)
RETURNS TABLE (row_count bigint, checksum numeric)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    part text := outbox._partition_name(day);
BEGIN
    PERFORM outbox._archive_source(source);
    PERFORM outbox._check_day(day);
    IF source = 'outbox.events' THEN
        IF NOT outbox._is_partition(part) THEN
            RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: outbox.events has no partition %', part
                USING ERRCODE = 'OB050';
        END IF;
        RETURN QUERY EXECUTE format(
            'SELECT count(*), coalesce(sum(%s), 0)::numeric FROM outbox.%I AS r',
            outbox._row_hash_sql(source), part
        );
    ELSE
        RETURN QUERY EXECUTE format(
            'SELECT count(*), coalesce(sum(%s), 0)::numeric FROM inbox.messages AS r'
            ' WHERE r.received_at >= $1 AND r.received_at < $2',
            outbox._row_hash_sql(source)
        ) USING outbox._day_from(day), outbox._day_from(day + 1);
    END IF;
END;
$$;
COMMENT ON FUNCTION outbox.archive_figures(text, date) IS
'Live row count and checksum of one day of outbox.events (its partition) or inbox.messages.';

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
            ' count(*) FILTER (WHERE status = ''DEAD_LETTER'') FROM outbox.%I', part
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

-- UTC days of inbox.messages that ended more than `retention` ago. Refuses a
-- retention shorter than the streams' max_age (inbox.retention_policy).
CREATE OR REPLACE FUNCTION inbox.archivable_days(
    retention interval DEFAULT interval '14 days',
    dead_letter_retention interval DEFAULT interval '30 days'
)
RETURNS TABLE (
    day date,
    row_count bigint,
    open_rows bigint,
    dead_letters bigint,
    eligible boolean,
    blocked_by text,
    audit_id bigint
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_retention(dead_letter_retention, 'dead_letter_retention');
    IF retention > interval '100 years' THEN
        PERFORM outbox._check_retention(retention, 'retention');
    END IF;
    IF retention IS NULL OR retention < inbox.stream_max_age() THEN
        RAISE EXCEPTION 'RETENTION_BELOW_MAX_AGE: inbox retention % is shorter than the streams'' max_age %', retention, inbox.stream_max_age()
            USING ERRCODE = 'OB057',
                  HINT = 'A redelivered message must find its inbox row; keep inbox rows at least as long as the streams keep messages.';
    END IF;
    RETURN QUERY
    WITH days AS (
        SELECT
            (m.received_at AT TIME ZONE 'UTC')::date AS d,
            count(*) AS n,
            count(*) FILTER (WHERE m.status IN ('RECEIVED', 'FAILED')) AS open_n,
            count(*) FILTER (WHERE m.status = 'DEAD_LETTER') AS dead_n
        FROM inbox.messages AS m
        WHERE m.received_at < now() - retention
        GROUP BY 1
    )
    SELECT
        days.d,
        days.n,
        days.open_n,
        days.dead_n,
        b.why IS NULL,
        b.why,
        a.id
    FROM days
    CROSS JOIN LATERAL (
        SELECT CASE
            WHEN outbox._day_from(days.d + 1) > now() - retention THEN 'day not over by retention yet'
            WHEN days.open_n > 0 THEN 'open rows (RECEIVED or FAILED)'
            WHEN days.dead_n > 0 AND outbox._day_from(days.d + 1) > now() - dead_letter_retention
                THEN 'dead letters younger than dead_letter_retention'
        END AS why
    ) AS b
    LEFT JOIN outbox.archive_audit AS a
        ON a.source = 'inbox.messages' AND a.day = days.d AND a.voided_at IS NULL
    ORDER BY days.d;
END;
$$;
COMMENT ON FUNCTION inbox.archivable_days(interval, interval) IS
'UTC days of inbox.messages old enough to archive (never younger than the streams'' max_age), and what blocks each.';

CREATE OR REPLACE FUNCTION inbox.set_stream_max_age(max_age interval)
RETURNS interval
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF max_age IS NULL OR max_age <= interval '0' OR max_age > interval '100 years' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: max_age must be positive and at most 100 years, got %', max_age
            USING ERRCODE = 'OB006';
    END IF;
    INSERT INTO inbox.retention_policy AS p (singleton, stream_max_age)
    VALUES (TRUE, max_age)
    ON CONFLICT (singleton) DO UPDATE
    SET stream_max_age = excluded.stream_max_age, changed_at = now(), changed_by = session_user;
    RETURN max_age;
END;
$$;
COMMENT ON FUNCTION inbox.set_stream_max_age(interval) IS
'Sets the inbox retention floor to the longest max_age of the streams feeding this inbox (admins).';

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
    -- Index lookups only (events_claimable_idx, events_dead_letter_idx, the
    -- primary key): claims and marks lock every partition, so they wait for
    -- as long as this transaction holds the lock. No count here.
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM outbox.%1$I WHERE status IN (''PENDING'', ''FAILED'', ''PROCESSING'')),'
        ' EXISTS (SELECT 1 FROM outbox.%1$I WHERE status = ''DEAD_LETTER''),'
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

-- Records the audit row of an exported unit, once the figures the archiver
-- read back from its archive equal the live figures computed here. Same
-- figures and URI again: returns the same row (a re-run after a crash).
CREATE OR REPLACE FUNCTION outbox.record_archive(
    source text,
    day date,
    row_count bigint,
    checksum numeric,
    archive_uri text
)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    live record;
    standing outbox.archive_audit;
    open_rows bigint;
    new_id bigint;
BEGIN
    PERFORM outbox._archive_source(source);
    IF day IS NULL OR row_count IS NULL OR checksum IS NULL OR nullif(btrim(archive_uri), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: day, row_count, checksum and archive_uri are required'
            USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_day(day);
    PERFORM outbox._check_text(archive_uri, 'archive_uri', 2048);
    IF row_count < 0 OR checksum < 0 OR checksum <> trunc(checksum) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: row_count and checksum must be non-negative integers, got % and %', row_count, checksum
            USING ERRCODE = 'OB006';
    END IF;
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key(source, day));
    IF source = 'outbox.events' AND NOT outbox._is_sealed(outbox._partition_name(day)) THEN
        RAISE EXCEPTION 'NOT_SEALED: partition % must be sealed before its archive is recorded', outbox._partition_name(day)
            USING ERRCODE = 'OB061', HINT = 'Call outbox.seal_partition() before exporting it.';
    END IF;
    IF source = 'inbox.messages' THEN
        PERFORM inbox._check_floor(day);
        SELECT count(*) INTO open_rows FROM inbox.messages AS m
        WHERE m.received_at >= outbox._day_from(day) AND m.received_at < outbox._day_from(day + 1)
            AND m.status IN ('RECEIVED', 'FAILED');
        IF open_rows > 0 THEN
            RAISE EXCEPTION 'NOT_CLOSED: inbox day % has % row(s) still RECEIVED or FAILED', day, open_rows
                USING ERRCODE = 'OB051';
        END IF;
    END IF;
    SELECT * INTO live FROM outbox.archive_figures(source, day);
    IF (live.row_count, live.checksum) IS DISTINCT FROM (record_archive.row_count, record_archive.checksum) THEN
        RAISE EXCEPTION 'ARCHIVE_MISMATCH: the archive of % % does not match the live rows', source, day
            USING ERRCODE = 'OB053',
                  DETAIL = format('archive: %s rows, checksum %s; live: %s rows, checksum %s',
                      row_count, checksum, live.row_count, live.checksum);
    END IF;
    SELECT * INTO standing FROM outbox.archive_audit AS a
    WHERE a.source = record_archive.source AND a.day = record_archive.day AND a.voided_at IS NULL;
    IF FOUND THEN
        IF standing.removed_at IS NULL
            AND (standing.row_count, standing.checksum, standing.archive_uri)
            = (record_archive.row_count, record_archive.checksum, record_archive.archive_uri) THEN
            RETURN standing.id;
        END IF;
        RAISE EXCEPTION 'ARCHIVE_CONFLICT: % % already has audit %', source, day, standing.id
            USING ERRCODE = 'OB055',
                  DETAIL = format('audit: %s rows, checksum %s, %s%s; given: %s rows, checksum %s, %s',
                      standing.row_count, standing.checksum, standing.archive_uri,
                      CASE WHEN standing.removed_at IS NULL THEN '' ELSE ', removed' END,
                      row_count, checksum, archive_uri),
                  HINT = 'If the standing audit is wrong and its rows are still live, void it: outbox.void_archive().';
    END IF;
    INSERT INTO outbox.archive_audit (source, day, relation, row_count, checksum, archive_uri)
    VALUES (
        source, day,
        CASE WHEN source = 'outbox.events' THEN outbox._partition_name(day) END,
        row_count, checksum, archive_uri
    )
    RETURNING id INTO new_id;
    RETURN new_id;
END;
$$;
COMMENT ON FUNCTION outbox.record_archive(text, date, bigint, numeric, text) IS
'Records the audit row of an exported day once its archived figures equal the live ones; idempotent.';

-- Drops an audited partition after re-checking its live figures against
-- the audit. The partition is sealed, so only a trigger-bypassing owner could
-- change it between the check and the DROP. Already dropped: returns 0.
CREATE OR REPLACE FUNCTION outbox.drop_archived(
    partition_name text,
    lock_timeout interval DEFAULT interval '5 seconds'
)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    part_day date := outbox._partition_day(partition_name);
    standing outbox.archive_audit;
BEGIN
    PERFORM outbox._check_lock_timeout(lock_timeout);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key('outbox.events', part_day));
    IF NOT outbox._is_partition(partition_name) THEN
        IF EXISTS (
            SELECT 1 FROM outbox.archive_audit AS a
            WHERE a.source = 'outbox.events' AND a.day = part_day
                AND a.voided_at IS NULL AND a.removed_at IS NOT NULL
        ) THEN
            RETURN 0;
        END IF;
        RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: outbox.events has no partition %', partition_name
            USING ERRCODE = 'OB050';
    END IF;
    standing := outbox._standing_audit('outbox.events', part_day);
    IF NOT outbox._is_sealed(partition_name) THEN
        RAISE EXCEPTION 'NOT_SEALED: partition % lost its seal after audit %', partition_name, standing.id
            USING ERRCODE = 'OB061';
    END IF;
    -- DROP takes ACCESS EXCLUSIVE on outbox.events for the rest of this short
    -- transaction; lock_timeout keeps emitters from queueing behind us.
    PERFORM outbox._with_lock_timeout(format('DROP TABLE outbox.%I', partition_name), lock_timeout);
    UPDATE outbox.archive_audit SET removed_at = now(), removed_by = session_user
    WHERE id = standing.id;
    RETURN standing.row_count;
END;
$$;
COMMENT ON FUNCTION outbox.drop_archived(text, interval) IS
'Drops a sealed, audited day partition whose live count and checksum still match its audit row.';

-- Deletes an audited inbox day in one statement, hashing exactly the rows
-- it deletes (DELETE ... RETURNING), and rolls back unless they match the
-- audit row: a row changed, added or removed since the audit aborts it.
-- Already purged: returns 0.
CREATE OR REPLACE FUNCTION inbox.purge_archived(day date)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    standing outbox.archive_audit;
    n bigint;
    sum_hash numeric;
BEGIN
    PERFORM outbox._check_day(day);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key('inbox.messages', day));
    standing := outbox._standing_audit('inbox.messages', day);
    IF standing.removed_at IS NOT NULL THEN
        RETURN 0;
    END IF;
    PERFORM inbox._check_floor(day);
    PERFORM set_config('pgoutbox.inbox_purge', 'on', true);
    EXECUTE format(
        'WITH gone AS (DELETE FROM inbox.messages AS m'
        ' WHERE m.received_at >= $1 AND m.received_at < $2 RETURNING m.*)'
        ' SELECT count(*), coalesce(sum(%s), 0)::numeric FROM gone AS r',
        outbox._row_hash_sql('inbox.messages')
    ) INTO n, sum_hash USING outbox._day_from(day), outbox._day_from(day + 1);
    PERFORM set_config('pgoutbox.inbox_purge', '', true);
    IF (n, sum_hash) IS DISTINCT FROM (standing.row_count, standing.checksum) THEN
        RAISE EXCEPTION 'ARCHIVE_MISMATCH: inbox day % changed since audit %', day, standing.id
            USING ERRCODE = 'OB053',
                  DETAIL = format('audit: %s rows, checksum %s; deleting: %s rows, checksum %s',
                      standing.row_count, standing.checksum, n, sum_hash),
                  HINT = 'Nothing was removed (the delete is rolled back).';
    END IF;
    UPDATE outbox.archive_audit SET removed_at = now(), removed_by = session_user
    WHERE id = standing.id;
    RETURN n;
END;
$$;
COMMENT ON FUNCTION inbox.purge_archived(date) IS
'Deletes an audited inbox day whose deleted rows hash exactly to its audit row; all or nothing.';

-- Voids the standing audit of a unit whose rows are still live, and unseals
-- an outbox partition, so it can change again and be archived afresh.
-- Refused once the rows are removed: then the archive is all there is.
CREATE OR REPLACE FUNCTION outbox.void_archive(
    source text,
    day date,
    reason text,
    lock_timeout interval DEFAULT interval '5 seconds'
)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    standing outbox.archive_audit;
    part text := outbox._partition_name(day);
BEGIN
    PERFORM outbox._archive_source(source);
    PERFORM outbox._check_day(day);
    PERFORM outbox._check_text(reason, 'voiding an archive''s reason', 1000, TRUE);
    PERFORM outbox._check_lock_timeout(lock_timeout);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key(source, day));
    SELECT * INTO standing FROM outbox.archive_audit AS a
    WHERE a.source = void_archive.source AND a.day = void_archive.day AND a.voided_at IS NULL;
    IF FOUND AND standing.removed_at IS NOT NULL THEN
        RAISE EXCEPTION 'ARCHIVE_CONFLICT: % % was removed after audit %; its archive is the only copy', source, day, standing.id
            USING ERRCODE = 'OB055';
    END IF;
    IF FOUND THEN
        UPDATE outbox.archive_audit
        SET voided_at = now(), voided_by = session_user, void_reason = reason
        WHERE id = standing.id;
    END IF;
    IF source = 'outbox.events' AND outbox._is_sealed(part) THEN
        PERFORM outbox._with_lock_timeout(
            format('DROP TRIGGER _050_archived_read_only ON outbox.%I', part), lock_timeout
        );
        EXECUTE format('DROP TRIGGER _050_archived_no_truncate ON outbox.%I', part);
        EXECUTE format('REVOKE SELECT ON outbox.%I FROM pgoutbox_archiver', part);
    END IF;
    RETURN standing.id;
END;
$$;
COMMENT ON FUNCTION outbox.void_archive(text, date, text, interval) IS
'Voids the standing audit of a day whose rows are still live and unseals it (admins; reason required).';

CREATE OR REPLACE FUNCTION outbox.archive_audits(source text DEFAULT NULL)
RETURNS SETOF outbox.archive_audit
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._archive_source(archive_audits.source) WHERE archive_audits.source IS NOT NULL;
    SELECT * FROM outbox.archive_audit AS a
    WHERE archive_audits.source IS NULL OR a.source = archive_audits.source
    ORDER BY a.source, a.day, a.id;
$$;
COMMENT ON FUNCTION outbox.archive_audits(text) IS
'Every archive audit row (standing, removed and voided), by source and day.';

-- Session-level: held by one archiver for a whole unit; released by
-- unlock_archive or when its connection ends (a crash frees it).
CREATE OR REPLACE FUNCTION outbox.try_lock_archive(source text, day date)
RETURNS boolean
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._archive_source(source), outbox._check_day(day);
    SELECT pg_try_advisory_lock(outbox._archive_lock_key(source, day));
$$;

CREATE OR REPLACE FUNCTION outbox.unlock_archive(source text, day date)
RETURNS boolean
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._archive_source(source), outbox._check_day(day);
    SELECT pg_advisory_unlock(outbox._archive_lock_key(source, day));
$$;

-- ---- TRUNCATE and DETACH guards (sql/20_outbox_guards.sql) ----
-- Every existing partition, the default one included, gets its TRUNCATE guard.
DO $$
DECLARE
    part regclass;
BEGIN
    FOR part IN SELECT i.inhrelid::regclass FROM pg_inherits AS i WHERE i.inhparent = 'outbox.events'::regclass LOOP
        EXECUTE format(
            'CREATE OR REPLACE TRIGGER _100_forbid_truncate BEFORE TRUNCATE ON %s'
            ' FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_events__forbid_delete()', part
        );
    END LOOP;
END;
$$;

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

-- As sql/90_roles.sql does for every function: nothing to PUBLIC.
REVOKE ALL ON FUNCTION
outbox._check_headers(jsonb),
outbox.tg_events__guard_partitions(),
outbox._check_ids(uuid[], text),
outbox._check_text(text, text, integer, boolean),
outbox._check_context(text),
outbox._check_max_rows(integer),
outbox._clip_error(text),
outbox.set_notify_throttle(interval),
inbox._check_message(uuid, text),
outbox._check_day(date),
outbox._check_retention(interval, text),
outbox._check_lock_timeout(interval)
FROM public;

GRANT EXECUTE ON FUNCTION outbox.set_notify_throttle(interval), outbox.notify_throttle() TO pgoutbox_admin;
GRANT SELECT ON outbox.wakeup_policy TO pgoutbox_admin;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (6, '0006_poison_proof')
ON CONFLICT (version) DO NOTHING;

COMMIT;
