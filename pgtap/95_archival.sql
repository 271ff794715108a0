-- Archival lifecycle in SQL: list -> seal -> record -> drop (outbox) and
-- list -> record -> purge (inbox), as the owner and as the roles.
-- Scenarios:
--   * listing: only day partitions whose day ended more than `retention` ago;
--     open rows and dead letters younger than dead_letter_retention block a
--     day; older dead letters do not; the default partition is never listed
--   * seal refuses a non-partition (OB050), open rows (OB051), a young
--     partition or young dead letters (OB052); it is idempotent
--   * a sealed partition is read-only (OB056): requeue, insert, truncate;
--     today's partition is not affected
--   * the checksum of a known row equals a golden vector (the one the Spark
--     tests use), with NULL, '|' and '\' in it; the outbox's checksum leaves
--     out subject (derived), as it did while subject was generated
--   * record needs a seal (OB061), refuses figures that differ from the live
--     ones (OB053), is idempotent, and refuses a second, different archive (OB055)
--   * drop needs an audit (OB054), refuses a partition changed after its
--     audit (OB053), otherwise drops the table (no DELETE) and marks the
--     audit removed; dropping again returns 0
--   * void needs a reason (OB014), is refused once removed (OB055), unseals
--   * audit rows cannot be changed or deleted (OB060)
--   * inbox: a retention below the streams' max_age is refused by listing
--     and by record (OB057); open rows block a day (OB051); purge needs an
--     audit (OB054), rolls back when the day changed since (OB053), and
--     otherwise removes exactly that day; DELETE and TRUNCATE outside purge
--     are refused (OB012)
--   * seal figures: taken once after the seal (OB061 before it), returned
--     as taken; a change behind the seal (replica mode) or disabled seal
--     triggers fail record and drop with SEAL_BROKEN (OB062), also when the
--     archive equals the changed rows; void voids them; the archiver may
--     take them
--   * privileges: the archiver lists and records, and reads the partitions it
--     sealed (not others, nor voided ones), but cannot void, delete or update;
--     a writer cannot drop
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(77);
\ir fixtures/events.sql
\ir fixtures/archival.sql

SELECT
    today - 40 AS d40,
    today - 20 AS d20,
    today - 10 AS d10,
    today - 9 AS d9,
    today - 8 AS d8,
    today - 3 AS d3,
    outbox._partition_name(today - 40) AS p40,
    outbox._partition_name(today - 20) AS p20,
    outbox._partition_name(today - 10) AS p10,
    outbox._partition_name(today - 9) AS p9,
    outbox._partition_name(today - 8) AS p8,
    outbox._partition_name(today - 3) AS p3
FROM (SELECT (now() AT TIME ZONE 'UTC')::date AS today) AS t \gset

SELECT outbox.create_partitions(0, d)
FROM unnest(ARRAY[:'d40', :'d20', :'d10', :'d9', :'d8', :'d3']::date[]) AS x (d);

SELECT
    fixture.old_event(:'d40') AS e40a,
    fixture.old_event(:'d40') AS e40b,
    fixture.old_event(:'d40', 'DEAD_LETTER') AS dl40
\gset
SELECT fixture.old_event(d, s, c) AS event_id
FROM (
    VALUES
    (:'d20'::date, 'COMPLETED', 'sea'), (:'d20', 'DEAD_LETTER', 'sea'),
    (:'d10', 'COMPLETED', 'sea'), (:'d10', 'FAILED', 'sea'),
    (:'d9', 'COMPLETED', 'sea'), (:'d9', 'COMPLETED', 'vibespro'), (:'d9', 'COMPLETED', 'sea'),
    (:'d3', 'COMPLETED', 'sea')
) AS x (d, s, c);

