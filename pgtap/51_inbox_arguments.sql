-- The inbox API checks every argument before it acts (docs/reference.md, "Limits"):
-- bad ones are refused with a code, never with a PostgreSQL error class
-- (the handler name's CHECK, for one, is not what answers).
-- Scenarios:
--   * receive: NULL message_id; a handler name that is not [A-Za-z0-9_.-]
--     of 1-128; a subject with white space or over 1,024 characters; an
--     envelope that is not a JSON object
--   * mark_processed / record_error: NULL message_id, malformed handler
--   * record_error: dead NULL; replay_after over 366 days; an error text over
--     4,000 characters is kept truncated
--   * claim_replays: a worker over 256 characters
--   * redrive: empty ids, a NULL element, a duplicate, a malformed handler, a
--     reason over 1,000 characters; NULL ids still mean "all"
--   * set_replay: a reason over 1,000 characters
--   * backlog / dead_letters: a bad context, a handler over 128, bad max_rows
--   * receive_batch / settle: a malformed handler, a NULL id, arrays of
--     different lengths, a bad subject, over 10,000 ids, a blank error
--   * receive_processed: the same checks as receive_batch (a malformed
--     handler, a NULL id, arrays of different lengths, a bad subject or
--     envelope, over 10,000 ids), and a refused call writes no row
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(38);

-- receive
SET LOCAL ROLE pgoutbox_consumer;
SELECT throws_ok(
    $$SELECT * FROM inbox.receive(NULL, 'h', 'sea.event.x.v1')$$, 'OB020', NULL, 'receive: a NULL message_id is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive(gen_random_uuid(), 'bad handler', 'sea.event.x.v1')$$, 'OB020', NULL,
    'receive: a handler name with a space is refused with a code, not by the CHECK'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive(gen_random_uuid(), repeat('h', 129), 'sea.event.x.v1')$$, 'OB020', NULL,
    'receive: a handler name over 128 characters is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive(gen_random_uuid(), 'h', E'sea.event.x.v1\r\n')$$, 'OB020', NULL,
    'receive: a subject with white space is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive(gen_random_uuid(), 'h', repeat('s', 1025))$$, 'OB020', NULL,
    'receive: a subject over 1,024 characters is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive(gen_random_uuid(), 'h', 'sea.event.x.v1', '[1]')$$, 'OB020', NULL,
    'receive: an envelope that is not an object is refused'
);
SELECT lives_ok(
    $$SELECT * FROM inbox.receive('00000000-0000-0000-0000-000000000001', 'h', 'sea.event.x.v1', '{"a": 1}')$$,
    'receive: a well-formed delivery is recorded'
);

-- mark_processed, record_error
SELECT throws_ok($$SELECT * FROM inbox.mark_processed(NULL, 'h')$$, 'OB020', NULL, 'mark_processed: NULL message_id');
SELECT throws_ok(
    $$SELECT * FROM inbox.mark_processed(gen_random_uuid(), 'a/b')$$, 'OB020', NULL, 'mark_processed: malformed handler'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.record_error('00000000-0000-0000-0000-000000000001', 'h', 'x', NULL)$$, 'OB006', NULL,
    'record_error: dead NULL is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.record_error('00000000-0000-0000-0000-000000000001', 'h', 'x', TRUE, '367 days')$$,
    'OB006', NULL,
    'record_error: replay_after over 366 days is refused'
);
SELECT is(
    (
        SELECT length(last_error) FROM inbox.record_error(
            '00000000-0000-0000-0000-000000000001', 'h', repeat('E', 9000)
        )
    ),
    4000, 'record_error: an error text over 4,000 characters is kept truncated, not refused'
);

-- replay
SELECT throws_ok(
    $$SELECT * FROM inbox.claim_replays(repeat('w', 257), 10)$$, 'OB009', NULL,
    'claim_replays: a worker over 256 characters is refused'
);
RESET ROLE;
SET LOCAL ROLE pgoutbox_admin;
SELECT throws_ok(
    $$SELECT inbox.redrive('h', ARRAY[]::uuid[], 'r')$$, 'OB006', NULL, 'redrive: empty message_ids are refused'
);
SELECT throws_ok(
    $$SELECT inbox.redrive('h', ARRAY[NULL]::uuid[], 'r')$$, 'OB006', NULL, 'redrive: a NULL element is refused'
);
SELECT throws_ok(
    $$SELECT inbox.redrive(
        'h', ARRAY['00000000-0000-0000-0000-000000000001', '00000000-0000-0000-0000-000000000001']::uuid[], 'r'
    )$$,
    'OB006', NULL, 'redrive: a duplicate id is refused'
);
SELECT throws_ok(
    $$SELECT inbox.redrive('a b', NULL, 'r')$$, 'OB006', NULL, 'redrive: a malformed handler is refused'
);
SELECT throws_ok(
    $$SELECT inbox.redrive('h', NULL, repeat('r', 1001))$$, 'OB009', NULL, 'redrive: a reason over 1,000 characters'
);
SELECT is(inbox.redrive('h', NULL, 'nothing dead yet'), 0, 'redrive: NULL ids still mean every dead letter');
SELECT throws_ok(
    $$SELECT * FROM inbox.set_replay('h', FALSE, repeat('r', 1001))$$, 'OB009', NULL,
    'set_replay: a reason over 1,000 characters is refused'
);
RESET ROLE;

-- listings
SET LOCAL ROLE pgoutbox_relay;
SELECT throws_ok($$SELECT * FROM inbox.backlog('a b')$$, 'OB006', NULL, 'inbox.backlog: a bad context is refused');
SELECT throws_ok(
    $$SELECT * FROM inbox.dead_letters(repeat('h', 129))$$, 'OB009', NULL,
    'inbox.dead_letters: a handler over 128 characters is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.dead_letters('h', -1)$$, 'OB006', NULL, 'inbox.dead_letters: negative max_rows is refused'
);
RESET ROLE;

-- the batched calls
SET LOCAL ROLE pgoutbox_consumer;
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_batch('bad handler', ARRAY[gen_random_uuid()], '{sea.event.x.v1}', '{NULL}')$$,
    'OB020', NULL, 'receive_batch: a malformed handler is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_batch('h', ARRAY[NULL::uuid], '{sea.event.x.v1}', '{NULL}')$$,
    'OB020', NULL, 'receive_batch: a NULL message id is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_batch('h', ARRAY[gen_random_uuid()], '{}', '{}')$$,
    'OB006', NULL, 'receive_batch: arrays of different lengths are refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_batch('h', ARRAY[gen_random_uuid()], '{"sea.event x.v1"}', '{NULL}')$$,
    'OB020', NULL, 'receive_batch: a subject with white space refuses the batch'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_batch('h', ARRAY[gen_random_uuid()], '{sea.event.x.v1}', ARRAY['[1]'::jsonb])$$,
    'OB020', NULL, 'receive_batch: an envelope that is not an object refuses the batch'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.settle('h', ARRAY(SELECT gen_random_uuid() FROM generate_series(1, 10001)))$$,
    'OB006', NULL, 'settle: over 10,000 ids are refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.settle('h', '{}', ARRAY[gen_random_uuid()], '{""}')$$,
    'OB006', NULL, 'settle: a blank error text is refused'
);

