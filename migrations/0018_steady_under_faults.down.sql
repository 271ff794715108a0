-- 0018_steady_under_faults (down): back to version 17.
--
-- What it cannot undo: nothing is lost.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 18) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

-- ---- broker faults

DROP FUNCTION IF EXISTS outbox.hand_back(uuid, uuid[], text);

-- The update guard of version 17, without the hand-back branch.
-- Every status move the trigger's WHEN clause (below) lets through: a no-op,
-- an operator requeue (of a dead letter, or of a COMPLETED event whose
-- message the broker lost), or an illegal move.
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

-- ---- upcasters

-- inbox._upcast_all as 0017 has it (OTHERS only).
-- The chains of several payloads (event_types[k] v versions[k] ->
-- to_version, payloads[k]; ords[k] names them in the result), without
-- raising: (ordinal, payload, NULL), or (ordinal, NULL, why) for a missing
-- step, a step that raised or returned no JSON object, or an upcaster no
-- longer valid. The why starts with the code's name and number: it becomes
-- the dead letter's last_error. Step by step, each step applied to every
-- payload that needs it in one statement (one subtransaction); when that
-- statement raises, the step is applied one payload at a time, so that only
-- the payloads it raises on fail.
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
        EXCEPTION WHEN OTHERS THEN
            results := NULL;
        END;
        IF results IS NULL THEN
            results := '{}';
            FOREACH k IN ARRAY idx LOOP
                BEGIN
                    EXECUTE format('SELECT %s($1)', fn::oid::regproc) INTO one USING done[k];
                EXCEPTION WHEN OTHERS THEN
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

-- ---- held snapshots

-- ---- backfill
-- The role pgoutbox_backfiller stays (roles are cluster-wide: other
-- databases of the cluster may use it); it loses what it was granted here.

DROP FUNCTION IF EXISTS outbox.backfill_span(text[], timestamptz, timestamptz);
DROP FUNCTION IF EXISTS outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer);
DROP FUNCTION IF EXISTS outbox._check_backfill(text[], timestamptz, timestamptz, integer);
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgoutbox_backfiller') THEN
        REVOKE EXECUTE ON FUNCTION
        outbox.schema_version(), outbox.serves_workers_from(),
        inbox.receive(uuid, text, text, jsonb),
        inbox.mark_processed(uuid, text),
        inbox.record_error(uuid, text, text, boolean, interval)
        FROM pgoutbox_backfiller;
        REVOKE USAGE ON SCHEMA outbox, inbox FROM pgoutbox_backfiller;
    END IF;
END;
$$;

-- ---- the console

DELETE FROM outbox.schema_migrations
WHERE version = 18;

COMMIT;
