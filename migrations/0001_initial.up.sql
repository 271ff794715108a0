-- 0001_initial (up): outbox.events, inbox.messages, their functions, roles.
--
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once: one transaction, serialised by an
-- advisory lock, made of idempotent DDL. Refuses to run over a newer schema,
-- whose functions it would silently replace with older ones.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 1) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: a newer migration is applied; 0001 would replace its functions'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

-- ---- from sql/00_schemas.sql (as of this migration) ----
-- Schemas and the schema version record.
--
-- Every file under sql/ is idempotent DDL: migrations/0001 is built from these
-- files, and running a migration twice (or two at once, serialised by the
-- advisory lock the migration takes) must change nothing.

CREATE SCHEMA IF NOT EXISTS outbox;
CREATE SCHEMA IF NOT EXISTS inbox;
COMMENT ON SCHEMA outbox IS 'pgoutbox: transactional outbox (events awaiting relay to JetStream)';
COMMENT ON SCHEMA inbox IS 'pgoutbox: idempotent inbox (one row per message and handler)';

-- One row per applied migration. The relay refuses to start unless the
-- highest version here is one it understands.
CREATE TABLE IF NOT EXISTS outbox.schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    applied_by text NOT NULL DEFAULT session_user,
    CONSTRAINT version_is_positive CHECK (version >= 1),
    CONSTRAINT name_is_snake_case CHECK (name ~ '^[0-9]{4}_[a-z0-9_]+$')
);

CREATE OR REPLACE FUNCTION outbox.schema_version()
RETURNS integer
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT coalesce(max(version), 0) FROM outbox.schema_migrations;
$$;
COMMENT ON FUNCTION outbox.schema_version() IS
'Highest applied migration; workers compare it with the version they were built for.';

-- ---- from sql/10_outbox_events.sql (as of this migration) ----
-- outbox.events: one row per domain event, range-partitioned by created_at
-- (one partition per UTC day). Rows leave only when a whole partition is
-- archived and dropped; no role may DELETE (see 20_outbox_guards.sql).
--
-- Lifecycle (status), enforced for every UPDATE by tg_events__guard_update:
--   PENDING      emitted, waiting for a relay           -> PROCESSING
--   PROCESSING   claimed under a lease (available_at)   -> COMPLETED | FAILED | DEAD_LETTER
--                                                         | PROCESSING (lease expired, re-claim)
--   FAILED       publish failed, retry at available_at  -> PROCESSING (once due)
--   COMPLETED    acked by JetStream (terminal)
--   DEAD_LETTER  gave up; needs an operator             -> PENDING (outbox.requeue, audited)
--
-- available_at is "when may a relay take this row next": emit time for
-- PENDING, retry time for FAILED, lease expiry for PROCESSING. One column
-- keeps the claim predicate and its index simple.

CREATE TABLE IF NOT EXISTS outbox.events (
    id bigint GENERATED ALWAYS AS IDENTITY,
    event_id uuid NOT NULL DEFAULT gen_random_uuid(),
    context text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    event_type text NOT NULL,
    event_version integer NOT NULL DEFAULT 1,
    subject text GENERATED ALWAYS AS (
        context || '.event.' || event_type || '.v' || event_version::text
    ) STORED,
    payload jsonb NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}'::jsonb,
    correlation_id uuid,
    causation_id uuid,
    tenant_id text,
    ordering_key text,
    occurred_at timestamptz NOT NULL DEFAULT now(),
    created_at timestamptz NOT NULL DEFAULT now(),
    available_at timestamptz NOT NULL DEFAULT now(),
    status text NOT NULL DEFAULT 'PENDING',
    attempts integer NOT NULL DEFAULT 0,
    last_error text,
    claimed_at timestamptz,
    claimed_by text,
    claim_token uuid,
    published_at timestamptz,
    PRIMARY KEY (id, created_at),
    -- Only lifecycle invariants are CHECKs: CHECKs run on every UPDATE, and
    -- claim/mark update each row twice. The event's content is validated
    -- once, at INSERT, by _100_check_policies (with the README's codes) and
    -- cannot change afterwards (_100_guard_update), so re-checking it on
    -- every status move would only cost throughput.
    CONSTRAINT status_is_known CHECK (
        status IN ('PENDING', 'PROCESSING', 'COMPLETED', 'FAILED', 'DEAD_LETTER')
    ),
    CONSTRAINT attempts_is_non_negative CHECK (attempts >= 0),
    CONSTRAINT published_iff_completed CHECK (
        (status = 'COMPLETED') = (published_at IS NOT NULL)
    ),
    CONSTRAINT processing_has_a_claim CHECK (
        status <> 'PROCESSING'
        OR (claim_token IS NOT NULL AND claimed_at IS NOT NULL AND claimed_by IS NOT NULL)
    ),
    CONSTRAINT failed_or_dead_has_an_error CHECK (
        status NOT IN ('FAILED', 'DEAD_LETTER') OR last_error IS NOT NULL
    )
) PARTITION BY RANGE (created_at);

