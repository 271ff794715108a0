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
    PERFORM outbox._check_claim(claim_token, event_ids);
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
        AND e.status = 'PROCESSING' COLLATE "C"  -- events_claim_token_idx only
        AND e.event_id = ANY(hand_back.event_ids);
    GET DIAGNOSTICS marked = ROW_COUNT;
    PERFORM set_config('pgoutbox.hand_back', '', TRUE);
    IF marked = 0 THEN
        PERFORM outbox._stale_claim(claim_token, event_ids, FALSE);
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

-- generated from sql/05_helpers.sql: outbox._lower_floor
-- Lowers a floor (a sequence below whose value no row waits: the claim
-- floor of outbox.events by id, the backlog floor of inbox.messages by
-- received_at in µs) to pos, and cancels its candidate (the sequence
-- floor || '_next'). Under the floor's advisory lock (lock_key, the one its
-- mover takes), held to the end of the transaction, so that no mover takes
-- the floor past pos before the row is committed and seen. Its callers are
-- SECURITY DEFINER: only the owner moves the sequences.
CREATE OR REPLACE FUNCTION outbox._lower_floor(lock_key text, floor text, pos bigint)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(lock_key, 0));
    IF pos < pg_sequence_last_value(floor::regclass) THEN
        PERFORM setval(floor::regclass, pos);
    END IF;
    PERFORM setval((floor || '_next')::regclass, 1, FALSE);
END;
$$;
-- end generated

REVOKE ALL ON FUNCTION outbox._lower_floor(text, text, bigint) FROM public;

-- generated from sql/20_outbox_guards.sql: outbox._lower_claim_floor
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
-- end generated

-- generated from sql/20_outbox_guards.sql: outbox.tg_events__lower_claim_floor
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
-- end generated

CREATE OR REPLACE TRIGGER _200_lower_claim_floor
BEFORE UPDATE ON outbox.events
FOR EACH ROW
WHEN (
    old.status NOT IN ('PENDING', 'FAILED', 'PROCESSING')
    AND new.status IN ('PENDING', 'FAILED', 'PROCESSING')
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
-- floor (the policy trigger, outbox.tg_events__check_policies), and an id
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
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
            AND e.id >= floor_id;
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
    WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
        AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
        AND e.id >= floor_id AND e.id < next_id;
    PERFORM setval('outbox.claim_floor', floor_id), setval('outbox.claim_floor_next', 1, FALSE);
    RETURN floor_id;
END;
$$;
-- end generated

-- generated from sql/30_outbox_api.sql: outbox.claim
-- Claims up to batch_size due events for worker, under a lease, and returns
-- them with a fresh claim token. Scheduled events fallen due first, then the
-- rest of the batch, each one statement (the second is the claim proper);
-- the first runs only when a probe finds one (below), so that a claim costs
-- what it did without them:
--   * scheduled events waiting for their time lie in events_scheduled_idx,
--     by time, not in the id-ordered walk (10_outbox_events.sql). Those
--     fallen due (a range of that index that holds only what is due, however
--     many wait for later) are taken in due order, and each takes a new id
--     from the events' sequence as it moves to PROCESSING: it joins the
--     id-ordered queue now, above the claim floor, where a lease that
--     expires finds it like any other. Why the new id never falls below
--     the floor: the claim takes its transaction id first (after
--     _claim_floor), then locks and renumbers; a candidate floor published
--     before the new id was drawn lies at most at the sequence's value
--     then + 1, below it; one published after belongs to a step 2 that
--     waits for this transaction's id, and so sees the row. A separate
--     statement behind an EXISTS probe (about 30 µs over a week of
--     partitions): as a CTE of the claim, that scan and its UPDATE cost
--     every claim about 200 µs (a probe and an UPDATE prepared over every
--     partition), which a claim of five events at moderate rates felt;
--   * fair between tenants when there is a backlog, as one statement of two
--     lanes. Oldest first alone, a tenant that commits a backlog (an import,
--     a replay) would hold every other tenant's events behind it until it
--     drained. So when more ids were given out above the claim floor than
--     the batch takes (a backlog; a test of two sequences), the tenant lane
--     steps from one tenant with waiting due rows to the next in
--     events_tenant_waiting_idx (a loose scan, one descent per tenant: a
--     tenant with nothing due costs nothing; from after the last tenant this
--     session's previous claim met, so that with more tenants than the
--     batch has rows every tenant comes round), gives each tenant a share
--     of the batch by weight (outbox.tenant_weights, 1 if not set) and
--     takes the share from that tenant's own range, weighted rounds
--     deciding when the rounded shares add up to more. Without a backlog
--     the tenant lane is skipped (its anchor is gated by the test), and a
--     claim costs what it did; with one tenant met, its share is 0 and the
--     id lane takes its rows as before. In-flight rows are not in that
--     index, so that neither the step nor a share walks a backlog's
--     thousands of claimed rows. A share's ORDER BY (tenant DESC, id) is
--     an order only that index gives (read backwards): with ORDER BY id
--     the generic plan walked events_claimable_idx, filtering by tenant.
--     created_at <= now() prunes, at run time, the partitions made ahead,
--     whose indexes every step and share would otherwise descend too (a
--     row dated ahead, which only an owner's INSERT can make, is left to
--     the id lane);
--   * the id lane takes the rest of the batch, at least one row, in id order
--     from events_claimable_idx: the oldest due events (expired leases
--     too, which only this lane sees), so nothing waits for ever however
--     many tenants share the batch. Both lanes lock FOR UPDATE SKIP LOCKED,
--     so concurrent claimers walk past each other's rows instead of
--     queueing on them; LIMIT bounds the batch (what the scheduled events
--     left of it);
--   * the batch comes back each tenant's first event first, then each
--     one's second, ...: the relay publishes in that order, so that a
--     tenant with a few due events is published at the head of the
--     batch, not behind a backlog's share;
--   * both lanes start at the claim floor (outbox._claim_floor, moved up
--     just before): below it nothing is claimable, only the index entries
--     of finished events, which a snapshot held by another session keeps
--     from vacuum, and the walk stays as short with it as without (in the
--     tenant index the floor bounds the id within a tenant, so a share
--     starts above it; a step lands on a tenant's newest entry, and passes
--     the entries below the floor on the index page, without a heap visit,
--     only for a tenant with nothing waiting);
--   * available_at <= now() covers all three sources at once: new events,
--     failed events whose retry time has come, and expired leases;
--   * an event with an ordering_key is taken only when no earlier event of
--     its key is unfinished (not COMPLETED), so at most one event per key is
--     in flight and a FAILED or DEAD_LETTER event holds its successors back.
--     The keys' heads (each key's first unfinished event) are found first,
--     by a loose scan of the key index (one seek per key, up to batch_size
--     keys): a keyed row is then a head or not by a look-up in that array,
--     where probing the index for each row of a keyed backlog made a claim
--     walk the whole backlog at an index probe per row to find one event
--     per key. With more keys than batch_size the heads are not gathered
--     and each keyed row is probed as before;
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
--     probed once per id;
--   * jit is off: the generic plan of the heads' recursion is costed above
--     jit_above_cost, and compiling it took seconds at every claim.
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
SET jit TO off
AS $$
DECLARE
    token uuid := gen_random_uuid();
    floor_id bigint;
    released integer := 0;
    fair boolean;
    after_tenant text COLLATE "C" := coalesce(current_setting('pgoutbox.claim_after_tenant', TRUE), '');
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
    IF EXISTS (
        SELECT 1
        FROM outbox.events AS e
        WHERE e.status = 'PENDING' AND e.claimed_at IS NULL AND e.ordering_key IS NULL
            AND e.available_at > e.created_at
            AND e.available_at <= now()
    ) THEN
        PERFORM pg_current_xact_id();  -- before a new id is drawn (above)
        RETURN QUERY
        WITH due AS (
            SELECT e.id, e.created_at
            FROM outbox.events AS e
            WHERE e.status = 'PENDING' AND e.claimed_at IS NULL AND e.ordering_key IS NULL
                AND e.available_at > e.created_at
                AND e.available_at <= now()
            ORDER BY e.available_at
            LIMIT batch_size
            FOR UPDATE OF e SKIP LOCKED
        )
        UPDATE outbox.events AS e
        SET id = DEFAULT,
            status = 'PROCESSING',
            attempts = e.attempts + 1,
            claimed_at = now(),
            claimed_by = worker,
            claim_token = token,
            available_at = now() + lease
        WHERE e.id = ANY(ARRAY(SELECT d.id FROM due AS d))
            AND e.created_at = ANY(ARRAY(SELECT d.created_at FROM due AS d))
            AND e.created_at >= (SELECT min(d.created_at) FROM due AS d)
            AND e.created_at <= (SELECT max(d.created_at) FROM due AS d)
        RETURNING e.*;
        GET DIAGNOSTICS released = ROW_COUNT;
        IF released = batch_size THEN
            RETURN;
        END IF;
    END IF;
    -- More ids given out above the floor than this claim takes: a backlog,
    -- which oldest first would serve alone until it drains (see above).
    fair := coalesce(pg_sequence_last_value('outbox.events_id_seq'), 0) - (batch_size - released) > floor_id;
    RETURN QUERY
    WITH RECURSIVE heads (ordering_key, id, n) AS (
        (
            SELECT k.ordering_key, k.id, 1
            FROM outbox.events AS k
            WHERE k.ordering_key IS NOT NULL AND k.status <> 'COMPLETED'
            ORDER BY k.ordering_key, k.id
            LIMIT 1
        )
        UNION ALL
        SELECT nk.ordering_key, nk.id, h.n + 1
        FROM heads AS h
        CROSS JOIN LATERAL (
            SELECT k.ordering_key, k.id
            FROM outbox.events AS k
            WHERE k.ordering_key > h.ordering_key AND k.status <> 'COMPLETED'
            ORDER BY k.ordering_key, k.id
            LIMIT 1
        ) AS nk
        WHERE h.n <= batch_size
    ),
    head_ids AS (
        -- NULL: more keys than batch_size, probe each keyed row instead
        SELECT CASE WHEN count(*) <= batch_size THEN coalesce(array_agg(h.id), '{}') END AS ids
        FROM heads AS h
    ),
    -- the tenants with due rows waiting (not in flight), from the one after
    -- the last tenant the previous claim of this session met, wrapping
    -- round: one descent each, as many as the batch has rows for them. Each
    -- step lands on the tenant's newest entry (the index holds ids
    -- descending), where a tenant with due rows has them, not on the oldest,
    -- where it has the entries of every event it finished since vacuum
    -- last ran (a snapshot held by another session keeps them)
    tenants (tkey, wrapped, n) AS (
        (
            SELECT f.tkey, f.wrapped, 1
            FROM (
                (
                    SELECT (coalesce(e.tenant_id, '') COLLATE "C") AS tkey, FALSE AS wrapped
                    FROM outbox.events AS e
                    WHERE fair
                        AND e.status IN ('PENDING', 'FAILED')
                        AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
                        AND e.available_at <= now()
                        AND e.created_at <= now()
                        AND (coalesce(e.tenant_id, '') COLLATE "C") > after_tenant
                        AND e.id >= floor_id
                    ORDER BY (coalesce(e.tenant_id, '') COLLATE "C"), e.id DESC
                    LIMIT 1
                )
                UNION ALL
                (
                    SELECT (coalesce(e.tenant_id, '') COLLATE "C"), TRUE
                    FROM outbox.events AS e
                    WHERE fair
                        AND e.status IN ('PENDING', 'FAILED')
                        AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
                        AND e.available_at <= now()
                        AND e.created_at <= now()
                        AND e.id >= floor_id
                    ORDER BY (coalesce(e.tenant_id, '') COLLATE "C"), e.id DESC
                    LIMIT 1
                )
            ) AS f
            LIMIT 1
        )
        UNION ALL
        SELECT nt.tkey, nt.wrapped, t.n + 1
        FROM tenants AS t
        CROSS JOIN LATERAL (
            SELECT f.tkey, f.wrapped
            FROM (
                (
                    SELECT (coalesce(e.tenant_id, '') COLLATE "C") AS tkey, t.wrapped
                    FROM outbox.events AS e
                    WHERE e.status IN ('PENDING', 'FAILED')
                        AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
                        AND e.available_at <= now()
                        AND e.created_at <= now()
                        AND (coalesce(e.tenant_id, '') COLLATE "C") > t.tkey
                        AND e.id >= floor_id
                    ORDER BY (coalesce(e.tenant_id, '') COLLATE "C"), e.id DESC
                    LIMIT 1
                )
                UNION ALL
                (
                    SELECT (coalesce(e.tenant_id, '') COLLATE "C"), TRUE
                    FROM outbox.events AS e
                    WHERE NOT t.wrapped
                        AND e.status IN ('PENDING', 'FAILED')
                        AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
                        AND e.available_at <= now()
                        AND e.created_at <= now()
                        AND e.id >= floor_id
                    ORDER BY (coalesce(e.tenant_id, '') COLLATE "C"), e.id DESC
                    LIMIT 1
                )
            ) AS f
            LIMIT 1
        ) AS nt
        WHERE t.n < batch_size - released - 1 AND NOT (nt.wrapped AND nt.tkey > after_tenant)
    ),
    shares AS (
        SELECT
            t.tkey,
            coalesce(w.weight, 1) AS weight,
            CASE
                WHEN count(*) OVER () > 1
                    THEN ceil((batch_size - released - 1) * coalesce(w.weight, 1)::numeric / sum(coalesce(w.weight, 1)) OVER ())::integer
                ELSE 0  -- one tenant: the id lane takes its rows as well
            END AS share
        FROM tenants AS t
        LEFT JOIN outbox.tenant_weights AS w ON w.tenant_key = t.tkey
    ),
    -- each tenant's share, its oldest due rows, from its own range, from
    -- the floor up
    shared AS (
        SELECT s.tkey, s.weight, c.id, c.created_at
        FROM shares AS s
        CROSS JOIN head_ids AS hi
        CROSS JOIN LATERAL (
            SELECT e.id, e.created_at
            FROM outbox.events AS e
            WHERE e.status IN ('PENDING', 'FAILED')
                AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
                AND (coalesce(e.tenant_id, '') COLLATE "C") = s.tkey
                AND e.id >= floor_id
                AND e.available_at <= now()
                AND e.created_at <= now()
                AND (
                    e.ordering_key IS NULL
                    OR CASE
                        WHEN hi.ids IS NOT NULL THEN e.id = ANY(hi.ids)
                        ELSE NOT EXISTS (
                            SELECT 1
                            FROM outbox.events AS earlier
                            WHERE earlier.ordering_key = e.ordering_key
                                AND earlier.id < e.id
                                AND earlier.status <> 'COMPLETED'
                        )
                    END
                )
            ORDER BY (coalesce(e.tenant_id, '') COLLATE "C") DESC, e.id
            LIMIT s.share
            FOR UPDATE OF e SKIP LOCKED
        ) AS c
    ),
    -- by weighted rounds (a tenant of weight w takes its next row every 1/w)
    -- when the shares, rounded up, add up to more; one row is left to the
    -- id order below, so that the oldest due event (an expired lease, a
    -- retry) is taken at every claim however many tenants share the rest
    fair_part AS (
        SELECT r.id, r.created_at
        FROM (
            SELECT sh.id, sh.created_at, sh.weight, row_number() OVER (PARTITION BY sh.tkey ORDER BY sh.id) AS rn
            FROM shared AS sh
        ) AS r
        ORDER BY (r.rn - 1)::float8 / r.weight, r.id
        LIMIT batch_size - released - 1
    ),
    -- what the shares left, in id order from the claim floor (the oldest
    -- first): the tenants whose due rows outnumber their share, the rows
    -- of tenants not met, and expired leases (in flight, so not in the
    -- tenant index)
    rest AS (
        SELECT e.id, e.created_at
        FROM outbox.events AS e
        CROSS JOIN head_ids AS hi
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
            AND e.id >= floor_id
            AND e.available_at <= now()
            AND (
                e.ordering_key IS NULL
                OR CASE
                    WHEN hi.ids IS NOT NULL THEN e.id = ANY(hi.ids)
                    ELSE NOT EXISTS (
                        SELECT 1
                        FROM outbox.events AS earlier
                        WHERE earlier.ordering_key = e.ordering_key
                            AND earlier.id < e.id
                            AND earlier.status <> 'COMPLETED'
                    )
                END
            )
            AND NOT e.id = ANY(ARRAY(SELECT fp.id FROM fair_part AS fp))
        ORDER BY e.id
        LIMIT batch_size - released - (SELECT count(*) FROM fair_part)
        FOR UPDATE OF e SKIP LOCKED
    ),
    picked AS (
        SELECT fp.id, fp.created_at FROM fair_part AS fp
        UNION ALL
        SELECT r.id, r.created_at FROM rest AS r
    ),
    claimed AS (
        UPDATE outbox.events AS e
        SET status = 'PROCESSING',
            attempts = e.attempts + 1,
            claimed_at = now(),
            claimed_by = worker,
            claim_token = token,
            available_at = now() + lease
        WHERE e.id = ANY(ARRAY(SELECT p.id FROM picked AS p))
            AND e.created_at = ANY(ARRAY(SELECT p.created_at FROM picked AS p))
            AND e.created_at >= (SELECT min(p.created_at) FROM picked AS p)
            AND e.created_at <= (SELECT max(p.created_at) FROM picked AS p)
        RETURNING e AS ev, e.id, e.tenant_id
    ),
    -- where the next claim of this session starts its step (session-wide:
    -- a claim is a transaction of its own)
    resume AS (
        SELECT set_config('pgoutbox.claim_after_tenant', coalesce((SELECT t.tkey FROM tenants AS t ORDER BY t.n DESC LIMIT 1), after_tenant), FALSE)
    )
    -- each tenant's first event, then each one's second, ...: a tenant with
    -- a few due events is published at the head of the batch, not behind
    -- a backlog's share
    SELECT (x.ev).*
    FROM (
        SELECT c.ev, c.id, row_number() OVER (PARTITION BY coalesce(c.tenant_id, '') ORDER BY c.id) AS rn
        FROM claimed AS c
    ) AS x
    CROSS JOIN resume
    ORDER BY x.rn, x.id;
