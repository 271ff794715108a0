-- The two outbox.emit signatures (sql/30_outbox_api.sql, the common case;
-- sql/36_outbox_schedules.sql, with event_id, deliver_at, deliver_after):
-- every call of the first signature, by position or by name, still resolves
-- (no "function is not unique") and runs the first; a call that names an
-- option runs the second; a varchar argument runs the second, with the same
-- outcome. Which one ran is read from the transaction's function statistics
-- (track_functions).
-- Scenarios:
--   * by position: 4 literals, 12 arguments, a NULL context, typed text values
--   * by name: all named, in another order, mixed
--   * a statement prepared with untyped parameters (a driver's binding)
--   * event_id, deliver_at, deliver_after, each alone, by name; 15 by position
--   * varchar arguments: the second signature, the same row
--   * both are granted to pgoutbox_writer and to nobody else
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(18);

SELECT set_config('track_functions', 'all', TRUE);
SELECT set_config('pgoutbox.context', 'sea', TRUE);

-- Which signature a call ran: 'first', 'second' (or 'none', 'both').
CREATE FUNCTION pg_temp.ran(call text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    first_sig regprocedure := 'outbox.emit(text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz)';
    second_sig regprocedure := 'outbox.emit(character varying, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz, uuid, timestamptz, interval)';
    f0 bigint := coalesce(pg_stat_get_xact_function_calls(first_sig), 0);
    s0 bigint := coalesce(pg_stat_get_xact_function_calls(second_sig), 0);
    f bigint;
    s bigint;
BEGIN
    EXECUTE call;
    f := coalesce(pg_stat_get_xact_function_calls(first_sig), 0) - f0;
    s := coalesce(pg_stat_get_xact_function_calls(second_sig), 0) - s0;
    RETURN CASE WHEN f = 1 AND s = 0 THEN 'first' WHEN f = 0 AND s = 1 THEN 'second'
        WHEN f = 0 AND s = 0 THEN 'none' ELSE 'both' END;
END;
$$;

SET LOCAL ROLE pgoutbox_writer;
SELECT is(
    pg_temp.ran($$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}')$$),
    'first', 'by position, four literals: the first signature'
);
SELECT is(
    pg_temp.ran($$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', 'sea', 1, '{}',
    NULL, NULL, 't', 'k', now())$$),
    'first', 'by position, all twelve'
);
SELECT is(
    pg_temp.ran($$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', NULL)$$),
    'first', 'by position, a NULL context'
);
SELECT is(
    pg_temp.ran($$SELECT outbox.emit('order'::text, '1'::text, 'created'::text,
    '{"schema_version": 1}'::jsonb, 'sea'::text)$$),
    'first', 'by position, typed text values'
);
SELECT is(
    pg_temp.ran($$SELECT outbox.emit(aggregate_type => 'order', aggregate_id => '1',
    event_type => 'created', payload => '{"schema_version": 1}', context => 'sea', tenant_id => 't')$$),
    'first', 'all by name'
);
SELECT is(
    pg_temp.ran($$SELECT outbox.emit(payload => '{"schema_version": 1}', event_type => 'created',
    aggregate_id => '1', aggregate_type => 'order')$$),
    'first', 'by name, in another order'
);
SELECT is(
    pg_temp.ran($$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}',
    context => 'sea', ordering_key => 'k', occurred_at => now())$$),
    'first', 'by position then by name'
);
PREPARE untyped AS SELECT outbox.emit($1, $2, $3, $4, context => $5);
SELECT is(
    pg_temp.ran($$EXECUTE untyped('order', '1', 'created', '{"schema_version": 1}', 'sea')$$),
    'first', 'prepared with untyped parameters (as a driver binds them)'
);

SELECT is(
    pg_temp.ran($$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}',
    event_id => '6ba7b810-9dad-51d1-80b4-00c04fd43801')$$),
    'second', 'event_id alone, by name: the second signature'
);
SELECT is(
    pg_temp.ran($$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}',
    deliver_at => now() + interval '1 minute')$$),
    'second', 'deliver_at alone'
);
SELECT is(
    pg_temp.ran($$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}',
    deliver_after => interval '1 minute')$$),
    'second', 'deliver_after alone'
);
SELECT is(
    pg_temp.ran($$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', 'sea', 1, '{}',
    NULL, NULL, NULL, NULL, NULL, '6ba7b810-9dad-51d1-80b4-00c04fd43802', NULL, interval '1 minute')$$),
    'second', 'all fifteen by position'
);
SELECT is(
    pg_temp.ran($$SELECT outbox.emit('order'::varchar, '1', 'created', '{"schema_version": 1}', context => 'vc')$$),
    'second', 'a varchar aggregate_type: the second signature'
);
RESET ROLE;

SELECT results_eq(
    $$SELECT aggregate_type, aggregate_id, event_type, payload, subject, status, available_at
      FROM outbox.events WHERE context = 'vc'$$,
    $$VALUES ('order', '1', 'created', '{"schema_version": 1}'::jsonb, 'vc.event.created.v1', 'PENDING', now())$$,
    'and the same event as the first would write'
);
SELECT is(
    (SELECT count(*) FROM outbox.schedules), 3::bigint,
    'only the calls with a delivery time entered a schedule'
);
SELECT is(
    (SELECT count(*) FROM outbox.event_keys), 2::bigint,
    'only the calls with an event id registered it'
);
SELECT ok(
    has_function_privilege(
        'pgoutbox_writer',
        'outbox.emit(text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz)', 'EXECUTE'
    )
    AND has_function_privilege(
        'pgoutbox_writer',
        'outbox.emit(character varying, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz,'
        || ' uuid, timestamptz, interval)',
        'EXECUTE'
    ),
    'both signatures are granted to pgoutbox_writer'
);
SELECT is(
    (
        SELECT count(*) FROM pg_proc AS p, aclexplode(p.proacl) AS a
        WHERE
            p.oid
            = (
                'outbox.emit(character varying, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text,'
                || ' timestamptz, uuid, timestamptz, interval)'
            )::regprocedure
            AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
    ),
    1::bigint, 'the second signature to pgoutbox_writer only (not PUBLIC)'
);

SELECT * FROM finish();
ROLLBACK;