-- Listing.
SELECT results_eq(
    $$SELECT partition_name, eligible, blocked_by FROM outbox.archivable_partitions() ORDER BY 1$$,
    format(
        $$VALUES (%L, TRUE, NULL::text), (%L, FALSE, 'dead letters younger than dead_letter_retention'),
        (%L, FALSE, 'open rows (PENDING, PROCESSING or FAILED)'), (%L, TRUE, NULL), (%L, TRUE, NULL)$$,
        :'p40', :'p20', :'p10', :'p9', :'p8'
    ),
    'old partitions are listed with what blocks them; young ones and the default are not'
);
SELECT is(
    (
        SELECT format('%s/%s/%s', row_count, open_rows, dead_letters) FROM outbox.archivable_partitions()
        WHERE day = :'d40'
    ),
    '3/0/1',
    'listing counts rows, open rows and dead letters'
);
SELECT ok(
    (
        SELECT eligible FROM outbox.archivable_partitions(interval '7 days', interval '10 days')
        WHERE day = :'d20'
    ),
    'dead letters older than dead_letter_retention no longer block their day'
);
SELECT is(
    (SELECT count(*) FROM outbox.archivable_partitions(interval '30 days')), 1::bigint,
    'a longer retention lists fewer partitions'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.archivable_partitions(interval '-1 day')$$, 'OB006', NULL,
    'a negative retention is refused'
);

-- Seal.
SELECT throws_ok(
    $$SELECT * FROM outbox.seal_partition('events_default')$$, 'OB050', NULL,
    'the default partition is not a day partition'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.seal_partition('events_p20250230')$$, 'OB050', NULL,
    'a name that is no calendar day is refused'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.seal_partition('events_p19990101')$$, 'OB050', NULL,
    'a day without a partition is refused'
);
SELECT throws_ok(
    format('SELECT * FROM outbox.seal_partition(%L)', :'p10'), 'OB051', NULL,
    'a partition with a FAILED row is not closed'
);
SELECT throws_ok(
    format('SELECT * FROM outbox.seal_partition(%L)', :'p20'), 'OB052', NULL,
    'a partition with young dead letters waits for dead_letter_retention'
);
SELECT throws_ok(
    format('SELECT * FROM outbox.seal_partition(%L)', :'p3'), 'OB052', NULL,
    'a partition younger than the retention is refused'
);
SELECT is(
    (SELECT format('%s/%s', max_id - min_id, range_to - range_from) FROM outbox.seal_partition(:'p9')),
    '2/1 day', 'seal returns the id bounds and the day''s range'
);
SELECT is(
    (SELECT max_id - min_id FROM outbox.seal_partition(:'p9')), 2::bigint, 'sealing again is a no-op'
);
SELECT ok(outbox._is_sealed(:'p9'), 'the partition carries its seal');
SELECT lives_ok(
    format('SELECT * FROM outbox.seal_partition(%L)', :'p40'),
    'a partition with dead letters older than dead_letter_retention is sealed'
);
SELECT lives_ok(format('SELECT * FROM outbox.seal_partition(%L)', :'p8'), 'an empty partition is sealed');

-- Read-only once sealed.
SELECT throws_ok(
    format('SELECT outbox.requeue(ARRAY[%L]::uuid[], %L)', :'dl40', 'try again'), 'OB056', NULL,
    'a dead letter in a sealed partition cannot be requeued'
);
SELECT throws_ok(
    format('SELECT fixture.old_event(%L)', :'d40'), 'OB056', NULL,
    'no row can be added to a sealed partition'
);
SELECT throws_ok(format('TRUNCATE outbox.%I', :'p40'), 'OB056', NULL, 'a sealed partition cannot be truncated');
SELECT lives_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', context => 'sea')$$,
    'today''s partition is not affected'
);

