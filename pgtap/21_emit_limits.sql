-- What emit refuses because no relay could deliver it (docs/reference.md, "Limits"),
-- each with its SQLSTATE; the limits themselves are accepted.
-- Scenarios:
--   * TIMESTAMP_OUT_OF_RANGE (OB008): occurred_at -infinity, infinity, before
--     1900; a direct INSERT with a non-finite created_at or available_at
--   * RESERVED_HEADER (OB016): Nats-*, Pgoutbox-*, Status and Description header
--     names, any letter case
--   * INVALID_HEADER (OB017): empty name, colon, space, non-ASCII, over 256
--     characters; a value with CR or LF or white space at either end; a name
--     given twice in different letter case
--   * VALUE_TOO_LARGE (OB009): payload over 512 KiB of JSON, headers over
--     16 KiB, aggregate_type over 255, aggregate_id over 1024, tenant_id over
--     255, ordering_key over 512 characters (3,000 no longer reaches the index)
--   * INVALID_ARGUMENT (OB006): empty tenant_id or ordering_key, a line break
--     or white space at either end of a value sent as a header
--   * INVALID_SCHEMA_VERSION (OB005): 1.0, 0, 2^31, a huge number
--   * INVALID_SUBJECT_PART (OB003): context over 64, event_type over 128
--   * exactly at each limit is accepted, and non-string header values too
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(44);

-- Times.
SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea', occurred_at => '-infinity')$$,
    'OB008', NULL, 'occurred_at -infinity is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea', occurred_at => 'infinity')$$,
    'OB008', NULL, 'occurred_at infinity is refused (not merely a future event)'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        occurred_at => '1899-12-31 23:59:59+00')$$,
    'OB008', NULL, 'occurred_at before 1900 is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        occurred_at => '0044-03-15 12:00:00+00 BC')$$,
    'OB008', NULL, 'occurred_at BC is refused'
);
SELECT lives_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        occurred_at => '1900-01-01 00:00:00+00')$$,
    'occurred_at 1900-01-01 is accepted'
);
RESET ROLE;
SELECT throws_ok(
    $$INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload, created_at)
      VALUES ('sea', 'o', '1', 'created', '{"schema_version": 1}', 'infinity')$$,
    'OB008', NULL, 'a direct INSERT with created_at infinity is refused'
);
SELECT throws_ok(
    $$INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload, available_at)
      VALUES ('sea', 'o', '1', 'created', '{"schema_version": 1}', '-infinity')$$,
    'OB008', NULL, 'a direct INSERT with available_at -infinity is refused'
);

-- Header names.
SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"Nats-Msg-Id": "x"}')$$,
    'OB016', NULL, 'Nats-Msg-Id is reserved'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"nats-expected-last-sequence": "1"}')$$,
    'OB016', NULL, 'any Nats-* name, in lower case, is reserved'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"PGOUTBOX-CONTEXT": "other"}')$$,
    'OB016', NULL, 'Pgoutbox-* names, in upper case, are reserved'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"status": "404"}')$$,
    'OB016', NULL, 'Status (a status reply''s header, which would end a fetch) is reserved'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"traceparent": "00-\u00e9-01"}')$$,
    'OB017', NULL, 'a trace context that is not visible ASCII is refused (it becomes an HTTP header)'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea', headers => '{"": "x"}')$$,
    'OB017', NULL, 'an empty header name is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea', headers => '{"a:b": "x"}')$$,
    'OB017', NULL, 'a colon in a header name is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea', headers => '{"a b": "x"}')$$,
    'OB017', NULL, 'white space in a header name is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea', headers => '{"café": "x"}')$$,
    'OB017', NULL, 'a non-ASCII header name is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => jsonb_build_object(repeat('h', 257), 'x'))$$,
    'OB017', NULL, 'a header name over 256 characters is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"X-Trace": "1", "x-trace": "2"}')$$,
    'OB017', NULL, 'one header name twice, in different letter case, is refused'
);

