-- The INSERT policies' fast path and what lies beside it (sql/20_outbox_guards.sql,
-- sql/15_outbox_wakeup.sql): the trigger runs without a SET clause, so what
-- it does must not depend on the caller's search_path.
-- Scenarios:
--   * a row the fast test cannot tell about and no rule refuses (a
--     schema_version of ten digits) is written, and its drawn id is not
--     registered in outbox.event_keys
--   * its neighbour just past the bound is refused, INVALID_SCHEMA_VERSION (OB005)
--   * emit under a caller's search_path that puts another schema first gets
--     the same subject and the same refusals
--   * the wake-up test says due on a never-set throttle and not due inside
--     the interval just set
-- emit runs as pgoutbox_writer; the reads of event_keys as pgoutbox_admin.
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(8);

CREATE FUNCTION pg_temp.emit_as(payload jsonb)
RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
    got uuid;
BEGIN
    SET LOCAL ROLE pgoutbox_writer;
    got := outbox.emit('order', '1', 'created', payload, context => 'sea');
    RESET ROLE;
    RETURN got;
END;
$$;
CREATE TEMP TABLE emitted (event_id uuid);
GRANT SELECT ON emitted TO pgoutbox_admin;
INSERT INTO emitted SELECT pg_temp.emit_as('{"schema_version": 2147483647}');

SET LOCAL ROLE pgoutbox_admin;
SELECT is(
    (SELECT count(*) FROM outbox.events AS e INNER JOIN emitted AS m ON e.event_id = m.event_id),
    1::bigint,
    'a ten-digit schema_version within the bound is written'
);
SELECT is(
    (SELECT count(*) FROM outbox.event_keys AS k INNER JOIN emitted AS m ON k.event_id = m.event_id),
    0::bigint,
    'and its drawn id is not registered'
);
RESET ROLE;

SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 2147483648}', context => 'sea')$$,
    'OB005',
    NULL,
    'one past the bound is refused: INVALID_SCHEMA_VERSION'
);

-- A schema of the caller's own, first on its path, with a || of its own
-- (text || text): the trigger still builds the subject with pg_catalog's.
RESET ROLE;
CREATE SCHEMA fast_path_shadow;
CREATE FUNCTION fast_path_shadow.cat(a text, b text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$ SELECT 'shadowed' $$;
CREATE OPERATOR fast_path_shadow.|| (LEFTARG = text, RIGHTARG = text, FUNCTION = fast_path_shadow.cat);  -- noqa: PRS
GRANT USAGE ON SCHEMA fast_path_shadow TO pgoutbox_writer;
CREATE TEMP TABLE shadowed (subject text, refused text);
GRANT INSERT, UPDATE ON shadowed TO pgoutbox_writer;
CREATE FUNCTION pg_temp.emit_shadowed() RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    got uuid;
BEGIN
    SET LOCAL ROLE pgoutbox_writer;
    SET LOCAL search_path TO fast_path_shadow, pg_catalog;
    got := outbox.emit('order', '2', 'shipped', '{"schema_version": 1}', context => 'sea', event_version => 3);
    INSERT INTO pg_temp.shadowed (refused) VALUES (NULL);
    BEGIN
        PERFORM outbox.emit('order', ' 1', 'created', '{"schema_version": 1}', context => 'sea');
    EXCEPTION WHEN OTHERS THEN
        UPDATE pg_temp.shadowed SET refused = SQLSTATE;
    END;
    RESET search_path;
    RESET ROLE;
    UPDATE pg_temp.shadowed SET subject = (SELECT e.subject FROM outbox.events AS e WHERE e.event_id = got);
END;
$$;
SELECT pg_temp.emit_shadowed();
SELECT is(
    (SELECT subject FROM shadowed),
    'sea.event.shipped.v3',
    'a caller''s search_path with an operator of its own first: the subject as always'
);
SELECT is(
    (SELECT refused FROM shadowed),
    'OB006',
    'and the same refusal: INVALID_ARGUMENT for white space at the start of aggregate_id'
);

-- The wake-up test (inlined into the trigger): due when never set, not due
-- within the interval just set, due again once it is over.
SELECT setval('outbox.wakeup_due_at', 1, false);
SELECT ok(outbox._wakeup_is_due(), 'a throttle never set: a wake-up is due');
SELECT setval('outbox.wakeup_due_at', (extract(epoch FROM clock_timestamp() + interval '10 seconds') * 1000000)::bigint);
SELECT ok(NOT outbox._wakeup_is_due(), 'ten seconds before the due time: not due');
SELECT setval('outbox.wakeup_due_at', (extract(epoch FROM clock_timestamp() - interval '1 millisecond') * 1000000)::bigint);
SELECT ok(outbox._wakeup_is_due(), 'a millisecond after it: due');

SELECT * FROM finish();
ROLLBACK;
