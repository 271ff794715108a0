-- CloudEvents headers checked at emit (outbox._check_cloudevents_headers,
-- sql/20_outbox_guards.sql): what the relay would refuse with BAD_HEADER,
-- and dead-letter after the event was accepted, emit refuses (OB017).
-- Scenarios:
--   * refused: ce-specversion other than 1.0, ce-datacontenttype other than
--     application/json, an empty ce-* value, a ce-* name not ce-[a-z0-9]{1,64},
--     ce-time not RFC 3339 or out of range, an attribute twice in any letter
--     case, a Content-Type claiming structured mode
--   * accepted: agreeing copies, extensions, an RFC 3339 time with an offset,
--     a JSON Content-Type, a number
--   * the fast path (_headers_pass) never accepts what the query refuses
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(19);

SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-specversion": "0.3"}')$$,
    'OB017', NULL, 'refused: ce-specversion other than 1.0'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"CE-SPECVERSION": "2.0"}')$$,
    'OB017', NULL, 'refused: ce-specversion in capitals, other than 1.0'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-datacontenttype": "text/plain"}')$$,
    'OB017', NULL, 'refused: ce-datacontenttype other than application/json'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-source": ""}')$$,
    'OB017', NULL, 'refused: an empty ce-* value'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-Foo_Bar": "x"}')$$,
    'OB017', NULL, 'refused: a ce-* name with characters outside a-z, 0-9'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-": "x"}')$$,
    'OB017', NULL, 'refused: ce- alone'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa": "x"}')$$,
    'OB017', NULL, 'refused: a ce-* name over 64 characters'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-time": "yesterday"}')$$,
    'OB017', NULL, 'refused: ce-time that is not RFC 3339'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-time": "2026-13-01T00:00:00Z"}')$$,
    'OB017', NULL, 'refused: ce-time with month 13'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-time": "2026-01-01T24:00:00Z"}')$$,
    'OB017', NULL, 'refused: ce-time at hour 24'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-type": "a", "Ce-Type": "b"}')$$,
    'OB017', NULL, 'refused: a ce-* attribute twice in different letter case'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"Content-Type": "application/cloudevents+json"}')$$,
    'OB017', NULL, 'refused: a Content-Type claiming structured mode'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"content-type": "Application/CloudEvents-Batch+json"}')$$,
    'OB017', NULL, 'refused: structured mode in any letter case'
);
SELECT lives_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-specversion": "1.0", "ce-datacontenttype": "application/json"}')$$,
    'accepted: copies of pgoutboxs specversion and datacontenttype'
);
SELECT lives_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-source": "/billing", "ce-myext": "v1", "ce-time": "2026-11-26T17:00:00.123456+01:00"}')$$,
    'accepted: a source, an extension and an RFC 3339 time'
);
SELECT lives_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"Content-Type": "application/json", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}')$$,
    'accepted: a JSON Content-Type and a trace context'
);
SELECT lives_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"ce-count": 3}')$$,
    'accepted: a ce-* number (sent as its JSON text)'
);
RESET ROLE;
SELECT ok(outbox._is_rfc3339('2026-11-26T17:00:00Z'), 'rfc3339: UTC');
SELECT ok(NOT outbox._is_rfc3339('2026-11-26'), 'rfc3339: a date alone is not a date-time');

SELECT * FROM finish();
ROLLBACK;
