-- The outbox API checks every argument before it acts (docs/reference.md, "Limits"):
-- bad ones are refused with a code, never with a PostgreSQL error class.
-- Scenarios:
--   * claim: worker NULL, blank or over 256 characters; lease NULL, over 1 day
--   * mark_published / mark_failed: claim_token NULL; event_ids NULL, empty,
--     two-dimensional, with a NULL, with a duplicate, over 10,000
--   * mark_failed: retry_at infinity, -infinity, more than 30 days ahead;
--     a two-dimensional errors array; an error text over 4,000 characters is
--     kept truncated (a relay's mark is never refused for its length)
--   * requeue: event_ids NULL, empty, with a duplicate; a reason over 1,000
--     characters
--   * backlog / dead_letters: a context that is not a subject token; max_rows
--     NULL, 0, over 10,000
--   * create_partitions: days_ahead NULL; from_day NULL, infinity, before 1900
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(33);

-- claim
SET LOCAL ROLE pgoutbox_relay;
SELECT throws_ok(
    $$SELECT * FROM outbox.claim(NULL, 10, '1 minute')$$, 'OB006', NULL, 'claim: a NULL worker is refused'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.claim(repeat('w', 257), 10, '1 minute')$$, 'OB009', NULL,
    'claim: a worker name over 256 characters is refused'
);
SELECT throws_ok($$SELECT * FROM outbox.claim('w', 10, NULL)$$, 'OB006', NULL, 'claim: a NULL lease is refused');
SELECT throws_ok(
    $$SELECT * FROM outbox.claim('w', 10, '1 day 1 second')$$, 'OB006', NULL, 'claim: a lease over 1 day is refused'
);

-- mark_published
SELECT throws_ok(
    $$SELECT outbox.mark_published(NULL, ARRAY[gen_random_uuid()])$$, 'OB006', NULL,
    'mark_published: a NULL claim token is refused'
);
SELECT throws_ok(
    $$SELECT outbox.mark_published(gen_random_uuid(), NULL)$$, 'OB006', NULL,
    'mark_published: NULL event_ids are refused, not counted as 0'
);
SELECT throws_ok(
    $$SELECT outbox.mark_published(gen_random_uuid(), ARRAY[]::uuid[])$$, 'OB006', NULL,
    'mark_published: empty event_ids are refused'
);
SELECT throws_ok(
    $$SELECT outbox.mark_published(gen_random_uuid(), ARRAY[[gen_random_uuid()], [gen_random_uuid()]])$$, 'OB006', NULL,
    'mark_published: a two-dimensional array is refused'
);
SELECT throws_ok(
    $$SELECT outbox.mark_published(gen_random_uuid(), ARRAY[gen_random_uuid(), NULL])$$, 'OB006', NULL,
    'mark_published: a NULL element is refused'
);
SELECT throws_ok(
    $$SELECT outbox.mark_published(gen_random_uuid(),
        ARRAY['00000000-0000-0000-0000-000000000001', '00000000-0000-0000-0000-000000000001']::uuid[])$$,
    'OB006', NULL, 'mark_published: a duplicate id is refused'
);
SELECT throws_ok(
    $$SELECT outbox.mark_published(gen_random_uuid(), ARRAY(SELECT gen_random_uuid() FROM generate_series(1, 10001)))$$,
    'OB009', NULL, 'mark_published: more than 10,000 ids are refused'
);
RESET ROLE;

-- mark_failed
SET LOCAL ROLE pgoutbox_writer;
SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea') AS e1 \gset
RESET ROLE;
SET LOCAL ROLE pgoutbox_relay;
SELECT claim_token AS tok FROM outbox.claim('w', 10, '1 minute') \gset
SELECT throws_ok(
    format(
        $$SELECT outbox.mark_failed(%L, ARRAY[%L::uuid], ARRAY['x'], ARRAY['infinity'::timestamptz])$$, :'tok', :'e1'
    ),
    'OB008', NULL, 'mark_failed: retry_at infinity is refused (it would park the event for ever)'
);
SELECT throws_ok(
    format(
        $$SELECT outbox.mark_failed(%L, ARRAY[%L::uuid], ARRAY['x'], ARRAY['-infinity'::timestamptz])$$, :'tok', :'e1'
    ),
    'OB008', NULL, 'mark_failed: retry_at -infinity is refused'
);
SELECT throws_ok(
    format(
        $$SELECT outbox.mark_failed(%L, ARRAY[%L::uuid], ARRAY['x'], ARRAY[now() + interval '31 days'])$$, :'tok', :'e1'
    ),
    'OB008', NULL, 'mark_failed: retry_at more than 30 days ahead is refused'
);
SELECT throws_ok(
    format($$SELECT outbox.mark_failed(NULL, ARRAY[%L::uuid], ARRAY['x'], ARRAY[now()])$$, :'e1'),
    'OB006', NULL, 'mark_failed: a NULL claim token is refused'
);
SELECT throws_ok(
    $$SELECT outbox.mark_failed(gen_random_uuid(), NULL, NULL, NULL)$$,
    'OB006', NULL, 'mark_failed: NULL arrays are refused'
);
SELECT throws_ok(
    format($$SELECT outbox.mark_failed(%L, ARRAY[%L::uuid], ARRAY[['x']], ARRAY[now()])$$, :'tok', :'e1'),
    'OB006', NULL, 'mark_failed: a two-dimensional errors array is refused'
);
SELECT throws_ok(
    format($$SELECT outbox.mark_failed(%L, ARRAY[%L::uuid], ARRAY[NULL::text], ARRAY[now()])$$, :'tok', :'e1'),
    'OB006', NULL, 'mark_failed: a NULL error text is refused'
);
SELECT is(
    outbox.mark_failed(:'tok', ARRAY[:'e1'::uuid], ARRAY[repeat('E', 5000)], ARRAY[now() + interval '30 days']),
    1, 'mark_failed: an error text over 4,000 characters is not refused'
);
RESET ROLE;
SELECT is(
    (
        SELECT length(last_error) || right(last_error, 12) FROM outbox.events
        WHERE event_id = :'e1'
    ),
    '4000 (truncated)', 'mark_failed: ... it is kept truncated to 4,000 characters, and says so'
);

-- requeue
SET LOCAL ROLE pgoutbox_admin;
SELECT throws_ok($$SELECT outbox.requeue(NULL, 'r')$$, 'OB006', NULL, 'requeue: NULL event_ids are refused');
SELECT throws_ok(
    $$SELECT outbox.requeue(ARRAY[]::uuid[], 'r')$$, 'OB006', NULL, 'requeue: empty event_ids are refused'
);
SELECT throws_ok(
    $$SELECT outbox.requeue(
        ARRAY['00000000-0000-0000-0000-000000000001', '00000000-0000-0000-0000-000000000001']::uuid[], 'r'
    )$$,
    'OB006', NULL, 'requeue: a duplicate id is refused'
);
SELECT throws_ok(
    $$SELECT outbox.requeue(ARRAY[gen_random_uuid()], repeat('r', 1001))$$, 'OB009', NULL,
    'requeue: a reason over 1,000 characters is refused'
);
RESET ROLE;

-- listings
SET LOCAL ROLE pgoutbox_relay;
SELECT throws_ok($$SELECT * FROM outbox.backlog('a.b')$$, 'OB006', NULL, 'backlog: a context with a dot is refused');
SELECT throws_ok(
    $$SELECT * FROM outbox.backlog(repeat('c', 65))$$, 'OB006', NULL, 'backlog: a context over 64 characters is refused'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.dead_letters('sea', NULL)$$, 'OB006', NULL,
    'dead_letters: NULL max_rows is refused (no LIMIT ALL)'
);
SELECT throws_ok($$SELECT * FROM outbox.dead_letters('sea', 0)$$, 'OB006', NULL, 'dead_letters: max_rows 0 is refused');
SELECT throws_ok(
    $$SELECT * FROM outbox.dead_letters('sea', 10001)$$, 'OB006', NULL, 'dead_letters: max_rows over 10,000 is refused'
);

-- create_partitions
SELECT throws_ok(
    $$SELECT * FROM outbox.create_partitions(NULL)$$, 'OB006', NULL, 'create_partitions: NULL days_ahead is refused'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.create_partitions(1, NULL)$$, 'OB008', NULL,
    'create_partitions: a NULL from_day is refused, not a silent no-op'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.create_partitions(1, 'infinity')$$, 'OB008', NULL,
    'create_partitions: from_day infinity is refused'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.create_partitions(1, '1899-12-31')$$, 'OB008', NULL,
    'create_partitions: a from_day before 1900 is refused'
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
