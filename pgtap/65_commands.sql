-- Command inbox (sql/65_inbox_commands.sql).
-- Scenarios:
--   * the first claim of (handler, key) claims it (IN_PROGRESS, 1 attempt); a
--     repeated claim does not, and reports the status and stored result
--   * the key is (handler, command_key): two handlers claim the same key independently
--   * complete_command: IN_PROGRESS -> DONE with the result; a JSON null is a result
--   * fail_command: IN_PROGRESS -> FAILED; the next claim claims it again (attempts 2)
--   * every other move raises ILLEGAL_TRANSITION (OB010), through the API or a
--     direct UPDATE; the key and first claim are immutable (OB011)
--   * DELETE and TRUNCATE raise DELETE_FORBIDDEN (OB012)
--   * unknown keys raise UNKNOWN_COMMAND (OB081); bad names or keys (a blank
--     key: white space only, tabs and line breaks too) INVALID_COMMAND
--     (OB080); a missing result or error INVALID_ARGUMENT (OB006); a result over
--     1 MiB VALUE_TOO_LARGE (OB009)
--   * lookup_command returns the row, or none for a key never claimed
--   * the table's CHECKs hold for a row written around the API
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(37);

SET LOCAL ROLE pgoutbox_writer;
SELECT is(
    (SELECT claimed::text || '|' || status || '|' || attempts FROM inbox.claim_command('start_run', 'k1')),
    'true|IN_PROGRESS|1', 'a first claim claims the command'
);
SELECT is(
    (
        SELECT claimed::text || '|' || status || '|' || coalesce(result::text, 'no result')
        FROM inbox.claim_command('start_run', 'k1')
    ),
    'false|IN_PROGRESS|no result', 'a repeated claim does not claim it, and says it is in progress'
);
SELECT is(
    (SELECT claimed FROM inbox.claim_command('other_handler', 'k1')),
    TRUE, 'another handler has its own key'
);
RESET ROLE;
SELECT is(
    (
        SELECT claimed_by FROM inbox.commands
        WHERE handler = 'start_run' AND command_key = 'k1'
    ),
    session_user::text, 'claimed_by is the session''s login'
);
SET LOCAL ROLE pgoutbox_writer;
SELECT is(
    (SELECT status || '|' || (result ->> 'run_id') FROM inbox.complete_command('start_run', 'k1', '{"run_id": "r-1"}')),
    'DONE|r-1', 'complete_command stores the result'
);
SELECT is(
    (
        SELECT claimed::text || '|' || status || '|' || (result ->> 'run_id') || '|' || attempts
        FROM inbox.claim_command('start_run', 'k1')
    ),
    'false|DONE|r-1|1', 'a claim after DONE returns the stored result and claims nothing'
);
SELECT ok(
    (SELECT settled_at >= first_claimed_at FROM inbox.lookup_command('start_run', 'k1')),
    'a DONE command has its settled_at'
);
SELECT throws_ok(
    $$SELECT inbox.complete_command('start_run', 'k1', '{"run_id": "r-2"}')$$,
    'OB010', NULL, 'DONE is terminal: no second result'
);
SELECT throws_ok(
    $$SELECT inbox.fail_command('start_run', 'k1', 'late failure')$$,
    'OB010', NULL, 'DONE is terminal: it cannot fail'
);
SELECT is(
    (SELECT result ->> 'run_id' FROM inbox.lookup_command('start_run', 'k1')),
    'r-1', 'a refused move keeps the first result'
);

-- A failure, then a retry.
SELECT is((SELECT claimed FROM inbox.claim_command('start_run', 'k2')), TRUE, 'k2 claimed');
SELECT is(
    (SELECT status || '|' || last_error FROM inbox.fail_command('start_run', 'k2', 'workflow engine said 503')),
    'FAILED|workflow engine said 503', 'fail_command records the error'
);
SELECT throws_ok(
    $$SELECT inbox.complete_command('start_run', 'k2', '{}')$$,
    'OB010', NULL, 'a FAILED command is not completed without a new claim'
);
SELECT throws_ok(
    $$SELECT inbox.fail_command('start_run', 'k2', 'again')$$,
    'OB010', NULL, 'a FAILED command does not fail twice'
);
SELECT is(
    (
        SELECT
            claimed::text || '|' || status || '|' || attempts || '|' || last_error
            || '|' || (settled_at IS NULL)::text
        FROM inbox.claim_command('start_run', 'k2')
    ),
    'true|IN_PROGRESS|2|workflow engine said 503|true', 'a claim after FAILED claims it again and keeps the last error'
);
SELECT is(
    (SELECT claimed FROM inbox.claim_command('start_run', 'k2')),
    FALSE, 'and only that claim'
);
SELECT is(
    (SELECT status || '|' || result::text FROM inbox.complete_command('start_run', 'k2', 'null')),
    'DONE|null', 'a JSON null is a result'
);

