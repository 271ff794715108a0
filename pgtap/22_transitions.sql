-- Outbox lifecycle, enforced for every UPDATE whoever issues it (here the
-- table owner, bypassing the API functions on purpose).
-- Scenarios:
--   * each of the 7 legal moves succeeds
--   * each of the 18 other (from, to) pairs raises ILLEGAL_TRANSITION (OB010)
--   * guarded legal moves: re-claim before the lease expired, retry before it
--     is due, or finishing with another claim's token are refused (OB010)
--   * DEAD_LETTER -> PENDING needs a reason (OB014) and is written to requeue_log
--   * the event itself is immutable (OB011), also together with a legal move
--     and for the subject (a plain column since version 5); rewriting a
--     content column with its own value is allowed; a no-op UPDATE is not a move
--   * DELETE and TRUNCATE are refused (OB012)
--   * a legal move that would leave the row inconsistent (PROCESSING with no
--     claim, COMPLETED with no published_at, FAILED with no error, negative
--     attempts) is refused (OB010): the lifecycle invariants, CHECK
--     constraints until version 8, now the _500_check_state trigger
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(42);
\ir fixtures/events.sql

-- The 7 legal moves.
SELECT lives_ok(
    format($$UPDATE outbox.events SET status = 'PROCESSING', attempts = 1, claim_token = gen_random_uuid(),
        claimed_at = now(), claimed_by = 't', available_at = now() + interval '1 minute'
        WHERE event_id = %L$$, fixture.event('PENDING')),
    'PENDING -> PROCESSING'
);
SELECT lives_ok(
    format($$UPDATE outbox.events SET status = 'PROCESSING', attempts = attempts + 1,
        claim_token = gen_random_uuid(), available_at = now() + interval '1 minute'
        WHERE event_id = %L$$, fixture.event('FAILED')),
    'FAILED -> PROCESSING once due'
);
SELECT lives_ok(
    format($$UPDATE outbox.events SET attempts = attempts + 1, claim_token = gen_random_uuid(),
        claimed_by = 'other', available_at = now() + interval '1 minute'
        WHERE event_id = %L$$, fixture.event('PROCESSING')),
    'PROCESSING -> PROCESSING (re-claim) once the lease expired'
);
SELECT lives_ok(
    format($$UPDATE outbox.events SET status = 'COMPLETED', published_at = now()
        WHERE event_id = %L$$, fixture.event('PROCESSING', due => FALSE)),
    'PROCESSING -> COMPLETED'
);
SELECT lives_ok(
    format($$UPDATE outbox.events SET status = 'FAILED', last_error = 'x'
        WHERE event_id = %L$$, fixture.event('PROCESSING', due => FALSE)),
    'PROCESSING -> FAILED'
);
SELECT lives_ok(
    format($$UPDATE outbox.events SET status = 'DEAD_LETTER', last_error = 'x'
        WHERE event_id = %L$$, fixture.event('PROCESSING', due => FALSE)),
    'PROCESSING -> DEAD_LETTER'
);
SELECT fixture.event('DEAD_LETTER') AS dead_id \gset
SELECT set_config('pgoutbox.requeue_reason', 'fixed the subject mapping', TRUE);
SELECT lives_ok(
    format($$UPDATE outbox.events SET status = 'PENDING', attempts = 0 WHERE event_id = %L$$, :'dead_id'),
    'DEAD_LETTER -> PENDING with a reason'
);
SELECT set_config('pgoutbox.requeue_reason', '', TRUE);
SELECT is(
    (
        SELECT format('%s|%s|%s', reason, attempts_before, requeued_by = session_user)
        FROM outbox.requeue_log
        WHERE event_id = :'dead_id'
    ),
    'fixed the subject mapping|1|t',
    'the requeue is audited with who, why and the attempts before'
);

-- Every other (from, to) pair.
SELECT
    throws_ok(
        format(
            'UPDATE outbox.events SET status = %L, attempts = attempts + 1 WHERE event_id = %L',
            t.to_status, fixture.event(t.from_status)
        ),
        'OB010', NULL, format('%s -> %s is refused', t.from_status, t.to_status)
    )
FROM (
    VALUES
    ('PENDING', 'PENDING'), ('PENDING', 'COMPLETED'), ('PENDING', 'FAILED'),
    ('PENDING', 'DEAD_LETTER'),
    ('PROCESSING', 'PENDING'),
    ('FAILED', 'PENDING'), ('FAILED', 'COMPLETED'), ('FAILED', 'FAILED'),
    ('FAILED', 'DEAD_LETTER'),
    ('COMPLETED', 'PENDING'), ('COMPLETED', 'PROCESSING'), ('COMPLETED', 'COMPLETED'),
    ('COMPLETED', 'FAILED'), ('COMPLETED', 'DEAD_LETTER'),
    ('DEAD_LETTER', 'PROCESSING'), ('DEAD_LETTER', 'COMPLETED'), ('DEAD_LETTER', 'FAILED'),
    ('DEAD_LETTER', 'DEAD_LETTER')
) AS t (from_status, to_status);