END;
$$;
COMMENT ON FUNCTION outbox.claim(text, integer, interval) IS
'Claims up to batch_size due events (new, retry due, or lease expired) under a lease.';
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

REVOKE ALL ON FUNCTION outbox._claim_floor(), outbox._lower_claim_floor(bigint), outbox.tg_events__lower_claim_floor(),
outbox.oldest_snapshots(integer) FROM public;
GRANT EXECUTE ON FUNCTION outbox.oldest_snapshots(integer)
TO pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin, pgoutbox_viewer;

-- The backlog floor (sql/50_inbox.sql): inbox.backlog() walks
-- messages_unprocessed_idx from it, and the dead letters through
-- messages_dead_letter_idx; before, it walked the whole index past every
-- settled message's entry that a held snapshot keeps.
CREATE UNLOGGED SEQUENCE IF NOT EXISTS inbox.backlog_floor AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS inbox.backlog_floor_next AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS inbox.backlog_floor_wait AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
COMMENT ON SEQUENCE inbox.backlog_floor IS
'No RECEIVED/FAILED row has an earlier received_at (inbox._backlog_floor), in microseconds since the epoch.';

-- generated from sql/50_inbox.sql: inbox._backlog_micros
-- A received_at as the backlog floor's sequences hold it (microseconds since
-- the epoch; -infinity as the lowest bigint, which also stands for unset,
-- infinity as the highest), and back. Exact both ways: extract() gives a
-- numeric, and the way back multiplies intervals by whole seconds and
-- microseconds, each exact in a float8.
CREATE OR REPLACE FUNCTION inbox._backlog_micros(at timestamptz)
RETURNS bigint
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN at = '-infinity' THEN -9223372036854775807 - 1
        WHEN at = 'infinity' THEN 9223372036854775807
        ELSE (extract(epoch FROM at) * 1000000)::bigint END;
$$;
-- end generated

-- generated from sql/50_inbox.sql: inbox._backlog_time
CREATE OR REPLACE FUNCTION inbox._backlog_time(micros bigint)
RETURNS timestamptz
LANGUAGE sql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN micros IS NULL OR micros = -9223372036854775807 - 1 THEN timestamptz '-infinity'
        WHEN micros = 9223372036854775807 THEN timestamptz 'infinity'
        ELSE timestamptz 'epoch' + (micros / 1000000) * interval '1 second'
            + (micros % 1000000) * interval '1 microsecond' END;
$$;
-- end generated

