-- The backfill's view of the Parquet archive (sql/68_backfill.sql) and its role.
-- Scenarios:
--   * backfill_archived_days lists the standing, removed audits of
--     outbox.events overlapping the range, in day order; a day archived but
--     still live, a voided audit and the inbox's audits are not listed
--   * backfill_verify_archived_day returns the audited URI when the figures
--     are the audit's, and refuses other figures with ARCHIVE_TAMPERED
--     (OB111) and a day without a standing audit with ARCHIVE_NOT_AUDITED (OB112)
--   * bad arguments are refused with OB006
--   * pgoutbox_backfiller calls them and checksum_columns, and reads no audit table
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(10);

INSERT INTO outbox.archive_audit (source, day, relation, row_count, checksum, archive_uri) VALUES
('outbox.events', date '2026-01-03', 'events_p20260103', 5, 123, 'file:/a/day=2026-01-03'),
('outbox.events', date '2026-01-01', 'events_p20260101', 3, 456, 'file:/a/day=2026-01-01'),
('outbox.events', date '2026-01-02', 'events_p20260102', 4, 789, 'file:/a/day=2026-01-02'),
('outbox.events', date '2026-01-05', 'events_p20260105', 2, 10, 'file:/a/day=2026-01-05'),
('inbox.messages', date '2026-01-02', NULL, 7, 11, 'file:/i/day=2026-01-02');
-- Removed: 01-01 to 01-03 (and the inbox day); 01-05 is archived but still live.
UPDATE outbox.archive_audit SET removed_at = now(), removed_by = 'test'
WHERE day BETWEEN date '2026-01-01' AND date '2026-01-03';
-- A voided audit: 01-04 (its rows still live, to be archived afresh).
INSERT INTO outbox.archive_audit (source, day, relation, row_count, checksum, archive_uri)
VALUES ('outbox.events', date '2026-01-04', 'events_p20260104', 1, 1, 'file:/a/day=2026-01-04');
UPDATE outbox.archive_audit SET voided_at = now(), voided_by = 'test', void_reason = 'test'
WHERE day = date '2026-01-04';

SELECT results_eq(
    $$SELECT day, archive_uri, row_count, checksum
      FROM outbox.backfill_archived_days('2026-01-01T00:00:00Z', '2026-02-01T00:00:00Z')$$,
    $$VALUES (DATE '2026-01-01', 'file:/a/day=2026-01-01', 3::bigint, 456::numeric),
             (DATE '2026-01-02', 'file:/a/day=2026-01-02', 4::bigint, 789::numeric),
             (DATE '2026-01-03', 'file:/a/day=2026-01-03', 5::bigint, 123::numeric)$$,
    'backfill_archived_days lists the removed, standing outbox days in day order'
);
SELECT results_eq(
    $$SELECT day FROM outbox.backfill_archived_days('2026-01-01T12:00:00Z', '2026-01-02T00:00:01Z')$$,
    $$VALUES (DATE '2026-01-01'), (DATE '2026-01-02')$$,
    'a day is listed when any part of it is in the range'
);
SELECT is(
    outbox.backfill_verify_archived_day(date '2026-01-02', 4, 789), 'file:/a/day=2026-01-02',
    'the audited figures pass, and give the audited URI'
);
SELECT throws_ok(
    $$SELECT outbox.backfill_verify_archived_day(DATE '2026-01-02', 4, 790)$$,
    'OB111', 'ARCHIVE_TAMPERED: the archive of outbox.events for 2026-01-02 is not what was audited',
    'another checksum is ARCHIVE_TAMPERED'
);
SELECT throws_ok(
    $$SELECT outbox.backfill_verify_archived_day(DATE '2026-01-02', 3, 789)$$,
    'OB111', NULL, 'another row count is ARCHIVE_TAMPERED'
);
SELECT throws_ok(
    $$SELECT outbox.backfill_verify_archived_day(DATE '2026-01-04', 1, 1)$$,
    'OB112', NULL, 'a day whose audit was voided is ARCHIVE_NOT_AUDITED'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.backfill_archived_days('2026-01-02T00:00:00Z', '2026-01-01T00:00:00Z')$$,
    'OB006', NULL, 'an empty range is refused'
);

SET LOCAL ROLE pgoutbox_backfiller;
SELECT results_eq(
    $$SELECT count(*) FROM outbox.backfill_archived_days('2026-01-01T00:00:00Z', '2026-02-01T00:00:00Z')
      WHERE outbox.backfill_verify_archived_day(day, row_count, checksum) = archive_uri$$,
    ARRAY[3::bigint],
    'pgoutbox_backfiller lists the archived days and verifies them'
);
SELECT throws_ok('SELECT count(*) FROM outbox.archive_audit', '42501', NULL, 'but reads no audit table');
RESET ROLE;
SELECT ok(
    has_function_privilege('pgoutbox_backfiller', 'outbox.checksum_columns(text)', 'EXECUTE')
    AND NOT has_function_privilege(
        'pgoutbox_writer', 'outbox.backfill_archived_days(timestamptz, timestamptz)', 'EXECUTE'
    )
    AND NOT has_function_privilege(
        'pgoutbox_consumer', 'outbox.backfill_verify_archived_day(date, bigint, numeric)', 'EXECUTE'
    ),
    'pgoutbox_backfiller computes the archive checksum; other roles may not call the archive gates'
);

SELECT * FROM finish();
ROLLBACK;
