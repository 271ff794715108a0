-- Upcasters: SQL functions (jsonb) -> jsonb, each turning version n of an
-- event type's payload into version n + 1, registered here by an
-- application's own migration. A handler that declares the version it wants
-- gets every older payload through the chain n -> n + 1 -> ... in the same
-- call that records its fetch (inbox.receive_batch_as); in-database handlers
-- and tests call inbox.upcast().
--
-- An upcaster runs inside SECURITY DEFINER functions, as the owner of the
-- pgoutbox schema, with search_path pg_catalog, pg_temp: only
-- pgoutbox_admin registers one, it must be IMMUTABLE or STABLE (a replayed
-- message is upcast again and must come out the same), and it qualifies the
-- names it uses (or sets its own search_path).

CREATE TABLE IF NOT EXISTS inbox.upcasters (
    event_type text NOT NULL,
    from_version integer NOT NULL,
    to_version integer GENERATED ALWAYS AS (from_version + 1) STORED,
    upcaster regprocedure NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    registered_by text NOT NULL DEFAULT session_user,
    CONSTRAINT upcasters_pkey PRIMARY KEY (event_type, from_version),
    -- The event_type token of {context}.event.{event_type}.v{version}.
    CONSTRAINT event_type_is_named CHECK (event_type ~ '^[A-Za-z0-9_-]{1,128}$'),
    -- A subject's version has at most 9 digits: the last step ends at 999999999.
    CONSTRAINT from_version_is_in_range CHECK (from_version BETWEEN 1 AND 999999998)
);
COMMENT ON TABLE inbox.upcasters IS
'One step per row: upcaster(payload of event_type v from_version) = payload of v from_version + 1.';

-- Why a function cannot be an upcaster, or NULL when it can. Checked when
-- it is registered and again before each use (a function can be altered
-- since): a function that is not SECURITY DEFINER runs as the owner of the
-- inbox schema, so it must be owned by that owner (or a superuser), else an
-- admin could run code of their own with the owner's rights.
-- plpgsql, not sql: its plan is kept for the session (it runs for each
-- step of each fetch).
CREATE OR REPLACE FUNCTION inbox._upcaster_problem(upcaster regprocedure)
RETURNS text
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    p record;
    schema_owner oid;
BEGIN
    SELECT f.prokind, f.pronargs, f.proargtypes, f.prorettype, f.proretset, f.provolatile, f.prosecdef, f.proowner
    INTO p
    FROM pg_proc AS f WHERE f.oid = upcaster;
    IF NOT FOUND THEN
        RETURN 'it does not exist';
    ELSIF p.prokind <> 'f' THEN
        RETURN 'it is not a plain function';
    ELSIF p.pronargs <> 1 OR p.proargtypes[0] <> 'jsonb'::regtype
        OR p.prorettype <> 'jsonb'::regtype OR p.proretset THEN
        RETURN 'its signature is not (jsonb) -> jsonb';
    ELSIF p.provolatile = 'v' THEN
        RETURN 'it is VOLATILE; declare it IMMUTABLE or STABLE';
    ELSIF p.prosecdef THEN
        RETURN NULL;  -- runs as its own owner
    END IF;
    SELECT n.nspowner INTO schema_owner FROM pg_namespace AS n WHERE n.nspname = 'inbox';
    IF p.proowner = schema_owner
        OR (SELECT r.rolsuper FROM pg_roles AS r WHERE r.oid = p.proowner) THEN
        RETURN NULL;
    END IF;
    RETURN format(
        'it would run as %s, the owner of schema inbox, but is owned by %s: make it SECURITY DEFINER, or owned by %s',
        pg_get_userbyid(schema_owner), pg_get_userbyid(p.proowner), pg_get_userbyid(schema_owner)
    );
END;
$$;

-- Registers (or replaces) the step event_type v from_version -> v from_version + 1.
CREATE OR REPLACE FUNCTION inbox.register_upcaster(
    event_type text,
    from_version integer,
    upcaster regprocedure
)
RETURNS inbox.upcasters
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    problem text;
    row inbox.upcasters;