-- generated from sql/50_inbox.sql: inbox._lower_backlog_floor
-- A RECEIVED or FAILED row received before the backlog floor or its
-- candidate (inbox._backlog_floor) lowers the floor to its received_at and
-- cancels the candidate: a row inserted by a transaction that began before
-- the candidate was taken (received_at is the transaction's start), one
-- with a received_at of its own, and a dead letter replayed or redriven
-- (DEAD_LETTER -> RECEIVED keeps its old received_at). The claim floor's
-- rule (outbox._lower_floor: under the floor's lock, so that no step moves
-- the floor past it before it is committed and seen).
CREATE OR REPLACE FUNCTION inbox._lower_backlog_floor(received_at timestamptz)
RETURNS void
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._lower_floor('pgoutbox.backlog_floor', 'inbox.backlog_floor', inbox._backlog_micros(received_at));
$$;
-- end generated

-- generated from sql/50_inbox.sql: inbox.tg_messages__lower_backlog_floor_on_insert
-- Every INSERT statement, once (a statement trigger: a batch of a hundred
-- rows pays one test, not a hundred): this transaction's id first, then the
-- candidate, then the floor, the order inbox._backlog_floor's argument needs
-- (a CASE evaluates its conditions in order).
CREATE OR REPLACE FUNCTION inbox.tg_messages__lower_backlog_floor_on_insert()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    lowest timestamptz;
BEGIN
    SELECT min(a.received_at) INTO lowest FROM added AS a WHERE a.status IN ('RECEIVED', 'FAILED');
    IF (
        CASE
            WHEN lowest IS NULL OR pg_current_xact_id() IS NULL THEN FALSE
            WHEN inbox._backlog_micros(lowest) < pg_sequence_last_value('inbox.backlog_floor_next') THEN TRUE
            ELSE inbox._backlog_micros(lowest) < pg_sequence_last_value('inbox.backlog_floor')
        END
    ) THEN
        PERFORM inbox._lower_backlog_floor(lowest);
    END IF;
    RETURN NULL;
END;
$$;
-- end generated

CREATE OR REPLACE TRIGGER _200_lower_backlog_floor_on_insert
AFTER INSERT ON inbox.messages
REFERENCING NEW TABLE AS added
FOR EACH STATEMENT
EXECUTE FUNCTION inbox.tg_messages__lower_backlog_floor_on_insert();

-- generated from sql/50_inbox.sql: inbox.tg_messages__lower_backlog_floor
-- A settled row made RECEIVED or FAILED again (the WHEN of _200_lower_backlog_floor).
CREATE OR REPLACE FUNCTION inbox.tg_messages__lower_backlog_floor()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._lower_backlog_floor(NEW.received_at);
    RETURN NEW;
END;
$$;
-- end generated

CREATE OR REPLACE TRIGGER _200_lower_backlog_floor
BEFORE UPDATE ON inbox.messages
FOR EACH ROW
WHEN (
    old.status NOT IN ('RECEIVED', 'FAILED')
    AND new.status IN ('RECEIVED', 'FAILED')
)
EXECUTE FUNCTION inbox.tg_messages__lower_backlog_floor();

-- generated from sql/50_inbox.sql: inbox._backlog_floor
-- Moves the backlog floor up behind the RECEIVED/FAILED rows and returns
-- it; inbox.backlog() calls it first. The claim floor's two steps
-- (outbox._claim_floor, 30_outbox_api.sql), on received_at instead of the
-- id, by one caller at a time (the floor's advisory lock), under READ
-- COMMITTED, in a transaction that may write:
--   1. a candidate C: the earliest received_at of a RECEIVED/FAILED row at or
--      above the floor, at most this transaction's start (a row received by
--      a transaction that begins later has a later received_at). It is
--      published (backlog_floor_next), and only then does this transaction
--      take its own transaction id X (backlog_floor_wait);
--   2. at a later call, once no transaction with an id up to X is running
--      (the snapshot's xmin > X): the floor becomes the earliest received_at
--      below C of a RECEIVED/FAILED row, read in a snapshot taken after
--      that, or C.
-- Why no RECEIVED/FAILED row ends below the floor: every INSERT takes its
-- transaction id, then reads the candidate, then the floor
-- (_200_lower_backlog_floor_on_insert), and a row below either lowers them
-- under the floor's lock; a row that read the candidate before it was
-- published belongs to a transaction whose id came before X, which ended
-- before step 2, whose snapshot then sees its row. A settled row made
-- RECEIVED/FAILED again lowers the floor (_200_lower_backlog_floor). A
-- standby, a read-only transaction, or a caller whose transaction already
-- has an id (step 1) leaves the floor as it stands.
CREATE OR REPLACE FUNCTION inbox._backlog_floor()
RETURNS timestamptz
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
SET enable_seqscan TO off
AS $$
DECLARE
    floor_us bigint;
    next_us bigint;
    wait_xid bigint;
BEGIN
    IF pg_is_in_recovery() THEN
        RETURN timestamptz '-infinity';  -- a standby cannot read an unlogged sequence
    END IF;
    floor_us := coalesce(pg_sequence_last_value('inbox.backlog_floor'), -9223372036854775807 - 1);
    IF current_setting('transaction_isolation') <> 'read committed'
        OR current_setting('transaction_read_only') = 'on'
        OR NOT pg_try_advisory_xact_lock(hashtextextended('pgoutbox.backlog_floor', 0)) THEN
        RETURN inbox._backlog_time(floor_us);
    END IF;
    floor_us := coalesce(pg_sequence_last_value('inbox.backlog_floor'), floor_us);
    next_us := pg_sequence_last_value('inbox.backlog_floor_next');
    IF next_us IS NULL THEN
        IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
            RETURN inbox._backlog_time(floor_us);
        END IF;
        SELECT inbox._backlog_micros(least(min(m.received_at), now())) INTO next_us
        FROM inbox.messages AS m
        WHERE m.status IN ('RECEIVED', 'FAILED') AND m.received_at >= inbox._backlog_time(floor_us);
        IF next_us > floor_us THEN
            -- An abort between these leaves the wait at its maximum: step 2
            -- then drops the candidate.
            PERFORM setval('inbox.backlog_floor_wait', 9223372036854775807);
            PERFORM setval('inbox.backlog_floor_next', next_us);
            PERFORM setval('inbox.backlog_floor_wait', pg_current_xact_id()::text::bigint);
        END IF;
        RETURN inbox._backlog_time(floor_us);
    END IF;
    wait_xid := pg_sequence_last_value('inbox.backlog_floor_wait');
    IF wait_xid IS NULL OR wait_xid = 9223372036854775807 THEN
        PERFORM setval('inbox.backlog_floor_next', 1, FALSE);
        RETURN inbox._backlog_time(floor_us);
    END IF;
    IF pg_snapshot_xmin(pg_current_snapshot())::text::bigint <= wait_xid THEN
        RETURN inbox._backlog_time(floor_us);
    END IF;
    SELECT coalesce(inbox._backlog_micros(min(m.received_at)), next_us) INTO floor_us
    FROM inbox.messages AS m
    WHERE m.status IN ('RECEIVED', 'FAILED')
        AND m.received_at >= inbox._backlog_time(floor_us) AND m.received_at < inbox._backlog_time(next_us);
    PERFORM setval('inbox.backlog_floor', floor_us), setval('inbox.backlog_floor_next', 1, FALSE);
    RETURN inbox._backlog_time(floor_us);
END;
$$;
-- end generated

-- generated from sql/50_inbox.sql: inbox.backlog
-- QRY-051: unprocessed messages per context and handler. Two branches, each
-- served by its own partial index: the RECEIVED/FAILED rows from the backlog
-- floor up (inbox._backlog_floor, moved up first; below it only the index
-- entries of settled messages, which a snapshot held by another session
-- keeps from vacuum), the dead letters through messages_dead_letter_idx
-- (rare, and kept apart from the floor: a dead letter kept for months would
-- hold it down). VOLATILE: the floor's step writes its sequences.
CREATE OR REPLACE FUNCTION inbox.backlog(context text DEFAULT NULL)
RETURNS TABLE (
    context text,
    handler text,
    unprocessed bigint,
    oldest_unprocessed_at timestamptz,
    failed bigint,
    dead_letter bigint
)
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET enable_seqscan TO off
AS $$
    SELECT outbox._check_context(backlog.context);
    SELECT
        m.context,
        m.handler,
        count(*) FILTER (WHERE m.status IN ('RECEIVED', 'FAILED')),
        min(m.received_at) FILTER (WHERE m.status IN ('RECEIVED', 'FAILED')),
        count(*) FILTER (WHERE m.status = 'FAILED'),
        -- live dead letters: the discarded ones are counted by outbox.dlq_summary()
        count(*) FILTER (WHERE m.status = 'DEAD_LETTER' AND NOT m.discarded)
    FROM (
        SELECT u.context, u.handler, u.status, u.received_at, FALSE AS discarded
        FROM inbox.messages AS u
        WHERE u.status IN ('RECEIVED', 'FAILED')
            AND u.received_at >= (SELECT inbox._backlog_floor())
            AND (backlog.context IS NULL OR u.context = backlog.context)
        UNION ALL
        SELECT d.context, d.handler, d.status, d.received_at, d.dlq_metadata ? 'discarded'
        FROM inbox.messages AS d
        WHERE d.status = 'DEAD_LETTER'
            AND (backlog.context IS NULL OR d.context = backlog.context)
    ) AS m
    GROUP BY m.context, m.handler
    ORDER BY m.context, m.handler;
$$;
COMMENT ON FUNCTION inbox.backlog(text) IS
'Per context and handler: unprocessed count and oldest, failed and (live) dead-lettered counts.';
-- end generated

-- generated from sql/50_inbox.sql: inbox.settle
-- Settles a batch of one handler's outcomes: `processed` -> PROCESSED,
-- `failed` -> FAILED with the error of the same position, counted in
-- dlq_metadata.failures as record_error() counts it. Returns the rows
-- it moved; a message it does not return was not RECEIVED/FAILED (another
-- delivery settled it first: its outcome stands) or has no inbox row.
-- Dead letters go through record_error(), after their DLQ notice.
-- A probe of the primary key per message, whatever the table holds. Left to
-- choose, the planner joined the batch to a scan of messages_unprocessed_idx
-- (the status test implies its predicate), which it takes for small: a walk
-- over every unsettled message (a consumer behind) and every entry a held
-- snapshot keeps (a settled message's RECEIVED version), at each batch
-- (measured: 7.8 shared buffers a message before a hold, 82 three minutes
-- into it, at 400 messages/s). So the statuses a row may move from come
-- with the batch (w.movable, a materialized CTE's column): a join
-- condition, which no partial index's predicate can be proved from; and no
-- hash or merge join, which would scan the table instead.
CREATE OR REPLACE FUNCTION inbox.settle(
    handler text,
    processed uuid[],
    failed uuid[] DEFAULT '{}',
    errors text[] DEFAULT '{}'
)
RETURNS TABLE (message_id uuid, status text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET enable_hashjoin TO off
SET enable_mergejoin TO off
SET enable_seqscan TO off
AS $$
BEGIN
    PERFORM inbox._check_batch(settle.handler, settle.processed || settle.failed);
    IF cardinality(settle.errors) IS DISTINCT FROM cardinality(settle.failed) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: failed and errors must have the same length'
            USING ERRCODE = 'OB006';
    END IF;
    IF EXISTS (SELECT FROM unnest(settle.errors) AS e (error) WHERE nullif(btrim(e.error), '') IS NULL) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: an error text is required for every failed message'
            USING ERRCODE = 'OB006';
    END IF;
    -- EXECUTE: planned for this call. A plan cached while inbox.messages was
    -- small scans the whole table for every batch afterwards (measured: 40 ms
    -- a call at 50,000 rows).
    RETURN QUERY EXECUTE $q$
    WITH wanted AS MATERIALIZED (
        SELECT p.id, NULL::text AS error, ARRAY['RECEIVED', 'FAILED'] AS movable FROM unnest($2) AS p (id)
        UNION ALL
        SELECT f.id, f.error, ARRAY['RECEIVED', 'FAILED'] FROM unnest($3, $4) AS f (id, error)
    ),
    moved AS (
        UPDATE inbox.messages AS m
        SET status = CASE WHEN w.error IS NULL THEN 'PROCESSED' ELSE 'FAILED' END,
            processed_at = CASE WHEN w.error IS NULL THEN greatest(now(), m.received_at) END,
            last_error = outbox._clip_error(w.error),
            dlq_metadata = CASE WHEN w.error IS NULL THEN m.dlq_metadata ELSE
                m.dlq_metadata || jsonb_build_object(
                    'failures', coalesce((m.dlq_metadata ->> 'failures')::integer, 0) + 1
                )
            END
        FROM wanted AS w
        WHERE m.message_id = w.id AND m.handler = $1
            AND m.status = ANY (w.movable)
        RETURNING m.message_id, m.status
    )
    SELECT mv.message_id, mv.status FROM moved AS mv
    $q$
    USING settle.handler, settle.processed, settle.failed, settle.errors;
END;
$$;
COMMENT ON FUNCTION inbox.settle(text, uuid[], uuid[], text[]) IS
'Batch of outcomes for one handler: processed -> PROCESSED, failed -> FAILED (errors); returns the rows moved.';
-- end generated

REVOKE ALL ON FUNCTION inbox._backlog_micros(timestamptz), inbox._backlog_time(bigint),
inbox._lower_backlog_floor(timestamptz), inbox.tg_messages__lower_backlog_floor_on_insert(),
inbox.tg_messages__lower_backlog_floor(), inbox._backlog_floor() FROM public;

-- The marks' token index, its predicate in collation "C" (sql/10_outbox_events.sql):
-- a mark walked events_claimable_idx whole under a held snapshot. Built while
-- emit waits (a partitioned table's index cannot be built CONCURRENTLY; it
-- holds only PROCESSING rows, but the build reads every event kept);
-- partitions indexed beforehand (docs/upgrading.md) are attached, not built.
DROP INDEX IF EXISTS outbox.events_claim_token_idx;
CREATE INDEX IF NOT EXISTS events_claim_token_idx ON outbox.events (claim_token)
WHERE status = 'PROCESSING' COLLATE "C";

-- generated from sql/30_outbox_api.sql: outbox.mark_published
-- Marks the claim's events COMPLETED. Rows no longer held by claim_token (the
-- lease expired and another relay took them) are left alone: fencing. Returns
-- how many were marked; raises STALE_CLAIM when it could mark none of them.
-- (enable_seqscan off: see claim; the token's index probe in an empty
-- partition costs next to nothing. The status test in collation "C" makes
-- events_claim_token_idx the only index the plan can walk, whatever the
-- statistics say: sql/10_outbox_events.sql.)
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
    PERFORM outbox._check_claim(claim_token, event_ids);
    UPDATE outbox.events AS e
    SET status = 'COMPLETED', published_at = now(), last_error = NULL
    WHERE e.claim_token = mark_published.claim_token
        AND e.status = 'PROCESSING' COLLATE "C"  -- events_claim_token_idx only
        AND e.event_id = ANY(mark_published.event_ids);
    GET DIAGNOSTICS marked = ROW_COUNT;
    IF marked = 0 THEN
        PERFORM outbox._stale_claim(claim_token, event_ids, TRUE);
    END IF;
    RETURN marked;
END;
$$;
COMMENT ON FUNCTION outbox.mark_published(uuid, uuid[]) IS
'PROCESSING -> COMPLETED for the events still held by claim_token; returns the count.';
-- end generated

-- generated from sql/30_outbox_api.sql: outbox.mark_failed
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
    PERFORM outbox._check_claim(claim_token, event_ids);
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
        AND e.status = 'PROCESSING' COLLATE "C"  -- events_claim_token_idx only
        AND e.event_id = f.event_id;
    GET DIAGNOSTICS marked = ROW_COUNT;
    IF marked = 0 THEN
        PERFORM outbox._stale_claim(claim_token, event_ids, FALSE);
    END IF;
    RETURN marked;
END;
$$;
COMMENT ON FUNCTION outbox.mark_failed(uuid, uuid[], text[], timestamptz[]) IS
'PROCESSING -> FAILED (retry at retry_at[i]) or DEAD_LETTER (retry_at[i] NULL); returns the count.';
-- end generated

-- generated from sql/50_inbox.sql: inbox.mark_processed
-- The status test is written in collation "C" (for text equality the same
-- test) so that no partial index's predicate can be proved from it and the
-- plan probes the primary key whatever the statistics say. Written plainly it
-- proves messages_unprocessed_idx's (status <> 'PROCESSED'), and an ANALYZE
-- that saw no unsettled row prices a walk of that whole index at one page:
-- under a snapshot held by another session, every settled message's RECEIVED
-- entry (inbox.settle keeps out of it another way).
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
        AND m.status COLLATE "C" IN ('RECEIVED', 'FAILED')
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_move(message_id, handler, 'PROCESSED');
    END IF;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.mark_processed(uuid, text) IS
'RECEIVED/FAILED -> PROCESSED; in the handler''s own transaction for in-database handlers.';
-- end generated

-- generated from sql/50_inbox.sql: inbox.record_error
-- Records a handler failure: FAILED (transient, will be redelivered) or,
-- with dead => true, DEAD_LETTER (poison, or the last allowed failure).
-- Either way dlq_metadata.failures counts it: the consumer dead-letters on
-- the failure that reaches the handler's max_deliver, so that deliveries
-- cut short by an outage or a crash (which record no failure) never do.
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
        -- A new dead letter drops the previous one's notice (dlq_stream,
        -- dlq_stream_sequence): inbox.record_dlq_notice() names the new one.
        dlq_metadata = CASE WHEN dead THEN m.dlq_metadata - ARRAY['dlq_stream', 'dlq_stream_sequence']
            ELSE m.dlq_metadata END
        || jsonb_build_object('failures', coalesce((m.dlq_metadata ->> 'failures')::integer, 0) + 1)
        || CASE WHEN NOT dead THEN '{}'::jsonb ELSE
            jsonb_build_object(
                'dead_lettered_at', now(),
                'dead_letters', coalesce((m.dlq_metadata ->> 'dead_letters')::integer, 0) + 1,
                'replay_attempts', coalesce((m.dlq_metadata ->> 'replay_attempts')::integer, 0),
                'next_replay_at', now() + replay_after
            )
        END
    WHERE m.message_id = record_error.message_id AND m.handler = record_error.handler
        AND m.status COLLATE "C" IN ('RECEIVED', 'FAILED')  -- the primary key only: see mark_processed
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_move(message_id, handler, CASE WHEN dead THEN 'DEAD_LETTER' ELSE 'FAILED' END);
    END IF;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.record_error(uuid, text, text, boolean, interval) IS
'RECEIVED/FAILED -> FAILED, or -> DEAD_LETTER with dead => true (and the next replay after replay_after).';
-- end generated

-- ---- backfill: a handler that joins late replays the outbox's history

-- generated from sql/68_backfill.sql: outbox.backfill_span
-- What the outbox holds of a handler's subjects in [from_at, until_at) (a
-- scheduled event not yet due left out, as backfill_page leaves it; the later
-- events of its key are counted, though that page holds them back): how
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
        AND e.created_at >= backfill_span.from_at AND e.created_at < backfill_span.until_at
        AND NOT (e.status = 'PENDING' AND e.claimed_at IS NULL AND e.available_at > now());
END;
$$;
COMMENT ON FUNCTION outbox.backfill_span(text[], timestamptz, timestamptz) IS
'For pgoutbox backfill: how many events of these subjects the outbox holds in a range, and since when it keeps any.';
-- end generated

-- generated from sql/68_backfill.sql: outbox.backfill_page
-- One page of a backfill: the events of the handler's subjects created in
-- [from_at, until_at) with an id above after_id, in id order, whatever their
-- status, but one: a scheduled event not yet due is no history yet. It and
-- the later events of its key are left out (they would reach the handler
-- before their time, or before it); the relay publishes them when it falls
-- due, and the handler's consumer takes them then. Id order is emit order
-- within an ordering key (outbox.emit holds the key's lock until commit), so
-- a backfill that delivers pages in order, one event after the other, keeps
-- every key's order; after_id is the resume point. The columns are those the
-- relay publishes (wire.to_nats).
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
        AND NOT (e.status = 'PENDING' AND e.claimed_at IS NULL AND e.available_at > now())
        AND NOT (
            e.ordering_key IS NOT NULL AND EXISTS (
                SELECT 1
                FROM outbox.events AS k
                -- (status <> 'COMPLETED': events_unfinished_key_idx's predicate)
                WHERE k.ordering_key = e.ordering_key AND k.id < e.id AND k.status <> 'COMPLETED'
                    AND k.status = 'PENDING' AND k.claimed_at IS NULL AND k.available_at > now()
            )
        )
    ORDER BY e.id
    LIMIT backfill_page.page_size;
END;
$$;
COMMENT ON FUNCTION outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer) IS
'For pgoutbox backfill: the next page of events of these subjects in a range, in id (emit) order.';
-- end generated

-- generated from sql/68_backfill.sql: outbox._check_backfill_range
-- A backfill's range [from_at, until_at): both given, from_at first.
CREATE OR REPLACE FUNCTION outbox._check_backfill_range(from_at timestamptz, until_at timestamptz)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF from_at IS NULL OR until_at IS NULL OR NOT from_at < until_at THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: from_at must be before until_at, got % and %', from_at, until_at
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;
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
    PERFORM outbox._check_backfill_range(from_at, until_at);
    PERFORM outbox._check_range('page_size', page_size, 1, 10000, 'between 1 and 10000');
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
outbox._check_backfill_range(timestamptz, timestamptz),
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

-- generated from sql/68_backfill.sql: outbox.backfill_archived_days
-- The archived days a backfill reads from the Parquet archive: days of
-- outbox.events with a standing audit whose partition was removed (a day
-- archived but still live is read from the outbox), overlapping
-- [from_at, until_at), in day order, with the audited figures the archive
-- must still show (outbox.backfill_verify_archived_day).
CREATE OR REPLACE FUNCTION outbox.backfill_archived_days(
    from_at timestamptz,
    until_at timestamptz
)
RETURNS TABLE (day date, archive_uri text, row_count bigint, checksum numeric)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_backfill_range(from_at, until_at);
    RETURN QUERY
    SELECT a.day, a.archive_uri, a.row_count, a.checksum
    FROM outbox.archive_audit AS a
    WHERE a.source = 'outbox.events' AND a.voided_at IS NULL AND a.removed_at IS NOT NULL
        AND (a.day::timestamp AT TIME ZONE 'UTC') < backfill_archived_days.until_at
        AND ((a.day + 1)::timestamp AT TIME ZONE 'UTC') > backfill_archived_days.from_at
    ORDER BY a.day;
END;
$$;
COMMENT ON FUNCTION outbox.backfill_archived_days(timestamptz, timestamptz) IS
'For pgoutbox backfill: the archived and removed days of outbox.events in a range, with their audited figures.';
-- end generated

-- generated from sql/68_backfill.sql: outbox.backfill_verify_archived_day
-- The gate before a backfill delivers an archived day: the row count and
-- checksum it computed over the day's Parquet files (the archival job's
-- checksum, spark/pgoutbox_spark/checksum.py) must equal the standing audit,
-- else the day was altered after it was archived: ARCHIVE_TAMPERED (OB111),
-- and not one of its rows is delivered. A day without a standing audit is
-- ARCHIVE_NOT_AUDITED (OB112). Returns the audited archive URI.
CREATE OR REPLACE FUNCTION outbox.backfill_verify_archived_day(
    day date,
    row_count bigint,
    checksum numeric
)
RETURNS text
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    -- Scalars, not a row of outbox.archive_audit: this file runs before the
    -- one that creates that table (sql/91), and a declared row type must exist.
    audited_rows bigint;
    audited_sum numeric;
    audited_uri text;
BEGIN
    IF day IS NULL OR row_count IS NULL OR checksum IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: day, row_count and checksum are required'
            USING ERRCODE = 'OB006';
    END IF;
    SELECT a.row_count, a.checksum, a.archive_uri INTO audited_rows, audited_sum, audited_uri
    FROM outbox.archive_audit AS a
    WHERE a.source = 'outbox.events' AND a.day = backfill_verify_archived_day.day AND a.voided_at IS NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'ARCHIVE_NOT_AUDITED: outbox.events has no standing archive audit for %', day
            USING ERRCODE = 'OB112';
    END IF;
    IF audited_rows <> backfill_verify_archived_day.row_count
        OR audited_sum <> backfill_verify_archived_day.checksum THEN
        RAISE EXCEPTION 'ARCHIVE_TAMPERED: the archive of outbox.events for % is not what was audited',
            day
            USING ERRCODE = 'OB111',
            DETAIL = format(
                'audited %s rows, checksum %s; the files at %s give %s rows, checksum %s',
                audited_rows, audited_sum, audited_uri,
                backfill_verify_archived_day.row_count, backfill_verify_archived_day.checksum
            );
    END IF;
    RETURN audited_uri;
END;
$$;
COMMENT ON FUNCTION outbox.backfill_verify_archived_day(date, bigint, numeric) IS
'For pgoutbox backfill: checks an archived day''s figures against its audit (OB111 when they differ).';
-- end generated

REVOKE ALL ON FUNCTION
outbox.backfill_archived_days(timestamptz, timestamptz),
outbox.backfill_verify_archived_day(date, bigint, numeric)
FROM public;
GRANT EXECUTE ON FUNCTION
outbox.backfill_archived_days(timestamptz, timestamptz),
outbox.backfill_verify_archived_day(date, bigint, numeric),
outbox.checksum_columns(text)
TO pgoutbox_backfiller;

-- ---- source rules: five statuses, flows, small gaps

-- Five outbox statuses, no more (PENDING, PROCESSING, COMPLETED, FAILED,
-- DEAD_LETTER): a discarded dead letter stays DEAD_LETTER and carries a mark,
-- a row of outbox.discarded_events, as an inbox one carries
-- dlq_metadata.discarded. A table of its own, not a column of outbox.events,
-- whose row type outbox.claim returns (tests/upgrade/test_expand_only.py).
CREATE TABLE IF NOT EXISTS outbox.discarded_events (
    event_id uuid PRIMARY KEY,
    row_id bigint NOT NULL,
    created_at timestamptz NOT NULL,
    discarded_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE outbox.discarded_events IS
'Discarded dead letters of outbox.events (status stays DEAD_LETTER): outbox.dlq_discard adds, dlq_restore removes.';
CREATE INDEX IF NOT EXISTS discarded_events_row_idx ON outbox.discarded_events (row_id, created_at);

-- The events version 17 left DISCARDED become marked dead letters, discarded
-- when their last discard says (outbox.discard_log has the discard already:
-- no audit row is added). Only an unreleased build wrote DISCARDED. The
-- update guard is off for this one statement: no operator's move is
-- being made, and the guard refuses every move of a discarded event.
INSERT INTO outbox.discarded_events (event_id, row_id, created_at, discarded_at)
SELECT
    e.event_id,
    e.id,
    e.created_at,
    coalesce(l.acted_at, now()) AS discarded_at
FROM outbox.events AS e
LEFT JOIN LATERAL (
    SELECT max(g.acted_at) AS acted_at
    FROM outbox.discard_log AS g
    WHERE g.event_id = e.event_id AND g.action = 'discard'
) AS l ON TRUE
WHERE e.status = 'DISCARDED'
ON CONFLICT (event_id) DO NOTHING;
ALTER TABLE outbox.events DISABLE TRIGGER _100_guard_update;
UPDATE outbox.events SET status = 'DEAD_LETTER'
WHERE status = 'DISCARDED';
ALTER TABLE outbox.events ENABLE TRIGGER _100_guard_update;
DROP INDEX IF EXISTS outbox.events_discarded_idx;

-- generated from sql/67_dead_letters.sql: outbox.tg_discarded_events__guard
-- A mark is written or removed only as a discard or restore of a dead
-- letter (_check_discard_move, with the event's status read under a share
-- lock: a requeue of the same event waits, then sees the mark and is
-- refused, DISCARDED OB101); nothing else changes it.
CREATE OR REPLACE FUNCTION outbox.tg_discarded_events__guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    mark outbox.discarded_events := CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
    event_status text;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        RAISE EXCEPTION 'UNAUDITED_DISCARD: a discard mark is added by outbox.dlq_discard and removed by outbox.dlq_restore, never changed'
            USING ERRCODE = 'OB102';
    END IF;
    SELECT e.status INTO event_status
    FROM outbox.events AS e
    WHERE e.id = mark.row_id AND e.created_at = mark.created_at AND e.event_id = mark.event_id
    FOR SHARE;
    IF TG_OP = 'INSERT' THEN
        PERFORM outbox._check_discard_move(mark.event_id, coalesce(event_status, 'UNKNOWN'), 'DISCARDED', TRUE);
        NEW.discarded_at := now();
        RETURN NEW;
    END IF;
    PERFORM outbox._check_discard_move(mark.event_id, 'DISCARDED', coalesce(event_status, 'UNKNOWN'), TRUE);
    RETURN OLD;
END;
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.tg_discarded_events__audit
-- After the mark is written (an insert that ON CONFLICT passes by fires
-- nothing here): the audit row and the dead letter's entry.
CREATE OR REPLACE FUNCTION outbox.tg_discarded_events__audit()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    mark outbox.discarded_events := CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
BEGIN
    INSERT INTO outbox.discard_log (event_id, action, acted_by, reason, last_error)
    SELECT
        mark.event_id, current_setting('pgoutbox.dlq_action', true), session_user,
        current_setting('pgoutbox.dlq_reason', true), e.last_error
    FROM outbox.events AS e
    WHERE e.id = mark.row_id AND e.created_at = mark.created_at;
    UPDATE outbox.dlq_entries AS x
    SET discarded = TG_OP = 'INSERT', replayable = TG_OP = 'DELETE'
    WHERE x.side = 'outbox' AND x.id = mark.event_id AND x.handler = '';
    RETURN NULL;
END;
$$;
-- end generated

CREATE OR REPLACE TRIGGER _100_guard
BEFORE INSERT OR UPDATE OR DELETE ON outbox.discarded_events
FOR EACH ROW EXECUTE FUNCTION outbox.tg_discarded_events__guard();
CREATE OR REPLACE TRIGGER _100_guard_truncate
BEFORE TRUNCATE ON outbox.discarded_events
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_discard_log__append_only();
CREATE OR REPLACE TRIGGER _600_audit
AFTER INSERT OR DELETE ON outbox.discarded_events
FOR EACH ROW EXECUTE FUNCTION outbox.tg_discarded_events__audit();
REVOKE ALL ON FUNCTION outbox.tg_discarded_events__guard(), outbox.tg_discarded_events__audit() FROM public;
GRANT SELECT ON outbox.discarded_events TO pgoutbox_admin;

-- generated from sql/20_outbox_guards.sql: outbox.tg_events__refuse_bad_state
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
-- end generated

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
    -- Three branches so that each is served by its own partial index (the
    -- scheduled events' one is not walked from the floor: they keep their
    -- ids until claimed). A discarded dead letter (outbox.discarded_events)
    -- is parked for good: counted nowhere here.
    WITH unfinished AS (
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status = 'PENDING' AND e.claimed_at IS NULL AND e.ordering_key IS NULL
            AND e.available_at > e.created_at
            AND (backlog.context IS NULL OR e.context = backlog.context)
        UNION ALL
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
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
            AND NOT EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = e.event_id)
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
        -- A row stored by an older version with available_at -infinity is
        -- due and very old, not an error (interval has no infinity); with
        -- nothing due, NULL (greatest() would skip the NULL and make it
        -- 2,000 years).
        now() - CASE
            WHEN min(u.available_at) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now())
                < timestamptz '0001-01-01 00:00:00+00' THEN timestamptz '0001-01-01 00:00:00+00'
            ELSE min(u.available_at) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now())
        END,
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

-- generated from sql/30_outbox_api.sql: outbox.dead_letters
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
        -- discarded ones are parked for good (outbox.dlq_list shows them)
        AND NOT EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = e.event_id)
    ORDER BY e.id DESC
    LIMIT dead_letters.max_rows;