COMMENT ON TABLE outbox.events IS
'Transactional outbox. Write with outbox.emit(); relays move rows with claim/mark_*.';
COMMENT ON COLUMN outbox.events.event_id IS
'Idempotency key: the Nats-Msg-Id on the wire and the consumer''s message_id.';
COMMENT ON COLUMN outbox.events.available_at IS
'When a relay may take the row next: emit time, retry time (FAILED) or lease expiry (PROCESSING).';
COMMENT ON COLUMN outbox.events.attempts IS 'Number of claims, i.e. publish attempts.';
COMMENT ON COLUMN outbox.events.claim_token IS
'Fencing token of the current (or last) claim; mark_* must present it.';

-- Rows whose day has no partition land here rather than failing the
-- business transaction; create_partitions() leaves such a day alone (and says
-- so) until the default partition is archived.
CREATE TABLE IF NOT EXISTS outbox.events_default PARTITION OF outbox.events DEFAULT
WITH (
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0
);

-- Claim scan: claim() walks this partial index in id order; it holds only
-- unfinished rows, so it stays small however long partitions are kept.
CREATE INDEX IF NOT EXISTS events_claimable_idx ON outbox.events (id)
WHERE status IN ('PENDING', 'FAILED', 'PROCESSING');

-- Per-key ordering: "is there an earlier unfinished event with my key?"
CREATE INDEX IF NOT EXISTS events_unfinished_key_idx ON outbox.events (ordering_key, id)
WHERE ordering_key IS NOT NULL AND status <> 'COMPLETED';

-- mark_published / mark_failed find a claim's rows by token.
CREATE INDEX IF NOT EXISTS events_claim_token_idx ON outbox.events (claim_token)
WHERE status = 'PROCESSING';

CREATE INDEX IF NOT EXISTS events_dead_letter_idx ON outbox.events (context)
WHERE status = 'DEAD_LETTER';

-- Deliberately no index on event_id: every claim and mark would insert a
-- random UUID into it (scattered page writes, full-page images in the WAL),
-- which cost a third of the claim + mark throughput when measured. Marks find
-- rows by claim token, requeue by the DEAD_LETTER index; an operator's lookup
-- by event_id scans (add a created_at range to prune partitions).

-- DEAD_LETTER -> PENDING audit trail, written by the update guard itself so
-- that no path around outbox.requeue() escapes it.
CREATE TABLE IF NOT EXISTS outbox.requeue_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id uuid NOT NULL,
    requeued_at timestamptz NOT NULL DEFAULT now(),
    requeued_by text NOT NULL,
    reason text NOT NULL,
    attempts_before integer NOT NULL,
    last_error text,
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);

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
        RAISE EXCEPTION 'days_ahead must be between 0 and 366, got %', days_ahead
            USING ERRCODE = 'OB006';
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
            || ' WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,'
            || ' autovacuum_vacuum_cost_delay = 0)',
            part, lo, hi
        );
        RETURN NEXT part;
    END LOOP;
END;
$$;
COMMENT ON FUNCTION outbox.create_partitions(integer, date) IS
'Creates daily partitions of outbox.events ahead of time; safe to call any number of times.';

-- ---- from sql/20_outbox_guards.sql (as of this migration) ----
-- Guards on outbox.events that hold for every writer, whatever path it takes:
-- policies on INSERT, legal moves and immutability on UPDATE, no DELETE.
-- Trigger names carry their firing order (_100 before _900).

-- Policies, checked once per row at INSERT whoever inserts, and
-- raised with the codes of the README's error table.
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
    RETURN NEW;
END;
$$;

