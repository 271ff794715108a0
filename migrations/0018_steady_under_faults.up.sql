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

-- generated from sql/20_outbox_guards.sql: outbox.tg_events__guard_update
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

    -- DEAD_LETTER <-> DISCARDED only inside outbox.dlq_discard() and
    -- outbox.dlq_restore() (sql/67_dead_letters.sql), which set
    -- pgoutbox.dlq_action and pgoutbox.dlq_reason; written to
    -- outbox.discard_log here, so that no path around them escapes the audit.
    -- A discarded event moves nowhere else: it is never requeued until restored.
    IF 'DISCARDED' IN (OLD.status, NEW.status)
        OR coalesce(current_setting('pgoutbox.dlq_action', true), '') <> '' THEN
        PERFORM outbox._check_discard_move(
            OLD.event_id, OLD.status, NEW.status,
            (NEW.attempts, NEW.last_error, NEW.available_at, NEW.claimed_at, NEW.claimed_by,
                NEW.claim_token, NEW.published_at)
            IS NOT DISTINCT FROM
            (OLD.attempts, OLD.last_error, OLD.available_at, OLD.claimed_at, OLD.claimed_by,
                OLD.claim_token, OLD.published_at)
        );
        INSERT INTO outbox.discard_log (event_id, action, acted_by, reason, last_error)
        VALUES (
            OLD.event_id, current_setting('pgoutbox.dlq_action', true), session_user,
            current_setting('pgoutbox.dlq_reason', true), OLD.last_error
        );
        RETURN NEW;
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
-- end generated

