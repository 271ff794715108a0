-- Claiming and marking.
-- Scenarios:
--   * claim never returns more than batch_size, takes due events in id order,
--     moves them to PROCESSING under one fresh claim token, counts the attempt
--     and sets the lease (available_at = now() + lease)
--   * not yet due (FAILED before its retry time, leases still held), COMPLETED
--     and DEAD_LETTER events are never handed out
--   * an expired lease is taken over with a new token; the old token is fenced
--     off: mark_published / mark_failed with it raise STALE_CLAIM (OB013) and
--     leave the new owner's state alone
--   * mark_published marks only what the token holds and returns the count
--   * mark_failed: FAILED due at retry_at, or DEAD_LETTER when retry_at is NULL
--   * bad arguments raise INVALID_ARGUMENT (OB006)
--   * requeue: needs a reason (OB014), refuses non-dead events (OB015), resets attempts
--   * backlog counts unpublished, due, and the age of the oldest due event
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(33);
\ir fixtures/events.sql

SELECT fixture.event('PENDING') AS e1 \gset
SELECT fixture.event('PENDING') AS e2 \gset
SELECT fixture.event('PENDING') AS e3 \gset
SELECT fixture.event('FAILED', due => FALSE) AS parked \gset
SELECT fixture.event('PROCESSING', due => FALSE) AS held \gset
SELECT fixture.event('COMPLETED') AS done \gset
SELECT fixture.event('DEAD_LETTER') AS dead \gset

CREATE TEMP TABLE first_claim AS SELECT * FROM outbox.claim('w1', 2, '30 seconds');
SELECT is((SELECT count(*)::int FROM first_claim), 2, 'claim returns no more than batch_size');
SELECT results_eq(
    $$SELECT event_id FROM first_claim ORDER BY id$$,
    format($$VALUES (%L::uuid), (%L::uuid)$$, :'e1', :'e2'),
    'claim takes the oldest due events first'
);
SELECT is((SELECT count(DISTINCT claim_token)::int FROM first_claim), 1, 'one claim token per claim');
SELECT ok(
    (SELECT bool_and(
        status = 'PROCESSING' AND attempts = 1 AND claimed_by = 'w1'
        AND available_at = now() + interval '30 seconds'
    ) FROM first_claim),
    'claimed events are PROCESSING, counted, and leased'
);
SET LOCAL ROLE pgoutbox_relay;
SELECT results_eq(
    $$SELECT event_id FROM outbox.claim('w2', 100, '30 seconds')$$,
    format($$VALUES (%L::uuid)$$, :'e3'),
    'a second claim gets only what is left and due'
);
SELECT is_empty(
    $$SELECT * FROM outbox.claim('w3', 100, '30 seconds')$$,
    'parked retries, held leases, COMPLETED and DEAD_LETTER are never handed out'
);
RESET ROLE;

-- Marking what the claim holds.
SELECT is(
    outbox.mark_published((SELECT DISTINCT claim_token FROM first_claim), ARRAY[:'e1'::uuid, :'e3'::uuid]),
    1, 'mark_published marks only the events its token holds'
);
SELECT is(fixture.status(:'e1'), 'COMPLETED', 'the held event is COMPLETED');
SELECT ok((
    SELECT published_at IS NOT NULL FROM outbox.events
    WHERE event_id = :'e1'
), 'published_at is set');
SELECT is(fixture.status(:'e3'), 'PROCESSING', 'the event held by another claim is untouched');
SELECT is(
    outbox.mark_failed(
        (SELECT DISTINCT claim_token FROM first_claim), ARRAY[:'e2'::uuid],
        ARRAY['nats: timeout'], ARRAY[now() + interval '5 seconds']
    ),
    1, 'mark_failed with a retry time'
);
SELECT is(
    (
        SELECT status || '|' || last_error || '|' || (available_at = now() + interval '5 seconds')
        FROM outbox.events
        WHERE event_id = :'e2'
    ),
    'FAILED|nats: timeout|true', 'FAILED, with the error, due again at retry_at'
);