-- Everything the trigger's WHEN clause (below) lets through: the event's
-- content changing, a no-op, an operator requeue, or an illegal move.
CREATE OR REPLACE FUNCTION outbox.tg_events__guard_update()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    reason text;
BEGIN
    IF (NEW.id, NEW.event_id, NEW.context, NEW.aggregate_type, NEW.aggregate_id,
        NEW.event_type, NEW.event_version, NEW.payload, NEW.headers,
        NEW.correlation_id, NEW.causation_id, NEW.tenant_id, NEW.ordering_key,
        NEW.occurred_at, NEW.created_at)
        IS DISTINCT FROM
       (OLD.id, OLD.event_id, OLD.context, OLD.aggregate_type, OLD.aggregate_id,
        OLD.event_type, OLD.event_version, OLD.payload, OLD.headers,
        OLD.correlation_id, OLD.causation_id, OLD.tenant_id, OLD.ordering_key,
        OLD.occurred_at, OLD.created_at) THEN
        RAISE EXCEPTION 'IMMUTABLE_EVENT: event % is immutable once emitted; only its delivery state changes', OLD.event_id
            USING ERRCODE = 'OB011';
    END IF;

    -- A no-op update is not a move. (Compared column by column: generated
    -- columns such as subject are still NULL in NEW in a BEFORE trigger.)
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

-- The legal moves made by claim and mark_* (thousands a second) are told
-- apart here, in the WHEN clause, which runs without entering PL/pgSQL:
--   PENDING | FAILED -> PROCESSING   once due (available_at <= now())
--   PROCESSING -> PROCESSING         once the lease expired, under a new token
--   PROCESSING -> COMPLETED | FAILED | DEAD_LETTER   under the same token
-- with the event's content unchanged. Every other UPDATE goes to the function
-- (DEAD_LETTER -> PENDING with a reason is the one other legal move).
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
    OR (
        new.id, new.event_id, new.context, new.aggregate_type, new.aggregate_id,
        new.event_type, new.event_version, new.payload, new.headers,
        new.correlation_id, new.causation_id, new.tenant_id, new.ordering_key,
        new.occurred_at, new.created_at
    )
    IS DISTINCT FROM
    (
        old.id, old.event_id, old.context, old.aggregate_type, old.aggregate_id,
        old.event_type, old.event_version, old.payload, old.headers,
        old.correlation_id, old.causation_id, old.tenant_id, old.ordering_key,
        old.occurred_at, old.created_at
    )
)
EXECUTE FUNCTION outbox.tg_events__guard_update();

CREATE OR REPLACE TRIGGER _100_forbid_delete
BEFORE DELETE ON outbox.events
FOR EACH ROW EXECUTE FUNCTION outbox.tg_events__forbid_delete();

CREATE OR REPLACE TRIGGER _100_forbid_truncate
BEFORE TRUNCATE ON outbox.events
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_events__forbid_delete();

-- ---- from sql/30_outbox_api.sql (as of this migration) ----
-- The outbox API: emit (apps), claim / mark_published / mark_failed (relays),
-- requeue (operators), backlog (everyone who watches).

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
--     primary key instead of hash-joining the whole table.
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
AS $$
DECLARE
    token uuid := gen_random_uuid();
BEGIN
    IF nullif(btrim(worker), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: worker must be named' USING ERRCODE = 'OB006';
    END IF;
    IF batch_size IS NULL OR batch_size < 1 OR batch_size > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: batch_size must be between 1 and 10000, got %', batch_size
            USING ERRCODE = 'OB006';
    END IF;
    IF lease IS NULL OR lease <= interval '0' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: lease must be positive, got %', lease
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
    RETURNING e.*;
END;
$$;
COMMENT ON FUNCTION outbox.claim(text, integer, interval) IS
'Claims up to batch_size due events (new, retry due, or lease expired) under a lease.';

-- Marks the claim's events COMPLETED. Rows no longer held by claim_token (the
-- lease expired and another relay took them) are left alone: fencing. Returns
-- how many were marked; raises STALE_CLAIM when it could mark none of them.
CREATE OR REPLACE FUNCTION outbox.mark_published(
    claim_token uuid,
    event_ids uuid[]
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
AS $$
DECLARE
    marked integer;
BEGIN
    UPDATE outbox.events AS e
    SET status = 'COMPLETED', published_at = now(), last_error = NULL
    WHERE e.claim_token = mark_published.claim_token
        AND e.status = 'PROCESSING'
        AND e.event_id = ANY(mark_published.event_ids);
    GET DIAGNOSTICS marked = ROW_COUNT;
    IF marked = 0 AND cardinality(event_ids) > 0 THEN
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
-- retry_at[i] is NULL (the relay's retry policy decided to give up).
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
AS $$
DECLARE
    marked integer;
BEGIN
    IF cardinality(event_ids) IS DISTINCT FROM cardinality(errors)
        OR cardinality(event_ids) IS DISTINCT FROM cardinality(retry_at) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_ids, errors and retry_at must have the same length'
            USING ERRCODE = 'OB006';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(errors) AS x (err) WHERE nullif(btrim(x.err), '') IS NULL) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: every failure needs an error text'
            USING ERRCODE = 'OB006';
    END IF;
    UPDATE outbox.events AS e
    SET status = CASE WHEN f.retry_at IS NULL THEN 'DEAD_LETTER' ELSE 'FAILED' END,
        last_error = f.error,
        available_at = coalesce(f.retry_at, e.available_at)
    FROM unnest(event_ids, errors, retry_at) AS f (event_id, error, retry_at)
    WHERE e.claim_token = mark_failed.claim_token
        AND e.status = 'PROCESSING'
        AND e.event_id = f.event_id;
    GET DIAGNOSTICS marked = ROW_COUNT;
    IF marked = 0 AND cardinality(event_ids) > 0 THEN
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
    IF nullif(btrim(reason), '') IS NULL THEN
        RAISE EXCEPTION 'REASON_REQUIRED: a requeue needs a reason' USING ERRCODE = 'OB014';
    END IF;
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
        now() - min(u.available_at) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now()),
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
    SELECT e.event_id, e.context, e.subject, e.ordering_key, e.attempts, e.last_error, e.created_at
    FROM outbox.events AS e
    WHERE e.status = 'DEAD_LETTER'
        AND (dead_letters.context IS NULL OR e.context = dead_letters.context)
    ORDER BY e.id DESC
    LIMIT dead_letters.max_rows;