-- Header values.
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => '{"a": "x\r\ny"}')$$,
    'OB017', NULL, 'CR LF in a header value is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea', headers => '{"a": "x\n"}')$$,
    'OB017', NULL, 'a trailing LF in a header value is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea', headers => '{"a": " x"}')$$,
    'OB017', NULL, 'leading white space in a header value is refused (clients trim it)'
);
SELECT lives_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => jsonb_build_object('traceparent', '00-abc-def-01', 'n', 5, 'ok', TRUE, 'tab', E'a\tb',
            'obj', '{"k": "line\nbreak"}'::jsonb, repeat('h', 256), 'x'))$$,
    'token names up to 256 characters, inner tabs and non-string values (sent as JSON text) are accepted'
);

-- Sizes.
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', jsonb_build_object('schema_version', 1, 'x', repeat('a', 524259)),
        context => 'sea')$$,
    'OB009', NULL, 'a payload of 524,289 bytes of JSON is refused'
);
SELECT lives_ok(
    $$SELECT outbox.emit('o', '1', 'created', jsonb_build_object('schema_version', 1, 'x', repeat('a', 524258)),
        context => 'sea')$$,
    'a payload of exactly 524,288 bytes of JSON is accepted'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => jsonb_build_object('h', repeat('v', 16376)))$$,
    'OB009', NULL, 'headers of 16,385 bytes of JSON are refused'
);
SELECT lives_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        headers => jsonb_build_object('h', repeat('v', 16375)))$$,
    'headers of exactly 16,384 bytes of JSON are accepted'
);
SELECT throws_ok(
    $$SELECT outbox.emit(repeat('t', 256), '1', 'created', '{"schema_version": 1}', context => 'sea')$$,
    'OB009', NULL, 'aggregate_type over 255 characters is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', repeat('i', 1025), 'created', '{"schema_version": 1}', context => 'sea')$$,
    'OB009', NULL, 'aggregate_id over 1024 characters is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        tenant_id => repeat('t', 256))$$,
    'OB009', NULL, 'tenant_id over 255 characters is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea',
        ordering_key => repeat('k', 3000))$$,
    'OB009', NULL, 'a 3,000-character ordering_key is refused with a code, not 54000 from the index'
);
SELECT lives_ok(
    $$SELECT outbox.emit(repeat('t', 255), repeat('i', 1024), repeat('e', 128), '{"schema_version": 1}',
        context => repeat('c', 64), tenant_id => repeat('t', 255), ordering_key => repeat('é', 512))$$,
    'every text field at its maximum is accepted (a 512-character key of 2-byte letters fits the index)'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => repeat('c', 65))$$,
    'OB003', NULL, 'a context over 64 characters is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', repeat('e', 129), '{"schema_version": 1}', context => 'sea')$$,
    'OB003', NULL, 'an event_type over 128 characters is refused'
);

-- Values sent as Pgoutbox-* headers.
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea', tenant_id => '')$$,
    'OB006', NULL, 'an empty tenant_id is refused (NULL means none)'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea', ordering_key => '')$$,
    'OB006', NULL, 'an empty ordering_key is refused (NULL means none)'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', E'42\r\nNats-Msg-Id: x', 'created', '{"schema_version": 1}', context => 'sea')$$,
    'OB006', NULL, 'a line break in aggregate_id is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o ', '1', 'created', '{"schema_version": 1}', context => 'sea')$$,
    'OB006', NULL, 'trailing white space in aggregate_type is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea', ordering_key => E'k\n')$$,
    'OB006', NULL, 'a line break in ordering_key is refused'
);

-- schema_version.
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1.0}', context => 'sea')$$,
    'OB005', NULL, 'schema_version 1.0 is refused (it would reach consumers as a float)'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 2147483648}', context => 'sea')$$,
    'OB005', NULL, 'schema_version 2^31 is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1e400}', context => 'sea')$$,
    'OB005', NULL, 'a huge schema_version is refused'
);
SELECT throws_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": -1}', context => 'sea')$$,
    'OB005', NULL, 'a negative schema_version is refused'
);
SELECT lives_ok(
    $$SELECT outbox.emit('o', '1', 'created', '{"schema_version": 2147483647}', context => 'sea')$$,
    'schema_version 2^31 - 1 is accepted'
);
RESET ROLE;

SELECT is(
    (
        SELECT count(*) FROM outbox.events
        WHERE status = 'PENDING'
    ),
    6::bigint, 'only the accepted events were stored'
);

SELECT * FROM finish();
ROLLBACK;
