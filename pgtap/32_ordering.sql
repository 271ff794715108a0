-- Per-key ordering.
-- Scenarios:
--   * with an ordering_key, only the oldest unfinished event of the key is
--     handed out; other keys and key-less events are not held back
--   * a FAILED event holds its successors back across retries, until COMPLETED
--   * a DEAD_LETTER event holds its key until an operator requeues it and it
--     completes (strict order: successors never overtake a dead letter)
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(9);
\ir fixtures/events.sql

SELECT fixture.event('PENDING', key => 'A') AS a1 \gset
SELECT fixture.event('PENDING', key => 'A') AS a2 \gset
SELECT fixture.event('PENDING', key => 'B') AS b1 \gset
SELECT fixture.event('PENDING', key => 'A') AS a3 \gset
SELECT fixture.event('PENDING') AS n1 \gset

CREATE TEMP TABLE c1 AS SELECT * FROM outbox.claim('w1', 10, '1 minute');
SELECT results_eq(
    $$SELECT event_id FROM c1 ORDER BY id$$,
    format($$VALUES (%L::uuid), (%L::uuid), (%L::uuid)$$, :'a1', :'b1', :'n1'),
    'one event per key (the oldest) plus key-less events'
);
SET LOCAL ROLE pgoutbox_relay;
SELECT is_empty(
    $$SELECT * FROM outbox.claim('w2', 10, '1 minute')$$,
    'while A1 is in flight nobody gets A2 or A3'
);
RESET ROLE;

SELECT outbox.mark_published((SELECT DISTINCT claim_token FROM c1), ARRAY[:'b1'::uuid, :'n1'::uuid]);
SELECT outbox.mark_failed(
    (SELECT DISTINCT claim_token FROM c1), ARRAY[:'a1'::uuid], ARRAY['nats down'], ARRAY[now()]
);
CREATE TEMP TABLE c2 AS SELECT * FROM outbox.claim('w2', 10, '1 minute');
SELECT results_eq(
    $$SELECT event_id, attempts FROM c2$$,
    format($$VALUES (%L::uuid, 2)$$, :'a1'),
    'a failed A1 is retried before A2 is handed out'
);

SELECT outbox.mark_published((SELECT claim_token FROM c2), ARRAY[:'a1'::uuid]);
CREATE TEMP TABLE c3 AS SELECT * FROM outbox.claim('w3', 10, '1 minute');
SELECT results_eq(
    $$SELECT event_id FROM c3$$,
    format($$VALUES (%L::uuid)$$, :'a2'),
    'once A1 completed, A2 is next'
);

SELECT outbox.mark_failed(
    (SELECT claim_token FROM c3), ARRAY[:'a2'::uuid], ARRAY['poison'], ARRAY[NULL::timestamptz]
);
SELECT is(fixture.status(:'a2'), 'DEAD_LETTER', 'A2 is dead-lettered');
SELECT fixture.event('PENDING', key => 'B') AS b2 \gset
SET LOCAL ROLE pgoutbox_relay;
SELECT results_eq(
    $$SELECT event_id FROM outbox.claim('w4', 10, '1 minute')$$,
    format($$VALUES (%L::uuid)$$, :'b2'),
    'a dead letter holds its key (A3 waits) but not other keys'
);
RESET ROLE;

SET LOCAL ROLE pgoutbox_admin;
SELECT outbox.requeue(ARRAY[:'a2'::uuid], 'fixed the consumer schema');
RESET ROLE;
CREATE TEMP TABLE c5 AS SELECT * FROM outbox.claim('w5', 10, '1 minute');
SELECT results_eq(
    $$SELECT event_id FROM c5$$,
    format($$VALUES (%L::uuid)$$, :'a2'),
    'after the requeue the dead letter goes first'
);
SELECT outbox.mark_published((SELECT claim_token FROM c5), ARRAY[:'a2'::uuid]);
SET LOCAL ROLE pgoutbox_relay;
SELECT results_eq(
    $$SELECT event_id FROM outbox.claim('w6', 10, '1 minute')$$,
    format($$VALUES (%L::uuid)$$, :'a3'),
    'and then A3'
);
SELECT is_empty(
    $$SELECT * FROM outbox.claim('w7', 10, '1 minute')$$, 'nothing else is due'
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