-- Checksum golden vector (also in tests/test_archive_spark.py). The E'' literal
-- continues on the next line, escapes included.
SELECT results_eq(
    $$SELECT column_name, kind FROM outbox.checksum_columns('inbox.messages') ORDER BY ordinal$$,
    $$VALUES ('message_id', 'plain'), ('handler', 'text'), ('subject', 'text'), ('envelope', 'text'),
        ('status', 'text'), ('received_at', 'timestamp'), ('processed_at', 'timestamp'),
        ('attempts', 'plain'), ('last_error', 'text'), ('dlq_metadata', 'text')$$,
    'the inbox checksum columns: stored, non-generated, in table order'
);
SELECT results_eq(
    $$SELECT column_name FROM outbox.checksum_columns('outbox.events') ORDER BY ordinal$$,
    $$VALUES ('id'), ('event_id'), ('context'), ('aggregate_type'), ('aggregate_id'), ('event_type'),
        ('event_version'), ('payload'), ('headers'), ('correlation_id'), ('causation_id'),
        ('tenant_id'), ('ordering_key'), ('occurred_at'), ('created_at'), ('available_at'),
        ('status'), ('attempts'), ('last_error'), ('claimed_at'), ('claimed_by'), ('claim_token'),
        ('published_at')$$,
    'the outbox checksum columns: every column but the derived subject, in table order'
);
INSERT INTO inbox.messages (
    message_id, handler, subject, envelope, status, received_at, processed_at, attempts, last_error, dlq_metadata
) VALUES (
    '00000000-0000-0000-0000-000000000001', 'h', 'sea.event.x.v1', NULL, 'PROCESSED',
    '2001-01-01 00:00:00.5+00', '2001-01-01 00:00:01.5+00', 1, E'a|b\\c', '{"k": "v|w"}'
);
SELECT is(
    (SELECT format('%s/%s', row_count, checksum) FROM outbox.archive_figures('inbox.messages', '2001-01-01')),
    format('1/%s', ('x' || substr(md5(
        E'00000000-0000-0000-0000-000000000001|h|sea.event.x.v1|\\N|PROCESSED'
        '|978307200500000|978307201500000|1|a\\|b\\\\c|{"k": "v\\|w"}'
    ), 1, 15))::bit(60)::bigint),
    'the checksum of a known row is the golden vector'
);
SELECT throws_ok(
    $$SELECT * FROM outbox.archive_figures('public.t', '2001-01-01')$$, 'OB050', NULL,
    'only the two sources are archived'
);

-- Record.
SELECT * FROM outbox.archive_figures('outbox.events', :'d9') \gset f9_
SELECT throws_ok(
    format('SELECT outbox.record_archive(%L, %L, 1, 1, %L)', 'outbox.events', :'d10', 'file:/a'), 'OB061', NULL,
    'an unsealed partition cannot be recorded'
);
SELECT throws_ok(
    format(
        'SELECT outbox.record_archive(%L, %L, %s, %s, %L)',
        'outbox.events',
        :'d9',
        :f9_row_count,
        :f9_checksum + 1,
        'file:/a'
    ),
    'OB053', NULL, 'figures that differ from the live rows are refused'
);
SELECT outbox.record_archive('outbox.events', :'d9', :f9_row_count, :f9_checksum, 'file:/a/day9') AS a9 \gset
SELECT is(
    outbox.record_archive('outbox.events', :'d9', :f9_row_count, :f9_checksum, 'file:/a/day9'), :a9::bigint,
    'recording the same archive again returns the same audit row'
);
SELECT throws_ok(
    format(
        'SELECT outbox.record_archive(%L, %L, %s, %s, %L)',
        'outbox.events',
        :'d9',
        :f9_row_count,
        :f9_checksum,
        'file:/b'
    ),
    'OB055', NULL, 'a second, different archive of a day is refused'
);

