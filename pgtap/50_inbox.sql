-- Inbox.
-- Scenarios:
--   * receive records a first delivery (RECEIVED, 1 attempt) and counts redeliveries
--   * the key is (message_id, handler): two handlers process the same message independently
--   * once PROCESSED, receive reports it (a duplicate) and changes nothing
--   * record_error: FAILED (retryable) or DEAD_LETTER; a FAILED message can still be processed
--   * processed_at is set, never before received_at (POL-047-004)
--   * illegal moves raise ILLEGAL_TRANSITION (OB010); a received message is immutable (OB011)
--   * unknown messages raise UNKNOWN_MESSAGE (OB021); bad input INVALID_MESSAGE (OB020)
--   * backlog counts unprocessed, failed and dead-lettered per context and handler
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(21);

SELECT gen_random_uuid() AS m1 \gset
SELECT gen_random_uuid() AS m2 \gset

SET LOCAL ROLE pgoutbox_consumer;
SELECT is(
    (SELECT status || '|' || attempts FROM inbox.receive(:'m1', 'billing', 'sea.event.created.v1', '{"a": 1}')),
    'RECEIVED|1', 'a first delivery is RECEIVED'
);
SELECT is(
    (SELECT status || '|' || attempts FROM inbox.receive(:'m1', 'billing', 'sea.event.created.v1')),
    'RECEIVED|2', 'a redelivery is counted'
);
SELECT is(
    (SELECT status || '|' || attempts FROM inbox.receive(:'m1', 'shipping', 'sea.event.created.v1')),
    'RECEIVED|1', 'another handler has its own row'
);
RESET ROLE;
SELECT is(
    (
        SELECT context FROM inbox.messages
        WHERE message_id = :'m1' AND handler = 'billing'
    ),
    'sea', 'the context is derived from the subject'
);
SET LOCAL ROLE pgoutbox_consumer;
SELECT is(
    (SELECT status FROM inbox.mark_processed(:'m1', 'billing')), 'PROCESSED', 'mark_processed'
);
RESET ROLE;
SELECT ok(
    (
        SELECT processed_at >= received_at FROM inbox.messages
        WHERE message_id = :'m1' AND handler = 'billing'
    ),
    'processed_at is set and not before received_at'
);
SET LOCAL ROLE pgoutbox_consumer;
SELECT is(
    (SELECT status || '|' || attempts FROM inbox.receive(:'m1', 'billing', 'sea.event.created.v1')),
    'PROCESSED|2', 'a duplicate of a processed message is reported, not counted'
);
SELECT throws_ok(
    format($$SELECT inbox.mark_processed(%L, 'billing')$$, :'m1'),
    'OB010', NULL, 'processing twice is an illegal move'
);
SELECT throws_ok(
    format($$SELECT inbox.record_error(%L, 'billing', 'late failure')$$, :'m1'),
    'OB010', NULL, 'a processed message cannot fail afterwards'
);

SELECT is(
    (SELECT status FROM inbox.record_error(:'m1', 'shipping', 'handler returned 503')),
    'FAILED', 'record_error: FAILED'
);
SELECT is(
    (SELECT status || '|' || attempts FROM inbox.receive(:'m1', 'shipping', 'sea.event.created.v1')),
    'FAILED|2', 'a failed message is redelivered for processing'
);
SELECT is(
    (SELECT status FROM inbox.mark_processed(:'m1', 'shipping')), 'PROCESSED',
    'a failed message can still be processed'
);

SELECT inbox.receive(:'m2', 'billing', 'vibespro.event.vibe_created.v1');
SELECT is(
    (
        SELECT status || '|' || last_error
        FROM inbox.record_error(:'m2', 'billing', 'handler returned 422', dead => TRUE)
    ),
    'DEAD_LETTER|handler returned 422', 'record_error with dead => true: DEAD_LETTER'
);
SELECT is(
    (SELECT status FROM inbox.receive(:'m2', 'billing', 'vibespro.event.vibe_created.v1')),
    'DEAD_LETTER', 'a dead-lettered message is reported as such on redelivery'
);
SELECT throws_ok(
    format($$SELECT inbox.mark_processed(%L, 'billing')$$, :'m2'),
    'OB010', NULL, 'DEAD_LETTER -> PROCESSED is illegal'
);
RESET ROLE;
SELECT throws_ok(
    format($$UPDATE inbox.messages SET subject = 'x.event.y.v1' WHERE message_id = %L$$, :'m2'),
    'OB011', NULL, 'a received message is immutable'
);
SET LOCAL ROLE pgoutbox_consumer;
SELECT throws_ok(
    format($$SELECT inbox.mark_processed(%L, 'nobody')$$, :'m2'),
    'OB021', NULL, 'UNKNOWN_MESSAGE for a message never received'
);
SELECT throws_ok(
    $$SELECT inbox.receive(NULL, 'billing', 'sea.event.created.v1')$$,
    'OB020', NULL, 'INVALID_MESSAGE without a message id'
);
SELECT throws_ok(
    format($$SELECT inbox.receive(%L, 'billing', '')$$, gen_random_uuid()),
    'OB020', NULL, 'INVALID_MESSAGE without a subject'
);
SELECT throws_ok(
    format($$SELECT inbox.record_error(%L, 'billing', '')$$, :'m2'),
    'OB006', NULL, 'an error needs a text'
);

SELECT inbox.receive(gen_random_uuid(), 'billing', 'sea.event.created.v1');
RESET ROLE;
SET LOCAL ROLE pgoutbox_relay;
SELECT results_eq(
    $$SELECT context, handler, unprocessed, failed, dead_letter FROM inbox.backlog()$$,
    $$VALUES ('sea'::text, 'billing'::text, 1::bigint, 0::bigint, 0::bigint),
             ('vibespro', 'billing', 0, 0, 1)$$,
    'backlog per context and handler'
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
