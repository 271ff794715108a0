-- outbox.hand_back (sql/30_outbox_api.sql): a relay hands back what the
-- broker did not answer for, and the update guard's branch for it
-- (sql/20_outbox_guards.sql). Calls run as pgoutbox_relay.
-- Scenarios:
--   * claim then hand_back: the events are PENDING, due now, with the
--     claim's attempt undone, the reason as last_error, the claim kept
--   * a handed-back event is claimed again at once; ten claims each handed
--     back leave attempts where they started
--   * fenced by the claim token: another token, or rows no longer
--     PROCESSING under it, are left alone (STALE_CLAIM, OB013, when none)
--   * a blank reason or no token is INVALID_ARGUMENT (OB006)
--   * around the function, PROCESSING -> PENDING is illegal (OB010), and with
--     the marker set it still allows only the exact move (same claim,
--     attempts - 1, due now)
--   * who may call it: pgoutbox_relay, not writers or consumers
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(16);
\ir fixtures/events.sql

SELECT fixture.event('PENDING') AS a_id \gset
SELECT fixture.event('PENDING') AS b_id \gset
SELECT fixture.event('PROCESSING', due => FALSE) AS held_id \gset

SET LOCAL ROLE pgoutbox_relay;
SELECT min(claim_token::text) AS token FROM outbox.claim('t-relay', 10, '1 minute') \gset
SELECT is(
    outbox.hand_back(:'token', ARRAY[:'a_id', :'b_id']::uuid[], 'NATS_UNAVAILABLE: JetStream away'),
    2, 'hand_back returns both claimed events'
);
RESET ROLE;
SELECT is(
    (
        SELECT format('%s|%s|%s|%s|%s', status, attempts, available_at <= now(), last_error, claim_token = :'token')
        FROM outbox.events
        WHERE event_id = :'a_id'
    ),
    'PENDING|0|t|NATS_UNAVAILABLE: JetStream away|t',
    'PENDING, due now, the attempt undone, the reason kept, the claim kept'
);

-- Claimed again at once, and no attempt is used up however often.
SET LOCAL ROLE pgoutbox_relay;
SELECT min(claim_token::text) AS again FROM outbox.claim('t-relay', 10, '1 minute') \gset
RESET ROLE;
SELECT is(
    (
        SELECT count(*)::integer FROM outbox.events
        WHERE claim_token = :'again' AND status = 'PROCESSING'
    ),
    2, 'handed-back events are claimed again at once'
);
SET LOCAL ROLE pgoutbox_relay;
SELECT outbox.hand_back(:'again', ARRAY[:'a_id', :'b_id']::uuid[], 'away');
DO $$
DECLARE
    token uuid;
    ids uuid[];
BEGIN
    FOR i IN 1..10 LOOP
        SELECT min(c.claim_token::text)::uuid, array_agg(c.event_id) INTO token, ids
        FROM outbox.claim('t-relay', 10, '1 minute') AS c;
        PERFORM outbox.hand_back(token, ids, 'away');
    END LOOP;
END;
$$;
RESET ROLE;
SELECT is(
    (
        SELECT attempts FROM outbox.events
        WHERE event_id = :'b_id'
    ),
    0, 'ten claims each handed back leave attempts where they were'
);

-- Fencing.
SET LOCAL ROLE pgoutbox_relay;
SELECT throws_ok(
    format(
        'SELECT outbox.hand_back(%L, ARRAY[%L]::uuid[], %L)', gen_random_uuid(), :'held_id', 'away'
    ),
    'OB013', NULL, 'another token holds none of the events: STALE_CLAIM'
);
RESET ROLE;
SELECT is(fixture.status(:'held_id'), 'PROCESSING', 'and the event held by its own claim stays PROCESSING');
SET LOCAL ROLE pgoutbox_relay;
SELECT min(claim_token::text) AS b_token FROM outbox.claim('t-relay', 10, '1 minute') \gset
SELECT is(
    outbox.hand_back(:'b_token', ARRAY[:'b_id', :'held_id']::uuid[], 'away'),
    1, 'only the rows held by the token are handed back'
);
SELECT throws_ok(
    format('SELECT outbox.hand_back(%L, ARRAY[%L]::uuid[], %L)', :'b_token', :'b_id', 'away'),
    'OB013', NULL, 'a row already handed back is no longer held: STALE_CLAIM'
);

-- Arguments.
SELECT throws_ok(
    format('SELECT outbox.hand_back(%L, ARRAY[%L]::uuid[], %L)', :'b_token', :'b_id', ' '),
    'OB006', NULL, 'a blank reason is INVALID_ARGUMENT'
);
SELECT throws_ok(
    format('SELECT outbox.hand_back(NULL, ARRAY[%L]::uuid[], %L)', :'b_id', 'away'),
    'OB006', NULL, 'no token is INVALID_ARGUMENT'
);

RESET ROLE;

-- Around the function.
SELECT claim_token AS held_token FROM outbox.events
WHERE event_id = :'held_id' \gset
SELECT throws_ok(
    format(
        $$UPDATE outbox.events SET status = 'PENDING', attempts = attempts - 1, available_at = now()
        WHERE event_id = %L$$,
        :'held_id'
    ),
    'OB010', NULL, 'PROCESSING -> PENDING by hand is illegal'
);
SELECT set_config('pgoutbox.hand_back', :'held_token', TRUE);
SELECT throws_ok(
    format(
        $$UPDATE outbox.events SET status = 'PENDING', attempts = attempts + 1, available_at = now()
        WHERE event_id = %L$$,
        :'held_id'
    ),
    'OB010', NULL, 'with the marker, any other count of attempts is still illegal'
);
SELECT throws_ok(
    format(
        $$UPDATE outbox.events SET status = 'PENDING', attempts = attempts - 1, available_at = now(),
        claim_token = NULL WHERE event_id = %L$$,
        :'held_id'
    ),
    'OB010', NULL, 'with the marker, dropping the claim is still illegal'
);
SELECT throws_ok(
    format(
        $$UPDATE outbox.events SET status = 'FAILED', last_error = 'x', claim_token = gen_random_uuid()
        WHERE event_id = %L$$,
        :'held_id'
    ),
    'OB010', NULL, 'with the marker, another move is still illegal'
);
SELECT set_config('pgoutbox.hand_back', '', TRUE);

-- Who may call it.
SELECT ok(
    has_function_privilege('pgoutbox_relay', 'outbox.hand_back(uuid, uuid[], text)', 'EXECUTE'),
    'pgoutbox_relay may hand events back'
);
SELECT ok(
    NOT has_function_privilege('pgoutbox_writer', 'outbox.hand_back(uuid, uuid[], text)', 'EXECUTE')
    AND NOT has_function_privilege('pgoutbox_consumer', 'outbox.hand_back(uuid, uuid[], text)', 'EXECUTE')
    AND NOT has_function_privilege('public', 'outbox.hand_back(uuid, uuid[], text)', 'EXECUTE'),
    'writers, consumers and the public may not'
);

SELECT * FROM finish();
ROLLBACK;