-- Drop.
SELECT throws_ok(
    format('SELECT outbox.drop_archived(%L)', :'p40'), 'OB054', NULL,
    'a partition without an audit row is not dropped'
);
SELECT outbox.record_archive('outbox.events', :'d40', f.row_count, f.checksum, 'file:/a/day40')
FROM outbox.archive_figures('outbox.events', :'d40') AS f;
SET LOCAL session_replication_role = replica;  -- tampering bypasses every trigger
UPDATE outbox.events SET last_error = 'tampered'
WHERE event_id = :'dl40';
RESET session_replication_role;
SELECT throws_ok(
    format('SELECT outbox.drop_archived(%L)', :'p40'), 'OB053', NULL,
    'a partition changed after its audit is not dropped'
);
SELECT has_table('outbox', :'p40', 'the tampered partition is still there');
-- Schedule rows of delivered events, one on the day dropped and one on a day kept.
INSERT INTO outbox.schedules (event_id, created_at, context, deliver_at, emitted_by)
WITH done AS (
    SELECT
        e.id,
        e.event_id,
        e.created_at,
        e.context,
        (e.created_at AT TIME ZONE 'UTC')::date AS day
    FROM outbox.events AS e
    WHERE e.status = 'COMPLETED'
)

SELECT DISTINCT ON (d.day)
    d.event_id,
    d.created_at,
    d.context,
    d.created_at AS deliver_at,
    'fixture' AS emitted_by
FROM done AS d
WHERE d.day IN (:'d9', :'d3')
ORDER BY d.day, d.id;
SELECT is(outbox.drop_archived(:'p9'), 3::bigint, 'an audited partition is dropped: its row count');
SELECT is(
    (
        SELECT array_agg((s.created_at AT TIME ZONE 'UTC')::date) FROM outbox.schedules AS s
        WHERE s.emitted_by = 'fixture'
    ),
    ARRAY[:'d3'::date], 'the dropped day''s schedule rows go with it, other days'' stay'
);
SELECT hasnt_table('outbox', :'p9', 'the partition is gone as a table');
SELECT is(
    (
        SELECT count(*)
        FROM outbox.events
        WHERE
            created_at >= :'d9'::timestamp AT TIME ZONE 'UTC'
            AND created_at < (:'d9'::date + 1)::timestamp AT TIME ZONE 'UTC'
    ),
    0::bigint, 'none of its rows is left'
);
SELECT ok(
    (
        SELECT removed_at IS NOT NULL AND removed_by = session_user FROM outbox.archive_audit
        WHERE id = :a9
    ),
    'the audit row says who removed it and when'
);
SELECT is(outbox.drop_archived(:'p9'), 0::bigint, 'dropping again is a no-op');

-- Void.
SELECT throws_ok(
    format('SELECT outbox.void_archive(%L, %L, %L)', 'outbox.events', :'d9', 'oops'), 'OB055', NULL,
    'a removed day cannot be voided: its archive is the only copy'
);
SELECT throws_ok(
    format('SELECT outbox.void_archive(%L, %L, %L)', 'outbox.events', :'d40', ' '), 'OB014', NULL,
    'voiding needs a reason'
);
SELECT lives_ok(
    format('SELECT outbox.void_archive(%L, %L, %L)', 'outbox.events', :'d40', 'changed by hand, investigated'),
    'a standing audit is voided with a reason'
);
SELECT ok(NOT outbox._is_sealed(:'p40'), 'voiding unseals the partition');
SELECT lives_ok(
    format('SELECT outbox.requeue(ARRAY[%L]::uuid[], %L)', :'dl40', 'after the void'),
    'its dead letter can be requeued again'
);

-- Audit rows are evidence.
SELECT throws_ok($$UPDATE outbox.archive_audit SET row_count = 0$$, 'OB060', NULL, 'audit figures cannot be changed');
SELECT throws_ok($$DELETE FROM outbox.archive_audit$$, 'OB060', NULL, 'audit rows cannot be deleted');