-- Unknown keys and bad arguments.
SELECT throws_ok(
    $$SELECT inbox.complete_command('start_run', 'never', '{}')$$, 'OB081', NULL, 'complete of an unknown key'
);
SELECT throws_ok(
    $$SELECT inbox.fail_command('other_handler', 'k2', 'x')$$, 'OB081', NULL,
    'fail of a key claimed by another handler only'
);
SELECT throws_ok($$SELECT * FROM inbox.claim_command('bad name', 'k')$$, 'OB080', NULL, 'a handler with a space');
SELECT throws_ok($$SELECT * FROM inbox.claim_command(NULL, 'k')$$, 'OB080', NULL, 'no handler');
SELECT throws_ok($$SELECT * FROM inbox.claim_command('start_run', '  ')$$, 'OB080', NULL, 'a blank key');
SELECT throws_ok($$SELECT * FROM inbox.claim_command('start_run', E'\t')$$, 'OB080', NULL, 'a key of one tab is blank');
SELECT throws_ok(
    $$SELECT * FROM inbox.claim_command('start_run', E'\n')$$, 'OB080', NULL, 'a key of one line break is blank'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.claim_command('start_run', E' \t\r\n\f\x0b ')$$, 'OB080', NULL,
    'a key of white space only is blank'
);
SELECT lives_ok($$SELECT * FROM inbox.claim_command('start_run', E'a\tb')$$, 'a key with a tab inside is a key');
SELECT throws_ok($$SELECT * FROM inbox.claim_command('start_run', NULL)$$, 'OB080', NULL, 'no key');
SELECT throws_ok(
    $$SELECT * FROM inbox.claim_command('start_run', repeat('k', 257))$$, 'OB080', NULL, 'a key of 257 characters'
);
SELECT lives_ok(
    $$SELECT * FROM inbox.claim_command('start_run', repeat('k', 256))$$, 'a key of 256 characters'
);
SELECT throws_ok(
    $$SELECT inbox.complete_command('start_run', repeat('k', 256), NULL)$$, 'OB006', NULL, 'a SQL NULL result'
);
SELECT throws_ok(
    $$SELECT inbox.complete_command('start_run', repeat('k', 256), to_jsonb(repeat('x', 1048576)))$$,
    'OB009', NULL, 'a result over 1 MiB'
);
SELECT throws_ok(
    $$SELECT inbox.fail_command('start_run', repeat('k', 256), ' ')$$, 'OB006', NULL, 'a blank error'
);
SELECT is_empty(
    $$SELECT * FROM inbox.lookup_command('start_run', 'never')$$, 'lookup of a key never claimed: no row'
);
RESET ROLE;

-- Around the API (the owner): the guards and CHECKs still hold.
SELECT throws_ok(
    $$UPDATE inbox.commands SET status = 'IN_PROGRESS', settled_at = NULL, result = NULL
      WHERE handler = 'start_run' AND command_key = 'k1'$$,
    'OB010', NULL, 'DONE -> IN_PROGRESS by UPDATE'
);
SELECT throws_ok(
    $$UPDATE inbox.commands SET command_key = 'k9' WHERE handler = 'start_run' AND command_key = 'k1'$$,
    'OB011', NULL, 'the key is immutable'
);
SELECT throws_ok(
    $$DELETE FROM inbox.commands WHERE handler = 'start_run' AND command_key = 'k1'$$,
    'OB012', NULL, 'no DELETE, owner included'
);
SELECT throws_ok(
    $$INSERT INTO inbox.commands (handler, command_key, status, settled_at) VALUES ('start_run', 'k3', 'DONE', now())$$,
    '23514', NULL, 'a DONE row without a result breaks command_result_iff_done'
);

SELECT * FROM finish();
ROLLBACK;
