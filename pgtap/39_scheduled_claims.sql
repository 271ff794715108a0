-- How outbox.claim (sql/30_outbox_api.sql) takes scheduled events: from
-- events_scheduled_idx once due, each with a new id (sql/10_outbox_events.sql),
-- and the content guard's one exception for that id (sql/20_outbox_guards.sql).
-- Scenarios:
--   * a scheduled event fallen due is claimed before the id-ordered events of
--     the same claim, PROCESSING under the claim's token with one attempt, its
--     content and created_at kept and a new id above every id given out before
--   * a batch of one takes the due scheduled event first; one not yet due is
--     not taken
--   * handed back, a released event is claimed again through the id-ordered
--     walk with the id it took
--   * a keyed scheduled event keeps its id and its place in its key's order
--   * a cancelled scheduled event that an operator requeues is claimed (in a
--     later transaction than its emit's through events_scheduled_idx, with
--     a new id; here, in the same, through the id-ordered walk)
--   * the id changes only by that claim: an UPDATE of the id of an unkeyed
--     PENDING event, of a scheduled event that stays PENDING, or of a claimed
--     one is IMMUTABLE_EVENT (OB011)
--   * backlog() counts scheduled events as unpublished, wherever their ids lie,
--     and gives no age of the oldest due event when nothing is due
-- Scheduled events fallen due are written by the owner with times in the past
-- (inside one transaction now() stands still); claims and hand-backs run as
-- pgoutbox_relay, emit and cancel as pgoutbox_writer, requeue as pgoutbox_admin.
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(14);

CREATE FUNCTION pg_temp.scheduled(aggregate_id text, due interval, ordering_key text DEFAULT NULL)
RETURNS uuid LANGUAGE sql AS $$
    INSERT INTO outbox.events (
        context, aggregate_type, aggregate_id, event_type, payload, ordering_key, created_at, available_at
    )
    VALUES (
        'sea', 'order', aggregate_id, 'remind', '{"schema_version": 1}', ordering_key,
        now() - interval '2 hours', now() + due
    )
    RETURNING event_id
$$;
CREATE FUNCTION pg_temp.row_id(given uuid) RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT e.id FROM outbox.events AS e WHERE e.event_id = given
$$;

SELECT pg_temp.scheduled('1', interval '-1 hour') AS due_id \gset
SELECT pg_temp.scheduled('2', interval '1 hour') AS later_id \gset
SELECT pg_temp.row_id(:'due_id') AS due_row \gset
SET LOCAL ROLE pgoutbox_writer;
SELECT outbox.emit('order', '3', 'created', '{"schema_version": 1}', 'sea') AS plain_id \gset
RESET ROLE;
SELECT pg_temp.row_id(:'plain_id') AS plain_row \gset

-- A batch of one: the scheduled event fallen due comes first.
SET LOCAL ROLE pgoutbox_relay;
CREATE TEMP TABLE first_claim AS SELECT * FROM outbox.claim('t-relay', 1, '1 minute');
RESET ROLE;
SELECT is(
    (SELECT array_agg(event_id) FROM first_claim), ARRAY[:'due_id']::uuid[],
    'a batch of one takes the scheduled event fallen due first'
);
SELECT ok(
    (SELECT id > :plain_row AND id > :due_row FROM first_claim),
    'it took a new id, above every id given out before the claim'
);
SELECT is(
    (
        SELECT
            format(
                '%s|%s|%s|%s|%s', e.status, e.attempts, e.claim_token = f.claim_token,
                e.created_at = now() - interval '2 hours', e.id = f.id
            )
        FROM first_claim AS f
        INNER JOIN outbox.events AS e ON f.event_id = e.event_id
    ),
    'PROCESSING|1|t|t|t',
    'PROCESSING under the claim''s token, one attempt, created_at kept, the new id stored'
);

-- The rest: the id-ordered event; the one not yet due stays.
SET LOCAL ROLE pgoutbox_relay;
CREATE TEMP TABLE second_claim AS SELECT * FROM outbox.claim('t-relay', 10, '1 minute');
RESET ROLE;
SELECT is(
    (SELECT array_agg(event_id) FROM second_claim), ARRAY[:'plain_id']::uuid[],
    'then the id-ordered event; a scheduled event not yet due is not taken'
);

-- Due scheduled events before id-ordered ones within a claim too.
SET LOCAL ROLE pgoutbox_writer;
SELECT outbox.emit('order', '4', 'created', '{"schema_version": 1}', 'sea') AS plain2_id \gset
RESET ROLE;
SELECT pg_temp.scheduled('5', interval '-1 minute') AS due2_id \gset
SET LOCAL ROLE pgoutbox_relay;
CREATE TEMP TABLE third_claim AS
SELECT
    row_number() OVER () AS n,
    c.*
