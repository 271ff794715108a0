-- Handler failures counted by the inbox (dlq_metadata.failures), and the
-- dead letters of in-database handlers.
-- Scenarios:
--   * record_error counts every failure it records, transient or dead;
--     settle counts its failed messages and leaves processed ones alone
--   * claim_replays starts a replay's new round at zero failures
--   * record_in_database_error records the delivery and the failure of an
--     in-database handler and marks the row in_database; a row another
--     delivery settled meanwhile is returned as it stands
--   * an in_database dead letter is never claimed for replay, and redrive
--     refuses it (OB031), alone or among other dead letters
--   * plans: a session whose batch calls were planned while inbox.messages
--     was small does not scan the whole table in later calls
--   * privileges: the consumer role records in-database failures; a writer
--     cannot
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(13);
\ir fixtures/inbox.sql

-- Failures counted.
SELECT fixture.message('billing', 'FAILED') AS failed_id \gset
SELECT inbox.record_error(:'failed_id', 'billing', 'HTTP 503');
SELECT is(
    (
        SELECT dlq_metadata ->> 'failures' FROM inbox.messages
        WHERE message_id = :'failed_id'
    ),
    '2', 'record_error counts each transient failure'
);
SELECT inbox.record_error(:'failed_id', 'billing', 'HTTP 422', dead => TRUE, replay_after => interval '0');
SELECT is(
    (
        SELECT format('%s|%s', status, dlq_metadata ->> 'failures') FROM inbox.messages
        WHERE message_id = :'failed_id'
    ),
    'DEAD_LETTER|3', 'a dead letter counts as a failure too'
);
SELECT fixture.message('billing') AS ok_id \gset
SELECT fixture.message('billing') AS bad_id \gset
SELECT * FROM inbox.settle('billing', ARRAY[:'ok_id'::uuid], ARRAY[:'bad_id'::uuid], ARRAY['HTTP 500']);
SELECT is(
    (
        SELECT array_agg(format('%s|%s', status, coalesce(dlq_metadata ->> 'failures', '-')) ORDER BY status)
        FROM inbox.messages
        WHERE message_id IN (:'ok_id', :'bad_id')
    ),
    ARRAY['FAILED|1', 'PROCESSED|-'],
    'settle counts its failed messages, not its processed ones'
);

-- A replay starts a new round.
SELECT is(
    (
        SELECT dlq_metadata ->> 'failures' FROM inbox.claim_replays('replayer-1', 10)
        WHERE message_id = :'failed_id'
    ),
    '0', 'claim_replays resets the failure count'
);

-- In-database handlers.
SELECT gen_random_uuid() AS db_id \gset
SELECT is(
    (
        SELECT format('%s|%s|%s|%s', status, attempts, dlq_metadata ->> 'failures', dlq_metadata ->> 'in_database')
        FROM inbox.record_in_database_error(
            :'db_id', 'totals', 'sea.event.order_created.v1', '{"payload": {}}', 'ValueError: negative total'
        )
    ),
    'FAILED|1|1|true',
    'record_in_database_error records the delivery and the failure, and marks the row'
);
SELECT is(
    (
        SELECT format('%s|%s', status, attempts)
        FROM inbox.record_in_database_error(
            :'db_id', 'totals', 'sea.event.order_created.v1', '{"payload": {}}', 'ValueError: again', dead => TRUE
        )
    ),
    'DEAD_LETTER|2', 'on the last delivery it dead-letters'
);
SELECT fixture.message('totals', 'PROCESSED') AS done_id \gset
SELECT is(
    (
        SELECT format('%s|%s', status, dlq_metadata ? 'in_database')
        FROM inbox.record_in_database_error(
            :'done_id', 'totals', 'sea.event.order_created.v1', '{"payload": {}}', 'late failure'
        )
    ),
    'PROCESSED|f', 'a row another delivery settled is returned as it stands'
);
SELECT fixture.message('totals', 'DEAD_LETTER', interval '0') AS http_id \gset
SELECT is(
    (SELECT array_agg(message_id) FROM inbox.claim_replays('replayer-1', 10)),
    ARRAY[:'http_id'::uuid],
    'an in-database dead letter is never claimed for replay'
);
SELECT throws_ok(
    format($$SELECT inbox.redrive('totals', ARRAY[%L]::uuid[], 'operator decision')$$, :'db_id'),
    'OB031', NULL, 'redrive refuses an in-database dead letter'
);
SELECT throws_ok(
    $$SELECT inbox.redrive('totals', NULL, 'every dead letter')$$,
    'OB031', NULL, 'and refuses a redrive of every dead letter that includes one'
);

-- Plans: eight calls each on a small table, each its own statement
-- (PostgreSQL caches a generic plan from the sixth on), then thousands of
-- rows: the next calls read a few rows, not the table.
-- (\gexec runs each generated statement on its own.)
SELECT
    format(
        $$SELECT count(*) FROM inbox.receive_batch(
        'plans', ARRAY[%L]::uuid[], '{sea.event.order_created.v1}', '{"{}"}')$$,
        gen_random_uuid()
    ) AS statement
FROM generate_series(1, 8) \gexec
SELECT format($$SELECT count(*) FROM inbox.settle('plans', ARRAY[%L]::uuid[])$$, gen_random_uuid()) AS statement
FROM generate_series(1, 8) \gexec
SELECT
    format(
        $$SELECT count(*) FROM inbox.receive_processed(
        'plans', ARRAY[%L, %L]::uuid[], '{sea.event.order_created.v1, sea.event.order_created.v1}', '{"{}", "{}"}')$$,
        gen_random_uuid(), gen_random_uuid()
    ) AS statement
FROM generate_series(1, 8) \gexec
INSERT INTO inbox.messages (message_id, handler, subject)
SELECT
    gen_random_uuid() AS message_id,
    'plans' AS handler,
    'sea.event.order_created.v1' AS subject
FROM generate_series(1, 5000);
SELECT seq_tup_read + idx_tup_fetch AS read_before FROM pg_stat_xact_user_tables
WHERE relid = 'inbox.messages'::regclass \gset
SELECT gen_random_uuid() AS plan_id \gset
SELECT count(*) FROM inbox.receive_batch(
    'plans', ARRAY[:'plan_id'::uuid], ARRAY['sea.event.order_created.v1'], ARRAY['{}'::jsonb]
);
SELECT count(*) FROM inbox.settle('plans', ARRAY[:'plan_id'::uuid]);
SELECT count(*) FROM inbox.receive_processed(
    'plans', ARRAY[gen_random_uuid(), :'plan_id'::uuid],
    ARRAY['sea.event.order_created.v1', 'sea.event.order_created.v1'], ARRAY['{}'::jsonb, '{}'::jsonb]
);
SELECT cmp_ok(
    (
        SELECT seq_tup_read + idx_tup_fetch FROM pg_stat_xact_user_tables
        WHERE relid = 'inbox.messages'::regclass
    ) - :read_before,
    '<',
    50::bigint,
    'batch calls planned on a small table read a few rows, not the whole table, once it has grown'
);

-- Privileges.
SET LOCAL ROLE pgoutbox_consumer;
SELECT lives_ok(
    format(
        $$SELECT inbox.record_in_database_error(%L, 'totals', 'sea.event.order_created.v1', NULL, 'x')$$,
        gen_random_uuid()
    ),
    'the consumer role records in-database failures'
);
RESET ROLE;
SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    format(
        $$SELECT inbox.record_in_database_error(%L, 'totals', 'sea.event.order_created.v1', NULL, 'x')$$,
        gen_random_uuid()
    ),
    '42501', NULL, 'a writer cannot'
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