-- Inbox.
SELECT fixture.inbox_row(:'d40', 'DEAD_LETTER') AS idl40
\gset
SELECT fixture.inbox_row(d, s) AS message_id
FROM (
    VALUES
    (:'d40'::date, 'PROCESSED'), (:'d40', 'PROCESSED'), (:'d20', 'PROCESSED'), (:'d20', 'RECEIVED'),
    (:'d3', 'PROCESSED')
) AS x (d, s);
SELECT throws_ok(
    $$SELECT * FROM inbox.archivable_days(interval '3 days')$$, 'OB057', NULL,
    'an inbox retention below the streams'' max_age is refused'
);
SELECT results_eq(
    $$SELECT day, eligible, blocked_by FROM inbox.archivable_days(interval '14 days', interval '30 days') ORDER BY 1$$,
    format($$VALUES ('2001-01-01'::date, TRUE, NULL::text), (%L::date, TRUE, NULL),
        (%L::date, FALSE, 'open rows (RECEIVED or FAILED)')$$, :'d40', :'d20'),
    'inbox days older than the retention, with what blocks them'
);
SELECT inbox.set_stream_max_age(interval '45 days');
SELECT throws_ok(
    $$SELECT * FROM inbox.archivable_days(interval '14 days')$$, 'OB057', NULL,
    'a longer stream max_age raises the floor'
);
SELECT throws_ok(
    format('SELECT outbox.record_archive(%L, %L, 3, 0, %L)', 'inbox.messages', :'d40', 'file:/i'),
    'OB057', NULL, 'record refuses a day younger than the floor, whatever retention the caller used'
);
SELECT inbox.set_stream_max_age(interval '7 days');
SELECT throws_ok(
    format('SELECT outbox.record_archive(%L, %L, 2, 0, %L)', 'inbox.messages', :'d20', 'file:/i'),
    'OB051', NULL, 'an inbox day with open rows cannot be recorded'
);
SELECT throws_ok(
    format('SELECT inbox.purge_archived(%L)', :'d40'), 'OB054', NULL,
    'an inbox day without an audit row is not purged'
);
SELECT throws_ok($$DELETE FROM inbox.messages$$, 'OB012', NULL, 'DELETE on the inbox outside purge is refused');
SELECT throws_ok($$TRUNCATE inbox.messages$$, 'OB012', NULL, 'TRUNCATE on the inbox is refused');
SELECT outbox.record_archive('inbox.messages', :'d40', f.row_count, f.checksum, 'file:/i/day40')
FROM outbox.archive_figures('inbox.messages', :'d40') AS f;
UPDATE inbox.messages SET dlq_metadata = '{"replay_attempts": 1}'
WHERE message_id = :'idl40';
SELECT throws_ok(
    format('SELECT inbox.purge_archived(%L)', :'d40'), 'OB053', NULL,
    'a day changed since its audit is not purged'
);
SELECT is(
    (
        SELECT count(*)
        FROM inbox.messages
        WHERE
            received_at >= :'d40'::timestamp AT TIME ZONE 'UTC'
            AND received_at < (:'d40'::date + 1)::timestamp AT TIME ZONE 'UTC'
    ),
    3::bigint, 'the refused purge deleted nothing'
);
SELECT outbox.void_archive('inbox.messages', :'d40', 'replay bookkeeping changed it');
SELECT outbox.record_archive('inbox.messages', :'d40', f.row_count, f.checksum, 'file:/i/day40b')
FROM outbox.archive_figures('inbox.messages', :'d40') AS f;
SELECT is(inbox.purge_archived(:'d40'), 3::bigint, 'an audited inbox day is purged: its row count');
SELECT is(
    (SELECT count(*) FROM inbox.messages), 4::bigint,
    'exactly that day is gone (2001-01-01, d20 and d3 remain)'
);
SELECT is(inbox.purge_archived(:'d40'), 0::bigint, 'purging again is a no-op');

-- Seal figures (a fresh day, d12).
SELECT
    today - 12 AS d12,
    outbox._partition_name(today - 12) AS p12
FROM (SELECT (now() AT TIME ZONE 'UTC')::date AS today) AS t \gset
SELECT outbox.create_partitions(0, :'d12');
SELECT
    fixture.old_event(:'d12') AS e12a,
    fixture.old_event(:'d12') AS e12b
