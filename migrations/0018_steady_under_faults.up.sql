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

-- The claim floor (sql/10_outbox_events.sql): claim and backlog walk
-- events_claimable_idx from it, not from the bottom. A claim of schema 17's
-- definition still works on this schema (it walks from the bottom).
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor_next AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor_wait AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
COMMENT ON SEQUENCE outbox.claim_floor IS
'No claimable event has a lower id (outbox._claim_floor). Unlogged: unset (walk from the bottom) after a crash.';

-- generated from sql/20_outbox_guards.sql: outbox.tg_events__lower_claim_floor
-- An event below the claim floor or its candidate (outbox._claim_floor,
-- sql/30_outbox_api.sql) that is, or becomes, claimable lowers the floor to
-- its id and cancels the candidate: a finished event made claimable again
-- (requeue, requeue_completed), and a row inserted with an id of its own
-- (a restore, an owner's INSERT ... OVERRIDING SYSTEM VALUE) or one whose id
-- the sequence gave out before a candidate was taken. Under the floor's
-- lock, held to the end of the transaction, so that no claimer moves the
-- floor past it before it is committed and seen.
CREATE OR REPLACE FUNCTION outbox.tg_events__lower_claim_floor()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('pgoutbox.claim_floor', 0));
    IF NEW.id < pg_sequence_last_value('outbox.claim_floor') THEN
        PERFORM setval('outbox.claim_floor', NEW.id);
    END IF;
    PERFORM setval('outbox.claim_floor_next', 1, FALSE);
    RETURN NEW;
END;
$$;
-- end generated

CREATE OR REPLACE TRIGGER _200_lower_claim_floor
BEFORE UPDATE ON outbox.events
FOR EACH ROW
WHEN (
    old.status NOT IN ('PENDING', 'FAILED', 'PROCESSING')
    AND new.status IN ('PENDING', 'FAILED', 'PROCESSING')
)
EXECUTE FUNCTION outbox.tg_events__lower_claim_floor();

-- The INSERT's transaction id first, then the candidate, then the floor:
-- the order _claim_floor's argument needs (a CASE evaluates its conditions
-- in order; read the other way round, a floor read before a step 2 and a
-- candidate read after it would miss both). Rows of ids the sequence has
-- just given out are above both: no call.
CREATE OR REPLACE TRIGGER _200_lower_claim_floor_on_insert
BEFORE INSERT ON outbox.events
FOR EACH ROW
WHEN (
    CASE
        WHEN pg_current_xact_id() IS NULL THEN FALSE
        WHEN new.status NOT IN ('PENDING', 'FAILED', 'PROCESSING') THEN FALSE
        WHEN new.id < pg_sequence_last_value('outbox.claim_floor_next') THEN TRUE
        ELSE new.id < pg_sequence_last_value('outbox.claim_floor')
    END
)
EXECUTE FUNCTION outbox.tg_events__lower_claim_floor();

