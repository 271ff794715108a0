-- The testing kit's assertions on the events a statement emits (docs/testing.md).
--
--     SELECT pgoutbox_tap.emits($$SELECT shop.place_order('c-1', 5)$$, 'order_created', '{"total": 5}');
--     SELECT pgoutbox_tap.emits_exactly(1, $$SELECT shop.place_order('c-1', 5)$$, 'order_created');
--     SELECT pgoutbox_tap.emits_nothing($$SELECT shop.cancel_order('no-such-order')$$);
--     SELECT pgoutbox_tap.emitted_in_order(
--         $$SELECT shop.pay_order(shop.place_order('c-1', 5))$$, ARRAY['order_created', 'order_paid']
--     );
--
-- Each assertion runs its statement (SQL text, or the name of a prepared
-- statement, as pgTAP's own), looks at the events that statement emitted and
-- is one test of the plan; it fails, with a diagnostic naming what was
-- expected and what was emitted, when they differ or when the statement
-- raises. The events stay in the test's transaction, which rolls them back.
--
-- Installed with `pgoutbox testing install-tap` (from the wheel),
-- `CREATE EXTENSION pgoutbox_tap` (docs/extension.md), or included with \i
-- inside a test's transaction (a checkout or the sdist). The assertions need
-- pgTAP; high_water() and emitted_since(), which the pytest plugin
-- (pgoutbox.testing) uses, need nothing but pgoutbox.

CREATE SCHEMA IF NOT EXISTS pgoutbox_tap;
GRANT USAGE ON SCHEMA pgoutbox_tap TO public;

-- The newest event id written so far: a capture starts there. Events of the
-- caller's transaction emitted later get higher ids (one identity sequence).
CREATE OR REPLACE FUNCTION pgoutbox_tap.high_water()
RETURNS bigint
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT coalesce(max(e.id), 0) FROM outbox.events AS e;
$$;

-- The events the calling transaction wrote itself (its own rows, not yet
-- committed) with an id above `since`, in emit order. A row not yet
-- committed is visible to no other transaction than the one that wrote it,
-- so a row seen here whose xmin is still in progress is the caller's own:
-- this shows a role nothing but what it emitted, hence EXECUTE for every
-- role. xmin is a 32-bit xid and pg_xact_status() takes the 64-bit one: the
-- rows above `since` were written moments ago, so their xids lie within
-- 2^31 of the caller's own (pg_current_xact_id_if_assigned(), NULL when the
-- caller wrote nothing), and each is taken as the 64-bit xid nearest it.
CREATE OR REPLACE FUNCTION pgoutbox_tap.emitted_since(since bigint)
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
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    WITH own AS (
        SELECT pg_current_xact_id_if_assigned()::text::bigint AS top
    ),

    recent AS (
        SELECT
            e.*,
            ((o.top >> 32) << 32) + e.xmin::text::bigint - o.top AS ahead
        FROM outbox.events AS e
        INNER JOIN own AS o ON o.top IS NOT NULL
        WHERE e.id > emitted_since.since
    ),

    placed AS (
        SELECT
            r.*,
            o.top + r.ahead - CASE
                WHEN r.ahead >= 2147483648 THEN 4294967296
                WHEN r.ahead < -2147483648 THEN -4294967296
                ELSE 0
            END AS xid64
        FROM recent AS r
        CROSS JOIN own AS o
    )

    SELECT
        p.id, p.event_id, p.subject, p.context, p.aggregate_type, p.aggregate_id, p.event_type,
        p.event_version, p.payload, p.headers, p.correlation_id, p.causation_id, p.tenant_id,
        p.ordering_key, p.occurred_at, p.created_at
    FROM placed AS p
    WHERE p.xid64 >= 0 AND pg_xact_status(p.xid64::text::xid8) = 'in progress'
    ORDER BY p.id;
$$;

-- Runs `statement` and returns what it emitted, as a JSON array in emit
-- order, or the error it raised ('[SQLSTATE] message') with events NULL.
CREATE OR REPLACE FUNCTION pgoutbox_tap._emitted_by(statement text, OUT events jsonb, OUT error text)
LANGUAGE plpgsql
AS $$
DECLARE
    mark bigint := pgoutbox_tap.high_water();
BEGIN
    -- A bare name is a prepared statement, as in pgTAP's own assertions.
    IF statement ~ '^\s*[A-Za-z_][A-Za-z_0-9]*\s*$' THEN
        EXECUTE 'EXECUTE ' || statement;
    ELSE
        EXECUTE statement;
    END IF;
    SELECT coalesce(
        jsonb_agg(
            jsonb_build_object('event_type', e.event_type, 'payload', e.payload, 'ordering_key', e.ordering_key)
            ORDER BY e.id
        ),
        '[]'::jsonb
    )
    INTO events
    FROM pgoutbox_tap.emitted_since(mark) AS e;
EXCEPTION WHEN OTHERS THEN
    events := NULL;
    error := format('[%s] %s', SQLSTATE, SQLERRM);
END;
$$;