$$;
COMMENT ON FUNCTION outbox.dead_letters(text, integer) IS
'Dead-lettered events (newest first) with their last error; requeue them with outbox.requeue().';
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.dlq_show
-- One dead letter (live or discarded) as a JSON document: its envelope,
-- headers, payload (only for a session_user that may read the table, i.e.
-- not pgoutbox_viewer), recorded attempts and replay state, and its history
-- (requeues, redrives, discards and restores, newest first; seq is the
-- audit row's id in its own log, which orders entries of one transaction).
CREATE OR REPLACE FUNCTION outbox.dlq_show(
    side text,
    id uuid,
    handler text DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    r record;
    doc jsonb;
    visible boolean;
    history jsonb;
BEGIN
    IF side IS NULL OR side NOT IN ('outbox', 'inbox') OR id IS NULL THEN
        RAISE EXCEPTION 'INVALID_FILTER: side (outbox or inbox) and id are required'
            USING ERRCODE = 'OB100';
    END IF;
    IF side = 'inbox' AND (handler IS NULL OR handler !~ '^[A-Za-z0-9_.-]{1,128}$') THEN
        RAISE EXCEPTION 'INVALID_FILTER: an inbox dead letter is named by its message id and handler'
            USING ERRCODE = 'OB100';
    END IF;
    SELECT x.* INTO r
    FROM outbox._dlq_rows(
        jsonb_build_object(
            'side', dlq_show.side, 'ids', jsonb_build_array(dlq_show.id), 'discarded', NULL, 'owner', dlq_show.handler
        )
    ) AS x;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'DEAD_LETTER_NOT_FOUND: no % dead letter % %', dlq_show.side, dlq_show.id, coalesce('for handler ' || dlq_show.handler, '')
            USING ERRCODE = 'OB105';
    END IF;
    doc := jsonb_build_object(
        'side', r.side, 'owner', r.owner, 'id', r.id, 'handler', r.handler, 'subject', r.subject,
        'status', 'DEAD_LETTER', 'discarded', r.discarded,
        'tenant', r.tenant, 'attempts', r.attempts, 'last_error', r.last_error,
        'error_class', r.error_class, 'error_pattern', r.error_pattern, 'group_id', r.group_id,
        'seen_at', r.seen_at, 'created_at', r.created_at, 'refailed', r.refailed, 'replays', r.replays,
        'redrive_pending', r.redrive_pending
    );
    IF side = 'outbox' THEN
        visible := has_table_privilege(session_user, 'outbox.events', 'SELECT');
        SELECT doc || jsonb_build_object(
            'envelope', to_jsonb(e) - 'payload' - 'headers',
            'headers', e.headers,
            'payload', CASE WHEN visible THEN e.payload END,
            'dlq_metadata', NULL, 'replay_enabled', NULL, 'dlq_stream', NULL, 'dlq_stream_sequence', NULL
        ) INTO doc
        FROM outbox.events AS e
        WHERE e.id = r.row_id AND e.created_at = r.created_at;
        SELECT coalesce(jsonb_agg(h ORDER BY h.at DESC, h.seq DESC), '[]') INTO history
        FROM (
            SELECT q.id AS seq, q.requeued_at AS at, 'requeue' AS action, q.requeued_by AS by, q.reason,
                jsonb_build_object('from_status', q.from_status, 'attempts_before', q.attempts_before,
                    'last_error', q.last_error) AS detail
            FROM outbox.requeue_log AS q WHERE q.event_id = r.id
            UNION ALL
            SELECT d.id, d.acted_at, d.action, d.acted_by, d.reason, jsonb_build_object('last_error', d.last_error)
            FROM outbox.discard_log AS d WHERE d.event_id = r.id
        ) AS h;
    ELSE
        visible := has_table_privilege(session_user, 'inbox.messages', 'SELECT');
        SELECT doc || jsonb_build_object(
            'envelope', m.envelope - 'payload',
            'headers', m.envelope -> 'headers',
            'payload', CASE WHEN visible THEN m.envelope -> 'payload' END,
            'dlq_metadata', m.dlq_metadata,
            'replay_enabled', coalesce(s.enabled, TRUE),
            -- the notice's place in the DLQ stream (inbox.record_dlq_notice)
            'dlq_stream', m.dlq_metadata -> 'dlq_stream',
            'dlq_stream_sequence', m.dlq_metadata -> 'dlq_stream_sequence'
        ) INTO doc
        FROM inbox.messages AS m
        LEFT JOIN inbox.replay_switches AS s ON s.handler = m.handler
        WHERE m.message_id = r.id AND m.handler = r.handler;
        SELECT coalesce(jsonb_agg(h ORDER BY h.at DESC, h.seq DESC), '[]') INTO history
        FROM (
            SELECT q.id AS seq, q.redriven_at AS at, 'redrive' AS action, q.redriven_by AS by, q.reason,
                jsonb_build_object('replay_attempts_before', q.replay_attempts_before,
                    'last_error', q.last_error) AS detail
            FROM inbox.redrive_log AS q WHERE q.message_id = r.id AND q.handler = r.handler
            UNION ALL
            SELECT d.id, d.acted_at, d.action, d.acted_by, d.reason, jsonb_build_object('last_error', d.last_error)
            FROM inbox.discard_log AS d WHERE d.message_id = r.id AND d.handler = r.handler
        ) AS h;
    END IF;
    RETURN doc || jsonb_build_object('payload_visible', visible, 'history', history);
END;
$$;
COMMENT ON FUNCTION outbox.dlq_show(text, uuid, text) IS
'One dead letter: envelope, headers, payload (for roles that may read the table), attempts, replay state, history.';
-- end generated

-- generated from sql/94_archival_listing.sql: outbox.archivable_partitions
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
            -- discarded events are dead letters too (kept, and restorable)
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
-- end generated

-- generated from sql/95_archival_steps.sql: outbox.seal_partition
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
    -- Index lookups only (events_claimable_idx, events_scheduled_idx,
    -- events_dead_letter_idx, which holds the discarded ones too, the primary
    -- key): claims and marks lock every partition, so they wait for as long
    -- as this transaction holds the lock. No count here.
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM outbox.%1$I WHERE status IN (''PENDING'', ''FAILED'', ''PROCESSING'')'
        ' AND (status <> ''PENDING'' OR claimed_at IS NOT NULL OR ordering_key IS NOT NULL OR available_at <= created_at))'
        ' OR EXISTS (SELECT 1 FROM outbox.%1$I WHERE status = ''PENDING'' AND claimed_at IS NULL'
        ' AND ordering_key IS NULL AND available_at > created_at),'
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
-- end generated

-- A business flow by its correlation id. Built while emit waits (a
-- partitioned table's index cannot be built CONCURRENTLY); partitions
-- indexed beforehand (docs/upgrading.md) are attached, not built again.
CREATE INDEX IF NOT EXISTS events_correlation_idx ON outbox.events (correlation_id, id)
WHERE correlation_id IS NOT NULL;

-- generated from sql/70_flows.sql: outbox.flow
-- One row per event and handler (handler NULL: no handler has received the
-- event yet, or none consumes it). Events come in id order (emit order, which
-- is commit order per ordering key), their handlers in name order; at most
-- max_rows events (the first ones of the flow), served by
-- events_correlation_idx. A discarded dead letter shows as DEAD_LETTER with
-- discarded true, on either side (outbox: a row in outbox.discarded_events).
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
        EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = e.event_id)
        OR coalesce(m.dlq_metadata ? 'discarded', FALSE)
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

REVOKE ALL ON FUNCTION outbox.flow(uuid, integer) FROM public;
GRANT EXECUTE ON FUNCTION outbox.flow(uuid, integer) TO pgoutbox_viewer, pgoutbox_admin;

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

-- An application upcasts in its own transaction too (docs/in-database.md).
GRANT EXECUTE ON FUNCTION inbox.upcast(text, integer, integer, jsonb) TO pgoutbox_writer;

-- ---- fairness: fair claims across tenants

-- Built inside this file's transaction, which holds a lock on outbox.events
-- that blocks writes (emit) while it reads the claimable rows of every
-- partition: docs/upgrading.md says what that costs and when to migrate.
-- Fair claims: the rows of events_claimable_idx that wait (not those in
-- flight, PROCESSING), by tenant, then id, newest first. claim() steps from
-- one tenant with due rows to the next (a loose scan: one descent per
-- tenant, landing on its newest rows, so a tenant with nothing due costs
-- nothing) and takes each tenant's share from its own range. In-flight rows are left out so that neither step walks a
-- backlog's thousands of claimed rows; an expired lease is taken in id
-- order (claim). Events without a tenant are the tenant '' (emit refuses ''
-- as a tenant id). Collation "C": bytewise comparison, cheaper than the
-- database's collation, and any total order will do. No column of
-- outbox.events: claim() returns its row type, and relays of the previous
-- release keep running on a migrated schema.
CREATE INDEX IF NOT EXISTS events_tenant_waiting_idx ON outbox.events ((coalesce(tenant_id, '') COLLATE "C"), id DESC)
WHERE status IN ('PENDING', 'FAILED')
AND (status <> 'PENDING' OR claimed_at IS NOT NULL OR ordering_key IS NOT NULL OR available_at <= created_at);

-- A tenant's weight in fair claims (outbox.set_tenant_weight, admins): its
-- share of a claim that meets several tenants, against 1 for every tenant
-- not listed. tenant_key is the claim's key: '' for events without a tenant.
CREATE TABLE IF NOT EXISTS outbox.tenant_weights (
    tenant_key text COLLATE "C" PRIMARY KEY,
    weight integer NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL,
    CONSTRAINT weight_in_range CHECK (weight BETWEEN 1 AND 1000)
);
COMMENT ON TABLE outbox.tenant_weights IS
'Tenants'' weights in fair claims (1 when not listed); set with outbox.set_tenant_weight().';

-- Every change of a weight: who, when, from what to what, and why.
CREATE TABLE IF NOT EXISTS outbox.tenant_weight_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_key text NOT NULL,
    weight_before integer NOT NULL,
    weight_after integer NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL,
    reason text NOT NULL,
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);
COMMENT ON TABLE outbox.tenant_weight_log IS
'Who changed which tenant''s weight in fair claims, when, from what to what and why.';

-- generated from sql/30_outbox_api.sql: outbox.set_tenant_weight
-- Sets a tenant's weight in fair claims (claim above): a claim that meets
-- several tenants gives each a share of its batch in proportion to its
-- weight, 1 for every tenant not set. tenant_id NULL names the events
-- without a tenant. Weight 1 removes the setting. Every change is written to
-- outbox.tenant_weight_log with the caller and the reason, and logged.
-- Returns the weight it had.
CREATE OR REPLACE FUNCTION outbox.set_tenant_weight(tenant_id text, weight integer, reason text)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    tkey text COLLATE "C" := coalesce(set_tenant_weight.tenant_id, '');
    before integer;
BEGIN
    IF set_tenant_weight.tenant_id IS NOT NULL
        AND (set_tenant_weight.tenant_id ~ '[\r\n]|^\s|\s$|^$' OR length(set_tenant_weight.tenant_id) > 255) THEN
        RAISE EXCEPTION 'INVALID_TENANT: tenant_id % is not one emit accepts (1-255 characters, no CR / LF, no white space at either end)', quote_literal(left(set_tenant_weight.tenant_id, 100))
            USING ERRCODE = 'OB027';
    END IF;
    IF weight IS NULL OR weight < 1 OR weight > 1000 THEN
        RAISE EXCEPTION 'INVALID_TENANT_WEIGHT: weight must be between 1 and 1000, got %', coalesce(weight::text, 'NULL')
            USING ERRCODE = 'OB026';
    END IF;
    PERFORM outbox._check_text(reason, 'a weight''s reason', 1000, TRUE);
    -- one change at a time per tenant, so that the log's before is right
    PERFORM pg_advisory_xact_lock(hashtextextended('pgoutbox.tenant_weight:' || tkey, 0));
    SELECT w.weight INTO before FROM outbox.tenant_weights AS w WHERE w.tenant_key = tkey;
    before := coalesce(before, 1);
    IF weight = 1 THEN
        DELETE FROM outbox.tenant_weights AS w WHERE w.tenant_key = tkey;
    ELSE
        INSERT INTO outbox.tenant_weights AS w (tenant_key, weight, changed_by)
        VALUES (tkey, weight, session_user)
        ON CONFLICT (tenant_key) DO UPDATE
        SET weight = excluded.weight, changed_at = now(), changed_by = excluded.changed_by;
    END IF;
    INSERT INTO outbox.tenant_weight_log (tenant_key, weight_before, weight_after, changed_by, reason)
    VALUES (tkey, before, weight, session_user, reason);
    RAISE LOG 'pgoutbox: tenant % weight % -> % by %: %',
        coalesce(quote_literal(set_tenant_weight.tenant_id), 'NULL (no tenant)'), before, weight, session_user, reason;
    RETURN before;
END;
$$;
COMMENT ON FUNCTION outbox.set_tenant_weight(text, integer, text) IS
'Sets a tenant''s weight (1-1000) in fair claims (admins), audited in outbox.tenant_weight_log.';
-- end generated

REVOKE ALL ON FUNCTION outbox.set_tenant_weight(text, integer, text) FROM public;
GRANT EXECUTE ON FUNCTION outbox.set_tenant_weight(text, integer, text) TO pgoutbox_admin;
GRANT SELECT ON outbox.tenant_weights, outbox.tenant_weight_log TO pgoutbox_admin;

-- ---- emit: a caller's id, a delivery time, a cheap common case

-- The event ids callers gave emit (event_id => ...), one row each, kept for
-- good (a retry after its event was archived is still the same event).
-- Drawn ids (version-4 UUIDs, 122 random bits) are never registered: that
-- every event id is unique then rests on the primary key here for given ids,
-- on chance for drawn ones, and on a given id never being of version 4 (emit
-- refuses one). The INSERT policy trigger registers the id of any other
-- INSERT (an owner's); a dump restores this table with the events, so a
-- restored database keeps the rule. content_md5: what a second emit with the
-- same id must match (outbox._event_fingerprint).
CREATE TABLE IF NOT EXISTS outbox.event_keys (
    event_id uuid PRIMARY KEY,
    content_md5 uuid NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE outbox.event_keys IS
'Event ids given by callers (outbox.emit(event_id => ...)): one event per id, kept for good.';

-- Events emitted with a delivery time (deliver_at, deliver_after), one row
-- each, written by emit only for them: the common case pays nothing. It
-- answers what outbox.events could answer only by a scan or by an index
-- every emit would pay for: when the next one falls due (the relay sleeps
-- until then), how many wait per context (pgoutbox status), and who emitted
-- one (outbox.cancel). A cancelled event's row is deleted.
CREATE TABLE IF NOT EXISTS outbox.schedules (
    event_id uuid PRIMARY KEY,
    created_at timestamptz NOT NULL,
    context text NOT NULL,
    deliver_at timestamptz NOT NULL,
    emitted_by text NOT NULL
);
CREATE INDEX IF NOT EXISTS schedules_deliver_at_idx ON outbox.schedules (deliver_at);
COMMENT ON TABLE outbox.schedules IS
'Events emitted with a delivery time: when each falls due, its context, who emitted it.';

-- Scheduled events waiting for their time leave the claim's id-ordered walk
-- for an index by time of their own (sql/10_outbox_events.sql), and take a
-- new id as they are first claimed (outbox.claim), which the content guard
-- lets through for that move only. Both indexes are built while emit waits
-- (a partitioned table's index cannot be built CONCURRENTLY); they hold
-- only unfinished rows, but the build reads every event kept.
DROP INDEX IF EXISTS outbox.events_claimable_idx;
CREATE INDEX IF NOT EXISTS events_claimable_idx ON outbox.events (id)
WHERE status IN ('PENDING', 'FAILED', 'PROCESSING')
AND (status <> 'PENDING' OR claimed_at IS NOT NULL OR ordering_key IS NOT NULL OR available_at <= created_at);
CREATE INDEX IF NOT EXISTS events_scheduled_idx ON outbox.events (available_at)
WHERE status = 'PENDING' AND claimed_at IS NULL AND ordering_key IS NULL AND available_at > created_at;

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

-- Scheduled events cancelled before they fell due (PENDING -> DEAD_LETTER),
-- written by the update guard itself so that no path around outbox.cancel()
-- escapes it.
CREATE TABLE IF NOT EXISTS outbox.cancel_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id uuid NOT NULL,
    cancelled_at timestamptz NOT NULL DEFAULT now(),
    cancelled_by text NOT NULL,
    reason text NOT NULL,
    deliver_at timestamptz NOT NULL,
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);
COMMENT ON TABLE outbox.cancel_log IS
'Who cancelled which scheduled event, when and why (outbox.cancel).';

-- generated from sql/20_outbox_guards.sql: outbox._event_fingerprint
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

-- generated from sql/15_outbox_wakeup.sql: outbox._wakeup_is_due
-- Whether the next wake-up is due. Not due while the due time lies ahead, by
-- at most the largest throttle (1 minute): a clock set back further cannot
-- mute wake-ups for long. A sequence never set (fresh, or reset by a crash)
-- reads NULL: due. No SET clause and no SECURITY DEFINER, so that it is
-- inlined (it runs inside the policy trigger, under its search_path). A
-- range rather than BETWEEN, which would read the sequence and the clock twice.
-- date_part, not extract: extract's numeric arithmetic cost every emit about
-- 1 µs more (float8 carries today's microseconds since the epoch exactly).
CREATE OR REPLACE FUNCTION outbox._wakeup_is_due()
RETURNS boolean
LANGUAGE sql VOLATILE
AS $$
    SELECT NOT pg_catalog.int8range(1, 60000000, '[]') @> (
        coalesce(pg_catalog.pg_sequence_last_value('outbox.wakeup_due_at'), 0)
        - (pg_catalog.date_part('epoch', pg_catalog.clock_timestamp()) * 1000000)::bigint
    );
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
-- end generated

-- generated from sql/36_outbox_schedules.sql: outbox._delivery_time
-- When an event emitted with deliver_at or deliver_after falls due, checked:
-- one of the two, finite, not more than a minute in the past (a clock a
-- little behind the database's: due now), and at most 366 days ahead (a
-- year of reminders; further is a parked event nobody sees, and it keeps its
-- day's partition from archival meanwhile).
CREATE OR REPLACE FUNCTION outbox._delivery_time(deliver_at timestamptz, deliver_after interval)
RETURNS timestamptz
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    due timestamptz;
BEGIN
    IF deliver_at IS NOT NULL AND deliver_after IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: give deliver_at or deliver_after, not both'
            USING ERRCODE = 'OB006';
    END IF;
    due := coalesce(deliver_at, now() + deliver_after);
    IF NOT isfinite(due) AND due > now() OR due > now() + interval '366 days' THEN
        RAISE EXCEPTION 'DELIVERY_TOO_FAR: delivery time % is more than 366 days ahead', due
            USING ERRCODE = 'OB023';
    END IF;
    IF NOT isfinite(due) OR due < now() - interval '1 minute' THEN
        RAISE EXCEPTION 'DELIVERY_IN_PAST: delivery time % is more than a minute in the past', due
            USING ERRCODE = 'OB022',
                  HINT = 'Leave deliver_at and deliver_after out to deliver at once.';
    END IF;
    RETURN greatest(due, now());
END;
$$;
-- end generated

-- generated from sql/36_outbox_schedules.sql: outbox.emit
-- outbox.emit with three options more (30_outbox_api.sql has the common
-- case): returns the event id.
--
-- event_id: the caller's own id for the event, to retry safely (e.g. a
-- UUIDv5 of its business key, after a commit whose acknowledgement was
-- lost). Emitted again with the same content (outbox._event_fingerprint), it
-- returns the id and writes nothing; with other content, EVENT_ID_CONFLICT.
-- A version-4 id is refused (INVALID_EVENT_ID): those are the ids emit draws,
-- which are not registered (outbox.event_keys). emit registers a given id
-- itself and tells the INSERT policy trigger so (pgoutbox.registered_event_id),
-- which registers the id of any other INSERT: an owner's is held to the same
-- rule.
--
-- deliver_at / deliver_after: the event commits with the business change and
-- is published when due (outbox._delivery_time says which times are taken),
-- not before; it is entered in outbox.schedules, which tells relays when to
-- wake (outbox.next_scheduled) and operators what waits (outbox.scheduled).
-- A scheduled event with an ordering_key holds its key's later events back
-- until it is published, as every unfinished event of a key does.
--
-- Why aggregate_type is character varying here: PostgreSQL refuses a call
-- that two functions with the same types at the given positions could take
-- with their defaults ("is not unique"), and every call of the first
-- signature would match this one too. With one type differing, it chooses:
-- a text or untyped (literal) argument goes to the first signature, whose
-- text is the preferred type of strings; a varchar one comes here, which
-- does the same with the three options left out. Calls that name an option
-- can only come here.
CREATE OR REPLACE FUNCTION outbox.emit(
    aggregate_type character varying,
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
    event_id uuid DEFAULT NULL,
    deliver_at timestamptz DEFAULT NULL,
    deliver_after interval DEFAULT NULL
)
RETURNS uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    new_id uuid := coalesce(emit.event_id, gen_random_uuid());
    ctx text := coalesce(emit.context, nullif(current_setting('pgoutbox.context', true), ''));
    due timestamptz := now();
    fingerprint uuid;
BEGIN
    IF emit.deliver_at IS NOT NULL OR emit.deliver_after IS NOT NULL THEN
        due := outbox._delivery_time(emit.deliver_at, emit.deliver_after);
    END IF;
    -- Per-key order is id order; holding a per-key lock until commit makes id
    -- order equal commit order (30_outbox_api.sql).
    IF emit.ordering_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('pgoutbox.key:' || emit.ordering_key, 0));
    END IF;
    IF emit.event_id IS NOT NULL THEN
        IF substr(emit.event_id::text, 15, 1) = '4' THEN
            RAISE EXCEPTION 'INVALID_EVENT_ID: % is a version-4 (random) UUID, the kind emit draws itself', emit.event_id
                USING ERRCODE = 'OB019',
                      HINT = 'Derive the id from your business key, e.g. a UUIDv5 (uuid_generate_v5, Python''s uuid.uuid5).';
        END IF;
        fingerprint := outbox._event_fingerprint(
            ctx, emit.aggregate_type, emit.aggregate_id, emit.event_type, emit.event_version,
            emit.payload, emit.correlation_id, emit.causation_id, emit.tenant_id, emit.ordering_key
        );
        -- NULL when a required part is missing: the INSERT's policies then
        -- refuse the event with that part's code, before any registering.
        IF fingerprint IS NOT NULL THEN
            IF NOT outbox._register_event_id(new_id, fingerprint) THEN
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
        occurred_at, available_at
    ) VALUES (
        new_id, ctx, emit.aggregate_type, emit.aggregate_id, emit.event_type, emit.event_version,
        emit.payload, emit.headers, emit.correlation_id, emit.causation_id,
        emit.tenant_id, emit.ordering_key, coalesce(emit.occurred_at, now()), due
    );
    IF due > now() THEN
        INSERT INTO outbox.schedules (event_id, created_at, context, deliver_at, emitted_by)
        VALUES (new_id, now(), ctx, due, session_user);
    END IF;
    RETURN new_id;
END;
$$;
COMMENT ON FUNCTION outbox.emit(
    character varying, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz,
    uuid, timestamptz, interval
) IS 'emit with a caller''s event id (safe to retry) and a delivery time (deliver_at or deliver_after).';
-- end generated

-- generated from sql/36_outbox_schedules.sql: outbox.cancel
-- Cancels a scheduled event before it falls due: PENDING -> DEAD_LETTER with
-- last_error 'CANCELLED: reason', written to outbox.cancel_log by the update
-- guard (20_outbox_guards.sql). Only the login that emitted it, or a member
-- of pgoutbox_admin, may. An event that is due already is not cancelled (a
-- relay may be publishing it): NOT_CANCELLABLE, as for an event emitted
-- without a delivery time, unknown, or cancelled already. A cancelled event
-- is a dead letter: outbox.requeue() sends it after all. Returns the
-- delivery time it had.
CREATE OR REPLACE FUNCTION outbox.cancel(event_id uuid, reason text)
RETURNS timestamptz
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    s outbox.schedules;
    moved integer;
BEGIN
    PERFORM outbox._check_text(reason, 'a cancel''s reason', 1000, TRUE);
    IF cancel.event_id IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_id is required' USING ERRCODE = 'OB006';
    END IF;
    SELECT * INTO s FROM outbox.schedules AS x WHERE x.event_id = cancel.event_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'NOT_CANCELLABLE: % is not a scheduled event (unknown, emitted without a delivery time, or cancelled already)', cancel.event_id
            USING ERRCODE = 'OB024';
    END IF;
    IF s.emitted_by <> session_user AND NOT pg_has_role(session_user, 'pgoutbox_admin', 'MEMBER') THEN
        RAISE EXCEPTION 'CANCEL_NOT_ALLOWED: event % was emitted by another login; only it or pgoutbox_admin may cancel it', cancel.event_id
            USING ERRCODE = 'OB025';
    END IF;
    PERFORM set_config('pgoutbox.cancel_reason', reason, true);
    UPDATE outbox.events AS e
    SET status = 'DEAD_LETTER', last_error = outbox._clip_error('CANCELLED: ' || reason)
    WHERE e.event_id = cancel.event_id AND e.created_at = s.created_at
        AND e.status = 'PENDING' AND e.available_at > now();
    GET DIAGNOSTICS moved = ROW_COUNT;
    PERFORM set_config('pgoutbox.cancel_reason', '', true);
    IF moved = 0 THEN
        RAISE EXCEPTION 'NOT_CANCELLABLE: event % is due already (or published, or dead-lettered)', cancel.event_id
            USING ERRCODE = 'OB024';
    END IF;
    DELETE FROM outbox.schedules AS x WHERE x.event_id = cancel.event_id;
    RETURN s.deliver_at;
END;
$$;
COMMENT ON FUNCTION outbox.cancel(uuid, text) IS
'Cancels a scheduled event before it falls due (its emitter or pgoutbox_admin), audited in outbox.cancel_log.';
-- end generated

-- generated from sql/36_outbox_schedules.sql: outbox.scheduled
-- Scheduled events per context: how many wait for their delivery time, and
-- the first and last of those times. Apart from outbox.backlog(), whose
-- unpublished count holds them too: a year of reminders is not an outage.
CREATE OR REPLACE FUNCTION outbox.scheduled(context text DEFAULT NULL)
RETURNS TABLE (
    context text,
    scheduled bigint,
    next_due_at timestamptz,
    last_due_at timestamptz
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(scheduled.context);
    SELECT s.context, count(*), min(s.deliver_at), max(s.deliver_at)
    FROM outbox.schedules AS s
    WHERE s.deliver_at > now()
        AND (scheduled.context IS NULL OR s.context = scheduled.context)
    GROUP BY s.context
    ORDER BY s.context;
$$;
COMMENT ON FUNCTION outbox.scheduled(text) IS
'Per context: events waiting for their delivery time, the next and the last of those times.';
-- end generated

-- generated from sql/36_outbox_schedules.sql: outbox.next_scheduled
-- When the next scheduled event falls due (NULL: none is waiting). The relay
-- asks after a claim that found nothing, and sleeps until then rather than
-- until its next poll: one probe of schedules_deliver_at_idx.
CREATE OR REPLACE FUNCTION outbox.next_scheduled()
RETURNS timestamptz
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT min(s.deliver_at) FROM outbox.schedules AS s WHERE s.deliver_at > now();
$$;
COMMENT ON FUNCTION outbox.next_scheduled() IS
'When the next scheduled event falls due, or NULL; relays sleep until then.';
-- end generated

REVOKE ALL ON FUNCTION
outbox._event_fingerprint(text, text, text, text, integer, jsonb, uuid, uuid, text, text),
outbox._register_event_id(uuid, uuid),
outbox._delivery_time(timestamptz, interval),
outbox.emit(
    character varying, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz,
    uuid, timestamptz, interval
),
outbox.cancel(uuid, text),
outbox.scheduled(text),
outbox.next_scheduled()
FROM public;
-- emit's options, cancelling, and schedules (sql/36_outbox_schedules.sql).
GRANT EXECUTE ON FUNCTION
outbox.emit(
    character varying, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz,
    uuid, timestamptz, interval
),
outbox.cancel(uuid, text)
TO pgoutbox_writer;
GRANT EXECUTE ON FUNCTION outbox.cancel(uuid, text) TO pgoutbox_admin;
GRANT EXECUTE ON FUNCTION outbox.next_scheduled() TO pgoutbox_relay;
GRANT EXECUTE ON FUNCTION outbox.scheduled(text)
TO pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin, pgoutbox_viewer;
GRANT SELECT ON outbox.event_keys, outbox.schedules, outbox.cancel_log TO pgoutbox_admin;

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

-- generated from sql/67_dead_letters.sql: outbox._dlq_enter
-- Writes a dead letter's entry: a new one, or every column of the one it
-- replaces (same side, id and handler), with its error's class and pattern
-- and its group: the md5 of side, owner, subject, class and pattern. The
-- one writer of an entry, under _dlq_enter_event and _dlq_enter_message.
CREATE OR REPLACE FUNCTION outbox._dlq_enter(
    side text, owner text, id uuid, handler text, subject text, tenant text, attempts integer, last_error text,
    seen_at timestamptz, discarded boolean, refailed boolean, replays integer, redrive_pending boolean,
    replayable boolean, row_id bigint, created_at timestamptz
)
RETURNS void
LANGUAGE sql
SET search_path TO pg_catalog, pg_temp
AS $$
    INSERT INTO outbox.dlq_entries (
        side, owner, id, handler, subject, tenant, attempts, last_error, error_class, error_pattern, group_id,
        seen_at, discarded, refailed, replays, redrive_pending, replayable, row_id, created_at
    )
    SELECT
        _dlq_enter.side, _dlq_enter.owner, _dlq_enter.id, _dlq_enter.handler, _dlq_enter.subject,
        _dlq_enter.tenant, _dlq_enter.attempts, _dlq_enter.last_error, c.cls, c.pattern,
        md5(concat_ws(E'\n', _dlq_enter.side, _dlq_enter.owner, _dlq_enter.subject, c.cls, c.pattern)),
        _dlq_enter.seen_at, _dlq_enter.discarded, _dlq_enter.refailed, _dlq_enter.replays,
        _dlq_enter.redrive_pending, _dlq_enter.replayable, _dlq_enter.row_id, _dlq_enter.created_at
    FROM (
        SELECT outbox._dlq_error_class(_dlq_enter.last_error) AS cls,
            outbox._dlq_error_pattern(_dlq_enter.last_error) AS pattern
    ) AS c
    ON CONFLICT ON CONSTRAINT dlq_entries_pkey DO UPDATE
    SET owner = excluded.owner, subject = excluded.subject, tenant = excluded.tenant, attempts = excluded.attempts,
        last_error = excluded.last_error, error_class = excluded.error_class,
        error_pattern = excluded.error_pattern, group_id = excluded.group_id, seen_at = excluded.seen_at,
        discarded = excluded.discarded, refailed = excluded.refailed, replays = excluded.replays,
        redrive_pending = excluded.redrive_pending, replayable = excluded.replayable,
        row_id = excluded.row_id, created_at = excluded.created_at;
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox._dlq_enter_event
-- An outbox event's entry, written or removed as its status says.
CREATE OR REPLACE FUNCTION outbox._dlq_enter_event(e outbox.events)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    n integer;
    discarded boolean;
BEGIN
    IF e.status <> 'DEAD_LETTER' THEN
        DELETE FROM outbox.dlq_entries AS x WHERE x.side = 'outbox' AND x.id = e.event_id AND x.handler = '';
        RETURN;
    END IF;
    SELECT count(*) INTO n FROM outbox.requeue_log AS q WHERE q.event_id = e.event_id AND q.from_status = 'DEAD_LETTER';
    discarded := EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = e.event_id);
    -- A row written around emit may have no subject (the relay dead-letters it
    -- BAD_SUBJECT): its entry says '' rather than fail the relay's mark.
    PERFORM outbox._dlq_enter(
        side => 'outbox', owner => e.context, id => e.event_id, handler => '', subject => coalesce(e.subject, ''),
        tenant => e.tenant_id, attempts => e.attempts, last_error => e.last_error,
        seen_at => coalesce(e.claimed_at, e.created_at), discarded => discarded, refailed => n > 0, replays => n,
        redrive_pending => FALSE, replayable => NOT discarded, row_id => e.id, created_at => e.created_at
    );
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
    asked boolean;
BEGIN
    IF m.status IS DISTINCT FROM 'DEAD_LETTER' THEN
        DELETE FROM outbox.dlq_entries AS x WHERE x.side = 'inbox' AND x.id = m.message_id AND x.handler = m.handler;
        RETURN;
    END IF;
    asked := coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE);
    PERFORM outbox._dlq_enter(
        side => 'inbox', owner => m.handler, id => m.message_id, handler => m.handler, subject => m.subject,
        tenant => m.envelope ->> 'tenant_id', attempts => m.attempts, last_error => m.last_error,
        seen_at => coalesce((m.dlq_metadata ->> 'dead_lettered_at')::timestamptz, m.received_at),
        discarded => m.dlq_metadata ? 'discarded',
        refailed => coalesce((m.dlq_metadata ->> 'dead_letters')::integer, 1) > 1,
        replays => coalesce((m.dlq_metadata ->> 'replay_attempts')::integer, 0)
            + coalesce((m.dlq_metadata ->> 'redrives')::integer, 0),
        redrive_pending => asked,
        replayable => NOT m.dlq_metadata ? 'discarded' AND m.envelope IS NOT NULL
            AND NOT m.dlq_metadata ? 'in_database' AND NOT asked,
        row_id => NULL, created_at => m.received_at
    );
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
WHEN (old.status = 'DEAD_LETTER' OR new.status = 'DEAD_LETTER')
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
    PERFORM outbox._dlq_enter_event(e) FROM outbox.events AS e WHERE e.status = 'DEAD_LETTER';
    PERFORM outbox._dlq_enter_message(m) FROM inbox.messages AS m WHERE m.status = 'DEAD_LETTER';
END;
$$;

-- _dlq_rows returns rows of outbox.dlq_entries now (its columns, no list
-- of its own): a new return type, so it is dropped and made again.
DROP FUNCTION IF EXISTS outbox._dlq_rows(jsonb);
-- generated from sql/67_dead_letters.sql: outbox._dlq_rows
-- Every dead letter the filter matches, both sides, with its group and
-- state: the rows of outbox.dlq_entries, handler NULL for the outbox. Called
-- by the functions below (already checked filter); granted to no one. No
-- SET clause: so that the planner inlines it into its callers (whose
-- search_path is pinned) and uses the entries' indexes for a group, an owner
-- or a time range.
CREATE OR REPLACE FUNCTION outbox._dlq_rows(filter jsonb)
RETURNS SETOF outbox.dlq_entries
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
    -- Its scheduled events' rows (sql/10_outbox_events.sql), all delivered: a
    -- day with a pending scheduled event is not archivable. Else they would
    -- stay for good, a row per reminder ever sent.
    DELETE FROM outbox.schedules AS s
    WHERE s.created_at >= (part_day::timestamp AT TIME ZONE 'UTC')
        AND s.created_at < ((part_day + 1)::timestamp AT TIME ZONE 'UTC');
    UPDATE outbox.archive_audit SET removed_at = now(), removed_by = session_user
    WHERE id = standing.id;
    RETURN standing.row_count;
END;
$$;
COMMENT ON FUNCTION outbox.drop_archived(text, interval) IS
'Drops a sealed, audited day partition whose live count and checksum still match its audit row.';
-- end generated

REVOKE ALL ON FUNCTION
outbox._dlq_enter(
    text, text, uuid, text, text, text, integer, text, timestamptz, boolean, boolean, integer, boolean, boolean,
    bigint, timestamptz
),
outbox._dlq_rows(jsonb),
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
        WHERE e.id = p.row_id AND e.created_at = p.created_at AND e.status = 'DEAD_LETTER'
            AND NOT EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = e.event_id);
        GET DIAGNOSTICS outbox_moved = ROW_COUNT;
        PERFORM set_config('pgoutbox.requeue_reason', '', true);
        RETURN outbox_moved + inbox._redrive(message_ids, handlers, reason, FALSE);
    END IF;
    PERFORM set_config('pgoutbox.dlq_action', action, true);
    PERFORM set_config('pgoutbox.dlq_reason', reason, true);
    IF action = 'discard' THEN
        -- The mark's triggers check the move and write the audit row.
        INSERT INTO outbox.discarded_events (event_id, row_id, created_at)
        SELECT e.event_id, e.id, e.created_at
        FROM outbox.events AS e
        INNER JOIN unnest(row_ids, created) AS p (row_id, created_at)
            ON e.id = p.row_id AND e.created_at = p.created_at
        WHERE e.status = 'DEAD_LETTER'
        ON CONFLICT (event_id) DO NOTHING;
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
        DELETE FROM outbox.discarded_events AS d
        USING unnest(row_ids, created) AS p (row_id, created_at)
        WHERE d.row_id = p.row_id AND d.created_at = p.created_at;
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
    PERFORM outbox._check_dlq_action(action, TRUE);
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
    PERFORM outbox._check_dlq_action(a.action, TRUE);
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