$$;
COMMENT ON FUNCTION outbox.dead_letters(text, integer) IS
'Dead-lettered events (newest first) with their last error; requeue them with outbox.requeue().';

-- ---- from sql/40_outbox_wakeup.sql (as of this migration) ----
-- Wake-up hints for relays: NOTIFY outbox_v1 with the context as payload.
--
-- A transaction that has issued NOTIFY takes a cluster-wide lock while it
-- commits, which serialises the commits of concurrent writers (measured here:
-- 4 writers fell from ~7,400 to ~2,900 rows/s with a per-row NOTIFY). So:
--   * the trigger is per statement: a bulk insert notifies once per context;
--   * per context, at most one notification per throttle interval
--     (pgoutbox.notify_throttle, default 5 ms), decided on the unlogged
--     outbox.wakeups row; a writer that finds the row locked by another writer
--     skips (SKIP LOCKED) rather than waiting: that writer is about to notify.
-- A skipped hint is covered by the relay, which keeps claiming while work
-- remains, claims again one throttle interval after a wake-up, and polls on a
-- fallback interval. Notifications are hints; the table is the truth.

CREATE UNLOGGED TABLE IF NOT EXISTS outbox.wakeups (
    context text PRIMARY KEY,
    notified_at timestamptz NOT NULL
);
COMMENT ON TABLE outbox.wakeups IS
'Last wake-up NOTIFY per context (throttle state; unlogged, losing it only costs one extra NOTIFY).';

CREATE OR REPLACE FUNCTION outbox.notify_throttle()
RETURNS interval
LANGUAGE sql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT coalesce(nullif(current_setting('pgoutbox.notify_throttle', true), '')::interval, interval '5 milliseconds');
$$;
COMMENT ON FUNCTION outbox.notify_throttle() IS
'Minimum gap between two wake-ups of one context (setting pgoutbox.notify_throttle, default 5 ms).';

CREATE OR REPLACE FUNCTION outbox.tg_events__notify()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    ctx text;
    last_at timestamptz;
    gap interval := outbox.notify_throttle();
BEGIN
    FOR ctx IN SELECT DISTINCT n.context FROM new_rows AS n LOOP
        -- Plain read first: within the interval (the common case under load)
        -- the trigger neither locks nor writes anything.
        SELECT w.notified_at INTO last_at FROM outbox.wakeups AS w WHERE w.context = ctx;
        IF NOT FOUND THEN
            INSERT INTO outbox.wakeups (context, notified_at)
            VALUES (ctx, clock_timestamp())
            ON CONFLICT DO NOTHING;
            CONTINUE WHEN NOT FOUND;  -- another writer created it and notifies
        ELSE
            CONTINUE WHEN last_at > clock_timestamp() - gap;
            -- Due: one writer takes the row, the others skip instead of waiting.
            PERFORM 1 FROM outbox.wakeups AS w WHERE w.context = ctx FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;
            UPDATE outbox.wakeups AS w SET notified_at = clock_timestamp()
            WHERE w.context = ctx AND w.notified_at <= clock_timestamp() - gap;
            CONTINUE WHEN NOT FOUND;  -- notified by a writer that committed meanwhile
        END IF;
        PERFORM pg_notify('outbox_v1', ctx);
    END LOOP;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER _900_notify