-- generated from sql/30_outbox_api.sql: outbox._claim_floor
-- Moves the claim floor (outbox.claim_floor, 10_outbox_events.sql) up
-- behind the claimable rows and returns it; claim() calls it first. A step at
-- a time, by one claimer at a time (the floor's advisory lock; the others use
-- the floor as it stands), under READ COMMITTED (a snapshot per statement):
--   1. a candidate C: the lowest claimable id at or above the floor, at most
--      the last id events_id_seq gave out + 1 (so that new ids stay above
--      it). It is published (claim_floor_next), and only then does this
--      transaction take its own transaction id X (claim_floor_wait);
--   2. at a later claim, once no transaction with an id up to X is running
--      (the snapshot's xmin > X): the floor becomes the lowest claimable id
--      below C, read in a snapshot taken after that, or C.
-- Why no claimable row ends below the floor, whatever stalls or fails:
-- every INSERT takes its transaction id, then reads the candidate, then the
-- floor (trigger _200_lower_claim_floor_on_insert, its WHEN), and an id
-- below either lowers them under the floor's lock. An INSERT T of an id
-- below C either read the candidate after C was published, and lowers the
-- floor (it waits for the lock if step 2 holds it, and comes after it); or
-- read it before, so its transaction id came before X (ids are handed out
-- in order) and T ended before step 2 (X's transaction has ended, so the
-- snapshot's xmax is above X and every running id up to X counts in its
-- xmin), whose snapshot then sees T's row as it is.
-- The same holds for a row made claimable again (requeue,
-- requeue_completed): _200_lower_claim_floor takes the lock. Not the
-- snapshot's xmax: it is the latest ended id + 1, and a commit waiting for
-- a synchronous standby keeps a run of ids above it running, whose rows
-- the floor passed. Not a time: a stalled INSERT is still running. A
-- transaction that had its id before step 1 takes no candidate (X would
-- come before the publication). A crash or a promotion resets the unlogged
-- sequences: the floor reads 0 and the candidate is gone.
CREATE OR REPLACE FUNCTION outbox._claim_floor()
RETURNS bigint
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    -- unset (a crash, a promotion): from the lowest id there is
    floor_id bigint := coalesce(pg_sequence_last_value('outbox.claim_floor'), -9223372036854775807 - 1);
    next_id bigint;
    wait_xid bigint;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed'
        OR NOT pg_try_advisory_xact_lock(hashtextextended('pgoutbox.claim_floor', 0)) THEN
        RETURN floor_id;
    END IF;
    floor_id := coalesce(pg_sequence_last_value('outbox.claim_floor'), floor_id);
    next_id := pg_sequence_last_value('outbox.claim_floor_next');
    IF next_id IS NULL THEN
        IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
            RETURN floor_id;
        END IF;
        SELECT least(min(e.id), coalesce(pg_sequence_last_value('outbox.events_id_seq'), 0) + 1) INTO next_id
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING') AND e.id >= floor_id;
        IF next_id > floor_id THEN
            -- An abort between these leaves the wait at its maximum: step 2
            -- then drops the candidate.
            PERFORM setval('outbox.claim_floor_wait', 9223372036854775807);
            PERFORM setval('outbox.claim_floor_next', next_id);
            PERFORM setval('outbox.claim_floor_wait', pg_current_xact_id()::text::bigint);
        END IF;
        RETURN floor_id;
    END IF;
    wait_xid := pg_sequence_last_value('outbox.claim_floor_wait');
    IF wait_xid IS NULL OR wait_xid = 9223372036854775807 THEN
        PERFORM setval('outbox.claim_floor_next', 1, FALSE);
        RETURN floor_id;
    END IF;
    IF pg_snapshot_xmin(pg_current_snapshot())::text::bigint <= wait_xid THEN
        RETURN floor_id;
    END IF;
    SELECT coalesce(min(e.id), next_id) INTO floor_id
    FROM outbox.events AS e
    WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING') AND e.id >= floor_id AND e.id < next_id;
    PERFORM setval('outbox.claim_floor', floor_id), setval('outbox.claim_floor_next', 1, FALSE);
    RETURN floor_id;
END;
$$;
-- end generated

-- generated from sql/30_outbox_api.sql: outbox.claim
-- Claims up to batch_size due events for worker, under a lease, and returns
-- them with a fresh claim token. One statement:
--   * the CTE picks candidates in id order from events_claimable_idx and locks
--     them FOR UPDATE SKIP LOCKED, so concurrent claimers walk past each
--     other's rows instead of queueing on them, and LIMIT bounds the batch;
--   * it starts at the claim floor (outbox._claim_floor, moved up just
--     before): below it nothing is claimable, only the index entries of
--     finished events, which a snapshot held by another session keeps from
--     vacuum, and the walk stays as short with it as without;
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
    floor_id bigint;
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
    floor_id := outbox._claim_floor();
    RETURN QUERY
    WITH candidates AS (
        SELECT e.id, e.created_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND e.id >= floor_id
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
-- end generated

-- generated from sql/30_outbox_api.sql: outbox.backlog
-- Backlog per context (QRY-050). "due" is what a relay could take right now;
-- oldest_due_age growing while due > 0 means no relay is making progress,
-- whereas a large unpublished count with nothing due is just parked retries.
-- The unfinished rows are read from the claim floor up (see claim).
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
            AND e.id >= (
                -- (a standby cannot read an unlogged sequence: from the bottom there)
                SELECT CASE WHEN pg_is_in_recovery() THEN -9223372036854775807 - 1
                    ELSE coalesce(pg_sequence_last_value('outbox.claim_floor'), -9223372036854775807 - 1) END
            )
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
-- end generated

-- generated from sql/30_outbox_api.sql: outbox.oldest_snapshots
-- The oldest snapshot that keeps vacuum from removing pgoutbox's dead rows,
-- and what holds it, oldest first: sessions of this database (and WAL
-- senders: a standby's hot_standby_feedback) by backend_xmin, replication
-- slots by xmin and catalog_xmin (the catalog's horizon only), prepared
-- transactions by their xid. The age in xids orders them; the age in seconds
-- runs from the session's transaction start (an upper bound under READ
-- COMMITTED, where the snapshot is the running statement's) or from the
-- PREPARE, and is NULL for a slot (a slot records no time). Never query text.
-- SECURITY DEFINER: reading other sessions' backend_xmin takes the owner's
-- right (superuser, or pg_read_all_stats).
CREATE OR REPLACE FUNCTION outbox.oldest_snapshots(max_rows integer DEFAULT 5)
RETURNS TABLE (
    kind text,
    age_xids integer,
    age_seconds double precision,
    pid integer,
    slot_name text,
    gid text,
    application_name text,
    state text,
    xact_start timestamptz
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_max_rows(oldest_snapshots.max_rows);
    SELECT h.kind, h.age_xids, h.age_seconds, h.pid, h.slot_name, h.gid, h.application_name, h.state, h.xact_start
    FROM (
        SELECT
            'session' AS kind, age(a.backend_xmin) AS age_xids,
            extract(epoch FROM now() - coalesce(a.xact_start, a.backend_start))::double precision AS age_seconds,
            a.pid, NULL::text AS slot_name, NULL::text AS gid, a.application_name, a.state, a.xact_start
        FROM pg_stat_activity AS a
        WHERE a.backend_xmin IS NOT NULL
            AND a.pid <> pg_backend_pid()
            AND (a.datname = current_database() OR a.backend_type = 'walsender')
        UNION ALL
        SELECT 'slot', age(s.xmin), NULL, s.active_pid, s.slot_name::text, NULL, NULL, NULL, NULL
        FROM pg_replication_slots AS s
        WHERE s.xmin IS NOT NULL
        UNION ALL
        SELECT 'slot catalog', age(s.catalog_xmin), NULL, s.active_pid, s.slot_name::text, NULL, NULL, NULL, NULL
        FROM pg_replication_slots AS s
        WHERE s.catalog_xmin IS NOT NULL
        UNION ALL
        SELECT
            'prepared', age(p.transaction), extract(epoch FROM now() - p.prepared)::double precision,
            NULL, NULL, p.gid, NULL, NULL, p.prepared
        FROM pg_prepared_xacts AS p
    ) AS h
    ORDER BY h.age_xids DESC, h.age_seconds DESC NULLS LAST
    LIMIT oldest_snapshots.max_rows;
$$;
COMMENT ON FUNCTION outbox.oldest_snapshots(integer) IS
'What holds back vacuum of pgoutbox''s tables, oldest first: sessions, replication slots, prepared transactions.';
-- end generated

REVOKE ALL ON FUNCTION outbox._claim_floor(), outbox.tg_events__lower_claim_floor(),
outbox.oldest_snapshots(integer) FROM public;
GRANT EXECUTE ON FUNCTION outbox.oldest_snapshots(integer)
TO pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin, pgoutbox_viewer;

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

-- ---- source rules: five statuses, flows, small gaps

-- ---- fairness: fair claims across tenants

-- ---- emit: a caller's id, a delivery time, a cheap common case

-- ---- the console

-- Dead letters classified once, when recorded: outbox.dlq_entries, kept by
-- triggers on outbox.events and inbox.messages (no column of theirs
-- changes: workers of schema 17 write the same rows), filled here with the
-- dead letters already there; the pages read only it.
-- generated from sql/67_dead_letters.sql: outbox._dlq_error_pattern
-- An error text with what differs between occurrences of one cause masked:
-- uuids (<uuid>), double- or single-quoted values (<q>), numbers (<n>);
-- white space runs become one space; at most 500 characters. A leading HTTP
-- status stays as it is (`HTTP 422: ...`): the handler's answer is the
-- cause, and 422 and 400 are different ones. Inlined like _dlq_error_class.
CREATE OR REPLACE FUNCTION outbox._dlq_error_pattern(error text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pg_catalog.left(pg_catalog.btrim(
        CASE WHEN error OPERATOR(pg_catalog.~) '^HTTP [1-5][0-9][0-9]($|[^0-9])'
            THEN pg_catalog.substr(error, 1, 8) ELSE '' END
        OPERATOR(pg_catalog.||)
        pg_catalog.regexp_replace(pg_catalog.regexp_replace(
            pg_catalog.regexp_replace(pg_catalog.regexp_replace(pg_catalog.regexp_replace(
                CASE WHEN error OPERATOR(pg_catalog.~) '^HTTP [1-5][0-9][0-9]($|[^0-9])'
                    THEN pg_catalog.substr(error, 9) ELSE coalesce(error, '') END,
                '[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}', '<uuid>', 'g'),
                '"([^"\\]|\\.)*"', '<q>', 'g'),
                '''([^'']|'''')*''', '<q>', 'g'),
            '[0-9]+([.][0-9]+)?', '<n>', 'g'),
            '\s+', ' ', 'g')),
        500);
$$;
-- end generated

CREATE TABLE IF NOT EXISTS outbox.dlq_entries (
    side text NOT NULL,
    owner text NOT NULL,
    id uuid NOT NULL,
    handler text NOT NULL,
    subject text NOT NULL,
    tenant text,
    attempts integer NOT NULL,
    last_error text,
    error_class text NOT NULL,
    error_pattern text NOT NULL,
    group_id text NOT NULL,
    seen_at timestamptz NOT NULL,
    discarded boolean NOT NULL,
    refailed boolean NOT NULL,
    replays integer NOT NULL,
    redrive_pending boolean NOT NULL,
    replayable boolean NOT NULL,
    row_id bigint,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (side, id, handler),
    CONSTRAINT side_is_known CHECK (side IN ('outbox', 'inbox'))
);
COMMENT ON TABLE outbox.dlq_entries IS
'Every dead letter of both sides with its group; kept by triggers on outbox.events and inbox.messages.';
-- A group's page (newest first, keyset), the groups' newest error, the list.
CREATE INDEX IF NOT EXISTS dlq_entries_group_idx ON outbox.dlq_entries (group_id, seen_at DESC, side, id, handler);
CREATE INDEX IF NOT EXISTS dlq_entries_seen_idx ON outbox.dlq_entries (seen_at DESC, side, id, handler);
CREATE INDEX IF NOT EXISTS dlq_entries_owner_idx ON outbox.dlq_entries (owner, side);

-- generated from sql/67_dead_letters.sql: outbox._dlq_enter_event
-- An outbox event's entry, written or removed as its status says.
CREATE OR REPLACE FUNCTION outbox._dlq_enter_event(e outbox.events)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    cls text;
    pattern text;
    n integer;
BEGIN
    IF e.status NOT IN ('DEAD_LETTER', 'DISCARDED') THEN
        DELETE FROM outbox.dlq_entries AS x WHERE x.side = 'outbox' AND x.id = e.event_id AND x.handler = '';
        RETURN;
    END IF;
    cls := outbox._dlq_error_class(e.last_error);
    pattern := outbox._dlq_error_pattern(e.last_error);
    -- A row written around emit may have no subject (the relay dead-letters it
    -- BAD_SUBJECT): its entry says '' rather than fail the relay's mark.
    e.subject := coalesce(e.subject, '');
    SELECT count(*) INTO n FROM outbox.requeue_log AS q WHERE q.event_id = e.event_id AND q.from_status = 'DEAD_LETTER';
    INSERT INTO outbox.dlq_entries AS x (
        side, owner, id, handler, subject, tenant, attempts, last_error, error_class, error_pattern, group_id,
        seen_at, discarded, refailed, replays, redrive_pending, replayable, row_id, created_at
    ) VALUES (
        'outbox', e.context, e.event_id, '', e.subject, e.tenant_id, e.attempts, e.last_error, cls, pattern,
        md5(concat_ws(E'\n', 'outbox', e.context, e.subject, cls, pattern)),
        coalesce(e.claimed_at, e.created_at), e.status = 'DISCARDED', n > 0, n, FALSE, e.status = 'DEAD_LETTER',
        e.id, e.created_at
    )
    ON CONFLICT (side, id, handler) DO UPDATE
    SET owner = excluded.owner, subject = excluded.subject, tenant = excluded.tenant, attempts = excluded.attempts,
        last_error = excluded.last_error, error_class = excluded.error_class,
        error_pattern = excluded.error_pattern, group_id = excluded.group_id, seen_at = excluded.seen_at,
        discarded = excluded.discarded, refailed = excluded.refailed, replays = excluded.replays,
        redrive_pending = excluded.redrive_pending, replayable = excluded.replayable,
        row_id = excluded.row_id, created_at = excluded.created_at;
END;
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox._dlq_enter_message
-- An inbox message's entry, written or removed as its status says.
CREATE OR REPLACE FUNCTION outbox._dlq_enter_message(m inbox.messages)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    cls text;
    pattern text;
    asked boolean;
BEGIN
    IF m.status IS DISTINCT FROM 'DEAD_LETTER' THEN
        DELETE FROM outbox.dlq_entries AS x WHERE x.side = 'inbox' AND x.id = m.message_id AND x.handler = m.handler;
        RETURN;
    END IF;
    cls := outbox._dlq_error_class(m.last_error);
    pattern := outbox._dlq_error_pattern(m.last_error);
    asked := coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE);
    INSERT INTO outbox.dlq_entries AS x (
        side, owner, id, handler, subject, tenant, attempts, last_error, error_class, error_pattern, group_id,
        seen_at, discarded, refailed, replays, redrive_pending, replayable, row_id, created_at
    ) VALUES (
        'inbox', m.handler, m.message_id, m.handler, m.subject, m.envelope ->> 'tenant_id', m.attempts,
        m.last_error, cls, pattern, md5(concat_ws(E'\n', 'inbox', m.handler, m.subject, cls, pattern)),
        coalesce((m.dlq_metadata ->> 'dead_lettered_at')::timestamptz, m.received_at),
        m.dlq_metadata ? 'discarded',
        coalesce((m.dlq_metadata ->> 'dead_letters')::integer, 1) > 1,
        coalesce((m.dlq_metadata ->> 'replay_attempts')::integer, 0)
        + coalesce((m.dlq_metadata ->> 'redrives')::integer, 0),
        asked,
        NOT m.dlq_metadata ? 'discarded' AND m.envelope IS NOT NULL AND NOT m.dlq_metadata ? 'in_database'
        AND NOT asked,
        NULL, m.received_at
    )
    ON CONFLICT (side, id, handler) DO UPDATE
    SET owner = excluded.owner, subject = excluded.subject, tenant = excluded.tenant, attempts = excluded.attempts,
        last_error = excluded.last_error, error_class = excluded.error_class,
        error_pattern = excluded.error_pattern, group_id = excluded.group_id, seen_at = excluded.seen_at,
        discarded = excluded.discarded, refailed = excluded.refailed, replays = excluded.replays,
        redrive_pending = excluded.redrive_pending, replayable = excluded.replayable,
        row_id = excluded.row_id, created_at = excluded.created_at;
END;
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.tg_events__dlq_entry
CREATE OR REPLACE FUNCTION outbox.tg_events__dlq_entry()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._dlq_enter_event(NEW);
    RETURN NULL;
END;
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.tg_messages__dlq_entry
CREATE OR REPLACE FUNCTION outbox.tg_messages__dlq_entry()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        DELETE FROM outbox.dlq_entries AS x WHERE x.side = 'inbox' AND x.id = OLD.message_id AND x.handler = OLD.handler;
    ELSE
        PERFORM outbox._dlq_enter_message(NEW);
    END IF;
    RETURN NULL;
END;
$$;
-- end generated

-- Only updates that touch a dead letter fire (the WHEN clause runs without
-- entering PL/pgSQL): claim and mark of live events pay nothing. Outbox
-- events are never inserted as dead letters, nor deleted (a day leaves by
-- DROP of its partition: outbox.drop_archived deletes that day's entries).
CREATE OR REPLACE TRIGGER _600_dlq_entry
AFTER UPDATE ON outbox.events
FOR EACH ROW
WHEN (old.status IN ('DEAD_LETTER', 'DISCARDED') OR new.status IN ('DEAD_LETTER', 'DISCARDED'))
EXECUTE FUNCTION outbox.tg_events__dlq_entry();
CREATE OR REPLACE TRIGGER _600_dlq_entry
AFTER UPDATE ON inbox.messages
FOR EACH ROW
WHEN (old.status = 'DEAD_LETTER' OR new.status = 'DEAD_LETTER')
EXECUTE FUNCTION outbox.tg_messages__dlq_entry();
CREATE OR REPLACE TRIGGER _600_dlq_entry_insert
AFTER INSERT ON inbox.messages
FOR EACH ROW
WHEN (new.status = 'DEAD_LETTER')
EXECUTE FUNCTION outbox.tg_messages__dlq_entry();
CREATE OR REPLACE TRIGGER _600_dlq_entry_delete
AFTER DELETE ON inbox.messages
FOR EACH ROW
WHEN (old.status = 'DEAD_LETTER')
EXECUTE FUNCTION outbox.tg_messages__dlq_entry();

DO $$
BEGIN
    PERFORM outbox._dlq_enter_event(e) FROM outbox.events AS e WHERE e.status IN ('DEAD_LETTER', 'DISCARDED');
    PERFORM outbox._dlq_enter_message(m) FROM inbox.messages AS m WHERE m.status = 'DEAD_LETTER';
END;
$$;

-- generated from sql/67_dead_letters.sql: outbox._dlq_rows
-- Every dead letter the filter matches, both sides, with its group and
-- state, from outbox.dlq_entries. Called by the functions below (already
-- checked filter); granted to no one. No SET clause: so that the planner
-- inlines it into its callers (whose search_path is pinned) and uses the
-- entries' indexes for a group, an owner or a time range.
CREATE OR REPLACE FUNCTION outbox._dlq_rows(filter jsonb)
RETURNS TABLE (
    side text,
    owner text,
    id uuid,
    handler text,
    subject text,
    tenant text,
    attempts integer,
    last_error text,
    error_class text,
    error_pattern text,
    group_id text,
    seen_at timestamptz,
    discarded boolean,
    refailed boolean,
    replays integer,
    redrive_pending boolean,
    replayable boolean,
    row_id bigint,
    created_at timestamptz
)
LANGUAGE sql STABLE
AS $$
    SELECT
        x.side, x.owner, x.id, NULLIF(x.handler, ''), x.subject, x.tenant, x.attempts, x.last_error,
        x.error_class, x.error_pattern, x.group_id, x.seen_at, x.discarded, x.refailed,
        x.replays, x.redrive_pending, x.replayable, x.row_id, x.created_at
    FROM outbox.dlq_entries AS x
    WHERE (filter ->> 'side' IS NULL OR x.side = filter ->> 'side')
        AND (filter ->> 'owner' IS NULL OR x.owner = filter ->> 'owner')
        AND (filter ->> 'group' IS NULL OR x.group_id = filter ->> 'group')
        AND (filter ->> 'subject' IS NULL OR x.subject = filter ->> 'subject')
        AND (filter ->> 'tenant' IS NULL OR x.tenant = filter ->> 'tenant')
        AND (filter ->> 'since' IS NULL OR x.seen_at >= (filter ->> 'since')::timestamptz)
        AND (filter ->> 'until' IS NULL OR x.seen_at < (filter ->> 'until')::timestamptz)
        AND (filter ->> 'error' IS NULL OR strpos(lower(x.last_error), lower(filter ->> 'error')) > 0)
        AND (jsonb_typeof(filter -> 'ids') IS DISTINCT FROM 'array'
            OR x.id = ANY(ARRAY(SELECT (jsonb_array_elements_text(filter -> 'ids'))::uuid)))
        AND CASE coalesce(filter -> 'discarded', 'false')
            WHEN 'null' THEN TRUE WHEN 'true' THEN x.discarded ELSE NOT x.discarded END;
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox._dlq_targets
-- The rows an action may take now: replay the live replayable ones, discard
-- the live ones, restore the discarded ones; never an event of a sealed
-- (archived, read-only) partition, which refuses every UPDATE (OB056): one
-- such row would refuse its whole batch, at every run. They stay listed.
-- No SET clause, like _dlq_rows: inlined into its callers, whose plans see
-- the filter's values and take a group's or an owner's rows by index (with
-- SET it ran as a query of its own, with the filter unknown to its plan:
-- every entry scanned, 2 s a dialog at 100,000 dead letters).
CREATE OR REPLACE FUNCTION outbox._dlq_targets(filter jsonb, action text)
RETURNS TABLE (side text, id uuid, handler text, row_id bigint, created_at timestamptz, seen_at timestamptz)
LANGUAGE sql STABLE
AS $$
    WITH sealed AS (
        SELECT to_date(right(c.relname::text, 8), 'YYYYMMDD') AS day
        FROM pg_trigger AS t
        INNER JOIN pg_class AS c ON t.tgrelid = c.oid
        INNER JOIN pg_inherits AS i ON c.oid = i.inhrelid
        WHERE i.inhparent = 'outbox.events'::regclass
            AND t.tgname = '_050_archived_read_only'
            AND c.relname ~ '^events_p[0-9]{8}$'
    )
    SELECT r.side, r.id, r.handler, r.row_id, r.created_at, r.seen_at
    -- (jsonb_build_object is STABLE: a constant object keeps the filter foldable.)
    FROM outbox._dlq_rows(
        filter || CASE WHEN action = 'restore' THEN '{"discarded": true}'::jsonb ELSE '{"discarded": false}'::jsonb END
    ) AS r
    WHERE (action <> 'replay' OR r.replayable)
        AND (
            r.side = 'inbox'
            OR NOT EXISTS (SELECT 1 FROM sealed AS s WHERE s.day = (r.created_at AT TIME ZONE 'UTC')::date)
        );
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.dlq_groups
-- Dead letters grouped by cause, newest group first.
CREATE OR REPLACE FUNCTION outbox.dlq_groups(
    filter jsonb DEFAULT '{}'::jsonb,
    max_rows integer DEFAULT 100
)
RETURNS TABLE (
    group_id text,
    side text,
    owner text,
    subject text,
    error_class text,
    error_pattern text,
    sample_error text,
    dead_letters bigint,
    discarded bigint,
    refailed bigint,
    replayable bigint,
    first_seen timestamptz,
    last_seen timestamptz
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_dlq_filter(filter);
    PERFORM outbox._check_max_rows(max_rows);
    -- Counted over the entries (one pass, no regular expression: 100,000 in
    -- about 100 ms); what names a group (the same on all its rows) and its
    -- newest error are read by index for the groups shown only.
    RETURN QUERY
    SELECT
        g.group_id, k.side, k.owner, k.subject, k.error_class, k.error_pattern, k.last_error,
        g.live, g.gone, g.refailed, g.replayable, g.first_seen, g.last_seen
    FROM (
        SELECT
            r.group_id,
            count(*) FILTER (WHERE NOT r.discarded) AS live,
            count(*) FILTER (WHERE r.discarded) AS gone,
            count(*) FILTER (WHERE r.refailed) AS refailed,
            count(*) FILTER (WHERE r.replayable) AS replayable,
            min(r.seen_at) AS first_seen,
            max(r.seen_at) AS last_seen
        FROM outbox._dlq_rows(filter) AS r
        GROUP BY r.group_id
        ORDER BY max(r.seen_at) DESC, r.group_id
        LIMIT max_rows
    ) AS g
    CROSS JOIN LATERAL (
        SELECT x.side, x.owner, x.subject, x.error_class, x.error_pattern, x.last_error
        FROM outbox.dlq_entries AS x
        WHERE x.group_id = g.group_id
        ORDER BY x.seen_at DESC
        LIMIT 1
    ) AS k
    ORDER BY g.last_seen DESC, g.group_id;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_groups(jsonb, integer) IS
'Dead letters of both sides grouped by side, owner, subject and normalised error, with counts and first/last seen.';
-- end generated

-- generated from sql/95_archival_steps.sql: outbox.drop_archived
-- Drops an audited partition after re-checking its live figures against
-- the audit and the seal figures. The partition is sealed, so only a
-- trigger-bypassing owner could change it between the check and the DROP.
-- Already dropped: returns 0.
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
    -- The live rows equal the audit (just checked); they must equal the seal too.
    PERFORM outbox._check_seal(partition_name, standing.row_count, standing.checksum);
    -- DROP takes ACCESS EXCLUSIVE on outbox.events for the rest of this short
    -- transaction; lock_timeout keeps emitters from queueing behind us.
    PERFORM outbox._with_lock_timeout(format('DROP TABLE outbox.%I', partition_name), lock_timeout);
    -- Its dead letters' entries (sql/67_dead_letters.sql): DROP fires no row trigger.
    DELETE FROM outbox.dlq_entries AS x
    WHERE x.side = 'outbox' AND x.created_at >= (part_day::timestamp AT TIME ZONE 'UTC')
        AND x.created_at < ((part_day + 1)::timestamp AT TIME ZONE 'UTC');
    UPDATE outbox.archive_audit SET removed_at = now(), removed_by = session_user
    WHERE id = standing.id;
    RETURN standing.row_count;
END;
$$;
COMMENT ON FUNCTION outbox.drop_archived(text, interval) IS
'Drops a sealed, audited day partition whose live count and checksum still match its audit row.';
-- end generated

REVOKE ALL ON FUNCTION
outbox._dlq_enter_event(outbox.events),
outbox._dlq_enter_message(inbox.messages),
outbox.tg_events__dlq_entry(),
outbox.tg_messages__dlq_entry()
FROM public;

-- Bulk actions on a set fixed at confirmation (sql/67_dead_letters.sql):
-- two new tables of the actions' own bookkeeping; the three actions by
-- filter now share one writer (_dlq_apply), with the same results.
CREATE TABLE IF NOT EXISTS outbox.dlq_actions (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    action text NOT NULL,
    filter jsonb NOT NULL,
    created_by text NOT NULL DEFAULT session_user,
    created_at timestamptz NOT NULL DEFAULT now(),
    total bigint NOT NULL DEFAULT 0,
    reason text,
    started_at timestamptz,
    taken bigint NOT NULL DEFAULT 0,
    touched bigint NOT NULL DEFAULT 0,
    stopped_at timestamptz,
    stopped_by text,
    finished_at timestamptz,
    CONSTRAINT action_is_known CHECK (action IN ('replay', 'discard', 'restore')),
    CONSTRAINT touched_at_most_taken_at_most_total CHECK (touched <= taken AND taken <= total)
);
COMMENT ON TABLE outbox.dlq_actions IS
'Bulk dead-letter actions on a set fixed at confirmation (outbox.dlq_prepare), taken in batches by outbox.dlq_act.';

CREATE TABLE IF NOT EXISTS outbox.dlq_action_targets (
    action_id bigint NOT NULL REFERENCES outbox.dlq_actions (id) ON DELETE CASCADE,
    seq integer NOT NULL,
    side text NOT NULL,
    id uuid NOT NULL,
    handler text,
    row_id bigint,
    created_at timestamptz,
    taken_at timestamptz,
    PRIMARY KEY (action_id, seq),
    CONSTRAINT side_is_known CHECK (side IN ('outbox', 'inbox'))
);
COMMENT ON TABLE outbox.dlq_action_targets IS
'The rows a bulk action was confirmed for, in the order it takes them; taken_at: when a batch took the row.';
-- The next batch: the targets not taken yet, in order.
CREATE INDEX IF NOT EXISTS dlq_action_targets_open_idx ON outbox.dlq_action_targets (action_id, seq)
WHERE taken_at IS NULL;

-- generated from sql/67_dead_letters.sql: outbox._dlq_apply
-- Applies `action` to the rows named by the parallel arrays (outbox: row id
-- and created_at; inbox: message id and handler), each only while it is
-- still what the action takes: replay a live dead letter (outbox
-- DEAD_LETTER -> PENDING as outbox.requeue does, audited in
-- outbox.requeue_log; inbox: due now for the replayer as inbox.redrive does,
-- audited in inbox.redrive_log, unless already asked for), discard a live one
-- (parked for good, kept, an inbox row's pending replay cancelled; audited in
-- outbox/inbox.discard_log), restore a discarded one (back to DEAD_LETTER,
-- parked). Returns how many it moved. The one writer of every dead-letter
-- action: dlq_replay/dlq_discard/dlq_restore (by filter) and dlq_act (a
-- prepared action's targets) pick the rows, this moves them.
CREATE OR REPLACE FUNCTION outbox._dlq_apply(
    action text,
    reason text,
    row_ids bigint[],
    created timestamptz[],
    message_ids uuid[],
    handlers text[]
)
RETURNS integer
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    outbox_moved integer;
    inbox_moved integer;
BEGIN
    IF action = 'replay' THEN
        PERFORM set_config('pgoutbox.requeue_reason', reason, true);
        UPDATE outbox.events AS e
        SET status = 'PENDING', attempts = 0, available_at = now()
        FROM unnest(row_ids, created) AS p (row_id, created_at)
        WHERE e.id = p.row_id AND e.created_at = p.created_at AND e.status = 'DEAD_LETTER';
        GET DIAGNOSTICS outbox_moved = ROW_COUNT;
        PERFORM set_config('pgoutbox.requeue_reason', '', true);
        WITH marked AS (
            UPDATE inbox.messages AS m
            SET dlq_metadata = m.dlq_metadata
                || jsonb_build_object('redrive_requested', TRUE, 'next_replay_at', now())
            FROM unnest(message_ids, handlers) AS p (message_id, handler)
            WHERE m.message_id = p.message_id AND m.handler = p.handler
                AND m.status = 'DEAD_LETTER'
                AND NOT m.dlq_metadata ? 'discarded'
                AND NOT coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE)
            RETURNING m.message_id, m.handler, m.dlq_metadata, m.last_error
        )
        INSERT INTO inbox.redrive_log (
            message_id, handler, redriven_by, reason, replay_attempts_before, last_error
        )
        SELECT
            k.message_id, k.handler, session_user, _dlq_apply.reason,
            coalesce((k.dlq_metadata ->> 'replay_attempts')::integer, 0), k.last_error
        FROM marked AS k;
        GET DIAGNOSTICS inbox_moved = ROW_COUNT;
        RETURN outbox_moved + inbox_moved;
    END IF;
    PERFORM set_config('pgoutbox.dlq_action', action, true);
    PERFORM set_config('pgoutbox.dlq_reason', reason, true);
    IF action = 'discard' THEN
        UPDATE outbox.events AS e
        SET status = 'DISCARDED'
        FROM unnest(row_ids, created) AS p (row_id, created_at)
        WHERE e.id = p.row_id AND e.created_at = p.created_at AND e.status = 'DEAD_LETTER';
        GET DIAGNOSTICS outbox_moved = ROW_COUNT;
        UPDATE inbox.messages AS m
        SET dlq_metadata = m.dlq_metadata || jsonb_build_object(
            'discarded', jsonb_build_object('at', now(), 'by', session_user, 'reason', _dlq_apply.reason),
            'next_replay_at', NULL,
            'redrive_requested', FALSE
        )
        FROM unnest(message_ids, handlers) AS p (message_id, handler)
        WHERE m.message_id = p.message_id AND m.handler = p.handler
            AND m.status = 'DEAD_LETTER' AND NOT m.dlq_metadata ? 'discarded';
        GET DIAGNOSTICS inbox_moved = ROW_COUNT;
    ELSE
        UPDATE outbox.events AS e
        SET status = 'DEAD_LETTER'
        FROM unnest(row_ids, created) AS p (row_id, created_at)
        WHERE e.id = p.row_id AND e.created_at = p.created_at AND e.status = 'DISCARDED';
        GET DIAGNOSTICS outbox_moved = ROW_COUNT;
        UPDATE inbox.messages AS m
        SET dlq_metadata = m.dlq_metadata - 'discarded'
        FROM unnest(message_ids, handlers) AS p (message_id, handler)
        WHERE m.message_id = p.message_id AND m.handler = p.handler
            AND m.status = 'DEAD_LETTER' AND m.dlq_metadata ? 'discarded';
        GET DIAGNOSTICS inbox_moved = ROW_COUNT;
    END IF;
    PERFORM set_config('pgoutbox.dlq_action', '', true);
    PERFORM set_config('pgoutbox.dlq_reason', '', true);
    RETURN outbox_moved + inbox_moved;
END;
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox._dlq_act_on
-- One batch of `action` by filter: the rows _dlq_batch picks, moved by _dlq_apply.
CREATE OR REPLACE FUNCTION outbox._dlq_act_on(filter jsonb, action text, reason text, max_rows integer)
RETURNS integer
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    picked record;
BEGIN
    SELECT
        coalesce(array_agg(b.row_id) FILTER (WHERE b.side = 'outbox'), '{}') AS row_ids,
        coalesce(array_agg(b.created_at) FILTER (WHERE b.side = 'outbox'), '{}') AS created,
        coalesce(array_agg(b.id) FILTER (WHERE b.side = 'inbox'), '{}') AS message_ids,
        coalesce(array_agg(b.handler) FILTER (WHERE b.side = 'inbox'), '{}') AS handlers
    INTO picked
    FROM outbox._dlq_batch(filter, action, reason, max_rows) AS b;
    RETURN outbox._dlq_apply(action, reason, picked.row_ids, picked.created, picked.message_ids, picked.handlers);
END;
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.dlq_replay
-- Replays the dead letters matching the filter, max_rows per call, and
-- returns how many it took; call again until 0 (each call its own
-- transaction). Outbox: DEAD_LETTER -> PENDING as outbox.requeue does,
-- audited in outbox.requeue_log. Inbox: due now for the replayer, as
-- inbox.redrive does, audited in inbox.redrive_log; rows already asked for,
-- without an envelope or of an in-database handler are not taken. A row
-- that fails again matches again: a bulk action that must end takes a set
-- fixed beforehand (dlq_prepare, dlq_act).
CREATE OR REPLACE FUNCTION outbox.dlq_replay(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._dlq_act_on(filter, 'replay', reason, max_rows);
$$;
COMMENT ON FUNCTION outbox.dlq_replay(jsonb, text, integer) IS
'Requeues (outbox) or redrives (inbox) up to max_rows dead letters matching a filter, audited; call until 0.';
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.dlq_discard
-- Discards the live dead letters matching the filter, max_rows per call
-- (call until 0): parked for good, kept, reversible by dlq_restore; an inbox
-- row's pending replay is cancelled. Audited in outbox/inbox.discard_log.
CREATE OR REPLACE FUNCTION outbox.dlq_discard(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._dlq_act_on(filter, 'discard', reason, max_rows);
$$;
COMMENT ON FUNCTION outbox.dlq_discard(jsonb, text, integer) IS
'Discards up to max_rows live dead letters matching a filter (kept, restorable), audited; call until 0.';
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.dlq_restore
-- Restores the discarded dead letters matching the filter, max_rows per
-- call (call until 0): back to DEAD_LETTER, parked (no replay scheduled).
CREATE OR REPLACE FUNCTION outbox.dlq_restore(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._dlq_act_on(filter, 'restore', reason, max_rows);
$$;
COMMENT ON FUNCTION outbox.dlq_restore(jsonb, text, integer) IS
'Restores up to max_rows discarded dead letters matching a filter to DEAD_LETTER, audited; call until 0.';
-- end generated

-- generated from sql/67_dead_letters.sql: outbox._dlq_action_function
-- The function an action runs as, by name: its grant is the action's.
CREATE OR REPLACE FUNCTION outbox._dlq_action_function(action text)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT format('outbox.dlq_%s(jsonb, text, integer)', action);
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.dlq_prepare
-- Fixes the set an action will touch (the rows dlq_count counts now) and
-- returns the action's id and that number. Only a role that may run the
-- action itself may prepare it (42501 otherwise).
CREATE OR REPLACE FUNCTION outbox.dlq_prepare(
    filter jsonb,
    action text
)
RETURNS TABLE (action_id bigint, total bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    new_id bigint;
    n bigint;
BEGIN
    PERFORM outbox._check_dlq_filter(filter);
    IF action IS NULL OR action NOT IN ('replay', 'discard', 'restore') THEN
        RAISE EXCEPTION 'INVALID_ACTION: action must be replay, discard or restore, got %', quote_literal(left(coalesce(action, 'NULL'), 50))
            USING ERRCODE = 'OB106';
    END IF;
    IF NOT has_function_privilege(session_user, outbox._dlq_action_function(action), 'EXECUTE') THEN
        RAISE EXCEPTION 'permission denied for function dlq_%', action USING ERRCODE = '42501';
    END IF;
    DELETE FROM outbox.dlq_actions AS a WHERE a.created_at < now() - interval '7 days';
    INSERT INTO outbox.dlq_actions (action, filter) VALUES (dlq_prepare.action, dlq_prepare.filter)
    RETURNING id INTO new_id;
    INSERT INTO outbox.dlq_action_targets (action_id, seq, side, id, handler, row_id, created_at)
    SELECT
        new_id, row_number() OVER (ORDER BY t.seen_at, t.side, t.id, t.handler),
        t.side, t.id, t.handler, t.row_id, t.created_at
    FROM outbox._dlq_targets(filter, action) AS t;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE outbox.dlq_actions AS a SET total = n WHERE a.id = new_id;
    RETURN QUERY SELECT new_id, n;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_prepare(jsonb, text) IS
'Fixes the rows a replay/discard/restore would touch now as an action''s targets: (action_id, total).';
-- end generated

-- generated from sql/67_dead_letters.sql: outbox._dlq_action
-- The action `action_id` of this session_user (OB110 otherwise).
CREATE OR REPLACE FUNCTION outbox._dlq_action(action_id bigint)
RETURNS outbox.dlq_actions
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    a outbox.dlq_actions;
BEGIN
    SELECT x.* INTO a FROM outbox.dlq_actions AS x WHERE x.id = action_id AND x.created_by = session_user;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'ACTION_NOT_FOUND: no action % prepared by %', action_id, session_user
            USING ERRCODE = 'OB110';
    END IF;
    RETURN a;
END;
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.dlq_act
-- One batch of a prepared action: takes its next max_rows targets (each
-- once: taken_at is set in the same transaction) and acts on those still
-- eligible, through the action's own audited function. Returns the targets
-- taken (those no longer eligible, e.g. replayed by someone else meanwhile,
-- are taken and not touched); 0 when none is left or the action was stopped.
CREATE OR REPLACE FUNCTION outbox.dlq_act(
    action_id bigint,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    a outbox.dlq_actions;
    n integer;
    row_ids bigint[];
    created timestamptz[];
    message_ids uuid[];
    handlers text[];
    moved integer := 0;
BEGIN
    PERFORM outbox._check_text(reason, 'a bulk action''s reason', 1000, TRUE);
    PERFORM outbox._check_max_rows(max_rows);
    a := outbox._dlq_action(action_id);
    IF NOT has_function_privilege(session_user, outbox._dlq_action_function(a.action), 'EXECUTE') THEN
        RAISE EXCEPTION 'permission denied for function dlq_%', a.action USING ERRCODE = '42501';
    END IF;
    IF a.stopped_at IS NOT NULL OR a.finished_at IS NOT NULL THEN
        RETURN 0;
    END IF;
    WITH next AS (
        SELECT t.action_id, t.seq
        FROM outbox.dlq_action_targets AS t
        WHERE t.action_id = a.id AND t.taken_at IS NULL
        ORDER BY t.seq
        LIMIT max_rows
        FOR UPDATE SKIP LOCKED
    ),
    taken AS (
        UPDATE outbox.dlq_action_targets AS t
        SET taken_at = now()
        FROM next
        WHERE t.action_id = next.action_id AND t.seq = next.seq
        RETURNING t.side, t.id, t.handler, t.row_id, t.created_at
    )
    SELECT
        count(*),
        coalesce(array_agg(k.row_id) FILTER (WHERE k.side = 'outbox'), '{}'),
        coalesce(array_agg(k.created_at) FILTER (WHERE k.side = 'outbox'), '{}'),
        coalesce(array_agg(k.id) FILTER (WHERE k.side = 'inbox'), '{}'),
        coalesce(array_agg(k.handler) FILTER (WHERE k.side = 'inbox'), '{}')
    INTO n, row_ids, created, message_ids, handlers
    FROM taken AS k;
    IF n > 0 THEN
        moved := outbox._dlq_apply(a.action, reason, row_ids, created, message_ids, handlers);
    END IF;
    UPDATE outbox.dlq_actions AS x
    SET reason = coalesce(x.reason, dlq_act.reason),
        started_at = coalesce(x.started_at, now()),
        taken = x.taken + n,
        touched = x.touched + moved,
        finished_at = CASE WHEN n = 0 THEN now() END
    WHERE x.id = a.id;
    RETURN n;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_act(bigint, text, integer) IS
'One batch of a prepared action: its next max_rows targets, each taken once; 0 when done or stopped.';
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.dlq_stop
-- Stops a running action of this session_user: no batch takes anything after.
CREATE OR REPLACE FUNCTION outbox.dlq_stop(action_id bigint)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    a outbox.dlq_actions;
BEGIN
    a := outbox._dlq_action(action_id);
    UPDATE outbox.dlq_actions AS x SET stopped_at = now(), stopped_by = session_user
    WHERE x.id = a.id AND x.stopped_at IS NULL AND x.finished_at IS NULL;
    RETURN FOUND;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_stop(bigint) IS
'Stops an action of outbox.dlq_prepare / dlq_act: later batches take nothing. True when it was running.';
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.dlq_action_progress
-- Where an action of this session_user stands: its counts, and (replay) how
-- many of the rows it took are dead letters again since (dead-lettered after
-- the batch that took them).
CREATE OR REPLACE FUNCTION outbox.dlq_action_progress(action_id bigint)
RETURNS TABLE (
    action text,
    total bigint,
    taken bigint,
    touched bigint,
    failed_again bigint,
    started_at timestamptz,
    stopped_at timestamptz,
    finished_at timestamptz
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    a outbox.dlq_actions;
    again bigint := 0;
BEGIN
    a := outbox._dlq_action(action_id);
    IF a.action = 'replay' THEN
        SELECT count(*) INTO again
        FROM outbox.dlq_action_targets AS t
        WHERE t.action_id = a.id AND t.taken_at IS NOT NULL
            AND CASE t.side
                WHEN 'outbox' THEN EXISTS (
                    SELECT 1 FROM outbox.events AS e
                    WHERE e.id = t.row_id AND e.created_at = t.created_at
                        AND e.status = 'DEAD_LETTER' AND e.claimed_at > t.taken_at
                )
                ELSE EXISTS (
                    SELECT 1 FROM inbox.messages AS m
                    WHERE m.message_id = t.id AND m.handler = t.handler AND m.status = 'DEAD_LETTER'
                        AND (m.dlq_metadata ->> 'dead_lettered_at')::timestamptz > t.taken_at
                )
            END;
    END IF;
    RETURN QUERY SELECT a.action, a.total, a.taken, a.touched, again, a.started_at, a.stopped_at, a.finished_at;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_action_progress(bigint) IS
'An action''s total, taken, touched and (replay) failed-again counts, and when it started, stopped or finished.';
-- end generated

REVOKE ALL ON FUNCTION
outbox._dlq_apply(text, text, bigint[], timestamptz[], uuid[], text[]),
outbox._dlq_act_on(jsonb, text, text, integer),
outbox._dlq_action_function(text),
outbox._dlq_action(bigint),
outbox.dlq_prepare(jsonb, text),
outbox.dlq_act(bigint, text, integer),
outbox.dlq_stop(bigint),
outbox.dlq_action_progress(bigint)
FROM public;
GRANT EXECUTE ON FUNCTION
outbox.dlq_prepare(jsonb, text),
outbox.dlq_act(bigint, text, integer),
outbox.dlq_stop(bigint),
outbox.dlq_action_progress(bigint)
TO pgoutbox_admin;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (18, '0018_steady_under_faults')
ON CONFLICT (version) DO NOTHING;

COMMIT;