-- ---- one home for each SQL shape: one audited purge, one delete guard, one policy setter,
-- one check of a mark's claim, one check of a dead-letter action,
-- one writer of a command's outcome

-- Definitions that were written twice or three times now share one private
-- helper; every public function keeps its signature, grants, codes and
-- behaviour.

-- generated from sql/05_helpers.sql: outbox._set_policy
-- Sets the one value `setting` of a singleton policy table
-- (outbox.wakeup_policy, inbox.retention_policy, inbox.command_policy: one
-- row, keyed by `singleton`, with a named CHECK on the value) and records
-- who changed it when. The admins' setter checks the value first, with its
-- own code; the table's CHECK stands behind it. Returns the value.
CREATE OR REPLACE FUNCTION outbox._set_policy(policy text, setting text, value interval)
RETURNS interval
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    EXECUTE format(
        'INSERT INTO %s AS p (singleton, %I) VALUES (TRUE, $1)'
        ' ON CONFLICT (singleton) DO UPDATE'
        ' SET %I = excluded.%I, changed_at = now(), changed_by = session_user',
        policy, setting, setting, setting
    ) USING value;
    RETURN value;
END;
$$;
-- end generated

-- generated from sql/15_outbox_wakeup.sql: outbox.set_notify_throttle
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
    RETURN outbox._set_policy('outbox.wakeup_policy', 'notify_throttle', throttle);
