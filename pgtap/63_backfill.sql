-- The backfill's reads of the outbox (sql/68_backfill.sql) and its role.
-- Scenarios:
--   * backfill_page returns the events of the given subjects in the range,
--     in id order, above after_id, at most page_size, whatever their status,
--     but a scheduled event not yet due, and the later events of its key
--   * backfill_span counts them and gives the first and last created_at and
--     the oldest created_at the outbox keeps
--   * bad arguments are refused with OB006
--   * pgoutbox_backfiller calls both and the inbox calls it needs, and reads
--     no table; other roles may not call the backfill functions
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(14);

SELECT outbox.create_partitions(2, (now() AT TIME ZONE 'UTC')::date - 1);
SELECT outbox.emit('order', 'a', 'order_created', '{"schema_version": 1, "n": 1}', 'shop', ordering_key => 'a');
SELECT outbox.emit('order', 'b', 'order_created', '{"schema_version": 1, "n": 2}', 'shop', ordering_key => 'b');
SELECT outbox.emit('order', 'a', 'order_paid', '{"schema_version": 1, "n": 3}', 'shop', ordering_key => 'a');
SELECT outbox.emit('user', 'u', 'user_joined', '{"schema_version": 1, "n": 4}', 'shop');

CREATE TEMP TABLE subjects AS SELECT ARRAY['shop.event.order_created.v1', 'shop.event.order_paid.v1'] AS s;
GRANT SELECT ON subjects TO public;

SELECT results_eq(
    $$SELECT (payload ->> 'n')::int FROM outbox.backfill_page(
        (SELECT s FROM subjects), now() - interval '1 day', now() + interval '1 day', 0, 100)$$,
    ARRAY[1, 2, 3],
    'backfill_page returns the handler''s subjects in id order'
);
SELECT results_eq(
    $$SELECT (payload ->> 'n')::int FROM outbox.backfill_page((SELECT s FROM subjects), now() - interval '1 day',
        now() + interval '1 day', (SELECT min(id) FROM outbox.events), 1)$$,
    ARRAY[2],
    'after_id and page_size page through them'
);
SELECT is_empty(
    $$SELECT * FROM outbox.backfill_page(
        (SELECT s FROM subjects), now() + interval '1 hour', now() + interval '1 day', 0, 100)$$,
    'events created outside the range are not returned'
);
SELECT results_eq(
    $$SELECT events, first_at = now(), last_at = now(), kept_from = now()
      FROM outbox.backfill_span((SELECT s FROM subjects), now() - interval '1 day', now() + interval '1 day')$$,
    $$VALUES (3::bigint, TRUE, TRUE, TRUE)$$,
    'backfill_span counts them, with the first and last created_at and the oldest kept'
);

SELECT throws_ok(
    $$SELECT * FROM outbox.backfill_page('{}', now(), now() + interval '1 day', 0, 10)$$,
    'OB006', NULL, 'no subject is refused'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.backfill_page((SELECT s FROM subjects), now(), now(), 0, 10)$$,
    'OB006', NULL, 'an empty range is refused'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.backfill_page((SELECT s FROM subjects), now(), now() + interval '1 day', 0, 10001)$$,
    'OB006', NULL, 'a page over 10000 is refused'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.backfill_span((SELECT s FROM subjects), now(), NULL)$$,
    'OB006', NULL, 'a range without an end is refused'
);

SET LOCAL ROLE pgoutbox_backfiller;
SELECT results_eq(
    $$SELECT count(*) FROM outbox.backfill_page((SELECT s FROM subjects), now() - interval '1 day',
        now() + interval '1 day', 0, 100)$$,
    ARRAY[3::bigint],
    'pgoutbox_backfiller reads a page'
);
SELECT throws_ok('SELECT count(*) FROM outbox.events', '42501', NULL, 'but no table');
RESET ROLE;
SELECT ok(
    has_function_privilege('pgoutbox_backfiller', 'inbox.receive(uuid, text, text, jsonb)', 'EXECUTE')
    AND has_function_privilege('pgoutbox_backfiller', 'inbox.mark_processed(uuid, text)', 'EXECUTE')
    AND has_function_privilege(
        'pgoutbox_backfiller', 'inbox.record_error(uuid, text, text, boolean, interval)', 'EXECUTE'
    )
    AND NOT has_function_privilege('pgoutbox_backfiller', 'inbox.claim_replays(text, integer)', 'EXECUTE'),
    'pgoutbox_backfiller records deliveries in the inbox, and nothing more of the consumer''s calls'
);
SELECT ok(
    NOT has_function_privilege(
        'pgoutbox_consumer', 'outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer)', 'EXECUTE'
    )
    AND NOT has_function_privilege(
        'pgoutbox_writer', 'outbox.backfill_span(text[], timestamptz, timestamptz)', 'EXECUTE'
    ),
    'other roles may not read the outbox through the backfill functions'
);

-- A scheduled event not yet due is no history yet: left out, with the later
-- events of its key (the stream brings them once it is published).
SELECT outbox.emit(
    'order'::varchar, 'c', 'order_created', '{"schema_version": 1, "n": 5}', 'shop', ordering_key => 'c',
    deliver_after => interval '1 hour'
);
SELECT outbox.emit('order', 'c', 'order_paid', '{"schema_version": 1, "n": 6}', 'shop', ordering_key => 'c');
SELECT outbox.emit(
    'order'::varchar, 'd', 'order_created', '{"schema_version": 1, "n": 7}', 'shop', deliver_after => interval '1 day'
);
SELECT outbox.emit('order', 'b', 'order_paid', '{"schema_version": 1, "n": 8}', 'shop', ordering_key => 'b');
SELECT results_eq(
    $$SELECT (payload ->> 'n')::int FROM outbox.backfill_page(
        (SELECT s FROM subjects), now() - interval '1 day', now() + interval '1 day', 0, 100)$$,
    ARRAY[1, 2, 3, 8],
    'scheduled events not yet due, and the later events of their key, are left out of a page'
);
SELECT is(
    (
        SELECT events
        FROM outbox.backfill_span((SELECT s FROM subjects), now() - interval '1 day', now() + interval '1 day')
    ),
    5::bigint,
    'backfill_span leaves the scheduled events out of its count (a held-back successor is counted)'
);

SELECT * FROM finish();
ROLLBACK;