BEGIN
    IF event_type IS NULL OR event_type !~ '^[A-Za-z0-9_-]{1,128}$' THEN
        RAISE EXCEPTION 'INVALID_UPCASTER: event type % is not 1-128 letters, digits, _ -', quote_nullable(left(event_type, 150))
            USING ERRCODE = 'OB070';
    END IF;
    IF from_version IS NULL OR from_version NOT BETWEEN 1 AND 999999998 THEN
        RAISE EXCEPTION 'INVALID_UPCASTER: from_version must be between 1 and 999999998, got %', coalesce(from_version::text, 'NULL')
            USING ERRCODE = 'OB070';
    END IF;
    problem := coalesce(inbox._upcaster_problem(upcaster), CASE WHEN upcaster IS NULL THEN 'none is given' END);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_UPCASTER: % cannot upcast % v%: %', coalesce(upcaster::text, 'NULL'), event_type, from_version, problem
            USING ERRCODE = 'OB070';
    END IF;
    INSERT INTO inbox.upcasters AS u (event_type, from_version, upcaster)
    VALUES (register_upcaster.event_type, register_upcaster.from_version, register_upcaster.upcaster)
    ON CONFLICT ON CONSTRAINT upcasters_pkey DO UPDATE
    SET upcaster = excluded.upcaster, registered_at = now(), registered_by = session_user
    RETURNING * INTO row;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.register_upcaster(text, integer, regprocedure) IS
'Registers (or replaces) the upcaster of event_type v from_version -> v from_version + 1: a (jsonb) -> jsonb function.';

CREATE OR REPLACE FUNCTION inbox.unregister_upcaster(event_type text, from_version integer)
RETURNS inbox.upcasters
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.upcasters;
BEGIN
    DELETE FROM inbox.upcasters AS u
    WHERE u.event_type = unregister_upcaster.event_type AND u.from_version = unregister_upcaster.from_version
    RETURNING * INTO row;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'UNKNOWN_UPCASTER: no upcaster for % v%', coalesce(event_type, 'NULL'), coalesce(from_version::text, 'NULL')
            USING ERRCODE = 'OB073';
    END IF;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.unregister_upcaster(text, integer) IS
'Removes the upcaster of event_type v from_version -> v from_version + 1.';

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

-- The payload of event_type v from_version as v to_version (itself when the
-- versions are equal). Raises UPCAST_MISSING (OB071) or UPCAST_FAILED
-- (OB072), naming the event type and the step. For in-database handlers,
-- the replayer and an application's tests.
CREATE OR REPLACE FUNCTION inbox.upcast(
    event_type text,
    from_version integer,
    to_version integer,
    payload jsonb
)
RETURNS jsonb
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    got record;
BEGIN
    IF nullif(event_type, '') IS NULL OR from_version IS NULL OR to_version IS NULL
        OR from_version < 1 OR to_version < 1 OR jsonb_typeof(payload) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: an event type, versions from 1 and a JSON object payload are required'
            USING ERRCODE = 'OB006';
    END IF;
    SELECT * INTO got
    FROM inbox._upcast_all(ARRAY[1], ARRAY[event_type], ARRAY[from_version], to_version, ARRAY[payload]);
    IF got.error IS NOT NULL THEN
        RAISE EXCEPTION '%', got.error
            USING ERRCODE = CASE WHEN got.error LIKE 'UPCAST_MISSING%' THEN 'OB071' ELSE 'OB072' END;
    END IF;
    RETURN got.result;
END;
$$;
COMMENT ON FUNCTION inbox.upcast(text, integer, integer, jsonb) IS
'A payload from v from_version to v to_version through the registered upcasters (OB071 missing, OB072 failed).';