END;
$$;
COMMENT ON FUNCTION outbox.set_notify_throttle(interval) IS
'Sets the minimum gap between two wake-ups for every writer (admins); relays read it at start-up.';
-- end generated

-- generated from sql/94_archival_listing.sql: inbox.set_stream_max_age
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
    RETURN outbox._set_policy('inbox.retention_policy', 'stream_max_age', max_age);
END;
$$;
COMMENT ON FUNCTION inbox.set_stream_max_age(interval) IS
'Sets the inbox retention floor to the longest max_age of the streams feeding this inbox (admins).';
-- end generated

-- generated from sql/94_archival_listing.sql: inbox.set_command_retry_window
CREATE OR REPLACE FUNCTION inbox.set_command_retry_window(retry_window interval)
RETURNS interval
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF retry_window IS NULL OR retry_window <= interval '0' OR retry_window > interval '100 years' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: retry_window must be positive and at most 100 years, got %', retry_window
            USING ERRCODE = 'OB006';
    END IF;
    RETURN outbox._set_policy('inbox.command_policy', 'retry_window', retry_window);
END;
$$;
COMMENT ON FUNCTION inbox.set_command_retry_window(interval) IS
'Sets the command retention floor to the longest time a client may retry a command (admins).';
-- end generated

-- generated from sql/50_inbox.sql: inbox.tg_forbid_delete
-- No ad-hoc removal from an inbox table: rows leave only through its audited
-- purge (TG_ARGV[1]), which sets the flag TG_ARGV[0] to 'on' for its own
-- transaction. TRUNCATE never. One guard for inbox.messages (below)
-- and inbox.commands (sql/65_inbox_commands.sql).
CREATE OR REPLACE FUNCTION inbox.tg_forbid_delete()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'TRUNCATE'
        OR current_setting(TG_ARGV[0], true) IS DISTINCT FROM 'on' THEN
        RAISE EXCEPTION 'DELETE_FORBIDDEN: rows leave %.% only by audited archival (%)', TG_TABLE_SCHEMA, TG_TABLE_NAME, TG_ARGV[1]
            USING ERRCODE = 'OB012';
    END IF;
    RETURN NULL;
