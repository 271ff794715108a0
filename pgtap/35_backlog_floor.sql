-- The backlog floor of inbox.backlog() (sql/50_inbox.sql): no RECEIVED or
-- FAILED message is left below it. Calls run as pgoutbox_consumer; the floor
-- is set by hand (as the owner) where a scenario needs it above a message.
-- Scenarios:
--   * a received_at goes to the floor's microseconds and back exactly
--     (now, before the epoch, -infinity and infinity)
--   * a message received below the floor lowers it, and is counted
--   * a message received below a pending candidate cancels it
--   * a message recorded PROCESSED (receive_processed) leaves the floor alone
--   * a dead letter made RECEIVED again (claim_replays) lowers the floor to
--     its received_at; dead letters count whatever the floor
--   * a read-only transaction reads the floor and moves nothing
--   * the floor's functions are granted to no one
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(12);

SELECT is(
    (
        SELECT array_agg(inbox._backlog_time(inbox._backlog_micros(t)) = t ORDER BY t)
        FROM unnest(ARRAY[
            now(), timestamptz '1900-01-01 00:00:00.000001+00', timestamptz '2262-04-11 23:47:16.854775+00',
            timestamptz '-infinity', timestamptz 'infinity'
        ]) AS t
    ),
    ARRAY[TRUE, TRUE, TRUE, TRUE, TRUE],
    'a received_at goes to microseconds and back exactly'
);
SELECT is(inbox._backlog_time(NULL), timestamptz '-infinity', 'an unset floor is -infinity: from the bottom');

-- Below the floor: lowers it.
SELECT setval('inbox.backlog_floor', inbox._backlog_micros(now() + interval '1 hour'));
SET LOCAL ROLE pgoutbox_consumer;
SELECT count(*) FROM inbox.receive_batch(
    'h', ARRAY['00000000-0000-4000-8000-000000000001']::uuid[], ARRAY['held.event.x.v1'], ARRAY['{}']::jsonb[]
);
RESET ROLE;
SELECT is(
    pg_sequence_last_value('inbox.backlog_floor'), inbox._backlog_micros(now()),
    'a message received below the floor lowers it to its received_at'
);
SET LOCAL ROLE pgoutbox_consumer;
SELECT is(
    (
        SELECT format('%s|%s|%s', unprocessed, failed, dead_letter) FROM inbox.backlog()
        WHERE handler = 'h'
    ),
    '1|0|0', 'and inbox.backlog() counts it'
);
RESET ROLE;

-- Below a pending candidate: cancels it.
SELECT setval('inbox.backlog_floor', inbox._backlog_micros(now() - interval '1 hour'));
SELECT setval('inbox.backlog_floor_next', inbox._backlog_micros(now() + interval '1 hour'));
SET LOCAL ROLE pgoutbox_consumer;
SELECT count(*) FROM inbox.receive_batch(
    'h', ARRAY['00000000-0000-4000-8000-000000000002']::uuid[], ARRAY['held.event.x.v1'], ARRAY['{}']::jsonb[]
);
RESET ROLE;
SELECT is(
    format(
        '%s|%s', pg_sequence_last_value('inbox.backlog_floor_next'),
        pg_sequence_last_value('inbox.backlog_floor') = inbox._backlog_micros(now() - interval '1 hour')
    ),
    '|t', 'a message received below the candidate cancels it; the floor stays'
);

-- Recorded PROCESSED at once: nothing to count, the floor stays.
SELECT setval('inbox.backlog_floor', inbox._backlog_micros(now() + interval '1 hour'));
SET LOCAL ROLE pgoutbox_consumer;
SELECT count(*) FROM inbox.receive_processed(
    'h', ARRAY['00000000-0000-4000-8000-000000000003']::uuid[], ARRAY['held.event.x.v1'], ARRAY['{}']::jsonb[]
);
RESET ROLE;
SELECT is(
    pg_sequence_last_value('inbox.backlog_floor'), inbox._backlog_micros(now() + interval '1 hour'),
    'a message recorded PROCESSED leaves the floor alone'
);

-- A dead letter: counted below the floor; replayed, it lowers the floor.
SET LOCAL ROLE pgoutbox_consumer;
SELECT count(*) FROM inbox.settle(
    'h', ARRAY['00000000-0000-4000-8000-000000000001', '00000000-0000-4000-8000-000000000002']::uuid[]
);
SELECT count(*) FROM inbox.receive_batch(
    'h', ARRAY['00000000-0000-4000-8000-000000000004']::uuid[], ARRAY['held.event.x.v1'], ARRAY['{}']::jsonb[]
);
SELECT
    inbox.record_error(
        '00000000-0000-4000-8000-000000000004', 'h', 'poison', dead => TRUE, replay_after => interval '0'
    );
RESET ROLE;
SELECT setval('inbox.backlog_floor', inbox._backlog_micros(now() + interval '1 hour'));
SET LOCAL ROLE pgoutbox_consumer;
SELECT is(
    (
        SELECT format('%s|%s|%s', unprocessed, failed, dead_letter) FROM inbox.backlog()
        WHERE handler = 'h'
    ),
    '0|0|1', 'a dead letter below the floor is counted'
);
SELECT is(
    (SELECT count(*) FROM inbox.claim_replays('replayer', 10)), 1::bigint, 'the dead letter is replayed'
);
RESET ROLE;
SELECT is(
    pg_sequence_last_value('inbox.backlog_floor'), inbox._backlog_micros(now()),
    'a dead letter made RECEIVED again lowers the floor to its received_at'
);
SET LOCAL ROLE pgoutbox_consumer;
SELECT is(
    (
        SELECT format('%s|%s|%s', unprocessed, failed, dead_letter) FROM inbox.backlog()
        WHERE handler = 'h'
    ),
    '1|0|0', 'and is counted as unprocessed'
);
RESET ROLE;

SELECT is(
    (
        SELECT array_agg(has_function_privilege('pgoutbox_consumer', f, 'EXECUTE') ORDER BY f)
        FROM unnest(ARRAY[
            'inbox._backlog_floor()', 'inbox._lower_backlog_floor(timestamptz)',
            'inbox._backlog_micros(timestamptz)', 'inbox._backlog_time(bigint)'
        ]) AS f
    ),
    ARRAY[FALSE, FALSE, FALSE, FALSE],
    'the floor''s functions are granted to no one'
);

-- Read-only: the floor is read, nothing is written.
SELECT setval('inbox.backlog_floor_next', 1, FALSE);
SET LOCAL transaction_read_only = on;
SELECT is(
    inbox._backlog_floor(),
    inbox._backlog_time(inbox._backlog_micros(now())),
    'read-only: the floor as it stands'
);

SELECT * FROM finish();
ROLLBACK;