\gset
SELECT throws_ok(
    format('SELECT * FROM outbox.seal_figures(%L)', :'p12'), 'OB061', NULL,
    'no seal figures before the seal'
);
SELECT * FROM outbox.seal_partition(:'p12') \gset
SET LOCAL ROLE pgoutbox_archiver;
SELECT * FROM outbox.seal_figures(:'p12') \gset s12_
RESET ROLE;
SELECT is(:s12_row_count::bigint, 2::bigint, 'the archiver takes the seal figures: the sealed rows');
SELECT is(
    (SELECT format('%s/%s', row_count, checksum) FROM outbox.seal_figures(:'p12')),
    format('%s/%s', :s12_row_count, :s12_checksum), 'taken once, then returned as taken'
);
SET LOCAL session_replication_role = replica;  -- a change behind the seal, before any export
UPDATE outbox.events SET last_error = 'forged'
WHERE event_id = :'e12a';
RESET session_replication_role;
SELECT * FROM outbox.archive_figures('outbox.events', :'d12') \gset t12_
SELECT throws_ok(
    format(
        'SELECT outbox.record_archive(%L, %L, %s, %s, %L)',
        'outbox.events', :'d12', :t12_row_count, :t12_checksum, 'file:/a/day12'
    ),
    'OB062', NULL, 'an archive of rows changed since the seal is not recorded, though it matches them'
);
SET LOCAL session_replication_role = replica;
UPDATE outbox.events SET last_error = NULL
WHERE event_id = :'e12a';
RESET session_replication_role;
SELECT lives_ok(
    format(
        'SELECT outbox.record_archive(%L, %L, %s, %s, %L)',
        'outbox.events', :'d12', :s12_row_count, :s12_checksum, 'file:/a/day12'
    ),
    'the sealed rows themselves are recorded'
);
SELECT lives_ok(
    format('ALTER TABLE outbox.%I DISABLE TRIGGER _050_archived_read_only', :'p12'), 'the owner disables the seal'
);
SELECT throws_ok(
    format('SELECT outbox.drop_archived(%L)', :'p12'), 'OB062', NULL,
    'a partition whose seal triggers are disabled is not dropped, even unchanged'
);
SELECT lives_ok(
    format('ALTER TABLE outbox.%I ENABLE TRIGGER _050_archived_read_only', :'p12'), 'the owner enables it again'
);
SELECT lives_ok(
    format('SELECT outbox.void_archive(%L, %L, %L)', 'outbox.events', :'d12', 'tests'), 'void'
);
SELECT ok(
    (
        SELECT voided_at IS NOT NULL FROM outbox.archive_seal
        WHERE day = :'d12'
    ),
    'void voids the seal figures with the audit'
);
SELECT throws_ok(
    format('UPDATE outbox.archive_seal SET row_count = 0 WHERE day = %L', :'d12'), 'OB060', NULL,
    'seal figures cannot be changed'
);

-- Privileges.
SET LOCAL ROLE pgoutbox_archiver;
SELECT lives_ok($$SELECT * FROM outbox.archivable_partitions()$$, 'the archiver lists partitions');
SELECT lives_ok($$SELECT count(*) FROM outbox.events$$, 'the archiver reads outbox.events');
SELECT lives_ok(format('SELECT count(*) FROM outbox.%I', :'p8'), 'the archiver reads a partition it sealed');
SELECT throws_ok(
    format('SELECT count(*) FROM outbox.%I', :'p10'), '42501', NULL, 'but no partition that is not sealed'
);
SELECT throws_ok(
    format('SELECT count(*) FROM outbox.%I', :'p40'), '42501', NULL, 'nor one whose seal was voided'
);
SELECT throws_ok(
    format('SELECT outbox.void_archive(%L, %L, %L)', 'outbox.events', :'d40', 'x'), '42501', NULL,
    'the archiver cannot void an audit'
);
SELECT throws_ok($$DELETE FROM inbox.messages$$, '42501', NULL, 'the archiver cannot delete inbox rows');
SELECT throws_ok($$UPDATE outbox.events SET last_error = 'x'$$, '42501', NULL, 'the archiver cannot update events');
RESET ROLE;
SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(format('SELECT outbox.drop_archived(%L)', :'p8'), '42501', NULL, 'a writer cannot drop partitions');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
