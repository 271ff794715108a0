-- Archival of command keys (inbox.commands as a source of sql/91 to sql/95):
-- list -> record -> purge, as the owner and as the roles.
-- Scenarios:
--   * listing: a retention below the clients' retry window is refused
--     (OB057); days by first_claimed_at; IN_PROGRESS keys block a day, and so
--     does a key settled within the retention (claimed again later)
--   * the checksum covers every column of the table, text, integer and
--     timestamps each rendered as the Spark side renders them
--   * record refuses a day with IN_PROGRESS keys (OB051), or keys settled
--     within the retry window, whatever retention the caller used (OB057)
--   * DELETE and TRUNCATE outside the purge are refused (OB012), TRUNCATE
--     even with the purge's setting on
--   * purge needs an audit (OB054), rolls back when the day changed since
--     (OB053), otherwise removes exactly that day and marks the audit
--     removed; purging again returns 0
--   * a key of a purged day is claimed afresh (a new first claim)
--   * void_archive voids a command audit while the keys are live
--   * privileges: the archiver lists, reads the table and purges, but cannot
--     delete rows or set the retry window; a writer cannot purge; an admin
--     sets the retry window
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(26);

CREATE SCHEMA fixture;

-- One key first claimed at noon (UTC) of a past day, written around the API
-- (first_claimed_at is not settable through claim_command), settled `settled`
-- later unless IN_PROGRESS.
CREATE FUNCTION fixture.command(
    day date,
    key text,
    target text DEFAULT 'DONE',
    settled interval DEFAULT interval '1 second'
)
RETURNS text
LANGUAGE plpgsql
AS $$
DECLARE
    at timestamptz := (day::timestamp + interval '12 hours') AT TIME ZONE 'UTC';
BEGIN
    INSERT INTO inbox.commands (
        handler, command_key, status, result, last_error, first_claimed_at, claimed_at, settled_at
    ) VALUES (
        'start_run', key, target,
        CASE WHEN target = 'DONE' THEN jsonb_build_object('run_id', 'r|' || key, 'note', E'a\\b') END,
        CASE WHEN target = 'FAILED' THEN 'fixture failure' END,
        at, at,
        CASE WHEN target <> 'IN_PROGRESS' THEN at + settled END
    );
    RETURN key;
END;
$$;

SELECT
    today - 40 AS d40,
    today - 25 AS d25,
    today - 20 AS d20,
    today - 3 AS d3
FROM (SELECT (now() AT TIME ZONE 'UTC')::date AS today) AS t \gset

SELECT fixture.command(:'d40', 'k40a');
SELECT fixture.command(:'d40', 'k40b');
SELECT fixture.command(:'d40', 'k40c', 'FAILED');
SELECT fixture.command(:'d25', 'k25', 'DONE', interval '23 days');  -- settled two days ago
SELECT fixture.command(:'d20', 'k20', 'IN_PROGRESS');
SELECT fixture.command(:'d3', 'k3');

SELECT throws_ok(
    $$SELECT * FROM inbox.archivable_command_days(interval '3 days')$$, 'OB057', NULL,
    'a command retention below the clients'' retry window is refused'
);
SELECT results_eq(
    $$SELECT day, row_count, open_rows, failed_rows, eligible, blocked_by
    FROM inbox.archivable_command_days(interval '14 days') ORDER BY 1$$,
    format(
        $$VALUES (%L::date, 3::bigint, 0::bigint, 1::bigint, TRUE, NULL::text),
        (%L::date, 1::bigint, 0::bigint, 0::bigint, FALSE, 'keys settled within the retention'),
        (%L::date, 1::bigint, 1::bigint, 0::bigint, FALSE, 'open rows (IN_PROGRESS)')$$,
        :'d40', :'d25', :'d20'
    ),
    'command days older than the retention, by first claim, with what blocks them'
);
SELECT is(
    (SELECT count(*) FROM inbox.archivable_command_days()), 1::bigint,
    'the default retention (30 days) lists the oldest day only'
);
SELECT results_eq(
    $$SELECT column_name, kind FROM outbox.checksum_columns('inbox.commands') ORDER BY ordinal$$,
    $$VALUES ('handler', 'text'), ('command_key', 'text'), ('status', 'text'), ('result', 'text'),
        ('last_error', 'text'), ('attempts', 'plain'), ('first_claimed_at', 'timestamp'),
        ('claimed_at', 'timestamp'), ('claimed_by', 'text'), ('settled_at', 'timestamp')$$,
    'every column of inbox.commands enters the checksum'
);
SELECT is(
    (SELECT row_count FROM outbox.archive_figures('inbox.commands', :'d40')), 3::bigint,
    'the figures of a command day count the keys first claimed that day'
);