-- The diagnostic of a failed assertion: what was expected, then every
-- event the statement emitted (type, payload cut at 200 characters, key),
-- or the error it raised.
CREATE OR REPLACE FUNCTION pgoutbox_tap._shown(expected text, events jsonb, error text)
RETURNS text
LANGUAGE sql
IMMUTABLE
AS $$
    SELECT format(E'expected: %s\n', expected)
        || CASE
            WHEN error IS NOT NULL THEN 'raised:   ' || error
            WHEN jsonb_array_length(events) = 0 THEN 'emitted:  nothing'
            ELSE format('emitted:  %s event(s)', jsonb_array_length(events)) || (
                SELECT string_agg(
                    format(
                        E'\n    %s %s%s',
                        ev ->> 'event_type',
                        CASE
                            WHEN length((ev -> 'payload')::text) > 200 THEN left((ev -> 'payload')::text, 200) || '...'
                            ELSE (ev -> 'payload')::text
                        END,
                        coalesce(' (ordering_key ' || (ev ->> 'ordering_key') || ')', '')
                    ),
                    '' ORDER BY n
                )
                FROM jsonb_array_elements(events) WITH ORDINALITY AS x (ev, n)
            )
        END;
$$;

-- How many of `events` are of event_type with a payload containing payload_contains (jsonb @>).
CREATE OR REPLACE FUNCTION pgoutbox_tap._matching(events jsonb, event_type text, payload_contains jsonb)
RETURNS integer
LANGUAGE sql
IMMUTABLE
AS $$
    SELECT count(*)::integer
    FROM jsonb_array_elements(coalesce(events, '[]'::jsonb)) AS ev
    WHERE ev ->> 'event_type' = _matching.event_type AND ev -> 'payload' @> _matching.payload_contains;
$$;

CREATE OR REPLACE FUNCTION pgoutbox_tap._wanted(event_type text, payload_contains jsonb)
RETURNS text
LANGUAGE sql
IMMUTABLE
AS $$
    SELECT event_type || CASE
        WHEN payload_contains = '{}'::jsonb THEN ''
        ELSE ' whose payload contains ' || payload_contains::text
    END;
$$;

-- ok when `statement` emits at least one event_type whose payload contains payload_contains.
CREATE OR REPLACE FUNCTION pgoutbox_tap.emits(
    statement text,
    event_type text,
    payload_contains jsonb DEFAULT '{}'::jsonb,
    description text DEFAULT NULL
)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    got record := pgoutbox_tap._emitted_by(statement);
    wanted text := pgoutbox_tap._wanted(event_type, payload_contains);
    passed boolean := pgoutbox_tap._matching(got.events, event_type, payload_contains) > 0;
BEGIN
    RETURN ok(passed, coalesce(description, 'emits ' || wanted))
        || CASE
            WHEN passed THEN ''
            ELSE E'\n' || diag(pgoutbox_tap._shown('an event ' || wanted, got.events, got.error))
        END;
END;
$$;

-- ok when `statement` emits exactly n events of event_type whose payload contains payload_contains.
CREATE OR REPLACE FUNCTION pgoutbox_tap.emits_exactly(
    n integer,
    statement text,
    event_type text,
    payload_contains jsonb DEFAULT '{}'::jsonb,
    description text DEFAULT NULL
)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    got record := pgoutbox_tap._emitted_by(statement);
    wanted text := pgoutbox_tap._wanted(event_type, payload_contains);
    passed boolean := got.error IS NULL AND pgoutbox_tap._matching(got.events, event_type, payload_contains) = n;
BEGIN
    RETURN ok(passed, coalesce(description, format('emits exactly %s %s', n, wanted)))
        || CASE
            WHEN passed THEN ''
            ELSE E'\n' || diag(pgoutbox_tap._shown(format('exactly %s event(s) %s', n, wanted), got.events, got.error))
        END;
END;
$$;

-- ok when `statement` runs and emits no event at all.
CREATE OR REPLACE FUNCTION pgoutbox_tap.emits_nothing(statement text, description text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    got record := pgoutbox_tap._emitted_by(statement);
    passed boolean := got.error IS NULL AND jsonb_array_length(got.events) = 0;
BEGIN
    RETURN ok(passed, coalesce(description, 'emits nothing'))
        || CASE WHEN passed THEN '' ELSE E'\n' || diag(pgoutbox_tap._shown('no event', got.events, got.error)) END;
END;
$$;

-- ok when the event types `statement` emits, in emit order (the order a
-- consumer gets the events of one ordering key in), are event_types, no
-- more and no fewer.
CREATE OR REPLACE FUNCTION pgoutbox_tap.emitted_in_order(
    statement text,
    event_types text[],
    description text DEFAULT NULL
)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    got record := pgoutbox_tap._emitted_by(statement);
    emitted text[];
    passed boolean;
BEGIN
    SELECT coalesce(array_agg(ev ->> 'event_type' ORDER BY n), '{}')
    INTO emitted
    FROM jsonb_array_elements(coalesce(got.events, '[]'::jsonb)) WITH ORDINALITY AS x (ev, n);
    passed := got.error IS NULL AND emitted = event_types;
    RETURN ok(passed, coalesce(description, 'emits ' || array_to_string(event_types, ', ') || ' in this order'))
        || CASE
            WHEN passed THEN ''
            ELSE E'\n' || diag(pgoutbox_tap._shown(
                array_to_string(event_types, ', ') || ', in this order', got.events, got.error
            ))
        END;
END;
$$;
