-- emit with the caller's own event id (outbox.emit(event_id => ...)): a retry
-- is safe, and every path that writes rows keeps event ids unique.
-- Scenarios:
--   * a given id is the event's id and is registered in outbox.event_keys
--   * the same id with the same content: the same id back, one row; headers
--     and occurred_at are not content, key order in the payload is not either
--   * the same id with other content (payload, type, correlation): refused,
--     EVENT_ID_CONFLICT (OB018), whichever path writes it
--   * a version-4 id is refused: INVALID_EVENT_ID (OB019)
--   * an owner's INSERT of a given id is registered too: emit meets it
--   * emit without an id draws a version-4 id and registers nothing
--   * a rolled-back emit frees its id
--   * two sessions emitting one id at once (dblink, committed): one row
-- emit runs as pgoutbox_writer; the owner's INSERTs, the reads and the
-- dblink sessions as the owner (dblink needs it).
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(19);

-- Given ids: ...6a01 and ...6a02 (version 5), ...000c (version 7), and a version-4 one.
CREATE FUNCTION pg_temp.emit_as(id uuid, payload jsonb, event_type text DEFAULT 'created')
RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
    got uuid;
BEGIN
    SET LOCAL ROLE pgoutbox_writer;
    got := outbox.emit('order', '1', event_type, payload, context => 'sea', event_id => id);
    RESET ROLE;
    RETURN got;
END;
$$;
CREATE FUNCTION pg_temp.rows_of(given uuid) RETURNS bigint LANGUAGE sql AS $$
    SELECT count(*) FROM outbox.events WHERE event_id = given
$$;
CREATE FUNCTION pg_temp.keys_of(given uuid) RETURNS bigint LANGUAGE sql AS $$
    SELECT count(*) FROM outbox.event_keys WHERE event_id = given
$$;

SELECT is(
    pg_temp.emit_as('5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a01', '{"schema_version": 1, "n": 1}'),
    '5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a01'::uuid,
    'emit returns the given id'
);
SELECT is(pg_temp.rows_of('5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a01'), 1::bigint, 'the event carries the given id');
SELECT is(pg_temp.keys_of('5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a01'), 1::bigint, 'the given id is registered');
SET LOCAL ROLE pgoutbox_writer;
SELECT is(
    outbox.emit(
        'order', '1', 'created', '{"n": 1, "schema_version": 1}',
        context => 'sea',
        headers => '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}',
        occurred_at => now() - interval '1 second',
        event_id => '5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a01'
    ),
    '5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a01'::uuid,
    'the same id and content again (other headers, occurred_at, key order): the same id back'
);
RESET ROLE;
SELECT is(
    pg_temp.rows_of('5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a01'), 1::bigint, 'and nothing is written: still one row'
);
SELECT throws_ok(
    $$SELECT pg_temp.emit_as('5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a01', '{"schema_version": 1, "n": 2}')$$,
    'OB018', NULL, 'the same id with another payload is refused (EVENT_ID_CONFLICT)'
);
SELECT throws_ok(
    $$SELECT pg_temp.emit_as('5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a01', '{"schema_version": 1, "n": 1}', 'shipped')$$,
    'OB018', NULL, 'the same id with another event type is refused'
);
SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1, "n": 1}', context => 'sea',
        correlation_id => gen_random_uuid(), event_id => '5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a01')$$,
    'OB018', NULL, 'the same id with another correlation id is refused'
);
RESET ROLE;
SELECT throws_ok(
    $$SELECT pg_temp.emit_as('9c5b94b1-35ad-49bb-b118-8e8fc24abf80', '{"schema_version": 1}')$$,
    'OB019', NULL, 'a version-4 id (the kind emit draws) is refused (INVALID_EVENT_ID)'
);

SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}',
        event_id => '5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a09')$$,
    'OB001', NULL, 'a given id with a required part missing (no context): INVALID_OUTBOX, as without one'
);
RESET ROLE;