-- The registered versions of event_type whose chain does not reach
-- to_version, and the first step missing from it. No row: every registered
-- version reaches it (pgoutbox_tap.upcasters_reach() asserts that).
CREATE OR REPLACE FUNCTION inbox.upcast_gaps(event_type text, to_version integer)
RETURNS TABLE (from_version integer, missing_from integer)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT s.from_version, min(v.v)::integer
    FROM inbox.upcasters AS s
    CROSS JOIN LATERAL generate_series(s.from_version, upcast_gaps.to_version - 1) AS v (v)
    WHERE s.event_type = upcast_gaps.event_type AND s.from_version < upcast_gaps.to_version
        AND NOT EXISTS (
            SELECT FROM inbox.upcasters AS u
            WHERE u.event_type = upcast_gaps.event_type AND u.from_version = v.v
                AND inbox._upcaster_problem(u.upcaster) IS NULL
        )
    GROUP BY s.from_version
    ORDER BY s.from_version;
$$;
COMMENT ON FUNCTION inbox.upcast_gaps(text, integer) IS
'Registered versions of an event type whose chain does not reach to_version, with the first missing step.';

-- receive_batch() for a handler that wants every payload as version
-- to_version: the same rows, and for each message to process (RECEIVED or
-- FAILED) whose subject is older, the upcast payload (JSON text, numbers as
-- given) or why it cannot be upcast (that message's own dead letter). One
-- call, one round trip: the chain runs where the fetch is recorded.
-- event_version: the version the message came in at (its subject's).
CREATE OR REPLACE FUNCTION inbox.receive_batch_as(
    handler text,
    message_ids uuid[],
    subjects text[],
    envelopes jsonb[],
    to_version integer
)
RETURNS TABLE (
    ordinal integer,
    message_id uuid,
    status text,
    attempts integer,
    last_error text,
    dlq_metadata jsonb,
    event_version integer,
    upcast_payload text,
    upcast_error text
)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF to_version IS NULL OR to_version NOT BETWEEN 1 AND 999999999 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: to_version must be between 1 and 999999999, got %', coalesce(to_version::text, 'NULL')
            USING ERRCODE = 'OB006';
    END IF;
    RETURN QUERY
    WITH received AS MATERIALIZED (
        SELECT
            r.*,
            substring(s.subject FROM '^[^.]+\.event\.[^.]+\.v([1-9][0-9]{0,8})$')::integer AS v,
            nullif(split_part(s.subject, '.', 3), '') AS et
        FROM inbox.receive_batch(
            receive_batch_as.handler, receive_batch_as.message_ids, receive_batch_as.subjects,
            receive_batch_as.envelopes
        ) AS r
        CROSS JOIN LATERAL (SELECT receive_batch_as.subjects[r.ordinal] AS subject) AS s
    ),
    todo AS MATERIALIZED (
        SELECT
            array_agg(t.ordinal ORDER BY t.ordinal) AS ords,
            array_agg(t.et ORDER BY t.ordinal) AS ets,
            array_agg(t.v ORDER BY t.ordinal) AS vs,
            array_agg(receive_batch_as.envelopes[t.ordinal] -> 'payload' ORDER BY t.ordinal) AS payloads
        FROM received AS t
        WHERE t.status IN ('RECEIVED', 'FAILED') AND t.v IS DISTINCT FROM receive_batch_as.to_version
    ),
    upcast AS (
        SELECT u.*
        FROM todo
        CROSS JOIN LATERAL inbox._upcast_all(
            todo.ords, todo.ets, todo.vs, receive_batch_as.to_version, todo.payloads
        ) AS u
        WHERE todo.ords IS NOT NULL
    )
    SELECT
        r.ordinal, r.message_id, r.status, r.attempts, r.last_error, r.dlq_metadata, r.v,
        u.result::text, u.error
    FROM received AS r
    LEFT JOIN upcast AS u ON u.ordinal = r.ordinal
    ORDER BY r.ordinal;
END;
$$;
COMMENT ON FUNCTION inbox.receive_batch_as(text, uuid[], text[], jsonb[], integer) IS
'receive_batch() plus, for each message to process, its payload upcast to to_version or why it cannot be.';
