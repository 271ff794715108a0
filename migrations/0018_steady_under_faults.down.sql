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

-- ---- the console

DELETE FROM outbox.schema_migrations
WHERE version = 18;

COMMIT;
