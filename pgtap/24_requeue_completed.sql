-- COMPLETED -> PENDING for events a broker lost (outbox.requeue_completed,
-- sql/35_outbox_repair.sql) and the update guard's branch for it.
-- Scenarios:
--   * a requeue moves COMPLETED events to PENDING (no publish time, no
--     attempts, due now) and writes each to requeue_log with who, why, the
--     status it left and the publish time it erased
--   * the row_ids path finds the same events by primary key; a row id that
--     does not belong to the event finds nothing (OB040)
--   * all or nothing: one event that is unknown or not COMPLETED refuses the
--     whole call (OB040) and moves none
--   * published_before: an event published at or after it is refused (OB041)
--   * a missing reason is REASON_REQUIRED (OB014); bad row_ids or a
--     non-finite published_before INVALID_ARGUMENT (OB006)
--   * around the function, COMPLETED -> PENDING stays illegal (OB010) even
--     with a requeue reason set; with the function's marker but no reason it
--     needs one (OB014)
--   * a requeue of a dead letter is logged with from_status DEAD_LETTER
--   * only pgoutbox_admin may call it
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(20);
\ir fixtures/events.sql

-- The move and its log.
SELECT fixture.event('COMPLETED') AS done_id \gset
SET LOCAL ROLE pgoutbox_admin;
SELECT is(
    outbox.requeue_completed(ARRAY[:'done_id']::uuid[], 'broker lost it', now() + interval '1 second'),
    1, 'requeue_completed moves one COMPLETED event'
);
RESET ROLE;
SELECT is(
    (
        SELECT format('%s|%s|%s|%s', status, attempts, published_at IS NULL, available_at <= now())
        FROM outbox.events
        WHERE event_id = :'done_id'
    ),
    'PENDING|0|t|t',
    'the event is PENDING, unpublished, with no attempts, due now'
);
SELECT is(
    (
        SELECT format('%s|%s|%s|%s', reason, from_status, published_at_before IS NOT NULL, requeued_by = session_user)
        FROM outbox.requeue_log
        WHERE event_id = :'done_id'
    ),
    'broker lost it|COMPLETED|t|t',
    'the requeue is logged with why, the status it left, the erased publish time and who'
);

-- By primary key.
SELECT fixture.event('COMPLETED') AS keyed_id \gset
SELECT id AS keyed_row FROM outbox.events
WHERE event_id = :'keyed_id' \gset
SET LOCAL ROLE pgoutbox_admin;
SELECT throws_ok(
    format(
        'SELECT outbox.requeue_completed(ARRAY[%L]::uuid[], %L, NULL, ARRAY[%s]::bigint[])',
        :'keyed_id', 'lost', :'keyed_row'::bigint + 1000000
    ),
    'OB040', NULL, 'a row id that is not the event''s finds nothing'
);
SELECT is(
    outbox.requeue_completed(ARRAY[:'keyed_id']::uuid[], 'lost', NULL, ARRAY[:'keyed_row']::bigint[]),
    1, 'the row_ids path requeues the event'
);
RESET ROLE;
SELECT is(fixture.status(:'keyed_id'), 'PENDING', 'found by primary key, moved to PENDING');

-- All or nothing.
SELECT fixture.event('COMPLETED') AS ok_id \gset
SELECT throws_ok(
    format(
        'SELECT outbox.requeue_completed(ARRAY[%L, %L]::uuid[], %L)', :'ok_id', fixture.event('PENDING'), 'lost'
    ),
    'OB040', NULL, 'an event that is not COMPLETED refuses the whole call'
);
SET LOCAL ROLE pgoutbox_admin;
SELECT throws_ok(
    format('SELECT outbox.requeue_completed(ARRAY[%L, %L]::uuid[], %L)', :'ok_id', gen_random_uuid(), 'lost'),
    'OB040', NULL, 'an unknown event refuses the whole call'
);
RESET ROLE;
SELECT is(fixture.status(:'ok_id'), 'COMPLETED', 'and no event moved');

-- The duplicate-window cut-off (published_at is now() in this transaction).
SET LOCAL ROLE pgoutbox_admin;
SELECT throws_ok(
    format('SELECT outbox.requeue_completed(ARRAY[%L]::uuid[], %L, now())', :'ok_id', 'lost'),
    'OB041', NULL, 'an event published at or after published_before is refused'
);
RESET ROLE;
SELECT is(fixture.status(:'ok_id'), 'COMPLETED', 'and stays COMPLETED');

-- Arguments.
SET LOCAL ROLE pgoutbox_admin;
SELECT throws_ok(
    format('SELECT outbox.requeue_completed(ARRAY[%L]::uuid[], %L)', :'ok_id', ' '),
    'OB014', NULL, 'a blank reason is REASON_REQUIRED'
);
SELECT throws_ok(
    format('SELECT outbox.requeue_completed(ARRAY[%L]::uuid[], %L, NULL, ARRAY[1, 2]::bigint[])', :'ok_id', 'lost'),
    'OB006', NULL, 'row_ids of another length are refused'
);
SELECT throws_ok(
    format('SELECT outbox.requeue_completed(ARRAY[%L]::uuid[], %L, %L)', :'ok_id', 'lost', 'infinity'),
    'OB006', NULL, 'a non-finite published_before is refused'
);
RESET ROLE;

-- Around the function.
SELECT set_config('pgoutbox.requeue_reason', 'by hand', TRUE);
SELECT throws_ok(
    format($$UPDATE outbox.events SET status = 'PENDING', published_at = NULL WHERE event_id = %L$$, :'ok_id'),
    'OB010', NULL, 'COMPLETED -> PENDING by hand is illegal, even with a reason set'
);
SELECT set_config('pgoutbox.requeue_reason', '', TRUE);
SELECT set_config('pgoutbox.requeue_from', 'COMPLETED', TRUE);
SELECT throws_ok(
    format($$UPDATE outbox.events SET status = 'PENDING', published_at = NULL WHERE event_id = %L$$, :'ok_id'),
    'OB014', NULL, 'with the marker but no reason, the move needs a reason'
);
SELECT set_config('pgoutbox.requeue_from', '', TRUE);

-- A dead letter's requeue is logged as such.
SELECT fixture.event('DEAD_LETTER') AS dead_id \gset
SET LOCAL ROLE pgoutbox_admin;
SELECT is(outbox.requeue(ARRAY[:'dead_id']::uuid[], 'fixed'), 1, 'requeue of a dead letter still works');
RESET ROLE;
SELECT is(
    (
        SELECT from_status FROM outbox.requeue_log
        WHERE event_id = :'dead_id'
    ),
    'DEAD_LETTER', 'and is logged with from_status DEAD_LETTER'
);

-- Who may call it.
SET LOCAL ROLE pgoutbox_admin;
SELECT ok(
    has_function_privilege(
        'pgoutbox_admin', 'outbox.requeue_completed(uuid[], text, timestamptz, bigint[])', 'EXECUTE'
    ),
    'pgoutbox_admin may requeue COMPLETED events'
);
SELECT ok(
    NOT has_function_privilege(
        'pgoutbox_relay', 'outbox.requeue_completed(uuid[], text, timestamptz, bigint[])', 'EXECUTE'
    )
    AND NOT has_function_privilege(
        'pgoutbox_writer', 'outbox.requeue_completed(uuid[], text, timestamptz, bigint[])', 'EXECUTE'
    ),
    'relays and writers may not'
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