FROM outbox.claim('t-relay', 10, '1 minute') AS c;
RESET ROLE;
SELECT is(
    (SELECT array_agg(event_id ORDER BY n) FROM third_claim), ARRAY[:'due2_id', :'plain2_id']::uuid[],
    'within a claim, the scheduled event fallen due comes before the id-ordered event'
);

-- Handed back, a released event is claimed again with the id it took.
SELECT
    f.claim_token AS token,
    f.id AS released_row
FROM first_claim AS f \gset
SET LOCAL ROLE pgoutbox_relay;
SELECT outbox.hand_back(:'token', ARRAY[:'due_id']::uuid[], 'away');
CREATE TEMP TABLE fourth_claim AS SELECT * FROM outbox.claim('t-relay', 10, '1 minute');
RESET ROLE;
SELECT is(
    (SELECT array_agg(format('%s|%s', event_id, id)) FROM fourth_claim),
    ARRAY[format('%s|%s', :'due_id', :released_row)],
    'handed back, it is claimed again through the id-ordered walk, with the id it took'
);

-- A keyed scheduled event keeps its id and holds its key's successors.
SELECT pg_temp.scheduled('6', interval '-1 minute', 'k-1') AS keyed_id \gset
SELECT pg_temp.row_id(:'keyed_id') AS keyed_row \gset
SET LOCAL ROLE pgoutbox_writer;
SELECT outbox.emit(
    'order', '7', 'created', '{"schema_version": 1}', 'sea', ordering_key => 'k-1'
) AS successor_id \gset
RESET ROLE;
SET LOCAL ROLE pgoutbox_relay;
CREATE TEMP TABLE keyed_claim AS SELECT * FROM outbox.claim('t-relay', 10, '1 minute');
RESET ROLE;
SELECT is(
    (SELECT array_agg(format('%s|%s', event_id, id)) FROM keyed_claim),
    ARRAY[format('%s|%s', :'keyed_id', :keyed_row)],
    'a keyed scheduled event is claimed with its own id, its successor held back'
);

-- Cancelled, then requeued by an operator: claimed, with a new id.
SET LOCAL ROLE pgoutbox_writer;
SELECT outbox.emit(
    'order'::varchar, '8', 'remind', '{"schema_version": 1}', context => 'sea', deliver_after => interval '1 day'
) AS cancelled_id \gset
SELECT outbox.cancel(:'cancelled_id', 'not needed');
RESET ROLE;
SET LOCAL ROLE pgoutbox_admin;
SELECT outbox.requeue(ARRAY[:'cancelled_id']::uuid[], 'needed after all');
RESET ROLE;
SET LOCAL ROLE pgoutbox_relay;
CREATE TEMP TABLE requeued_claim AS SELECT * FROM outbox.claim('t-relay', 10, '1 minute');
RESET ROLE;
SELECT is(
    (SELECT array_agg(event_id) FROM requeued_claim), ARRAY[:'cancelled_id']::uuid[],
    'a requeued cancelled event is claimed'
);

-- The id changes by that claim only.
SELECT throws_ok(
    format('UPDATE outbox.events SET id = DEFAULT WHERE event_id = %L', :'successor_id'),
    'OB011', NULL, 'the id of an unkeyed or keyed PENDING event is immutable'
);
SELECT throws_ok(
    format('UPDATE outbox.events SET id = DEFAULT WHERE event_id = %L', :'later_id'),
    'OB011', NULL, 'the id of a scheduled event that stays PENDING is immutable'
);
SELECT throws_ok(
    format('UPDATE outbox.events SET id = DEFAULT WHERE event_id = %L', :'plain_id'),
    'OB011', NULL, 'the id of a claimed event is immutable'
);
SELECT is(pg_temp.row_id(:'later_id') < :plain_row, TRUE, 'the scheduled event not yet due kept its id');

-- backlog(): scheduled events are unpublished; no age when nothing is due.
SELECT is(
    (SELECT unpublished FROM outbox.backlog('sea')),
    (
        SELECT count(*) FROM outbox.events
        WHERE status IN ('PENDING', 'FAILED', 'PROCESSING')
    ),
    'backlog counts every unfinished event as unpublished, the scheduled one below the others'' ids included'
);
SET LOCAL ROLE pgoutbox_writer;
SELECT outbox.emit(
    'order'::varchar, '9', 'remind', '{"schema_version": 1}', context => 'air', deliver_after => interval '1 hour'
);
RESET ROLE;
SELECT is(
    (SELECT format('%s|%s|%s', unpublished, due, coalesce(oldest_due_age::text, 'NULL')) FROM outbox.backlog('air')),
    '1|0|NULL',
    'with nothing due, the age of the oldest due event is NULL (not 2,000 years)'
);

SELECT * FROM finish();
ROLLBACK;
