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

-- The flow is c0000000-...-0001, another one ...-0002; the events' ids by name.
CREATE TEMP TABLE flow_ids (name text PRIMARY KEY, id uuid);
GRANT SELECT ON flow_ids TO public;
CREATE FUNCTION pg_temp.id_of(event_name text) RETURNS uuid LANGUAGE sql STABLE AS $$
    SELECT id FROM flow_ids WHERE name = event_name
$$;

INSERT INTO flow_ids (name, id)
SELECT
    'placed' AS name,
    outbox.emit(
        'order', '1', 'placed', '{"schema_version": 1}',
        context => 'sea', correlation_id => 'c0000000-0000-4000-8000-000000000001'
    ) AS id;
INSERT INTO flow_ids (name, id)
SELECT
    'paid' AS name,
    outbox.emit(
        'payment', '7', 'paid', '{"schema_version": 2}',
        context => 'sea', event_version => 2,
        correlation_id => 'c0000000-0000-4000-8000-000000000001', causation_id => pg_temp.id_of('placed')
    ) AS id;
INSERT INTO flow_ids (name, id)
SELECT
    'elsewhere' AS name,
    outbox.emit(
        'order', '2', 'placed', '{"schema_version": 1}',
        context => 'sea', correlation_id => 'c0000000-0000-4000-8000-000000000002'
    ) AS id;

-- The first event published and received by two handlers, one of which
-- processed it and one of which dead-lettered it.
UPDATE outbox.events SET
    status = 'PROCESSING', attempts = 1, claim_token = gen_random_uuid(),
    claimed_at = now(), claimed_by = 'test', available_at = now() + interval '1 minute'
WHERE event_id = pg_temp.id_of('placed');
UPDATE outbox.events SET status = 'COMPLETED', published_at = now()
WHERE event_id = pg_temp.id_of('placed');
SELECT inbox.receive(pg_temp.id_of('placed'), 'billing', 'sea.event.placed.v1');
SELECT inbox.mark_processed(pg_temp.id_of('placed'), 'billing');
SELECT inbox.receive(pg_temp.id_of('placed'), 'shipping', 'sea.event.placed.v1');
SELECT inbox.record_error(pg_temp.id_of('placed'), 'shipping', 'HTTP 422: no address', TRUE);

SELECT results_eq(
    $$SELECT event_id, status, handler, inbox_status FROM outbox.flow('c0000000-0000-4000-8000-000000000001')$$,
    $$VALUES
        (pg_temp.id_of('placed'), 'COMPLETED'::text, 'billing'::text, 'PROCESSED'::text),
        (pg_temp.id_of('placed'), 'COMPLETED', 'shipping', 'DEAD_LETTER'),
        (pg_temp.id_of('paid'), 'PENDING', NULL, NULL)$$,
    'the flow: its events in emit order, each handler''s outcome, none of another flow'
);
SELECT results_eq(
    $$SELECT causation_id FROM outbox.flow('c0000000-0000-4000-8000-000000000001') WHERE handler IS NULL$$,
    $$VALUES (pg_temp.id_of('placed'))$$,
    'each event shows what caused it'
);
SELECT results_eq(
    $$SELECT inbox_last_error FROM outbox.flow('c0000000-0000-4000-8000-000000000001') WHERE handler = 'shipping'$$,
    $$VALUES ('HTTP 422: no address'::text)$$,
    'a dead-lettered handler shows its error'
);
SELECT is(
    (SELECT count(DISTINCT f.event_id) FROM outbox.flow('c0000000-0000-4000-8000-000000000001', 1) AS f), 1::bigint,
    'max_rows bounds the events (its handlers all come along)'
);
SELECT is((SELECT count(*) FROM outbox.flow(gen_random_uuid())), 0::bigint, 'an unknown correlation id: no rows');
SELECT throws_ok($$SELECT * FROM outbox.flow(NULL)$$, 'OB006', NULL, 'a NULL correlation id is refused');
SELECT throws_ok($$SELECT * FROM outbox.flow(gen_random_uuid(), 0)$$, 'OB006', NULL, 'max_rows 0 is refused');

SET LOCAL ROLE pgoutbox_viewer;
SELECT is(
    (SELECT count(*) FROM outbox.flow('c0000000-0000-4000-8000-000000000001')), 3::bigint,
    'pgoutbox_viewer may look a flow up'
);
RESET ROLE;
SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok($$SELECT * FROM outbox.flow(gen_random_uuid())$$, '42501', NULL, 'pgoutbox_writer may not');
RESET ROLE;

SELECT ok(
    EXISTS (
        SELECT 1 FROM pg_indexes
        WHERE
            schemaname = 'outbox' AND indexname = 'events_correlation_idx'
            AND indexdef LIKE '%(correlation_id, id)%' AND indexdef LIKE '%WHERE (correlation_id IS NOT NULL)%'
    ),
    'events_correlation_idx indexes (correlation_id, id) where a correlation id is given'
);

SELECT * FROM finish();
ROLLBACK;
