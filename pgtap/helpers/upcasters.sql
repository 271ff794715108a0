-- pgTAP helpers for an application's upcasters (needs the pgtap extension).
-- Include it in a test file, inside its transaction, after plan():
--
--     \i path/to/pgoutbox/pgtap/helpers/upcasters.sql
--     SELECT pgoutbox_tap.upcasters_reach('order_created', 2);
--     SELECT pgoutbox_tap.upcasts_to(
--         'order_created', 1, 2, '{"amount": 5}', '{"total": 5}'
--     );
--
-- Each is one test of the plan. Rolled back with the test's transaction.

CREATE SCHEMA IF NOT EXISTS pgoutbox_tap;

-- ok when every registered version of event_type reaches to_version through
-- registered, valid upcasters; otherwise not ok, with one diagnostic line
-- per version whose chain is broken (inbox.upcast_gaps()).
CREATE OR REPLACE FUNCTION pgoutbox_tap.upcasters_reach(
    event_type text,
    to_version integer,
    description text DEFAULT NULL
)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    gaps text;
BEGIN
    SELECT string_agg(format('v%s stops at v%s -> v%s', g.from_version, g.missing_from, g.missing_from + 1), E'\n')
    INTO gaps
    FROM inbox.upcast_gaps(upcasters_reach.event_type, upcasters_reach.to_version) AS g;
    RETURN ok(gaps IS NULL, coalesce(description, format('every registered version of %s reaches v%s', event_type, to_version)))
        || CASE WHEN gaps IS NULL THEN '' ELSE E'\n' || diag(gaps) END;
END;
$$;

-- is(): the sample payload of event_type v from_version, upcast to
-- to_version, equals expected. A chain that raises is not ok, with the
-- error (code and message) as the diagnostic.
CREATE OR REPLACE FUNCTION pgoutbox_tap.upcasts_to(
    event_type text,
    from_version integer,
    to_version integer,
    sample jsonb,
    expected jsonb,
    description text DEFAULT NULL
)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    what text := coalesce(description, format('%s v%s upcasts to the expected v%s', event_type, from_version, to_version));
BEGIN
    RETURN is(inbox.upcast(event_type, from_version, to_version, sample), expected, what);
EXCEPTION WHEN OTHERS THEN
    RETURN ok(FALSE, what) || E'\n' || diag(format('[%s] %s', SQLSTATE, SQLERRM));
END;
$$;