SELECT throws_ok(
    format('SELECT outbox.record_archive(%L, %L, 1, 0, %L)', 'inbox.commands', :'d20', 'file:/c'),
    'OB051', NULL, 'a command day with IN_PROGRESS keys cannot be recorded'
);
SELECT throws_ok(
    format('SELECT outbox.record_archive(%L, %L, 1, 0, %L)', 'inbox.commands', :'d25', 'file:/c'),
    'OB057', NULL, 'nor one with a key settled within the retry window'
);
SELECT inbox.set_command_retry_window(interval '45 days');
SELECT throws_ok(
    $$SELECT * FROM inbox.archivable_command_days(interval '30 days')$$, 'OB057', NULL,
    'a longer retry window raises the floor of the listing'
);
SELECT throws_ok(
    format('SELECT outbox.record_archive(%L, %L, 3, 0, %L)', 'inbox.commands', :'d40', 'file:/c'),
    'OB057', NULL, 'and of record, whatever retention the caller used'
);
SELECT inbox.set_command_retry_window(interval '7 days');

SELECT throws_ok(
    format('SELECT inbox.purge_archived_commands(%L)', :'d40'), 'OB054', NULL,
    'a command day without an audit row is not purged'
);
SELECT throws_ok($$DELETE FROM inbox.commands$$, 'OB012', NULL, 'DELETE on the command inbox outside purge is refused');
SELECT set_config('pgoutbox.command_purge', 'on', TRUE);
SELECT throws_ok(
    $$TRUNCATE inbox.commands$$, 'OB012', NULL, 'TRUNCATE is refused even with the purge''s setting on'
);
SELECT set_config('pgoutbox.command_purge', '', TRUE);

SELECT outbox.record_archive('inbox.commands', :'d40', f.row_count, f.checksum, 'file:/c/day40')
FROM outbox.archive_figures('inbox.commands', :'d40') AS f;
-- A change the API cannot make (the guard is bypassed in replica mode).
SET LOCAL session_replication_role = replica;
UPDATE inbox.commands SET result = '{"run_id": "changed"}'
WHERE command_key = 'k40a';
SET LOCAL session_replication_role = origin;
SELECT throws_ok(
    format('SELECT inbox.purge_archived_commands(%L)', :'d40'), 'OB053', NULL,
    'a command day changed since its audit is not purged'
);
SELECT is(
    (
        SELECT count(*) FROM inbox.commands
        WHERE command_key LIKE 'k40%'
    ),
    3::bigint,
    'the refused purge deleted nothing'
);
SELECT ok(
    outbox.void_archive('inbox.commands', :'d40', 'a key changed behind the API') IS NOT NULL,
    'the audit of a command day whose keys are live can be voided'
);
SELECT outbox.record_archive('inbox.commands', :'d40', f.row_count, f.checksum, 'file:/c/day40b')
FROM outbox.archive_figures('inbox.commands', :'d40') AS f;

-- The roles.
SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    format('SELECT inbox.purge_archived_commands(%L)', :'d40'), '42501', NULL, 'a writer cannot purge command days'
);
RESET ROLE;
SET LOCAL ROLE pgoutbox_archiver;
SELECT is(
    (SELECT count(*) FROM inbox.archivable_command_days()), 1::bigint, 'the archiver lists command days'
);
SELECT is((SELECT count(*) FROM inbox.commands), 6::bigint, 'the archiver reads the command inbox');
SELECT throws_ok($$DELETE FROM inbox.commands$$, '42501', NULL, 'the archiver cannot delete keys');
SELECT throws_ok(
    $$SELECT inbox.set_command_retry_window(interval '1 day')$$, '42501', NULL,
    'the archiver cannot change the retry window'
);
SELECT is(inbox.purge_archived_commands(:'d40'), 3::bigint, 'the archiver purges an audited command day');
RESET ROLE;
SET LOCAL ROLE pgoutbox_admin;
SELECT is(
    inbox.set_command_retry_window(interval '10 days'), interval '10 days', 'an admin sets the retry window'
);
RESET ROLE;

SELECT is(
    (SELECT array_agg(command_key ORDER BY command_key) FROM inbox.commands),
    ARRAY['k20', 'k25', 'k3'], 'exactly that day is gone'
);
SELECT ok(
    (
        SELECT removed_at IS NOT NULL AND row_count = 3
        FROM outbox.archive_audit
        WHERE source = 'inbox.commands' AND day = :'d40' AND voided_at IS NULL
    ),
    'its audit is marked removed'
);
SELECT is(inbox.purge_archived_commands(:'d40'), 0::bigint, 'purging again is a no-op');
SELECT is(
    (SELECT claimed::text || '|' || status || '|' || attempts FROM inbox.claim_command('start_run', 'k40a')),
    'true|IN_PROGRESS|1', 'a key of a purged day is claimed afresh'
);

SELECT * FROM finish();
ROLLBACK;