AFTER INSERT ON outbox.events
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_events__notify();

-- ---- from sql/50_inbox.sql (as of this migration) ----
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
       (OLD.status, OLD.processed_at, OLD.attempts, OLD.last_error, OLD.dlq_metadata)
        OR (OLD.status, NEW.status) IN (
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

CREATE OR REPLACE TRIGGER _100_guard_update
BEFORE UPDATE ON inbox.messages
FOR EACH ROW EXECUTE FUNCTION inbox.tg_messages__guard_update();

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

CREATE OR REPLACE FUNCTION inbox.mark_processed(message_id uuid, handler text)
RETURNS inbox.messages
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.messages;
BEGIN
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
CREATE OR REPLACE FUNCTION inbox.record_error(
    message_id uuid,
    handler text,
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
    IF nullif(btrim(error), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: an error text is required' USING ERRCODE = 'OB006';
    END IF;
    UPDATE inbox.messages AS m
    SET status = CASE WHEN dead THEN 'DEAD_LETTER' ELSE 'FAILED' END,
        last_error = record_error.error
    WHERE m.message_id = record_error.message_id AND m.handler = record_error.handler
        AND m.status IN ('RECEIVED', 'FAILED')
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_move(message_id, handler, CASE WHEN dead THEN 'DEAD_LETTER' ELSE 'FAILED' END);
    END IF;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.record_error(uuid, text, text, boolean) IS
'RECEIVED/FAILED -> FAILED, or -> DEAD_LETTER with dead => true.';

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

-- ---- from sql/90_roles.sql (as of this migration) ----
-- Roles (NOLOGIN groups: grant them to your login roles). Everything goes
-- through SECURITY DEFINER functions with a pinned search_path; the tables
-- themselves are granted to nobody but the owner, and admins may only read.
-- Roles are cluster-wide: created once, shared by every database using pgoutbox.

DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['pgoutbox_writer', 'pgoutbox_relay', 'pgoutbox_consumer', 'pgoutbox_admin'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', r);
        END IF;
    END LOOP;
END;
$$;

REVOKE ALL ON SCHEMA outbox, inbox FROM public;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox, inbox FROM public;

GRANT USAGE ON SCHEMA outbox, inbox
TO pgoutbox_writer, pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin;

GRANT EXECUTE ON FUNCTION
outbox.emit(text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz)
TO pgoutbox_writer;

GRANT EXECUTE ON FUNCTION
outbox.claim(text, integer, interval),
outbox.mark_published(uuid, uuid[]),
outbox.mark_failed(uuid, uuid[], text[], timestamptz[]),
outbox.notify_throttle()
TO pgoutbox_relay;

GRANT EXECUTE ON FUNCTION
inbox.receive(uuid, text, text, jsonb),
inbox.mark_processed(uuid, text),
inbox.record_error(uuid, text, text, boolean)
TO pgoutbox_consumer;

GRANT EXECUTE ON FUNCTION
outbox.requeue(uuid[], text),
outbox.create_partitions(integer, date)
TO pgoutbox_admin;

-- Read-only functions every worker uses for health and start-up checks; the
-- relay keeps partitions created ahead as part of its housekeeping.
GRANT EXECUTE ON FUNCTION
outbox.schema_version(), outbox.backlog(text), outbox.dead_letters(text, integer),
inbox.backlog(text)
TO pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin;
GRANT EXECUTE ON FUNCTION outbox.create_partitions(integer, date) TO pgoutbox_relay;

-- Named tables, not ALL TABLES: partitions are read through their parent,
-- and a re-run must not widen grants to partitions created since.
GRANT SELECT ON outbox.events, outbox.requeue_log, outbox.schema_migrations,
outbox.wakeups, inbox.messages TO pgoutbox_admin;

-- ---- from sql/99_version.sql (as of this migration) ----
-- The migration this canonical definition corresponds to, and the partitions
-- a fresh database starts with. Add a row here with every new migration.
INSERT INTO outbox.schema_migrations (version, name)
VALUES (1, '0001_initial')
ON CONFLICT (version) DO NOTHING;

SELECT count(*) AS partitions_created FROM outbox.create_partitions();

COMMIT;
