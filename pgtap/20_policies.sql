-- Outbox policies, each with its stable SQLSTATE.
-- Scenarios:
--   * emit returns the event_id and builds the subject {context}.event.{type}.v{n}
--   * the context comes from the argument, else the pgoutbox.context setting
--   * INVALID_OUTBOX (OB001): a missing context, aggregate or event type
--   * FUTURE_EVENT (OB002): occurred_at over a minute ahead; within a minute is fine
--   * INVALID_SUBJECT_PART (OB003): dots, wildcards or spaces in context or type; version < 1
--   * INVALID_PAYLOAD (OB004): payload not a JSON object
--   * INVALID_SCHEMA_VERSION (OB005): missing, non-numeric, fractional or < 1
--   * INVALID_ARGUMENT (OB006): headers not an object
--   * a direct INSERT meets the same policies (they live in a trigger)
--   * an event is born PENDING, whoever inserts it (OB010)
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(25);

SET LOCAL ROLE pgoutbox_writer;
SELECT lives_ok(
    $$SELECT outbox.emit('order', '42', 'order_created', '{"schema_version": 1, "total": 3}',
        context => 'sea', event_version => 2, headers => '{"traceparent": "00-abc-def-01"}')$$,
    'a well-formed event is accepted'
);
RESET ROLE;
SELECT is(
    (
        SELECT subject FROM outbox.events
        WHERE aggregate_id = '42'
    ),
    'sea.event.order_created.v2', 'the subject is {context}.event.{event_type}.v{event_version}'
);
SELECT is(
    (
        SELECT status || '/' || attempts FROM outbox.events
        WHERE aggregate_id = '42'
    ),
    'PENDING/0', 'an emitted event is PENDING with no attempts'
);
SET LOCAL ROLE pgoutbox_writer;
SELECT outbox.emit('order', '43', 'created', '{"schema_version": 1}', context => 'sea') AS new_id \gset
RESET ROLE;
SELECT is(
    (
        SELECT event_id FROM outbox.events
        WHERE aggregate_id = '43'
    ),
    :'new_id'::uuid,
    'emit returns the event_id it stored'
);
SELECT set_config('pgoutbox.context', 'vibespro', TRUE);
SET LOCAL ROLE pgoutbox_writer;
SELECT lives_ok(
    $$SELECT outbox.emit('vibe', '7', 'vibe_created', '{"schema_version": 1}')$$,
    'the context may come from the pgoutbox.context setting'
);
RESET ROLE;
SELECT is(
    (
        SELECT subject FROM outbox.events
        WHERE aggregate_id = '7'
    ),
    'vibespro.event.vibe_created.v1', 'the setting''s context is used'
);
SELECT set_config('pgoutbox.context', '', TRUE);

SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}')$$,
    'OB001', NULL, 'INVALID_OUTBOX: no context anywhere'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', NULL, '{"schema_version": 1}', context => 'sea')$$,
    'OB001', NULL, 'INVALID_OUTBOX: no event_type'
);
SELECT throws_ok(
    $$SELECT outbox.emit('', '1', 'created', '{"schema_version": 1}', context => 'sea')$$,
    'OB001', NULL, 'INVALID_OUTBOX: empty aggregate_type'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', NULL, 'created', '{"schema_version": 1}', context => 'sea')$$,
    'OB001', NULL, 'INVALID_OUTBOX: no aggregate_id'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', context => 'sea',
        occurred_at => now() + interval '61 seconds')$$,
    'OB002', NULL, 'FUTURE_EVENT: occurred_at over a minute ahead'
);
SELECT lives_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', context => 'sea',
        occurred_at => now() + interval '59 seconds')$$,
    'clock skew under a minute is tolerated'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'order.created', '{"schema_version": 1}', context => 'sea')$$,
    'OB003', NULL, 'INVALID_SUBJECT_PART: a dot in event_type'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', context => 'se*')$$,
    'OB003', NULL, 'INVALID_SUBJECT_PART: a wildcard in context'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'order created', '{"schema_version": 1}', context => 'sea')$$,
    'OB003', NULL, 'INVALID_SUBJECT_PART: a space in event_type'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', context => 'sea', event_version => 0)$$,
    'OB003', NULL, 'INVALID_SUBJECT_PART: event_version 0'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '[1, 2]', context => 'sea')$$,
    'OB004', NULL, 'INVALID_PAYLOAD: an array'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '"text"', context => 'sea')$$,
    'OB004', NULL, 'INVALID_PAYLOAD: a string'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"total": 1}', context => 'sea')$$,
    'OB005', NULL, 'INVALID_SCHEMA_VERSION: missing'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": "2"}', context => 'sea')$$,
    'OB005', NULL, 'INVALID_SCHEMA_VERSION: a string'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1.5}', context => 'sea')$$,
    'OB005', NULL, 'INVALID_SCHEMA_VERSION: fractional'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 0}', context => 'sea')$$,
    'OB005', NULL, 'INVALID_SCHEMA_VERSION: zero'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', context => 'sea', headers => '[]')$$,
    'OB006', NULL, 'INVALID_ARGUMENT: headers not an object'
);
RESET ROLE;
SELECT throws_ok(
    $$INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload)
      VALUES ('sea', 'order', '1', 'created', '{}')$$,
    'OB005', NULL, 'a direct INSERT meets the same policies'
);
SELECT throws_ok(
    $$INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload, status, published_at)
      VALUES ('sea', 'order', '1', 'created', '{"schema_version": 1}', 'COMPLETED', now())$$,
    'OB010', NULL, 'an event cannot be born in any state but PENDING'
);

SELECT * FROM finish();
ROLLBACK;
