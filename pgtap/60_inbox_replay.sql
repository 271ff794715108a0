-- Inbox dead letters: replay bookkeeping, the replay switch, audited redrive.
-- Scenarios:
--   * record_error(dead => true, replay_after) parks the row with its replay
--     bookkeeping in dlq_metadata; NULL replay_after leaves no next replay;
--     replay_after without dead, or negative, is refused (OB006); a dead
--     letter cannot be reported again (OB010), so it is counted once
--   * claim_replays takes due dead letters only (not parked, not early, not
--     without an envelope), at most batch_size, moves them to RECEIVED and
--     counts the replay; bad arguments are refused (OB006)
--   * set_replay switches a handler's automated replay off and on, with who
--     and why; a reason (OB014) and a valid handler (OB006) are required
--   * redrive needs a reason (OB014); is all or nothing over unknown or live
--     messages (OB030) and rows without an envelope (OB031); is written to
--     redrive_log; makes the rows due whatever the switch and the cap say,
--     and counts as a redrive, not an automated replay; NULL ids take every
--     dead letter of the handler
--   * dead_letters lists the replay state
--   * privileges: the consumer claims replays but cannot redrive or switch;
--     the admin redrives; a writer can do neither
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(43);
\ir fixtures/inbox.sql

-- record_error and the bookkeeping.
SELECT fixture.message('billing', 'DEAD_LETTER', interval '0') AS due_id \gset
SELECT is(
    (SELECT
        format(
            '%s|%s|%s|%s', status, dlq_metadata ->> 'dead_letters',
            dlq_metadata ->> 'replay_attempts', (dlq_metadata ->> 'next_replay_at')::timestamptz = now()
        )
    FROM inbox.messages
    WHERE message_id = :'due_id'),
    'DEAD_LETTER|1|0|t',
    'a dead letter records its count, no replay yet, and the next replay time'
);
SELECT ok(
    (
        SELECT (dlq_metadata ->> 'dead_lettered_at')::timestamptz = now()
        FROM inbox.messages
        WHERE message_id = :'due_id'
    ),
    'dead_lettered_at is recorded'
);
SELECT fixture.message('billing', 'DEAD_LETTER', NULL) AS parked_id \gset
SELECT is(
    (
        SELECT dlq_metadata -> 'next_replay_at' FROM inbox.messages
        WHERE message_id = :'parked_id'
    ),
    'null'::jsonb, 'no replay_after: parked, no next replay'
);
SELECT throws_ok(
    format($$SELECT inbox.record_error(%L, 'billing', 'HTTP 422 again', dead => TRUE)$$, :'parked_id'),
    'OB010', NULL, 'a dead letter cannot be reported again'
);
SELECT is(
    (
        SELECT dlq_metadata ->> 'dead_letters' FROM inbox.messages
        WHERE message_id = :'parked_id'
    ),
    '1', 'so it is counted once'
);
SELECT throws_ok(
    format(
        $$SELECT inbox.record_error(%L, 'billing', 'HTTP 500', replay_after => interval '1 minute')$$,
        fixture.message('billing')
    ),
    'OB006', NULL, 'replay_after without dead is refused'
);
SELECT throws_ok(
    format(
        $$SELECT inbox.record_error(%L, 'billing', 'HTTP 422', dead => TRUE, replay_after => interval '-1 second')$$,
        fixture.message('billing')
    ),
    'OB006', NULL, 'a negative replay_after is refused'
);
SELECT fixture.message('billing', 'FAILED') AS failed_id \gset
SELECT is(
    (
        SELECT format('%s|%s', status, dlq_metadata) FROM inbox.messages
        WHERE message_id = :'failed_id'
    ),
    'FAILED|{"failures": 1}', 'a transient failure only counts itself in dlq_metadata'
);

