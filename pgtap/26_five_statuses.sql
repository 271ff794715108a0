-- Five outbox statuses, no more: PENDING, PROCESSING, COMPLETED, FAILED,
-- DEAD_LETTER (the sources' rule; sql/10_outbox_events.sql, the state check
-- of sql/20_outbox_guards.sql). Scenarios:
--   * the state check (_500_check_state) names exactly the five
--   * each of the five is reached through legal moves
--   * no UPDATE from any of the five, nor an INSERT, leaves another value,
--     DISCARDED included (OB010)
--   * a discard and a restore (outbox.dlq_discard, dlq_restore) leave the
--     event DEAD_LETTER; the mark is a row of outbox.discarded_events
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(12);
\ir fixtures/events.sql

CREATE FUNCTION pg_temp.checked_statuses() RETURNS text[] LANGUAGE sql STABLE AS $$
    SELECT array_agg(m[1] ORDER BY m[1])
    FROM pg_trigger AS t,
        regexp_matches(
            substring(pg_get_triggerdef(t.oid) FROM 'status = ANY \(ARRAY\[([^]]*)\]'), '''([^'']*)''', 'g'
        ) AS m
    WHERE t.tgrelid = 'outbox.events'::regclass AND t.tgname = '_500_check_state'
$$;

-- Tries every value but the five from a row in each of the five; returns the
-- SQLSTATEs seen, one per try (a try that passes returns 'passed').
CREATE FUNCTION pg_temp.other_values_refused() RETURNS text[] LANGUAGE plpgsql AS $$
DECLARE
    codes text[] := '{}';
    here text;
    other text;
    row_id uuid;
BEGIN
    FOREACH here IN ARRAY ARRAY['PENDING', 'PROCESSING', 'COMPLETED', 'FAILED', 'DEAD_LETTER'] LOOP
        row_id := fixture.event(here);
        FOREACH other IN ARRAY ARRAY['DISCARDED', 'CANCELLED', 'ARCHIVED', 'dead_letter', ''] LOOP
            BEGIN
                UPDATE outbox.events SET status = other, last_error = 'x' WHERE event_id = row_id;
                codes := codes || 'passed'::text;
            EXCEPTION WHEN OTHERS THEN
                codes := codes || SQLSTATE::text;
            END;
        END LOOP;
    END LOOP;
    RETURN codes;
END;
$$;

SELECT is(
    pg_temp.checked_statuses(), ARRAY['COMPLETED', 'DEAD_LETTER', 'FAILED', 'PENDING', 'PROCESSING'],
    'the state check allows exactly the five statuses'
);
SELECT is(fixture.status(fixture.event('PENDING')), 'PENDING', 'PENDING is reached');
SELECT is(fixture.status(fixture.event('PROCESSING')), 'PROCESSING', 'PROCESSING is reached');
SELECT is(fixture.status(fixture.event('COMPLETED')), 'COMPLETED', 'COMPLETED is reached');
SELECT is(fixture.status(fixture.event('FAILED')), 'FAILED', 'FAILED is reached');
SELECT is(fixture.status(fixture.event('DEAD_LETTER')), 'DEAD_LETTER', 'DEAD_LETTER is reached');
SELECT is(
    (SELECT array_agg(DISTINCT c) FROM unnest(pg_temp.other_values_refused()) AS c), ARRAY['OB010'],
    'from each of the five, every other value (DISCARDED included) is refused: 25 tries, ILLEGAL_TRANSITION'
);
SELECT throws_ok(
    $$INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload, status, last_error)
    VALUES ('sea', 'order', '1', 'created', '{"schema_version": 1}', 'DISCARDED', 'x')$$,
    'OB010', NULL, 'an INSERT of another status is refused'
);

SELECT fixture.event('DEAD_LETTER') AS dead \gset
SET ROLE pgoutbox_admin;
SELECT is(
    outbox.dlq_discard(jsonb_build_object('ids', jsonb_build_array(:'dead')), 'obsolete'), 1,
    'a dead letter is discarded'
);
RESET ROLE;
SELECT is(
    (
        SELECT format('%s|%s', fixture.status(:'dead'), count(*)) FROM outbox.discarded_events
        WHERE event_id = :'dead'
    ),
    'DEAD_LETTER|1', 'discarded: still DEAD_LETTER, with its mark'
);
SET ROLE pgoutbox_admin;
SELECT is(
    outbox.dlq_restore(jsonb_build_object('ids', jsonb_build_array(:'dead')), 'wanted'), 1,
    'and restored'
);
RESET ROLE;
SELECT is(
    (
        SELECT format('%s|%s', fixture.status(:'dead'), count(*)) FROM outbox.discarded_events
        WHERE event_id = :'dead'
    ),
    'DEAD_LETTER|0', 'restored: DEAD_LETTER, no mark'
);

SELECT * FROM finish();
ROLLBACK;
