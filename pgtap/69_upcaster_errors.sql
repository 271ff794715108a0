-- Any error of an upcaster is that message's own outcome
-- (inbox._upcast_all, sql/66_upcasters.sql), as the consumer role calls it.
-- Scenarios:
--   * receive_batch_as, one fetch of six as pgoutbox_consumer: the upcaster
--     fails with an ASSERT (P0004) on one payload, a RAISE with a custom
--     SQLSTATE on another, a division by zero on a third, a RAISE with
--     SQLSTATE 57014 on a fourth (a fetch of one); each of those comes back
--     with its own UPCAST_FAILED naming the code and the text, the others
--     upcast, every message recorded
--   * a statement_timeout while the upcaster of a one-message call runs is
--     that message's UPCAST_FAILED [57014]
--   * inbox.upcast() (in-database handlers) raises OB072 for an ASSERT
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(7);

CREATE SCHEMA app;
-- Fails on {"n": 3} with an ASSERT, {"n": 4} with a custom SQLSTATE, {"n": 5}
-- with a division by zero, {"n": 6} with 57014 raised by hand.
CREATE FUNCTION app.picky(p jsonb) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    ASSERT (p ->> 'n')::integer <> 3, 'three is not allowed';
    IF (p ->> 'n')::integer = 4 THEN
        RAISE EXCEPTION 'four is not allowed' USING ERRCODE = 'AB123';
    END IF;
    IF (p ->> 'n')::integer = 6 THEN
        RAISE EXCEPTION 'six cancels' USING ERRCODE = 'query_canceled';
    END IF;
    RETURN p || jsonb_build_object('inverse', 1 / ((p ->> 'n')::integer - 5));
END $$;
-- Sleeps on {"slow": true}: STABLE as declared, so it registers.
CREATE FUNCTION app.slow(p jsonb) RETURNS jsonb
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p ? 'slow' THEN PERFORM pg_sleep(10); END IF;
    RETURN p;
END $$;
SELECT inbox.register_upcaster('reading_taken', 1, 'app.picky(jsonb)');
SELECT inbox.register_upcaster('reading_slow', 1, 'app.slow(jsonb)');

SET LOCAL ROLE pgoutbox_consumer;
CREATE TEMP TABLE got AS
SELECT * FROM inbox.receive_batch_as(
    'meter',
    (SELECT array_agg(gen_random_uuid()) FROM generate_series(1, 5)),
    array_fill('sea.event.reading_taken.v1'::text, ARRAY[5]),
    ARRAY[
        '{"payload": {"n": 1}}', '{"payload": {"n": 3}}', '{"payload": {"n": 4}}', '{"payload": {"n": 5}}',
        '{"payload": {"n": 7}}'
    ]::jsonb[],
    2
);
SELECT results_eq(
    $$SELECT ordinal, upcast_payload::jsonb FROM got WHERE upcast_error IS NULL ORDER BY ordinal$$,
    $$VALUES (1, '{"n": 1, "inverse": 0}'::jsonb), (5, '{"n": 7, "inverse": 0}'::jsonb)$$,
    'the messages the upcaster does not fail on come back upcast'
);
SELECT is(
    (
        SELECT upcast_error FROM got
        WHERE ordinal = 2
    ),
    'UPCAST_FAILED [OB072]: reading_taken v1 -> v2: app.picky(jsonb) raised [P0004] three is not allowed',
    'an ASSERT is that message''s UPCAST_FAILED, with its SQLSTATE and text'
);
SELECT is(
    (
        SELECT upcast_error FROM got
        WHERE ordinal = 3
    ),
    'UPCAST_FAILED [OB072]: reading_taken v1 -> v2: app.picky(jsonb) raised [AB123] four is not allowed',
    'a RAISE with a custom SQLSTATE is that message''s UPCAST_FAILED'
);
SELECT is(
    (
        SELECT upcast_error FROM got
        WHERE ordinal = 4
    ),
    'UPCAST_FAILED [OB072]: reading_taken v1 -> v2: app.picky(jsonb) raised [22012] division by zero',
    'a division by zero is that message''s UPCAST_FAILED'
);
SELECT is(
    (
        SELECT upcast_error FROM inbox.receive_batch_as(
            'meter', ARRAY[gen_random_uuid()], ARRAY['sea.event.reading_taken.v1'],
            ARRAY['{"payload": {"n": 6}}']::jsonb[], 2
        )
    ),
    'UPCAST_FAILED [OB072]: reading_taken v1 -> v2: app.picky(jsonb) raised [57014] six cancels',
    'a 57014 in a one-message call is that message''s UPCAST_FAILED (with several, the consumer calls each alone)'
);
SET LOCAL statement_timeout = '300ms';
SELECT is(
    (
        SELECT upcast_error FROM inbox.receive_batch_as(
            'meter', ARRAY[gen_random_uuid()], ARRAY['sea.event.reading_slow.v1'],
            ARRAY['{"payload": {"slow": true}}']::jsonb[], 2
        )
    ),
    'UPCAST_FAILED [OB072]: reading_slow v1 -> v2: app.slow(jsonb) raised [57014] '
    || 'canceling statement due to statement timeout',
    'a statement_timeout while the upcaster of a one-message call runs is that message''s UPCAST_FAILED'
);
RESET statement_timeout;
SELECT throws_ok(
    $$SELECT inbox.upcast('reading_taken', 1, 2, '{"n": 3}')$$, 'OB072', NULL,
    'inbox.upcast: an ASSERT is UPCAST_FAILED (OB072), not P0004'
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
