-- Invariants that hold for everyone, the table owner included (this file
-- runs as the owner), and the wake-up throttle no writer can change.
-- Scenarios:
--   * TRUNCATE of the default partition, or of a day partition by name, is
--     refused like DELETE (DELETE_FORBIDDEN, OB012); so is the parent's
--   * every partition carries its TRUNCATE guard: those the migration found,
--     those create_partitions makes, and one created by hand (the event
--     trigger adds it)
--   * DETACH PARTITION of a day or of the default partition is refused
--     (OB012) and the partition stays attached (DETACH ... CONCURRENTLY
--     cannot run in a transaction: tests/schema/test_sql_invariants.py)
--   * (dropping an archived partition through outbox.drop_archived still
--     works: pgtap/95_archival.sql)
--   * the throttle: set_notify_throttle refuses NULL, negative and over
--     1 minute (INVALID_SETTING, OB007) and an out-of-range value cannot be
--     stored at all; a session's pgoutbox.notify_throttle changes nothing;
--     only admins may set it, and nobody may write the table directly
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(23);

SELECT outbox._partition_name((now() AT TIME ZONE 'UTC')::date) AS today \gset
SELECT outbox.emit('o', '1', 'created', '{"schema_version": 1}', context => 'sea');

SELECT throws_ok($$TRUNCATE outbox.events$$, 'OB012', NULL, 'TRUNCATE of outbox.events is refused');
SELECT throws_ok(
    format('TRUNCATE outbox.%I', :'today'), 'OB012', NULL, 'TRUNCATE of today''s partition by name is refused'
);
SELECT throws_ok($$TRUNCATE outbox.events_default$$, 'OB012', NULL, 'TRUNCATE of the default partition is refused');
SELECT is((SELECT count(*) FROM outbox.events), 1::bigint, 'the event is still there');

SELECT is_empty(
    $$SELECT i.inhrelid::regclass FROM pg_inherits AS i
      WHERE i.inhparent = 'outbox.events'::regclass
        AND NOT EXISTS (
            SELECT 1 FROM pg_trigger AS t
            WHERE t.tgrelid = i.inhrelid AND t.tgname = '_100_forbid_truncate'
                AND t.tgfoid = 'outbox.tg_events__forbid_delete()'::regprocedure
        )$$,
    'every partition carries its TRUNCATE guard'
);
SELECT outbox.create_partitions(0, '2041-05-06');
SELECT throws_ok(
    $$TRUNCATE outbox.events_p20410506$$, 'OB012', NULL, 'a partition made by create_partitions refuses TRUNCATE'
);
CREATE TABLE outbox.events_p20410507 PARTITION OF outbox.events
FOR VALUES FROM ('2041-05-07 00:00:00+00') TO ('2041-05-08 00:00:00+00');
SELECT throws_ok(
    $$TRUNCATE outbox.events_p20410507$$, 'OB012', NULL, 'a partition created by hand gets the guard too'
);

SELECT throws_ok(
    format('ALTER TABLE outbox.events DETACH PARTITION outbox.%I', :'today'), 'OB012', NULL,
    'DETACH of a day partition is refused'
);
SELECT throws_ok(
    $$ALTER TABLE outbox.events DETACH PARTITION outbox.events_p20410506$$, 'OB012', NULL,
    'DETACH of an empty future partition is refused as well'
);
SELECT throws_ok(
    $$ALTER TABLE outbox.events DETACH PARTITION outbox.events_default$$, 'OB012', NULL,
    'DETACH of the default partition is refused'
);
SELECT is(
    (
        SELECT count(*) FROM pg_class
        WHERE oid IN (format('outbox.%I', :'today')::regclass, 'outbox.events_default'::regclass) AND relispartition
    ),
    2::bigint, 'the partitions are still attached'
);
SELECT is((SELECT count(*) FROM outbox.events), 1::bigint, 'and the event still visible through outbox.events');
SELECT lives_ok(
    $$ALTER TABLE outbox.events_p20410506 SET (autovacuum_vacuum_threshold = 5000)$$,
    'other ALTER TABLEs on a partition still work'
);

-- The throttle.
SELECT throws_ok($$SELECT outbox.set_notify_throttle(NULL)$$, 'OB007', NULL, 'a NULL throttle is refused');
SELECT throws_ok($$SELECT outbox.set_notify_throttle('-1 ms')$$, 'OB007', NULL, 'a negative throttle is refused');
SELECT throws_ok(
    $$SELECT outbox.set_notify_throttle('1 minute 1 ms')$$, 'OB007', NULL, 'a throttle over 1 minute is refused'
);
SELECT throws_ok(
    $$UPDATE outbox.wakeup_policy SET notify_throttle = '2 minutes'$$, '23514', NULL,
    'an out-of-range throttle cannot be stored, even by the owner'
);
SELECT is(outbox.set_notify_throttle('20 ms'), interval '20 ms', 'an admin''s throttle is stored');
SELECT set_config('pgoutbox.notify_throttle', '1 minute', TRUE);
SELECT is(outbox.notify_throttle(), interval '20 ms', 'a session setting pgoutbox.notify_throttle changes nothing');

CREATE ROLE t_writer IN ROLE pgoutbox_writer;
CREATE ROLE t_admin IN ROLE pgoutbox_admin;
SET LOCAL ROLE t_writer;
SELECT throws_ok(
    $$SELECT outbox.set_notify_throttle('1 minute')$$, '42501', NULL, 'a writer may not set the throttle'
);
SELECT throws_ok(
    $$UPDATE outbox.wakeup_policy SET notify_throttle = '1 minute'$$, '42501', NULL,
    'a writer may not write the throttle''s table'
);
RESET ROLE;
SET LOCAL ROLE t_admin;
SELECT lives_ok($$SELECT outbox.set_notify_throttle('5 ms')$$, 'an admin may set the throttle');
SELECT throws_ok(
    $$UPDATE outbox.wakeup_policy SET notify_throttle = '1 minute'$$, '42501', NULL,
    'an admin writes it only through the function'
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
