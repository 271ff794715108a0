-- Guards on outbox.events that hold for every writer, whatever path it takes:
-- policies on INSERT, legal moves and immutability on UPDATE, no DELETE.
-- Trigger names carry their firing order (_100 before _900).

-- Policies (seed 000), checked once per row at INSERT whoever inserts, and
-- raised with the codes of the README's error table; then the subject is
-- derived from the parts just checked.
CREATE OR REPLACE FUNCTION outbox.tg_events__check_policies()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
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
    IF NEW.occurred_at > now() + interval '1 minute' THEN
        RAISE EXCEPTION 'FUTURE_EVENT: occurred_at % is more than a minute ahead of the database clock', NEW.occurred_at
            USING ERRCODE = 'OB002';
    END IF;
    IF NEW.context !~ '^[A-Za-z0-9_-]{1,64}$' THEN
        RAISE EXCEPTION 'INVALID_SUBJECT_PART: context % is not a subject token ([A-Za-z0-9_-], 1-64 chars)', quote_literal(NEW.context)
            USING ERRCODE = 'OB003';
    END IF;
    IF NEW.event_type !~ '^[A-Za-z0-9_-]{1,128}$' THEN
        RAISE EXCEPTION 'INVALID_SUBJECT_PART: event_type % is not a subject token ([A-Za-z0-9_-], 1-128 chars)', quote_literal(NEW.event_type)
            USING ERRCODE = 'OB003';
    END IF;
    IF NEW.event_version IS NULL OR NEW.event_version < 1 THEN
        RAISE EXCEPTION 'INVALID_SUBJECT_PART: event_version must be a positive integer, got %', NEW.event_version
            USING ERRCODE = 'OB003';
    END IF;
    IF NEW.payload IS NULL OR jsonb_typeof(NEW.payload) <> 'object' THEN
        RAISE EXCEPTION 'INVALID_PAYLOAD: payload must be a JSON object, got %', coalesce(jsonb_typeof(NEW.payload), 'NULL')
            USING ERRCODE = 'OB004';
    END IF;
    IF jsonb_typeof(NEW.payload -> 'schema_version') IS DISTINCT FROM 'number'
        OR (NEW.payload ->> 'schema_version')::numeric < 1
        OR (NEW.payload ->> 'schema_version')::numeric
        <> trunc((NEW.payload ->> 'schema_version')::numeric) THEN
        RAISE EXCEPTION 'INVALID_SCHEMA_VERSION: payload.schema_version must be an integer >= 1, got %', coalesce(NEW.payload -> 'schema_version', 'null'::jsonb)
            USING ERRCODE = 'OB005';
    END IF;
    IF NEW.headers IS NULL OR jsonb_typeof(NEW.headers) <> 'object' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: headers must be a JSON object'
            USING ERRCODE = 'OB006';
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
-- an operator requeue, or an illegal move.
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

    IF OLD.status = 'DEAD_LETTER' AND NEW.status = 'PENDING' THEN
        reason := nullif(btrim(current_setting('pgoutbox.requeue_reason', true)), '');
        IF reason IS NULL THEN
            RAISE EXCEPTION 'REASON_REQUIRED: requeueing event % needs a reason', OLD.event_id
                USING ERRCODE = 'OB014',
                      HINT = 'Use outbox.requeue(event_ids, reason).';
        END IF;
        INSERT INTO outbox.requeue_log (event_id, requeued_by, reason, attempts_before, last_error)
        VALUES (OLD.event_id, session_user, reason, OLD.attempts, OLD.last_error);
        RETURN NEW;
    END IF;

    RAISE EXCEPTION 'ILLEGAL_TRANSITION: event % cannot move from % to %', OLD.event_id, OLD.status, NEW.status
        USING ERRCODE = 'OB010',
              DETAIL = format('available_at=%s, now=%s', OLD.available_at, now()),
              HINT = 'Legal moves are listed in the README (Lifecycle).';
END;
$$;

CREATE OR REPLACE FUNCTION outbox.tg_events__forbid_delete()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'DELETE_FORBIDDEN: rows leave outbox.events only by audited partition archival'
        USING ERRCODE = 'OB012';
END;
$$;

CREATE OR REPLACE TRIGGER _100_check_policies
BEFORE INSERT ON outbox.events
FOR EACH ROW EXECUTE FUNCTION outbox.tg_events__check_policies();

-- The event's content never changes. A trigger limited to UPDATEs that name
-- a content column (UPDATE OF), so that claim and mark, which set only
-- delivery columns, neither fire it nor pay for comparing 16 columns.
CREATE OR REPLACE TRIGGER _100_guard_content
BEFORE UPDATE OF
id, event_id, context, aggregate_type, aggregate_id, event_type, event_version, subject,
payload, headers, correlation_id, causation_id, tenant_id, ordering_key, occurred_at, created_at
ON outbox.events
FOR EACH ROW
WHEN (
    (
        new.id, new.event_id, new.context, new.aggregate_type, new.aggregate_id,
        new.event_type, new.event_version, new.subject, new.payload, new.headers,
        new.correlation_id, new.causation_id, new.tenant_id, new.ordering_key,
        new.occurred_at, new.created_at
    )
    IS DISTINCT FROM
    (
        old.id, old.event_id, old.context, old.aggregate_type, old.aggregate_id,
        old.event_type, old.event_version, old.subject, old.payload, old.headers,
        old.correlation_id, old.causation_id, old.tenant_id, old.ordering_key,
        old.occurred_at, old.created_at
    )
)
EXECUTE FUNCTION outbox.tg_events__forbid_content_change();

-- The legal moves made by claim and mark_* (thousands a second) are told
-- apart here, in the WHEN clause, which runs without entering PL/pgSQL:
--   PENDING | FAILED -> PROCESSING   once due (available_at <= now())
--   PROCESSING -> PROCESSING         once the lease expired, under a new token
--   PROCESSING -> COMPLETED | FAILED | DEAD_LETTER   under the same token
-- Every other UPDATE goes to the function (DEAD_LETTER -> PENDING with a
-- reason is the one other legal move).
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

CREATE OR REPLACE TRIGGER _100_forbid_delete
BEFORE DELETE ON outbox.events
FOR EACH ROW EXECUTE FUNCTION outbox.tg_events__forbid_delete();

CREATE OR REPLACE TRIGGER _100_forbid_truncate
BEFORE TRUNCATE ON outbox.events
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_events__forbid_delete();
