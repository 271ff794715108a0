-- Schema shape.
-- as owner: a check of the catalog (tables, functions, indexes) as the schemas' owner sees it; the
-- API is called as its role in the files after this one
-- Scenarios:
--   * the schemas, tables and public functions exist with their documented names
--   * outbox.events is range-partitioned by created_at with a default partition
--   * create_partitions() creates today and the days ahead, is idempotent,
--     validates its argument, and routes rows to the day's partition
--   * a day whose rows sit in the default partition is skipped, not broken
--   * day partitions and the default partition are vacuumed every 10,000 dead rows
--     and leave half of each page for the claim's and the mark's row versions
--   * the schema records its version
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(26);

SELECT has_schema('outbox');
SELECT has_schema('inbox');
SELECT has_table('outbox', 'events', 'outbox.events exists');
SELECT has_table('inbox', 'messages', 'inbox.messages exists');
SELECT columns_are('outbox', 'events', ARRAY[
    'id', 'event_id', 'context', 'aggregate_type', 'aggregate_id', 'event_type',
    'event_version', 'subject', 'payload', 'headers', 'correlation_id', 'causation_id',
    'tenant_id', 'ordering_key', 'occurred_at', 'created_at', 'available_at', 'status',
    'attempts', 'last_error', 'claimed_at', 'claimed_by', 'claim_token', 'published_at'
], 'outbox.events has its documented columns');
SELECT col_is_pk('inbox', 'messages', ARRAY['message_id', 'handler'], 'inbox is keyed by (message_id, handler)');
SELECT has_function('outbox', 'emit', 'outbox.emit exists');
SELECT has_function('outbox', 'claim', ARRAY['text', 'integer', 'interval'], 'outbox.claim(worker, batch_size, lease)');
SELECT has_function('outbox', 'mark_published', 'outbox.mark_published exists');
SELECT has_function('outbox', 'mark_failed', 'outbox.mark_failed exists');
SELECT has_function('outbox', 'requeue', 'outbox.requeue exists');
SELECT has_function('outbox', 'backlog', 'outbox.backlog exists');
SELECT has_function('inbox', 'receive', 'inbox.receive exists');
SELECT has_function('inbox', 'backlog', 'inbox.backlog exists');

SELECT is(
    (
        SELECT partstrat FROM pg_partitioned_table
        WHERE partrelid = 'outbox.events'::regclass
    ),
    'r', 'outbox.events is range-partitioned'
);
SELECT is(
    (
        SELECT count(*)::int
        FROM pg_inherits
        WHERE
            inhparent = 'outbox.events'::regclass
            AND inhrelid = 'outbox.events_default'::regclass
    ),
    1, 'a default partition catches days with no partition'
);
SELECT ok(
    to_regclass(format('outbox.events_p%s', to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD'))) IS NOT NULL,
    'today''s partition exists after migration'
);
SELECT results_eq(
    $$SELECT * FROM outbox.create_partitions(2, '2031-01-01')$$,
    ARRAY['events_p20310101', 'events_p20310102', 'events_p20310103'],
    'create_partitions creates from_day and the days ahead'
);
SELECT is_empty(
    $$SELECT * FROM outbox.create_partitions(2, '2031-01-01')$$,
    'create_partitions is idempotent'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.create_partitions(-1)$$, 'OB006', NULL,
    'a negative days_ahead is refused'
);

-- A row for a day with no partition lands in the default partition...
INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload, created_at)
VALUES ('sea', 'order', '1', 'created', '{"schema_version": 1}', '2032-06-01 12:00+00');
SELECT is(
    (
        SELECT tableoid::regclass::text FROM outbox.events
        WHERE created_at = '2032-06-01 12:00+00'
    ),
    'outbox.events_default', 'a row with no day partition lands in the default partition'
);
-- ...and creating that day's partition later is skipped with a warning.
SELECT is_empty(
    $$SELECT * FROM outbox.create_partitions(0, '2032-06-01')$$,
    'a day whose rows sit in the default partition is not created'
);
INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload, created_at)
VALUES ('sea', 'order', '2', 'created', '{"schema_version": 1}', '2031-01-02 08:00+00');
SELECT is(
    (
        SELECT tableoid::regclass::text FROM outbox.events
        WHERE created_at = '2031-01-02 08:00+00'
    ),
    'outbox.events_p20310102', 'a row is routed to its UTC day''s partition'
);

SELECT is(
    outbox.schema_version(), (SELECT count(*)::int FROM outbox.schema_migrations),
    'the schema records its version: the highest of versions 1..n, one row each'
);

SELECT is_empty(
    $$SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
      WHERE i.inhparent = 'outbox.events'::regclass
        AND NOT coalesce(c.reloptions, '{}') @> ARRAY['autovacuum_vacuum_scale_factor=0',
            'autovacuum_vacuum_threshold=10000']$$,
    'every partition of outbox.events is vacuumed by dead-row count, not by ratio'
);

SELECT is_empty(
    $$SELECT c.relname FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
      WHERE i.inhparent = 'outbox.events'::regclass
        AND NOT coalesce(c.reloptions, '{}') @> ARRAY['fillfactor=50']$$,
    'every partition of outbox.events is filled to half at insert (fillfactor 50)'
);

SELECT * FROM finish();
ROLLBACK;
