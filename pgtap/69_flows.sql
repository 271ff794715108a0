-- outbox.flow(correlation_id): a business flow by its correlation id.
-- Scenarios:
--   * the events of the flow in emit order, none of another flow
--   * each event's publish state, and one row per handler with its inbox
--     outcome (a handler-less event: one row, handler NULL)
--   * max_rows bounds the events; a NULL id or a bad max_rows is refused
--     (INVALID_ARGUMENT, OB006)
--   * pgoutbox_viewer may call it, pgoutbox_writer may not
--   * the lookup is served by events_correlation_idx
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(10);

CREATE TEMP TABLE flow_ids (name text PRIMARY KEY, id uuid);
INSERT INTO flow_ids VALUES ('flow', gen_random_uuid()), ('other', gen_random_uuid());
GRANT SELECT ON flow_ids TO public;

INSERT INTO flow_ids
SELECT 'placed', outbox.emit('order', '1', 'placed', '{"schema_version": 1}', context => 'sea',
    correlation_id => (SELECT id FROM flow_ids WHERE name = 'flow'));
INSERT INTO flow_ids
SELECT 'paid', outbox.emit('payment', '7', 'paid', '{"schema_version": 2}', context => 'sea', event_version => 2,
    correlation_id => (SELECT id FROM flow_ids WHERE name = 'flow'),
    causation_id => (SELECT id FROM flow_ids WHERE name = 'placed'));
INSERT INTO flow_ids
SELECT 'elsewhere', outbox.emit('order', '2', 'placed', '{"schema_version": 1}', context => 'sea',
    correlation_id => (SELECT id FROM flow_ids WHERE name = 'other'));

-- The first event published and received by two handlers, one of which
-- processed it and one of which dead-lettered it.
UPDATE outbox.events SET status = 'PROCESSING', attempts = 1, claim_token = gen_random_uuid(),
    claimed_at = now(), claimed_by = 'test', available_at = now() + interval '1 minute'
WHERE event_id = (SELECT id FROM flow_ids WHERE name = 'placed');
UPDATE outbox.events SET status = 'COMPLETED', published_at = now()
WHERE event_id = (SELECT id FROM flow_ids WHERE name = 'placed');
SELECT inbox.receive((SELECT id FROM flow_ids WHERE name = 'placed'), 'billing', 'sea.event.placed.v1');
SELECT inbox.mark_processed((SELECT id FROM flow_ids WHERE name = 'placed'), 'billing');
SELECT inbox.receive((SELECT id FROM flow_ids WHERE name = 'placed'), 'shipping', 'sea.event.placed.v1');
SELECT inbox.record_error((SELECT id FROM flow_ids WHERE name = 'placed'), 'shipping', 'HTTP 422: no address', TRUE);

SELECT results_eq(
    $$SELECT event_id, status, handler, inbox_status FROM outbox.flow((SELECT id FROM flow_ids WHERE name = 'flow'))$$,
    $$VALUES
        ((SELECT id FROM flow_ids WHERE name = 'placed'), 'COMPLETED'::text, 'billing'::text, 'PROCESSED'::text),
        ((SELECT id FROM flow_ids WHERE name = 'placed'), 'COMPLETED', 'shipping', 'DEAD_LETTER'),
        ((SELECT id FROM flow_ids WHERE name = 'paid'), 'PENDING', NULL, NULL)$$,
    'the flow: its events in emit order, each handler''s outcome, none of another flow'
);
SELECT is(
    (SELECT causation_id FROM outbox.flow((SELECT id FROM flow_ids WHERE name = 'flow'))
     WHERE event_id = (SELECT id FROM flow_ids WHERE name = 'paid')),
    (SELECT id FROM flow_ids WHERE name = 'placed'),
    'each event shows what caused it'
);
SELECT is(
    (SELECT inbox_last_error FROM outbox.flow((SELECT id FROM flow_ids WHERE name = 'flow'))
     WHERE handler = 'shipping'),
    'HTTP 422: no address',
    'a dead-lettered handler shows its error'
);
SELECT is(
    (SELECT count(DISTINCT event_id) FROM outbox.flow((SELECT id FROM flow_ids WHERE name = 'flow'), 1)),
    1::bigint, 'max_rows bounds the events (its handlers all come along)'
);
SELECT is(
    (SELECT count(*) FROM outbox.flow(gen_random_uuid())), 0::bigint, 'an unknown correlation id: no rows'
);
SELECT throws_ok($$SELECT * FROM outbox.flow(NULL)$$, 'OB006', NULL, 'a NULL correlation id is refused');
SELECT throws_ok($$SELECT * FROM outbox.flow(gen_random_uuid(), 0)$$, 'OB006', NULL, 'max_rows 0 is refused');

SET LOCAL ROLE pgoutbox_viewer;
SELECT is(
    (SELECT count(*) FROM outbox.flow((SELECT id FROM flow_ids WHERE name = 'flow'))),
    3::bigint, 'pgoutbox_viewer may look a flow up'
);
RESET ROLE;
SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    $$SELECT * FROM outbox.flow(gen_random_uuid())$$, '42501', NULL, 'pgoutbox_writer may not'
);
RESET ROLE;

SELECT ok(
    EXISTS (
        SELECT 1 FROM pg_indexes WHERE schemaname = 'outbox' AND indexname = 'events_correlation_idx'
            AND indexdef LIKE '%(correlation_id, id)%' AND indexdef LIKE '%WHERE (correlation_id IS NOT NULL)%'
    ),
    'events_correlation_idx indexes (correlation_id, id) where a correlation id is given'
);

SELECT * FROM finish();
ROLLBACK;
