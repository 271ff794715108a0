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

-- Why a function cannot be an upcaster, or NULL when it can.
CREATE OR REPLACE FUNCTION inbox._upcaster_problem(upcaster regprocedure)
RETURNS text
LANGUAGE sql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT CASE
        WHEN p.oid IS NULL THEN 'it does not exist'
        WHEN p.prokind <> 'f' THEN 'it is not a plain function'
        WHEN p.pronargs <> 1 OR p.proargtypes[0] <> 'jsonb'::regtype
            OR p.prorettype <> 'jsonb'::regtype OR p.proretset THEN 'its signature is not (jsonb) -> jsonb'
        WHEN p.provolatile = 'v' THEN 'it is VOLATILE; declare it IMMUTABLE or STABLE'
    END
    FROM (SELECT _upcaster_problem.upcaster::oid AS oid) AS given
    LEFT JOIN pg_proc AS p ON p.oid = given.oid;
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

-- The chain from_version -> to_version, without raising: (payload, NULL),
-- or (NULL, why) for a missing step or a step that raised or returned no
-- JSON object. The why starts with the code's name and number: it becomes
-- the dead letter's last_error. One subtransaction for the whole chain.
CREATE OR REPLACE FUNCTION inbox._upcast(
    event_type text,
    from_version integer,
    to_version integer,
    payload jsonb,
    OUT result jsonb,
    OUT error text
)
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    v integer := from_version;
    fn regprocedure;
    step jsonb;
BEGIN
    result := payload;
    IF from_version > to_version THEN
        result := NULL;
        error := format('UPCAST_MISSING [OB071]: %s v%s is newer than v%s; upcasters only go up', event_type, from_version, to_version);
        RETURN;
    END IF;
    BEGIN
        WHILE v < to_version LOOP
            SELECT u.upcaster INTO fn FROM inbox.upcasters AS u
            WHERE u.event_type = _upcast.event_type AND u.from_version = v;
            IF NOT FOUND THEN
                result := NULL;
                error := format('UPCAST_MISSING [OB071]: no upcaster for %s v%s -> v%s (chain v%s -> v%s)', event_type, v, v + 1, from_version, to_version);
                RETURN;
            END IF;
            EXECUTE format('SELECT %s($1)', fn::oid::regproc) INTO step USING result;
            IF jsonb_typeof(step) IS DISTINCT FROM 'object' THEN
                result := NULL;
                error := format('UPCAST_FAILED [OB072]: %s v%s -> v%s: %s returned %s, not a JSON object', event_type, v, v + 1, fn, coalesce(jsonb_typeof(step), 'NULL'));
                RETURN;
            END IF;
            result := step;
            v := v + 1;
        END LOOP;
    EXCEPTION WHEN OTHERS THEN
        result := NULL;
        error := format('UPCAST_FAILED [OB072]: %s v%s -> v%s: %s raised [%s] %s', event_type, v, v + 1, coalesce(fn::text, '?'), SQLSTATE, left(SQLERRM, 500));
    END;
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
    IF event_type IS NULL OR from_version IS NULL OR to_version IS NULL
        OR from_version < 1 OR to_version < 1 OR jsonb_typeof(payload) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: an event type, versions from 1 and a JSON object payload are required'
            USING ERRCODE = 'OB006';
    END IF;
    got := inbox._upcast(event_type, from_version, to_version, payload);
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
DECLARE
    r record;
    subject text;
    got record;
BEGIN
    IF to_version IS NULL OR to_version NOT BETWEEN 1 AND 999999999 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: to_version must be between 1 and 999999999, got %', coalesce(to_version::text, 'NULL')
            USING ERRCODE = 'OB006';
    END IF;
    FOR r IN
        SELECT * FROM inbox.receive_batch(
            receive_batch_as.handler, receive_batch_as.message_ids, receive_batch_as.subjects,
            receive_batch_as.envelopes
        )
    LOOP
        ordinal := r.ordinal;
        message_id := r.message_id;
        status := r.status;
        attempts := r.attempts;
        last_error := r.last_error;
        dlq_metadata := r.dlq_metadata;
        subject := receive_batch_as.subjects[r.ordinal];
        event_version := substring(subject FROM '^[^.]+\.event\.[^.]+\.v([1-9][0-9]{0,8})$')::integer;
        upcast_payload := NULL;
        upcast_error := NULL;
        IF r.status IN ('RECEIVED', 'FAILED') THEN
            IF event_version IS NULL THEN
                upcast_error := format('UPCAST_MISSING [OB071]: subject %s names no event type and version', subject);
            ELSIF event_version <> to_version THEN
                got := inbox._upcast(
                    split_part(subject, '.', 3), event_version, to_version,
                    receive_batch_as.envelopes[r.ordinal] -> 'payload'
                );
                upcast_payload := got.result::text;
                upcast_error := got.error;
            END IF;
        END IF;
        RETURN NEXT;
    END LOOP;
END;
$$;
COMMENT ON FUNCTION inbox.receive_batch_as(text, uuid[], text[], jsonb[], integer) IS
'receive_batch() plus, for each message to process, its payload upcast to to_version or why it cannot be.';