END;
$$;
-- end generated

CREATE OR REPLACE TRIGGER _100_forbid_delete
BEFORE DELETE ON inbox.messages
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_forbid_delete('pgoutbox.inbox_purge', 'inbox.purge_archived');

CREATE OR REPLACE TRIGGER _100_forbid_truncate
BEFORE TRUNCATE ON inbox.messages
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_forbid_delete('pgoutbox.inbox_purge', 'inbox.purge_archived');

CREATE OR REPLACE TRIGGER _100_forbid_delete
BEFORE DELETE ON inbox.commands
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_forbid_delete('pgoutbox.command_purge', 'inbox.purge_archived_commands');

CREATE OR REPLACE TRIGGER _100_forbid_truncate
BEFORE TRUNCATE ON inbox.commands
FOR EACH STATEMENT EXECUTE FUNCTION inbox.tg_forbid_delete('pgoutbox.command_purge', 'inbox.purge_archived_commands');

DROP FUNCTION IF EXISTS inbox.tg_messages__forbid_delete();
DROP FUNCTION IF EXISTS inbox.tg_commands__forbid_delete();

-- generated from sql/92_archival_helpers.sql: outbox._day_column
-- The column that places a row of an inbox source in its UTC day, and
-- never changes: when inbox.messages received it, when inbox.commands first
-- claimed its key. (outbox.events: its day partition.)
CREATE OR REPLACE FUNCTION outbox._day_column(source text)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT CASE source WHEN 'inbox.messages' THEN 'received_at' WHEN 'inbox.commands' THEN 'first_claimed_at' END;
$$;
-- end generated

-- generated from sql/93_archival_checksum.sql: outbox.archive_figures
-- Live row count and checksum of a unit: the day partition of outbox.events,
-- the rows inbox.messages received that UTC day, or the keys inbox.commands
-- first claimed that UTC day.
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
            'SELECT count(*), coalesce(sum(%s), 0)::numeric FROM %s AS r'
            ' WHERE r.%I >= $1 AND r.%I < $2',
            outbox._row_hash_sql(source), outbox._archive_source(source),
            outbox._day_column(source), outbox._day_column(source)
        ) USING outbox._day_from(day), outbox._day_from(day + 1);
    END IF;
END;
$$;
COMMENT ON FUNCTION outbox.archive_figures(text, date) IS
'Live row count and checksum of one day of outbox.events (its partition), inbox.messages or inbox.commands.';
-- end generated

-- generated from sql/95_archival_steps.sql: inbox._purge_audited
-- Deletes an audited day of an inbox source (its rows by _day_column) in
-- one statement, hashing exactly the rows it deletes (DELETE ... RETURNING),
-- and rolls back unless they match the audit row: a row changed, added or
-- removed since the audit aborts it. The day must be past the source's
-- floor (_check_floor, _check_command_floor); the delete guard lets the rows
-- go while the source's purge flag is on. Already purged: returns 0. The one
-- audited purge of both inbox tables.
CREATE OR REPLACE FUNCTION inbox._purge_audited(source text, day date)
RETURNS bigint
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    messages boolean := source = 'inbox.messages';
    flag text := CASE WHEN messages THEN 'pgoutbox.inbox_purge' ELSE 'pgoutbox.command_purge' END;
    standing outbox.archive_audit;
    n bigint;
    sum_hash numeric;
BEGIN
    PERFORM outbox._check_day(day);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key(source, day));
    standing := outbox._standing_audit(source, day);
    IF standing.removed_at IS NOT NULL THEN
        RETURN 0;
    END IF;
    IF messages THEN
        PERFORM inbox._check_floor(day);
    ELSE
        PERFORM inbox._check_command_floor(day);
    END IF;
    PERFORM set_config(flag, 'on', true);
    EXECUTE format(
        'WITH gone AS (DELETE FROM %s AS d'
        ' WHERE d.%I >= $1 AND d.%I < $2 RETURNING d.*)'
        ' SELECT count(*), coalesce(sum(%s), 0)::numeric FROM gone AS r',
        outbox._archive_source(source), outbox._day_column(source), outbox._day_column(source),
        outbox._row_hash_sql(source)
    ) INTO n, sum_hash USING outbox._day_from(day), outbox._day_from(day + 1);
    PERFORM set_config(flag, '', true);
    IF (n, sum_hash) IS DISTINCT FROM (standing.row_count, standing.checksum) THEN
        RAISE EXCEPTION 'ARCHIVE_MISMATCH: % day % changed since audit %',
            CASE WHEN messages THEN 'inbox' ELSE 'command' END, day, standing.id
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
-- end generated

-- generated from sql/95_archival_steps.sql: inbox.purge_archived
-- Deletes an audited inbox day whose deleted rows hash exactly to its audit
-- row, all or nothing (_purge_audited). Already purged: returns 0.
CREATE OR REPLACE FUNCTION inbox.purge_archived(day date)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT inbox._purge_audited('inbox.messages', day);
$$;
COMMENT ON FUNCTION inbox.purge_archived(date) IS
'Deletes an audited inbox day whose deleted rows hash exactly to its audit row; all or nothing.';
-- end generated

-- generated from sql/95_archival_steps.sql: inbox.purge_archived_commands
-- Deletes an audited day of command keys like purge_archived does an inbox
-- day (_purge_audited): a key claimed again since the audit aborts it. A
-- claim waiting on a deleted key claims it afresh (claim_command). Already
-- purged: returns 0.
CREATE OR REPLACE FUNCTION inbox.purge_archived_commands(day date)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT inbox._purge_audited('inbox.commands', day);
$$;
COMMENT ON FUNCTION inbox.purge_archived_commands(date) IS
'Deletes an audited day of command keys whose deleted rows hash exactly to its audit row; all or nothing.';
-- end generated