-- generated from sql/30_outbox_api.sql: outbox.hand_back
-- Hands events back that the broker did not answer for (JetStream away: no
-- ack in time, no responders, not connected, a 503 / no-leader / no-quorum
-- API error; docs/relay.md, "JetStream away"): PROCESSING -> PENDING, due
-- now, and the claim's attempt undone (attempts - 1), so that an outage of
-- the broker never uses up an event's attempts. reason becomes last_error
-- (it says why the event waits). Fenced by claim_token like mark_failed: rows
-- no longer held by it are left alone; STALE_CLAIM when it held none. The
-- update guard lets this move through only while pgoutbox.hand_back holds
-- the claim's token, which this function sets for its own transaction.
CREATE OR REPLACE FUNCTION outbox.hand_back(
    claim_token uuid,
    event_ids uuid[],
    reason text
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
    IF nullif(btrim(reason), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: a hand-back needs a reason' USING ERRCODE = 'OB006';
    END IF;
    PERFORM set_config('pgoutbox.hand_back', hand_back.claim_token::text, TRUE);
    UPDATE outbox.events AS e
    SET status = 'PENDING',
        attempts = e.attempts - 1,
        available_at = now(),
        last_error = outbox._clip_error(hand_back.reason)
    WHERE e.claim_token = hand_back.claim_token
        AND e.status = 'PROCESSING'
        AND e.event_id = ANY(hand_back.event_ids);
    GET DIAGNOSTICS marked = ROW_COUNT;
    PERFORM set_config('pgoutbox.hand_back', '', TRUE);
    IF marked = 0 THEN
        RAISE EXCEPTION 'STALE_CLAIM: claim % holds none of the % given events', claim_token, cardinality(event_ids)
            USING ERRCODE = 'OB013';
    END IF;
    RETURN marked;
END;
$$;
COMMENT ON FUNCTION outbox.hand_back(uuid, uuid[], text) IS
'PROCESSING -> PENDING, due now, with the claim''s attempt undone (the broker did not answer); returns the count.';
-- end generated

REVOKE ALL ON FUNCTION outbox.hand_back(uuid, uuid[], text) FROM public;
GRANT EXECUTE ON FUNCTION outbox.hand_back(uuid, uuid[], text) TO pgoutbox_relay;

-- ---- upcasters: any error of an upcaster is that message's own outcome

-- generated from sql/66_upcasters.sql: inbox._upcast_all
-- The chains of several payloads (event_types[k] v versions[k] ->
-- to_version, payloads[k]; ords[k] names them in the result), without
-- raising: (ordinal, payload, NULL), or (ordinal, NULL, why) for a missing
-- step, a step that raised or returned no JSON object, or an upcaster no
-- longer valid. The why starts with the code's name and number: it becomes
-- the dead letter's last_error. Step by step, each step applied to every
-- payload that needs it in one statement (one subtransaction); when that
-- statement raises, the step is applied one payload at a time, so that only
-- the payloads it raises on fail.
--
-- Any error of an upcaster is caught, with its SQLSTATE and text: OTHERS
-- leaves out assert_failure (P0004) and query_canceled (57014), so both are
-- named. A query_canceled (statement_timeout, or a cancel) leaves the
-- statement no time of its own to go on with: with a single payload it is
-- that payload's failure; with several it is raised again, and the caller
-- (the consumer) upcasts each message in a statement of its own.
CREATE OR REPLACE FUNCTION inbox._upcast_all(
    ords integer[],
    event_types text[],
    versions integer[],
    to_version integer,
    payloads jsonb[]
)
RETURNS TABLE (ordinal integer, result jsonb, error text)
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    cur integer[] := versions;
    done jsonb[] := payloads;
    errs text[] := array_fill(NULL::text, ARRAY[cardinality(ords)]);
    step record;
    fn regprocedure;
    problem text;
    idx integer[];
    results jsonb[];
    one jsonb;
    j integer;
    k integer;
BEGIN
    FOR k IN 1..coalesce(cardinality(ords), 0) LOOP
        IF cur[k] IS NULL OR event_types[k] IS NULL THEN
            errs[k] := 'UPCAST_MISSING [OB071]: the subject names no event type and version';
        ELSIF cur[k] > to_version THEN
            errs[k] := format('UPCAST_MISSING [OB071]: %s v%s is newer than v%s; upcasters only go up', event_types[k], cur[k], to_version);
        END IF;
    END LOOP;
    LOOP
        -- The lowest step still to take, and every payload waiting for it.
        SELECT t.et, t.v INTO step
        FROM unnest(event_types, cur, errs) AS t (et, v, e)
        WHERE t.e IS NULL AND t.v < to_version
        ORDER BY t.v, t.et
        LIMIT 1;
        EXIT WHEN NOT FOUND;
        SELECT array_agg(t.k ORDER BY t.k) INTO idx
        FROM unnest(event_types, cur, errs) WITH ORDINALITY AS t (et, v, e, k)
        WHERE t.e IS NULL AND t.et = step.et AND t.v = step.v;
        SELECT u.upcaster, inbox._upcaster_problem(u.upcaster) INTO fn, problem
        FROM inbox.upcasters AS u
        WHERE u.event_type = step.et AND u.from_version = step.v;
        IF NOT FOUND OR problem IS NOT NULL THEN
            FOREACH k IN ARRAY idx LOOP
                errs[k] := CASE WHEN problem IS NULL
                    THEN format('UPCAST_MISSING [OB071]: no upcaster for %s v%s -> v%s (chain v%s -> v%s)', step.et, step.v, step.v + 1, versions[k], to_version)
                    ELSE format('UPCAST_FAILED [OB072]: %s v%s -> v%s: %s cannot be used: %s', step.et, step.v, step.v + 1, fn, problem)
                END;
            END LOOP;
            CONTINUE;
        END IF;
        BEGIN
            EXECUTE format('SELECT array_agg(%s(t.p) ORDER BY t.i) FROM unnest($1) WITH ORDINALITY AS t (p, i)', fn::oid::regproc)
            INTO results
            USING (SELECT array_agg(done[i.k] ORDER BY i.n) FROM unnest(idx) WITH ORDINALITY AS i (k, n));
        EXCEPTION
            WHEN query_canceled THEN
                IF cardinality(ords) > 1 THEN
                    RAISE;
                END IF;
                errs[idx[1]] := format('UPCAST_FAILED [OB072]: %s v%s -> v%s: %s raised [%s] %s', step.et, step.v, step.v + 1, fn, SQLSTATE, left(SQLERRM, 500));
                CONTINUE;
            WHEN OTHERS OR assert_failure THEN
                results := NULL;
        END;
        IF results IS NULL THEN
            results := '{}';
            FOREACH k IN ARRAY idx LOOP
                BEGIN
                    EXECUTE format('SELECT %s($1)', fn::oid::regproc) INTO one USING done[k];
                EXCEPTION WHEN OTHERS OR assert_failure OR query_canceled THEN
                    IF SQLSTATE = '57014' AND cardinality(ords) > 1 THEN
                        RAISE;
                    END IF;
                    one := NULL;
                    errs[k] := format('UPCAST_FAILED [OB072]: %s v%s -> v%s: %s raised [%s] %s', step.et, step.v, step.v + 1, fn, SQLSTATE, left(SQLERRM, 500));
                END;
                results := array_append(results, one);
            END LOOP;
        END IF;
        FOR j IN 1..cardinality(idx) LOOP
            k := idx[j];
            CONTINUE WHEN errs[k] IS NOT NULL;
            IF jsonb_typeof(results[j]) IS DISTINCT FROM 'object' THEN
                errs[k] := format('UPCAST_FAILED [OB072]: %s v%s -> v%s: %s returned %s, not a JSON object', step.et, step.v, step.v + 1, fn, coalesce(jsonb_typeof(results[j]), 'NULL'));
            ELSE
                done[k] := results[j];
                cur[k] := cur[k] + 1;
            END IF;
        END LOOP;
    END LOOP;
    RETURN QUERY
    SELECT ords[i.k], CASE WHEN errs[i.k] IS NULL THEN done[i.k] END, errs[i.k]
    FROM generate_subscripts(ords, 1) AS i (k);
END;
$$;
-- end generated

-- ---- held snapshots: the hot path does not grow with the oldest snapshot

-- ---- backfill: a handler that joins late replays the outbox's history

-- generated from sql/68_backfill.sql: outbox.backfill_span
-- What the outbox holds of a handler's subjects in [from_at, until_at): how
-- many events, the first and last created_at among them, and the oldest
-- created_at the outbox keeps at all (older days were archived and dropped:
-- a range starting before it is not whole here). The plan the command prints
-- first is made of it.
CREATE OR REPLACE FUNCTION outbox.backfill_span(
    subjects text[],
    from_at timestamptz,
    until_at timestamptz
)
RETURNS TABLE (events bigint, first_at timestamptz, last_at timestamptz, kept_from timestamptz)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_backfill(subjects, from_at, until_at, 1);
    RETURN QUERY
    SELECT count(*), min(e.created_at), max(e.created_at), (SELECT min(k.created_at) FROM outbox.events AS k)
    FROM outbox.events AS e
    WHERE e.subject = ANY(backfill_span.subjects)
        AND e.created_at >= backfill_span.from_at AND e.created_at < backfill_span.until_at;
END;
$$;
COMMENT ON FUNCTION outbox.backfill_span(text[], timestamptz, timestamptz) IS
'For pgoutbox backfill: how many events of these subjects the outbox holds in a range, and since when it keeps any.';
-- end generated

-- generated from sql/68_backfill.sql: outbox.backfill_page
-- One page of a backfill: the events of the handler's subjects created in
-- [from_at, until_at) with an id above after_id, in id order, whatever their
-- status. Id order is emit order within an ordering key (outbox.emit holds
-- the key's lock until commit), so a backfill that delivers pages in order,
-- one event after the other, keeps every key's order; after_id is the
-- resume point. The columns are those the relay publishes (wire.to_nats).
CREATE OR REPLACE FUNCTION outbox.backfill_page(
    subjects text[],
    from_at timestamptz,
    until_at timestamptz,
    after_id bigint,
    page_size integer
)
RETURNS TABLE (
    id bigint,
    event_id uuid,
    subject text,
    context text,
    aggregate_type text,
    aggregate_id text,
    event_type text,
    event_version integer,
    payload jsonb,
    headers jsonb,
    correlation_id uuid,
    causation_id uuid,
    tenant_id text,
    ordering_key text,
    occurred_at timestamptz,
    created_at timestamptz
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_backfill(subjects, from_at, until_at, page_size);
    IF after_id IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: after_id is required (0 for the start)'
            USING ERRCODE = 'OB006';
    END IF;
    RETURN QUERY
    SELECT
        e.id, e.event_id, e.subject, e.context, e.aggregate_type, e.aggregate_id, e.event_type,
        e.event_version, e.payload, e.headers, e.correlation_id, e.causation_id, e.tenant_id,
        e.ordering_key, e.occurred_at, e.created_at
    FROM outbox.events AS e
    WHERE e.id > backfill_page.after_id
        AND e.subject = ANY(backfill_page.subjects)
        AND e.created_at >= backfill_page.from_at AND e.created_at < backfill_page.until_at
    ORDER BY e.id
    LIMIT backfill_page.page_size;
END;
$$;
COMMENT ON FUNCTION outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer) IS
'For pgoutbox backfill: the next page of events of these subjects in a range, in id (emit) order.';
-- end generated

-- generated from sql/68_backfill.sql: outbox._check_backfill
CREATE OR REPLACE FUNCTION outbox._check_backfill(
    subjects text[],
    from_at timestamptz,
    until_at timestamptz,
    page_size integer
)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF subjects IS NULL OR cardinality(subjects) = 0 OR array_position(subjects, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: subjects must name at least one subject, and no NULL'
            USING ERRCODE = 'OB006';
    END IF;
    IF from_at IS NULL OR until_at IS NULL OR NOT from_at < until_at THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: from_at must be before until_at, got % and %', from_at, until_at
            USING ERRCODE = 'OB006';
    END IF;
    IF page_size IS NULL OR page_size < 1 OR page_size > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: page_size must be between 1 and 10000, got %', page_size
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;
-- end generated

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgoutbox_backfiller') THEN
        CREATE ROLE pgoutbox_backfiller NOLOGIN;
    END IF;
END;
$$;

REVOKE ALL ON FUNCTION
outbox.backfill_span(text[], timestamptz, timestamptz),
outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer),
outbox._check_backfill(text[], timestamptz, timestamptz, integer)
FROM public;
GRANT USAGE ON SCHEMA outbox, inbox TO pgoutbox_backfiller;
GRANT EXECUTE ON FUNCTION
outbox.schema_version(), outbox.serves_workers_from(),
outbox.backfill_span(text[], timestamptz, timestamptz),
outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer),
inbox.receive(uuid, text, text, jsonb),
inbox.mark_processed(uuid, text),
inbox.record_error(uuid, text, text, boolean, interval)
TO pgoutbox_backfiller;

-- ---- the console

INSERT INTO outbox.schema_migrations (version, name)
VALUES (18, '0018_steady_under_faults')
ON CONFLICT (version) DO NOTHING;

COMMIT;