-- An owner's INSERT: held to the same register.
SELECT throws_ok(
    $$INSERT INTO outbox.events (event_id, context, aggregate_type, aggregate_id, event_type, payload)
      VALUES ('5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a01', 'sea', 'order', '1', 'created', '{"schema_version": 1, "n": 9}')$$,
    'OB018', NULL, 'an owner''s INSERT of a held id with other content is refused'
);
INSERT INTO outbox.events (event_id, context, aggregate_type, aggregate_id, event_type, payload)
VALUES ('5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a02', 'sea', 'order', '1', 'created', '{"schema_version": 1}');
SELECT is(
    pg_temp.keys_of('5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a02'), 1::bigint,
    'an owner''s INSERT of a given (non-version-4) id registers it'
);
SELECT is(
    pg_temp.emit_as('5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a02', '{"schema_version": 1}'),
    '5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a02'::uuid,
    'emit of the same event after an owner''s INSERT returns its id'
);
SELECT is(pg_temp.rows_of('5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a02'), 1::bigint, 'and writes no second row');

-- Drawn ids.
SET LOCAL ROLE pgoutbox_writer;
SELECT is(
    substr(outbox.emit('order', '3', 'created', '{"schema_version": 1}', context => 'sea')::text, 15, 1),
    '4', 'emit without an id draws a version-4 id'
);
RESET ROLE;
SELECT is((SELECT count(*) FROM outbox.event_keys), 2::bigint, 'drawn ids are not registered');

-- A rolled-back emit frees its id.
CREATE FUNCTION pg_temp.emit_then_fail(id uuid) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_temp.emit_as(id, '{"schema_version": 1, "n": 1}');
    RAISE EXCEPTION 'the business change failed' USING ERRCODE = 'P0001';
END;
$$;
SELECT throws_ok(
    $$SELECT pg_temp.emit_then_fail('0195d3a0-7c2e-7000-8000-00000000000c')$$, 'P0001', NULL,
    'an emit whose transaction fails after it (rolled back)'
);
SELECT lives_ok(
    $$SELECT pg_temp.emit_as('0195d3a0-7c2e-7000-8000-00000000000c', '{"schema_version": 1, "n": 2}')$$,
    'a rolled-back emit frees its id for other content'
);

-- Two sessions at once, each committing (dblink): the second waits for the
-- first's key, then finds the same event and writes nothing.
CREATE EXTENSION IF NOT EXISTS dblink;
CREATE FUNCTION pg_temp.here() RETURNS text LANGUAGE sql AS $$
    SELECT format(
        'host=%s dbname=%s port=%s user=%s',
        coalesce(host(inet_server_addr()), split_part(current_setting('unix_socket_directories'), ',', 1)),
        current_database(), current_setting('port'), current_user
    )
$$;
SELECT dblink_connect('one', pg_temp.here());
SELECT dblink_connect('two', pg_temp.here());
SELECT dblink_exec('one', 'BEGIN');
SELECT t.id
FROM dblink(
    'one', $$SELECT outbox.emit('order', '5', 'created', '{"schema_version": 1}',
    context => 'twosessions', event_id => '5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a05')::text$$
) AS t (id text);
SELECT dblink_send_query('two', $$SELECT outbox.emit('order', '5', 'created', '{"schema_version": 1}',
    context => 'twosessions', event_id => '5df6e0e2-7611-5b06-9a4c-0a7c0d3f6a05')::text$$);
SELECT dblink_exec('one', 'COMMIT');
SELECT t.id FROM dblink_get_result('two') AS t (id text);
SELECT t.id FROM dblink_get_result('two') AS t (id text);
SELECT is(
    (
        SELECT t.n
        FROM dblink('two', $$SELECT count(*) FROM outbox.events WHERE context = 'twosessions'$$) AS t (n bigint)
    ),
    1::bigint,
    'two sessions emitting one id at once write one row'
);
SELECT dblink_disconnect('one');
SELECT dblink_disconnect('two');

SELECT * FROM finish();
ROLLBACK;