-- receive_processed
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_processed('bad handler', ARRAY[gen_random_uuid()], '{sea.event.x.v1}', '{NULL}')$$,
    'OB020', NULL, 'receive_processed: a malformed handler is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_processed('h', ARRAY[NULL::uuid], '{sea.event.x.v1}', '{NULL}')$$,
    'OB020', NULL, 'receive_processed: a NULL message id is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_processed('h', ARRAY[gen_random_uuid()], '{sea.event.x.v1}', '{}')$$,
    'OB006', NULL, 'receive_processed: arrays of different lengths are refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_processed('h', ARRAY[gen_random_uuid()], '{"sea.event x.v1"}', '{NULL}')$$,
    'OB020', NULL, 'receive_processed: a subject with white space refuses the batch'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_processed('h', ARRAY[gen_random_uuid()], '{sea.event.x.v1}', ARRAY['"x"'::jsonb])$$,
    'OB020', NULL, 'receive_processed: an envelope that is not an object refuses the batch'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_processed(
        'h', ARRAY(SELECT gen_random_uuid() FROM generate_series(1, 10001)),
        array_fill('sea.event.x.v1'::text, ARRAY[10001]), array_fill(NULL::jsonb, ARRAY[10001])
    )$$,
    'OB006', NULL, 'receive_processed: over 10,000 ids are refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_processed(
        'h', ARRAY['00000000-0000-4000-8000-0000000000d1'::uuid, gen_random_uuid()],
        '{sea.event.x.v1,""}', '{NULL,NULL}'
    )$$,
    'OB020', NULL, 'receive_processed: one blank subject refuses the whole batch'
);
RESET ROLE;
SELECT is(
    (
        SELECT count(*) FROM inbox.messages
        WHERE message_id = '00000000-0000-4000-8000-0000000000d1'
    ), 0::bigint,
    'receive_processed: a refused call writes no row, not even for its good messages'
);

SELECT * FROM finish();
ROLLBACK;