-- claim_replays.
SELECT fixture.message('billing', 'DEAD_LETTER', interval '1 hour') AS early_id \gset
SELECT fixture.message('billing', 'DEAD_LETTER', interval '0', with_envelope => FALSE) AS bare_id \gset
SELECT is(
    (SELECT array_agg(message_id) FROM inbox.claim_replays('replayer-1', 10)),
    ARRAY[:'due_id'::uuid],
    'only the due dead letter with an envelope is claimed'
);
SELECT is(
    (SELECT
        format(
            '%s|%s|%s|%s|%s', status, dlq_metadata ->> 'replay_attempts',
            dlq_metadata -> 'next_replay_at', dlq_metadata ->> 'last_replay_by',
            (dlq_metadata ->> 'last_replay_at')::timestamptz = now()
        )
    FROM inbox.messages
    WHERE message_id = :'due_id'),
    'RECEIVED|1|null|replayer-1|t',
    'a claimed replay is RECEIVED again, counted, unscheduled, and attributed'
);
SELECT is(
    (
        SELECT array_agg(status ORDER BY status) FROM inbox.messages
        WHERE message_id IN (:'parked_id', :'early_id', :'bare_id')
    ),
    ARRAY['DEAD_LETTER', 'DEAD_LETTER', 'DEAD_LETTER'],
    'parked, early and envelope-less dead letters stay DEAD_LETTER'
);
SELECT is(
    (SELECT count(*)::int FROM inbox.claim_replays('replayer-1', 10)),
    0, 'a claimed replay is not claimed again'
);
SELECT lives_ok(
    format(
        $$SELECT inbox.record_error(%L, 'billing', 'HTTP 422', dead => TRUE, replay_after => interval '0')$$, :'due_id'
    ),
    'a replayed message can be dead-lettered again'
);
SELECT is(
    (
        SELECT format('%s|%s', dlq_metadata ->> 'dead_letters', dlq_metadata ->> 'replay_attempts')
        FROM inbox.messages
        WHERE message_id = :'due_id'
    ),
    '2|1', 'the second dead letter keeps the replay count'
);
SELECT fixture.message('billing', 'DEAD_LETTER', interval '0') FROM generate_series(1, 3);
SELECT is(
    (SELECT count(*)::int FROM inbox.claim_replays('replayer-1', 2)),
    2, 'claim_replays returns at most batch_size rows'
);
SELECT is(
    (SELECT count(*)::int FROM inbox.claim_replays('replayer-1', 10)),
    2, 'the next claim takes the rest'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.claim_replays(' ', 10)$$, 'OB006', NULL, 'an unnamed worker is refused'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.claim_replays('w', 0)$$, 'OB006', NULL, 'batch_size 0 is refused'
);

-- The replay switch.
SELECT fixture.message('shipping', 'DEAD_LETTER', interval '0') AS ship_id \gset
SELECT is(
    (
        SELECT format('%s|%s|%s', enabled, changed_by = session_user, reason)
        FROM inbox.set_replay('shipping', FALSE, 'handler bug #12 under analysis')
    ),
    'f|t|handler bug #12 under analysis',
    'set_replay records the switch, who and why'
);
SELECT is(
    (SELECT count(*)::int FROM inbox.claim_replays('replayer-1', 10)),
    0, 'a switched-off handler''s due dead letters are not replayed'
);
SELECT is(
    (SELECT replay_enabled FROM inbox.dead_letters('shipping')),
    FALSE, 'dead_letters shows the switch'
);
SELECT lives_ok(
    $$SELECT inbox.set_replay('shipping', TRUE, 'fixed in 1.4.2')$$, 'switching back on'
);
SELECT is(
    (SELECT array_agg(message_id) FROM inbox.claim_replays('replayer-1', 10)),
    ARRAY[:'ship_id'::uuid], 'switched on again, the due dead letter is replayed'
);
SELECT throws_ok(
    $$SELECT inbox.set_replay('shipping', FALSE, ' ')$$, 'OB014', NULL, 'a switch needs a reason'
);
SELECT throws_ok(
    $$SELECT inbox.set_replay('bad handler!', FALSE, 'x')$$, 'OB006', NULL, 'a switch needs a valid handler name'
);

