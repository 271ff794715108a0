-- 0011_emit_path (down): back to version 10: the policy trigger of version
-- 10, the wake-up in a trigger of its own (_900_wakeup), and the lifecycle
-- invariants as CHECK constraints instead of the _500_check_state trigger.
--
-- What it cannot undo: nothing is lost. The CHECK constraints are added
-- NOT VALID and then validated, which reads every partition (under a SHARE
-- UPDATE EXCLUSIVE lock: emits and relays go on meanwhile); rows written
-- under version 11 satisfy them, as its trigger enforced the same rules.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 11) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

ALTER TABLE outbox.events
ADD CONSTRAINT status_is_known CHECK (
    status IN ('PENDING', 'PROCESSING', 'COMPLETED', 'FAILED', 'DEAD_LETTER')
) NOT VALID,
ADD CONSTRAINT attempts_is_non_negative CHECK (attempts >= 0) NOT VALID,
ADD CONSTRAINT published_iff_completed CHECK (
    (status = 'COMPLETED') = (published_at IS NOT NULL)
) NOT VALID,
ADD CONSTRAINT processing_has_a_claim CHECK (
    status <> 'PROCESSING'
    OR (claim_token IS NOT NULL AND claimed_at IS NOT NULL AND claimed_by IS NOT NULL)
) NOT VALID,
ADD CONSTRAINT failed_or_dead_has_an_error CHECK (
    status NOT IN ('FAILED', 'DEAD_LETTER') OR last_error IS NOT NULL
) NOT VALID;
ALTER TABLE outbox.events VALIDATE CONSTRAINT status_is_known;
ALTER TABLE outbox.events VALIDATE CONSTRAINT attempts_is_non_negative;
ALTER TABLE outbox.events VALIDATE CONSTRAINT published_iff_completed;
ALTER TABLE outbox.events VALIDATE CONSTRAINT processing_has_a_claim;
ALTER TABLE outbox.events VALIDATE CONSTRAINT failed_or_dead_has_an_error;

DROP TRIGGER IF EXISTS _500_check_state ON outbox.events;
DROP FUNCTION IF EXISTS outbox.tg_events__refuse_bad_state();

-- ---- version 10 definitions (from sql/ before this migration) ----
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

CREATE OR REPLACE FUNCTION outbox.tg_events__wakeup()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    now_us bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    due_us bigint := coalesce(pg_sequence_last_value('outbox.wakeup_due_at'), 0);
BEGIN
    -- Not due while the due time lies ahead, by at most the largest throttle
    -- (1 minute): a clock set back further cannot mute wake-ups for long. A
    -- sequence never set (fresh, or reset by a crash) reads NULL: due.
    IF due_us - now_us BETWEEN 1 AND 60000000 THEN
        RETURN new;
    END IF;
    PERFORM setval('outbox.wakeup_due_at', now_us + (extract(epoch FROM outbox.notify_throttle()) * 1000000)::bigint);
    PERFORM pg_notify('outbox_v1', new.context);
    RETURN new;
END;
$$;

CREATE OR REPLACE TRIGGER _900_wakeup
BEFORE INSERT ON outbox.events
FOR EACH ROW EXECUTE FUNCTION outbox.tg_events__wakeup();

REVOKE ALL ON FUNCTION outbox.tg_events__wakeup() FROM public;

DROP FUNCTION IF EXISTS outbox._headers_pass(jsonb);
DROP FUNCTION IF EXISTS outbox._wake_relays(text);
DROP FUNCTION IF EXISTS outbox._wakeup_is_due();

DELETE FROM outbox.schema_migrations
WHERE version = 11;

COMMIT;
