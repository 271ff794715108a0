-- 0005_claim_mark_path (down): back to version 4: subject generated again,
-- default fillfactor, the content check inside the status guard's WHEN
-- clause, claim and mark_* planned with sequential scans allowed.
--
-- What it cannot undo: the position of outbox.events.subject. PostgreSQL 15
-- cannot turn a plain column into a generated one, so the column is dropped
-- and added again as generated: it comes back as the last column, and every
-- partition is rewritten (under an ACCESS EXCLUSIVE lock, for as long as the
-- rewrite of the whole outbox takes). Values are not lost: they were always
-- {context}.event.{event_type}.v{event_version}, which the generated column
-- recomputes. Rows written since keep their pages' fill.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 5) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

DROP TRIGGER IF EXISTS _100_guard_content ON outbox.events;
DROP FUNCTION IF EXISTS outbox.tg_events__forbid_content_change();

-- Only while subject is still the plain column of version 5 (a re-run finds
-- it generated already).
DO $$
BEGIN
    IF EXISTS (
        SELECT 1 FROM pg_attribute
        WHERE attrelid = 'outbox.events'::regclass AND attname = 'subject' AND attgenerated = ''
    ) THEN
        ALTER TABLE outbox.events DROP COLUMN subject;
        ALTER TABLE outbox.events ADD COLUMN subject text GENERATED ALWAYS AS (
            context || '.event.' || event_type || '.v' || event_version::text
        ) STORED;
    END IF;
END;
$$;

DO $$
DECLARE
    part regclass;
BEGIN
    FOR part IN SELECT i.inhrelid::regclass FROM pg_inherits AS i WHERE i.inhparent = 'outbox.events'::regclass LOOP
        EXECUTE format('ALTER TABLE %s RESET (fillfactor)', part);
    END LOOP;
END;
$$;

-- ---- version 4 definitions (from migrations/0001_initial.up.sql and 0003_archival.up.sql) ----
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
--     primary key instead of hash-joining the whole table. Known limit: a
--     generic plan made while a partition is young (before autovacuum has
--     analyzed it) may scan the partition in the UPDATE until the next
--     ANALYZE re-plans it (docs/relay.md, "For the SQL core").
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

-- The columns that enter the checksum, in order, and how each is rendered:
-- plain (integers, uuid, boolean: text form as is), text (text, json, jsonb:
-- escaped) or timestamp (timestamptz: epoch microseconds). Any other type
-- raises UNSUPPORTED_COLUMN, so a future column cannot be hashed differently
-- on the two sides without anyone noticing.
CREATE OR REPLACE FUNCTION outbox.checksum_columns(source text)
RETURNS TABLE (ordinal integer, column_name text, kind text)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    rel regclass := outbox._archive_source(source);
    bad text;
BEGIN
    SELECT string_agg(format('%s (%s)', a.attname, format_type(a.atttypid, a.atttypmod)), ', ')
    INTO bad
    FROM pg_attribute AS a
    WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
        AND a.atttypid NOT IN (
            'int2'::regtype, 'int4'::regtype, 'int8'::regtype, 'uuid'::regtype, 'bool'::regtype,
            'text'::regtype, 'varchar'::regtype, 'json'::regtype, 'jsonb'::regtype,
            'timestamptz'::regtype
        );
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'UNSUPPORTED_COLUMN: the archive checksum has no rendering for %', bad
            USING ERRCODE = 'OB058', HINT = 'Teach outbox.checksum_columns and spark/checksum.py the type.';
    END IF;
    RETURN QUERY
    SELECT
        (row_number() OVER (ORDER BY a.attnum))::integer,
        a.attname::text,
        CASE
            WHEN a.atttypid = 'timestamptz'::regtype THEN 'timestamp'
            WHEN a.atttypid IN ('text'::regtype, 'varchar'::regtype, 'json'::regtype, 'jsonb'::regtype)
                THEN 'text'
            ELSE 'plain'
        END
    FROM pg_attribute AS a
    WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
    ORDER BY a.attnum;
END;
$$;
COMMENT ON FUNCTION outbox.checksum_columns(text) IS
'Columns of outbox.events or inbox.messages that enter the archive checksum, in order, with their rendering.';

DELETE FROM outbox.schema_migrations
WHERE version = 5;

COMMIT;