-- generated from sql/30_outbox_api.sql: outbox._check_claim
-- What a relay's mark (mark_published, mark_failed, hand_back) names: its
-- claim's token and the ids of the events it marks (_check_ids).
CREATE OR REPLACE FUNCTION outbox._check_claim(claim_token uuid, event_ids uuid[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF claim_token IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: claim_token is required' USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_ids(event_ids, 'event_ids');
END;
$$;
-- end generated

-- generated from sql/30_outbox_api.sql: outbox._stale_claim
-- A mark that found none of the given events still held by its claim: the
-- lease expired and another relay re-claimed them (mark_published's error
-- says so; a relay that gets it from mark_failed or hand_back has nothing
-- left to undo either).
CREATE OR REPLACE FUNCTION outbox._stale_claim(claim_token uuid, event_ids uuid[], with_hint boolean)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF with_hint THEN
        RAISE EXCEPTION 'STALE_CLAIM: claim % holds none of the % given events', claim_token, cardinality(event_ids)
            USING ERRCODE = 'OB013',
                  HINT = 'The lease expired and another relay re-claimed them; it will publish them (deduplicated by Nats-Msg-Id).';
    END IF;
    RAISE EXCEPTION 'STALE_CLAIM: claim % holds none of the % given events', claim_token, cardinality(event_ids)
        USING ERRCODE = 'OB013';
END;
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox._check_dlq_action
-- An action of the dead-letter functions: replay, discard or restore
-- (OB106 otherwise). With may_act, also that session_user may run it: its
-- grant is that of the action's own function (outbox.dlq_replay, ...), so
-- only a role that may act by filter may prepare or take an action's
-- targets (42501 otherwise).
CREATE OR REPLACE FUNCTION outbox._check_dlq_action(action text, may_act boolean)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF action IS NULL OR action NOT IN ('replay', 'discard', 'restore') THEN
        RAISE EXCEPTION 'INVALID_ACTION: action must be replay, discard or restore, got %', quote_literal(left(coalesce(action, 'NULL'), 50))
            USING ERRCODE = 'OB106';
    END IF;
    IF may_act AND NOT has_function_privilege(
        session_user, format('outbox.dlq_%s(jsonb, text, integer)', action), 'EXECUTE'
    ) THEN
        RAISE EXCEPTION 'permission denied for function dlq_%', action USING ERRCODE = '42501';
    END IF;
END;
$$;
-- end generated

-- generated from sql/67_dead_letters.sql: outbox.dlq_count
-- The exact number of rows an action would touch now, over all its batches.
CREATE OR REPLACE FUNCTION outbox.dlq_count(
    filter jsonb DEFAULT '{}'::jsonb,
    action text DEFAULT 'replay'
)
RETURNS bigint
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_dlq_filter(filter);
    PERFORM outbox._check_dlq_action(action, FALSE);
    RETURN (SELECT count(*) FROM outbox._dlq_targets(filter, action));
END;
$$;
COMMENT ON FUNCTION outbox.dlq_count(jsonb, text) IS
'How many dead letters outbox.dlq_replay / dlq_discard / dlq_restore would touch for this filter (all batches).';
-- end generated

-- generated from sql/65_inbox_commands.sql: inbox._settle_command
-- Settles a claimed command: IN_PROGRESS -> DONE with its result, or FAILED
-- with its error (clipped like every recorded error), and returns the row;
-- any other move is refused (_refuse_command_move). The one writer of a
-- command's outcome, under complete_command and fail_command.
CREATE OR REPLACE FUNCTION inbox._settle_command(
    handler text, command_key text, status text, result jsonb, error text
)
RETURNS inbox.commands
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.commands;
BEGIN
    UPDATE inbox.commands AS c
    SET status = _settle_command.status,
        result = CASE WHEN _settle_command.status = 'DONE' THEN _settle_command.result ELSE c.result END,
        last_error = CASE
            WHEN _settle_command.status = 'FAILED' THEN outbox._clip_error(_settle_command.error) ELSE c.last_error
        END,
        settled_at = greatest(now(), c.claimed_at)
    WHERE c.handler = _settle_command.handler AND c.command_key = _settle_command.command_key
        AND c.status = 'IN_PROGRESS'
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_command_move(handler, command_key, status);
    END IF;
    RETURN row;
END;
$$;
-- end generated

-- generated from sql/65_inbox_commands.sql: inbox.complete_command
-- Stores a claimed command's result: IN_PROGRESS -> DONE. Every later claim
-- returns this result. At most 1 MiB of JSON: it is an answer, not a store.
CREATE OR REPLACE FUNCTION inbox.complete_command(handler text, command_key text, result jsonb)
RETURNS inbox.commands
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_command(handler, command_key);
    IF result IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: a result is required (JSON null is one)' USING ERRCODE = 'OB006';
    END IF;
    IF octet_length(result::text) > 1048576 THEN
        RAISE EXCEPTION 'VALUE_TOO_LARGE: result is % bytes of JSON, more than 1048576 (1 MiB)', octet_length(result::text)
            USING ERRCODE = 'OB009';
    END IF;
    RETURN inbox._settle_command(handler, command_key, 'DONE', result, NULL);
END;
$$;
COMMENT ON FUNCTION inbox.complete_command(text, text, jsonb) IS
'IN_PROGRESS -> DONE with the command''s result, which every later claim returns.';
-- end generated

-- generated from sql/65_inbox_commands.sql: inbox.fail_command
-- Records that a claimed command's work failed: IN_PROGRESS -> FAILED. The
-- next claim of the key claims it again (a retry runs the command again).
-- Also the way out for a command left IN_PROGRESS by a crash between two
-- transactions (claim committed, work never finished).
CREATE OR REPLACE FUNCTION inbox.fail_command(handler text, command_key text, error text)
RETURNS inbox.commands
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM inbox._check_command(handler, command_key);
    IF nullif(btrim(error), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: an error text is required' USING ERRCODE = 'OB006';
    END IF;
    RETURN inbox._settle_command(handler, command_key, 'FAILED', NULL, error);
END;
$$;
COMMENT ON FUNCTION inbox.fail_command(text, text, text) IS
'IN_PROGRESS -> FAILED with an error; the next claim of the key claims it again.';
-- end generated

REVOKE ALL ON FUNCTION
inbox._settle_command(text, text, text, jsonb, text),
outbox._check_claim(uuid, uuid[]),
outbox._stale_claim(uuid, uuid[], boolean),
outbox._check_dlq_action(text, boolean),
outbox._set_policy(text, text, interval),
inbox.tg_forbid_delete(),
inbox._purge_audited(text, date),
outbox._day_column(text)
FROM public;

-- ---- one home for each SQL shape, outbox and archival side: one range
-- check, one set of guard triggers

-- The row limit, page size, retention and lock timeout checks share one
-- range check; the guard triggers of outbox.events, the archive's audit and
-- seal tables, inbox.messages and inbox.commands are attached by one
-- function (the triggers themselves are those of version 17, unchanged).

-- generated from sql/05_helpers.sql: outbox._check_range
-- A bounded argument (a row limit, a page size, a retention, a lock
-- timeout): given, and from low to high, both included; `range` says so in
-- the error.
CREATE OR REPLACE FUNCTION outbox._check_range(
    what text, value anycompatible, low anycompatible, high anycompatible, range text
)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF value IS NULL OR value < low OR value > high THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: % must be %, got %', what, range, value
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;
-- end generated

-- generated from sql/05_helpers.sql: outbox._check_max_rows
-- A listing's row limit.
CREATE OR REPLACE FUNCTION outbox._check_max_rows(max_rows integer)
RETURNS void
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_range('max_rows', max_rows, 1, 10000, 'between 1 and 10000');
$$;
-- end generated

-- generated from sql/92_archival_helpers.sql: outbox._check_retention
-- Retentions: from 0 to 100 years (now() - retention must stay a time).
CREATE OR REPLACE FUNCTION outbox._check_retention(retention interval, what text)
RETURNS void
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_range(what, retention, interval '0', interval '100 years', 'an interval from 0 to 100 years');
$$;
-- end generated

-- generated from sql/92_archival_helpers.sql: outbox._check_lock_timeout
-- A lock_timeout argument: from 1 ms (PostgreSQL reads 0 as "wait for ever")
-- to 1 hour.
CREATE OR REPLACE FUNCTION outbox._check_lock_timeout(lock_timeout interval)
RETURNS void
LANGUAGE sql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_range(
        'lock_timeout', lock_timeout, interval '1 millisecond', interval '1 hour', 'an interval from 1 ms to 1 hour'
    );
$$;
-- end generated

-- generated from sql/05_helpers.sql: outbox._attach_guards
-- Attaches the guard triggers that keep rows in a table, one set written
-- once here rather than as CREATE TRIGGER statements repeated per table
-- (outbox.events and its default partition, the archive's audit and seal
-- tables, inbox.messages, inbox.commands):
--   _100_guard_update     BEFORE UPDATE, each row: update_guard, if given;
--   _100_forbid_delete    BEFORE DELETE, each ROW or once per STATEMENT
--                         (delete_per): delete_guard; none when delete_per
--                         is NULL (a partition has its parent's row trigger);
--   _100_forbid_truncate  BEFORE TRUNCATE: delete_guard.
-- A guard is a trigger function's call, with its arguments. CREATE OR
-- REPLACE: a re-run of the install leaves one set.
CREATE OR REPLACE FUNCTION outbox._attach_guards(
    tbl regclass,
    delete_guard text,
    delete_per text,
    update_guard text DEFAULT NULL
)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF update_guard IS NOT NULL THEN
        EXECUTE format(
            'CREATE OR REPLACE TRIGGER _100_guard_update BEFORE UPDATE ON %s FOR EACH ROW EXECUTE FUNCTION %s',
            tbl, update_guard
        );
    END IF;
    IF delete_per IS NOT NULL THEN
        EXECUTE format(
            'CREATE OR REPLACE TRIGGER _100_forbid_delete BEFORE DELETE ON %s FOR EACH %s EXECUTE FUNCTION %s',
            tbl, delete_per, delete_guard
        );
    END IF;
    EXECUTE format(
        'CREATE OR REPLACE TRIGGER _100_forbid_truncate BEFORE TRUNCATE ON %s FOR EACH STATEMENT EXECUTE FUNCTION %s',
        tbl, delete_guard
    );
END;
$$;
-- end generated

-- ---- one home for each SQL shape, the inbox side: one writer of an
-- inbox redrive, one writer of a dead letter's entry

-- inbox.redrive and outbox.dlq_replay (by filter or as a prepared action)
-- ask for a redrive through one writer, inbox._redrive, with the same rows,
-- audit rows and results as before.
-- generated from sql/60_inbox_replay.sql: inbox._redrive
-- Asks the replayer for the named dead letters (parallel arrays: message id
-- and handler) now: due at once, redrive_requested, each audited in
-- inbox.redrive_log with session_user and reason. A row that is no longer a
-- live dead letter (settled meanwhile, or discarded) is passed by, and so,
-- unless again, is one already asked for. Returns how many it asked for.
-- The one writer of a redrive: inbox.redrive (checked beforehand, all or
-- nothing) and outbox.dlq_replay / dlq_act (sql/67_dead_letters.sql).
CREATE OR REPLACE FUNCTION inbox._redrive(message_ids uuid[], handlers text[], reason text, again boolean)
RETURNS integer
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    moved integer;
BEGIN
    WITH marked AS (
        UPDATE inbox.messages AS m
        SET dlq_metadata = m.dlq_metadata
            || jsonb_build_object('redrive_requested', TRUE, 'next_replay_at', now())
        FROM unnest(message_ids, handlers) AS p (message_id, handler)
        WHERE m.message_id = p.message_id AND m.handler = p.handler
            AND m.status = 'DEAD_LETTER'
            AND NOT m.dlq_metadata ? 'discarded'
            AND (again OR NOT coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE))
        RETURNING m.message_id, m.handler, m.dlq_metadata, m.last_error
    )
    INSERT INTO inbox.redrive_log (
        message_id, handler, redriven_by, reason, replay_attempts_before, last_error
    )
    SELECT
        k.message_id, k.handler, session_user, _redrive.reason,
        coalesce((k.dlq_metadata ->> 'replay_attempts')::integer, 0), k.last_error
    FROM marked AS k;
    GET DIAGNOSTICS moved = ROW_COUNT;
    RETURN moved;
END;
$$;
-- end generated

REVOKE ALL ON FUNCTION
outbox._check_range(text, anycompatible, anycompatible, anycompatible, text),
outbox._attach_guards(regclass, text, text, text)
FROM public;

-- generated from sql/60_inbox_replay.sql: inbox.redrive
-- Operator redrive: the given dead letters of handler (all of them but the
-- discarded when message_ids is NULL; a discarded one named is refused,
-- OB101) become due now, whatever the replay switch and cap
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
    live_ids uuid [];
    live_handlers text [];
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
    -- A discarded dead letter is redriven only once restored (NULL ids pass it by).
    IF bad IS NULL THEN
        SELECT array_agg(x.id) INTO bad
        FROM unnest(message_ids) AS x (id)
        INNER JOIN inbox.messages AS m ON m.message_id = x.id AND m.handler = redrive.handler
        WHERE m.dlq_metadata ? 'discarded';
        IF bad IS NOT NULL THEN
            RAISE EXCEPTION 'DISCARDED: % of the given messages are discarded for handler %', cardinality(bad), handler
                USING ERRCODE = 'OB101', DETAIL = array_to_string(bad, ', '),
                      HINT = 'Restore them first (outbox.dlq_restore).';
        END IF;
    END IF;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'MESSAGE_NOT_DEAD_LETTER: % of the given messages are unknown or not DEAD_LETTER for handler %', cardinality(bad), handler
            USING ERRCODE = 'OB030', DETAIL = array_to_string(bad, ', ');
    END IF;
    SELECT array_agg(m.message_id) INTO bad
    FROM inbox.messages AS m
    WHERE m.handler = redrive.handler AND m.status = 'DEAD_LETTER'
        AND NOT m.dlq_metadata ? 'discarded'
        AND (m.envelope IS NULL OR m.dlq_metadata ? 'in_database')
        AND (redrive.message_ids IS NULL OR m.message_id = ANY(redrive.message_ids));
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'MESSAGE_NOT_REPLAYABLE: % of the messages were written by an in-database handler or have no stored envelope to re-publish', cardinality(bad)
            USING ERRCODE = 'OB031', DETAIL = array_to_string(bad, ', '),
                  HINT = 'Rows written by in-database handlers are redriven by their own application.';
    END IF;
    -- Every live dead letter named (NULL ids: of the handler), asked for
    -- again if it already was.
    SELECT array_agg(m.message_id), array_agg(m.handler) INTO live_ids, live_handlers
    FROM inbox.messages AS m
    WHERE m.handler = redrive.handler
        AND m.status = 'DEAD_LETTER'
        AND NOT m.dlq_metadata ? 'discarded'
        AND (redrive.message_ids IS NULL OR m.message_id = ANY(redrive.message_ids));
    RETURN inbox._redrive(live_ids, live_handlers, reason, TRUE);
END;
$$;
COMMENT ON FUNCTION inbox.redrive(text, uuid[], text) IS
'Makes dead letters of a handler due for re-publication now (NULL ids: all), audited in inbox.redrive_log.';
-- end generated

REVOKE ALL ON FUNCTION inbox._redrive(uuid[], text[], text, boolean) FROM public;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (18, '0018_steady_under_faults')
ON CONFLICT (version) DO NOTHING;

COMMIT;