-- Guards on the legal moves.
SELECT throws_ok(
    format($$UPDATE outbox.events SET attempts = attempts + 1, claim_token = gen_random_uuid()
        WHERE event_id = %L$$, fixture.event('PROCESSING', due => FALSE)),
    'OB010', NULL, 're-claim while the lease is held is refused'
);
SELECT throws_ok(
    format($$UPDATE outbox.events SET status = 'PROCESSING', attempts = attempts + 1,
        claim_token = gen_random_uuid() WHERE event_id = %L$$, fixture.event('FAILED', due => FALSE)),
    'OB010', NULL, 'retry before available_at is refused'
);
SELECT throws_ok(
    format($$UPDATE outbox.events SET status = 'COMPLETED', published_at = now(),
        claim_token = gen_random_uuid() WHERE event_id = %L$$, fixture.event('PROCESSING', due => FALSE)),
    'OB010', NULL, 'finishing under another claim token is refused'
);
SELECT throws_ok(
    format($$UPDATE outbox.events SET status = 'PENDING' WHERE event_id = %L$$, fixture.event('DEAD_LETTER')),
    'OB014', NULL, 'DEAD_LETTER -> PENDING without a reason is refused'
);

-- Immutability, deletion.
SELECT throws_ok(
    format(
        $$UPDATE outbox.events SET payload = '{"schema_version": 2}' WHERE event_id = %L$$,
        fixture.event('PENDING')
    ),
    'OB011', NULL, 'the payload cannot be rewritten'
);
SELECT throws_ok(
    format($$UPDATE outbox.events SET ordering_key = 'k' WHERE event_id = %L$$, fixture.event('FAILED')),
    'OB011', NULL, 'the ordering key cannot be rewritten'
);
SELECT throws_ok(
    format($$UPDATE outbox.events SET subject = 'sea.event.other.v1' WHERE event_id = %L$$, fixture.event('PENDING')),
    'OB011', NULL, 'the subject cannot be rewritten'
);
SELECT throws_ok(
    format($$UPDATE outbox.events SET status = 'PROCESSING', attempts = 1, claim_token = gen_random_uuid(),
        claimed_at = now(), claimed_by = 't', available_at = now() + interval '1 minute',
        aggregate_id = 'other' WHERE event_id = %L$$, fixture.event('PENDING')),
    'OB011', NULL, 'a legal move cannot carry a content change'
);
SELECT lives_ok(
    format($$UPDATE outbox.events SET payload = payload, subject = subject, status = 'PROCESSING', attempts = 1,
        claim_token = gen_random_uuid(), claimed_at = now(), claimed_by = 't',
        available_at = now() + interval '1 minute' WHERE event_id = %L$$, fixture.event('PENDING')),
    'a legal move that sets content columns to their own values passes'
);
SELECT lives_ok(
    format($$UPDATE outbox.events SET status = status WHERE event_id = %L$$, fixture.event('COMPLETED')),
    'a no-op UPDATE is not a move'
);
SELECT throws_ok(
    format($$UPDATE outbox.events SET status = 'PROCESSING', attempts = 1, claimed_at = now(), claimed_by = 't',
        available_at = now() + interval '1 minute' WHERE event_id = %L$$, fixture.event('PENDING')),
    'OB010', NULL, 'PROCESSING needs a claim token'
);
SELECT throws_ok(
    format($$UPDATE outbox.events SET status = 'COMPLETED'
        WHERE event_id = %L$$, fixture.event('PROCESSING', due => FALSE)),
    'OB010', NULL, 'COMPLETED needs a published_at'
);
SELECT throws_ok(
    format($$UPDATE outbox.events SET status = 'FAILED'
        WHERE event_id = %L$$, fixture.event('PROCESSING', due => FALSE)),
    'OB010', NULL, 'FAILED needs an error'
);
SELECT throws_ok(
    format($$UPDATE outbox.events SET status = 'PROCESSING', attempts = -1, claim_token = gen_random_uuid(),
        claimed_at = now(), claimed_by = 't', available_at = now() + interval '1 minute'
        WHERE event_id = %L$$, fixture.event('PENDING')),
    'OB010', NULL, 'attempts cannot be negative'
);
SELECT throws_ok(
    $$DELETE FROM outbox.events$$, 'OB012', NULL, 'DELETE is refused, even to the owner'
);
SELECT throws_ok(
    $$TRUNCATE outbox.events$$, 'OB012', NULL, 'TRUNCATE is refused'
);

SELECT * FROM finish();
ROLLBACK;