-- Redrive.
SELECT inbox.set_replay('billing', FALSE, 'no automated replay while we look');
SELECT fixture.message('billing', 'PROCESSED') AS done_id \gset
SELECT throws_ok(
    format($$SELECT inbox.redrive('billing', ARRAY[%L]::uuid[], '')$$, :'parked_id'),
    'OB014', NULL, 'a redrive needs a reason'
);
SELECT throws_ok(
    format($$SELECT inbox.redrive('billing', ARRAY[%L, %L]::uuid[], 'fixed')$$, :'parked_id', :'done_id'),
    'OB030', NULL, 'a processed message cannot be redriven'
);
SELECT throws_ok(
    format($$SELECT inbox.redrive('billing', ARRAY[%L, %L]::uuid[], 'fixed')$$, :'parked_id', gen_random_uuid()),
    'OB030', NULL, 'an unknown message cannot be redriven'
);
SELECT throws_ok(
    format($$SELECT inbox.redrive('shipping', ARRAY[%L]::uuid[], 'fixed')$$, :'parked_id'),
    'OB030', NULL, 'another handler''s dead letter cannot be redriven under this one'
);
SELECT is(
    (SELECT count(*)::int FROM inbox.redrive_log),
    0, 'a refused redrive changes nothing (all or nothing)'
);
SELECT throws_ok(
    format($$SELECT inbox.redrive('billing', ARRAY[%L]::uuid[], 'fixed')$$, :'bare_id'),
    'OB031', NULL, 'a dead letter without an envelope cannot be re-published'
);
SELECT is(
    inbox.redrive('billing', ARRAY[:'parked_id'::uuid], 'schema fixed in 2.1, verified on staging'),
    1, 'redrive returns how many it marked'
);
SELECT is(
    (
        SELECT format('%s|%s|%s|%s', handler, redriven_by = session_user, reason, replay_attempts_before)
        FROM inbox.redrive_log
        WHERE message_id = :'parked_id'
    ),
    'billing|t|schema fixed in 2.1, verified on staging|0',
    'the redrive is audited with who, why and the replays before'
);
SELECT is(
    (SELECT array_agg(message_id) FROM inbox.claim_replays('replayer-1', 10)),
    ARRAY[:'parked_id'::uuid],
    'a redriven dead letter is claimed although parked and switched off'
);
SELECT is(
    (SELECT
        format(
            '%s|%s|%s', dlq_metadata ->> 'redrives', dlq_metadata ->> 'replay_attempts',
            dlq_metadata ->> 'redrive_requested'
        )
    FROM inbox.messages
    WHERE message_id = :'parked_id'),
    '1|0|false', 'it counts as a redrive, not as an automated replay'
);
SELECT fixture.message('audit', 'DEAD_LETTER', NULL) FROM generate_series(1, 2);
SELECT fixture.message('audit', 'FAILED');
SELECT is(
    inbox.redrive('audit', NULL, 'replay everything after the outage'),
    2, 'NULL ids redrive every dead letter of the handler, and only those'
);
SELECT is(
    (
        SELECT count(*)::int FROM inbox.dead_letters('audit')
        WHERE next_replay_at = now()
    ),
    2, 'dead_letters shows them due now'
);

-- Privileges.
SET LOCAL ROLE pgoutbox_consumer;
SELECT lives_ok(
    $$SELECT * FROM inbox.claim_replays('replayer-2', 10)$$, 'the consumer role claims replays'
);
SELECT throws_ok(
    format($$SELECT inbox.redrive('billing', ARRAY[%L]::uuid[], 'x')$$, :'early_id'),
    '42501', NULL, 'the consumer role cannot redrive'
);
SELECT throws_ok(
    $$SELECT inbox.set_replay('billing', TRUE, 'x')$$, '42501', NULL, 'the consumer role cannot switch replay'
);
RESET ROLE;
SET LOCAL ROLE pgoutbox_admin;
SELECT lives_ok(
    format($$SELECT inbox.redrive('billing', ARRAY[%L]::uuid[], 'operator decision')$$, :'early_id'),
    'the admin role redrives'
);
RESET ROLE;
SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    $$SELECT * FROM inbox.claim_replays('w', 1)$$, '42501', NULL, 'a writer cannot claim replays'
);
SELECT throws_ok(
    $$SELECT * FROM inbox.dead_letters()$$, '42501', NULL, 'a writer cannot list inbox dead letters'
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