-- Lease expiry and fencing.
SELECT fixture.event('PROCESSING') AS expired \gset
SELECT claim_token AS old_token FROM outbox.events
WHERE event_id = :'expired' \gset
SET LOCAL ROLE pgoutbox_relay;
SELECT results_eq(
    $$SELECT event_id, attempts FROM outbox.claim('w4', 10, '1 minute')$$,
    format($$VALUES (%L::uuid, 2)$$, :'expired'),
    'an expired lease is taken over, counting another attempt'
);
RESET ROLE;
SELECT isnt(
    (
        SELECT claim_token FROM outbox.events
        WHERE event_id = :'expired'
    ), :'old_token'::uuid,
    'the take-over gets a new claim token'
);
SET LOCAL ROLE pgoutbox_relay;
SELECT throws_ok(
    format($$SELECT outbox.mark_published(%L, ARRAY[%L::uuid])$$, :'old_token', :'expired'),
    'OB013', NULL, 'the previous owner cannot mark it published (STALE_CLAIM)'
);
SELECT throws_ok(
    format(
        $$SELECT outbox.mark_failed(%L, ARRAY[%L::uuid], ARRAY['late'], ARRAY[NULL::timestamptz])$$,
        :'old_token', :'expired'
    ),
    'OB013', NULL, 'nor mark it failed'
);
RESET ROLE;
SELECT is(
    (
        SELECT status || '|' || claimed_by FROM outbox.events
        WHERE event_id = :'expired'
    ),
    'PROCESSING|w4', 'the new owner''s state is intact'
);
SELECT is(
    outbox.mark_failed(
        (
            SELECT claim_token FROM outbox.events
            WHERE event_id = :'expired'
        ),
        ARRAY[:'expired'::uuid], ARRAY['payload too large'], ARRAY[NULL::timestamptz]
    ),
    1, 'mark_failed without a retry time'
);
SELECT is(fixture.status(:'expired'), 'DEAD_LETTER', 'a NULL retry_at dead-letters the event');

-- Bad arguments.
SET LOCAL ROLE pgoutbox_relay;
SELECT throws_ok($$SELECT * FROM outbox.claim('w', 0, '1 minute')$$, 'OB006', NULL, 'batch_size 0 is refused');
SELECT
    throws_ok(
        $$SELECT * FROM outbox.claim('w', 10001, '1 minute')$$, 'OB006', NULL, 'batch_size over 10000 is refused'
    );
SELECT throws_ok($$SELECT * FROM outbox.claim('w', 10, '0 seconds')$$, 'OB006', NULL, 'a zero lease is refused');
SELECT throws_ok($$SELECT * FROM outbox.claim(' ', 10, '1 minute')$$, 'OB006', NULL, 'an unnamed worker is refused');
SELECT throws_ok(
    format(
        $$SELECT outbox.mark_failed(gen_random_uuid(), ARRAY[%L::uuid], ARRAY['a', 'b'], ARRAY[NULL::timestamptz])$$,
        :'e3'
    ),
    'OB006', NULL, 'mark_failed arrays of different lengths are refused'
);
SELECT throws_ok(
    format(
        $$SELECT outbox.mark_failed(gen_random_uuid(), ARRAY[%L::uuid], ARRAY[''], ARRAY[NULL::timestamptz])$$, :'e3'
    ),
    'OB006', NULL, 'a failure without an error text is refused'
);
SELECT throws_ok(
    $$SELECT outbox.mark_published(gen_random_uuid(), ARRAY[]::uuid[])$$,
    'OB006', NULL, 'marking an empty list is refused, not a silent no-op'
);
RESET ROLE;

-- Requeue.
SET LOCAL ROLE pgoutbox_admin;
SELECT throws_ok(
    format($$SELECT outbox.requeue(ARRAY[%L::uuid], '  ')$$, :'dead'),
    'OB014', NULL, 'requeue needs a reason'
);
SELECT throws_ok(
    format($$SELECT outbox.requeue(ARRAY[%L::uuid, %L::uuid], 'retry')$$, :'dead', :'e3'),
    'OB015', NULL, 'requeue refuses events that are not DEAD_LETTER, all or nothing'
);
RESET ROLE;
SELECT is(fixture.status(:'dead'), 'DEAD_LETTER', 'nothing was requeued by the refused call');
SET LOCAL ROLE pgoutbox_admin;
SELECT is(outbox.requeue(ARRAY[:'dead'::uuid], 'broker config fixed'), 1, 'requeue moves a dead letter');
RESET ROLE;
SELECT is(
    (
        SELECT status || '|' || attempts FROM outbox.events
        WHERE event_id = :'dead'
    ),
    'PENDING|0', 'requeued: PENDING with attempts reset'
);
SELECT is(
    (
        SELECT reason FROM outbox.requeue_log
        WHERE event_id = :'dead'
    ), 'broker config fixed',
    'the requeue is recorded with its reason'
);

-- Backlog: e3 (held by w2), e2 (parked), parked, held, dead (requeued, due) are unpublished.
SET LOCAL ROLE pgoutbox_relay;
SELECT results_eq(
    $$SELECT context, unpublished, due, processing, failed, dead_letter, oldest_due_age >= interval '0'
      FROM outbox.backlog('sea')$$,
    $$VALUES ('sea'::text, 5::bigint, 1::bigint, 2::bigint, 2::bigint, 1::bigint, TRUE)$$,
    'backlog counts unpublished, due, and by status'
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
