-- The archival functions' simple argument checks, each with its code:
-- nothing is sealed, recorded, dropped or purged on a bad argument.
-- Scenarios:
--   * retentions NULL, negative or over 100 years (seal_partition,
--     archivable_partitions, archivable_days)
--   * lock_timeout NULL, 0 (PostgreSQL's "wait for ever"), over 1 hour
--     (seal_partition, drop_archived, void_archive)
--   * days NULL, infinite or before 1900 (archive_figures, record_archive,
--     purge_archived, void_archive, try_lock_archive)
--   * record_archive: negative row_count, fractional checksum, a URI over
--     2,048 characters (refused by code, not by the audit table's CHECKs)
--   * void_archive: a reason over 1,000 characters; try_lock_archive /
--     archive_audits: an unknown source
--   * set_stream_max_age: over 100 years
--   * the bounds checks' messages (one range check under all of them) name
--     the argument, its range and the value given
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(25);

SET LOCAL ROLE pgoutbox_relay;
SELECT outbox.create_partitions(0, '2001-01-01');
RESET ROLE;

SET LOCAL ROLE pgoutbox_archiver;
SELECT throws_ok(
    $$SELECT * FROM outbox.seal_partition('events_p20010101', retention => NULL)$$, 'OB006', NULL,
    'seal_partition: a NULL retention is refused'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.seal_partition('events_p20010101', retention => '-1 day')$$, 'OB006', NULL,
    'seal_partition: a negative retention is refused (it would seal days to come)'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.seal_partition('events_p20010101', dead_letter_retention => '101 years')$$, 'OB006', NULL,
    'seal_partition: a dead_letter_retention over 100 years is refused'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.seal_partition('events_p20010101', lock_timeout => '0')$$, 'OB006', NULL,
    'seal_partition: lock_timeout 0 (wait for ever) is refused'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.archivable_partitions(interval '1000000 years')$$, 'OB006', NULL,
    'archivable_partitions: an absurd retention is refused, not 22008'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.archivable_days(interval '1000000 years')$$, 'OB006', NULL,
    'archivable_days: an absurd retention is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.archivable_days(dead_letter_retention => NULL)$$, 'OB006', NULL,
    'archivable_days: a NULL dead_letter_retention is refused'
);
SELECT throws_ok(
    $$SELECT outbox.drop_archived('events_p20010101', NULL)$$, 'OB006', NULL,
    'drop_archived: a NULL lock_timeout is refused'
);
SELECT throws_ok(
    $$SELECT outbox.drop_archived('events_p20010101', '2 hours')$$, 'OB006', NULL,
    'drop_archived: a lock_timeout over 1 hour is refused'
);
RESET ROLE;
SELECT throws_ok(
    $$SELECT * FROM outbox.archive_figures('outbox.events', NULL)$$, 'OB006', NULL, 'archive_figures: a NULL day'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.archive_figures('inbox.messages', 'infinity')$$, 'OB008', NULL,
    'archive_figures: day infinity is refused'
);
SELECT throws_ok(
    $$SELECT outbox.record_archive('inbox.messages', '2001-01-01', -1, 0, 'file:/a')$$, 'OB006', NULL,
    'record_archive: a negative row_count is refused by code'
);
SELECT throws_ok(
    $$SELECT outbox.record_archive('inbox.messages', '2001-01-01', 0, 0.5, 'file:/a')$$, 'OB006', NULL,
    'record_archive: a fractional checksum is refused by code'
);
SELECT throws_ok(
    $$SELECT outbox.record_archive('inbox.messages', '2001-01-01', 0, 0, 'file:/' || repeat('a', 2048))$$,
    'OB009', NULL,
    'record_archive: an archive_uri over 2,048 characters is refused'
);
SELECT throws_ok(
    $$SELECT outbox.record_archive('inbox.messages', '1899-12-31', 0, 0, 'file:/a')$$, 'OB008', NULL,
    'record_archive: a day before 1900 is refused'
);
SET LOCAL ROLE pgoutbox_archiver;
SELECT throws_ok($$SELECT inbox.purge_archived(NULL)$$, 'OB006', NULL, 'purge_archived: a NULL day is refused');
RESET ROLE;
SELECT throws_ok(
    $$SELECT outbox.void_archive('outbox.events', '2001-01-01', repeat('r', 1001))$$, 'OB009', NULL,
    'void_archive: a reason over 1,000 characters is refused'
);
SELECT throws_ok(
    $$SELECT outbox.void_archive('outbox.events', '-infinity', 'r')$$, 'OB008', NULL,
    'void_archive: day -infinity is refused'
);
SET LOCAL ROLE pgoutbox_archiver;
SELECT throws_ok(
    $$SELECT outbox.try_lock_archive(NULL, '2001-01-01')$$, 'OB050', NULL,
    'try_lock_archive: a NULL source is refused, not a NULL answer'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.archive_audits('public.t')$$, 'OB050', NULL, 'archive_audits: an unknown source is refused'
);
RESET ROLE;
SET LOCAL ROLE pgoutbox_admin;
SELECT throws_ok(
    $$SELECT inbox.set_stream_max_age('101 years')$$, 'OB006', NULL, 'set_stream_max_age: over 100 years is refused'
);
RESET ROLE;

SELECT throws_ok(
    $$SELECT outbox._check_retention(interval '-1 day', 'dead_letter_retention')$$, 'OB006',
    'INVALID_ARGUMENT: dead_letter_retention must be an interval from 0 to 100 years, got -1 days',
    'a retention''s message names it, its range and the value'
);
SELECT throws_ok(
    $$SELECT outbox._check_lock_timeout(NULL)$$, 'OB006',
    'INVALID_ARGUMENT: lock_timeout must be an interval from 1 ms to 1 hour, got <NULL>',
    'a lock_timeout''s message names it, its range and the value'
);
SELECT throws_ok(
    $$SELECT outbox._check_max_rows(10001)$$, 'OB006',
    'INVALID_ARGUMENT: max_rows must be between 1 and 10000, got 10001',
    'a row limit''s message names it, its range and the value'
);
SELECT lives_ok(
    $$SELECT outbox._check_max_rows(1), outbox._check_max_rows(10000),
        outbox._check_lock_timeout(interval '1 millisecond'), outbox._check_retention(interval '0', 'retention')$$,
    'both ends of a range are in it'
);

SELECT * FROM finish();
ROLLBACK;
