-- Delayed and scheduled events (sql/36_outbox_schedules.sql): emit's
-- deliver_at / deliver_after, outbox.cancel, outbox.scheduled,
-- outbox.next_scheduled, and the cancel branch of the UPDATE guard
-- (sql/20_outbox_guards.sql).
-- Scenarios:
--   * deliver_after / deliver_at set available_at; the event is entered in
--     outbox.schedules with its emitter, and is not claimable before it is due
--   * a time up to a minute in the past is due now; further back
--     DELIVERY_IN_PAST (OB022); beyond 366 days or infinite DELIVERY_TOO_FAR
--     (OB023); both options at once INVALID_ARGUMENT (OB006)
--   * outbox.scheduled() counts what waits, per context, apart from the
--     backlog's due count; outbox.next_scheduled() says when the next falls due
--   * cancel: another login CANCEL_NOT_ALLOWED (OB025); a reason is
--     required (OB014); the emitter cancels: DEAD_LETTER, CANCELLED: reason,
--     audited in outbox.cancel_log, gone from scheduled(); twice, or an event
--     emitted without a delivery time, NOT_CANCELLABLE (OB024); a member of
--     pgoutbox_admin may cancel another's; an UPDATE around cancel() is refused
--   * a cancelled event is a dead letter that outbox.requeue() sends after all
--   * archival keeps a day with a pending scheduled event
--   * an event scheduled a second ahead, committed, is not claimable, and is
--     claimable once due (two sessions through dblink)
--   * grants: the relay asks next_scheduled(), viewers read scheduled()
-- emit and cancel run as pgoutbox_writer (SET ROLE), claims as
-- pgoutbox_relay; the logins that cancel are test roles (SET SESSION
-- AUTHORIZATION: cancel checks session_user).
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(34);

CREATE ROLE t_emitter IN ROLE pgoutbox_writer;
CREATE ROLE t_other IN ROLE pgoutbox_writer;
CREATE ROLE t_admin IN ROLE pgoutbox_admin;
CREATE TEMP TABLE ids (name text PRIMARY KEY, id uuid);
GRANT ALL ON ids TO public;
CREATE FUNCTION pg_temp.remember(name text, id uuid) RETURNS uuid LANGUAGE sql AS $$
    INSERT INTO ids VALUES (name, id) RETURNING id
$$;
CREATE FUNCTION pg_temp.id_of(given text) RETURNS uuid LANGUAGE sql STABLE AS $$
    SELECT ids.id FROM ids WHERE ids.name = given
$$;

SET SESSION AUTHORIZATION t_emitter;
SELECT pg_temp.remember(
    'later',
    outbox.emit('order', '1', 'remind', '{"schema_version": 1}', context => 'sea', deliver_after => interval '1 hour')
);
SELECT pg_temp.remember(
    'at',
    outbox.emit(
        'order', '2', 'remind', '{"schema_version": 1}', context => 'sea', deliver_at => now() + interval '2 days'
    )
);
SELECT pg_temp.remember(
    'skewed',
    outbox.emit(
        'order', '3', 'remind', '{"schema_version": 1}', context => 'sea', deliver_at => now() - interval '30 seconds'
    )
);
SELECT pg_temp.remember('plain', outbox.emit('order', '4', 'created', '{"schema_version": 1}', context => 'sea'));
RESET SESSION AUTHORIZATION;

SELECT is(
    (
        SELECT e.available_at FROM outbox.events AS e
        WHERE e.event_id = pg_temp.id_of('later')
    ),
    now() + interval '1 hour', 'deliver_after: available_at is now + the interval'
);
SELECT is(
    (
        SELECT e.available_at FROM outbox.events AS e
        WHERE e.event_id = pg_temp.id_of('at')
    ),
    now() + interval '2 days', 'deliver_at: available_at is that time'
);
SELECT is(
    (
        SELECT e.available_at FROM outbox.events AS e
        WHERE e.event_id = pg_temp.id_of('skewed')
    ),
    now(), 'a delivery time less than a minute past is due now'
);
SELECT results_eq(
    $$SELECT name, s.emitted_by, s.deliver_at FROM outbox.schedules AS s INNER JOIN ids ON s.event_id = ids.id
      ORDER BY name$$,
    $$VALUES ('at', 't_emitter', now() + interval '2 days'), ('later', 't_emitter', now() + interval '1 hour')$$,
    'only the events due later are entered in outbox.schedules, with their emitter'
);
SET LOCAL ROLE pgoutbox_relay;
SELECT set_eq(
    $$SELECT event_id FROM outbox.claim('relay-1', 100, interval '1 minute')$$,
    $$VALUES (pg_temp.id_of('skewed')), (pg_temp.id_of('plain'))$$,
    'a claim takes what is due, and passes the scheduled events by'
);
RESET ROLE;

-- Bounds.
SET LOCAL ROLE pgoutbox_writer;
SELECT throws_ok(
    $$SELECT outbox.emit('order', '5', 'remind', '{"schema_version": 1}', context => 'sea',
        deliver_at => now() - interval '61 seconds')$$,
    'OB022', NULL, 'a delivery time more than a minute past: DELIVERY_IN_PAST'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '5', 'remind', '{"schema_version": 1}', context => 'sea',
        deliver_after => interval '-5 minutes')$$,
    'OB022', NULL, 'a negative deliver_after beyond the minute: DELIVERY_IN_PAST'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '5', 'remind', '{"schema_version": 1}', context => 'sea',
        deliver_at => '-infinity')$$,
    'OB022', NULL, '-infinity: DELIVERY_IN_PAST'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '5', 'remind', '{"schema_version": 1}', context => 'sea',
        deliver_after => interval '367 days')$$,
    'OB023', NULL, 'more than 366 days ahead: DELIVERY_TOO_FAR'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '5', 'remind', '{"schema_version": 1}', context => 'sea',
        deliver_at => 'infinity')$$,
    'OB023', NULL, 'infinity: DELIVERY_TOO_FAR'
);
SELECT lives_ok(
    $$SELECT outbox.emit('order', '5', 'remind', '{"schema_version": 1}', context => 'edge',
        deliver_at => now() + interval '366 days')$$,
    '366 days ahead is taken'
);
SELECT throws_ok(
    $$SELECT outbox.emit('order', '5', 'remind', '{"schema_version": 1}', context => 'sea',
        deliver_at => now() + interval '1 hour', deliver_after => interval '1 hour')$$,
    'OB006', NULL, 'deliver_at and deliver_after together: INVALID_ARGUMENT'
);
RESET ROLE;

-- What operators and relays see.
SET LOCAL ROLE pgoutbox_viewer;
SELECT results_eq(
    $$SELECT context, scheduled, next_due_at, last_due_at FROM outbox.scheduled()$$,
    $$VALUES ('edge', 1::bigint, now() + interval '366 days', now() + interval '366 days'),
        ('sea', 2::bigint, now() + interval '1 hour', now() + interval '2 days')$$,
    'outbox.scheduled(): per context, the count, the next and the last delivery time (as pgoutbox_viewer)'
);
SELECT results_eq(
    $$SELECT scheduled FROM outbox.scheduled('sea')$$, $$VALUES (2::bigint)$$,
    'outbox.scheduled(context) for one context'
);
SELECT is(
    (SELECT due FROM outbox.backlog('sea')), 0::bigint,
    'the backlog counts none of them as due'
);
RESET ROLE;
SET LOCAL ROLE pgoutbox_relay;
SELECT is(outbox.next_scheduled(), now() + interval '1 hour', 'outbox.next_scheduled(): the next delivery time');
RESET ROLE;
SELECT ok(
    NOT has_function_privilege('pgoutbox_writer', 'outbox.next_scheduled()', 'EXECUTE')
    AND NOT has_function_privilege('pgoutbox_viewer', 'outbox.cancel(uuid, text)', 'EXECUTE'),
    'next_scheduled is the relay''s, cancel the writer''s and the admin''s'
);

-- Cancel.
SET SESSION AUTHORIZATION t_other;
SELECT throws_ok(
    $$SELECT outbox.cancel(pg_temp.id_of('later'), 'not mine')$$,
    'OB025', NULL, 'another writer may not cancel it: CANCEL_NOT_ALLOWED'
);
RESET SESSION AUTHORIZATION;
SET SESSION AUTHORIZATION t_emitter;
SELECT throws_ok(
    $$SELECT outbox.cancel(pg_temp.id_of('later'), ' ')$$,
    'OB014', NULL, 'a cancel needs a reason: REASON_REQUIRED'
);
SELECT is(
    outbox.cancel(pg_temp.id_of('later'), 'order paid before the reminder'),
    now() + interval '1 hour', 'the emitter cancels it: cancel returns the delivery time it had'
);
SELECT throws_ok(
    $$SELECT outbox.cancel(pg_temp.id_of('later'), 'again')$$,
    'OB024', NULL, 'cancelled twice: NOT_CANCELLABLE'
);
SELECT throws_ok(
    $$SELECT outbox.cancel(pg_temp.id_of('plain'), 'no schedule')$$,
    'OB024', NULL, 'an event emitted without a delivery time: NOT_CANCELLABLE'
);
RESET SESSION AUTHORIZATION;
SELECT results_eq(
    $$SELECT status, last_error FROM outbox.events WHERE event_id = pg_temp.id_of('later')$$,
    $$VALUES ('DEAD_LETTER', 'CANCELLED: order paid before the reminder')$$,
    'a cancelled event is a DEAD_LETTER whose error says why'
);
SELECT results_eq(
    $$SELECT cancelled_by, reason, deliver_at FROM outbox.cancel_log
      WHERE event_id = pg_temp.id_of('later')$$,
    $$VALUES ('t_emitter', 'order paid before the reminder', now() + interval '1 hour')$$,
    'and outbox.cancel_log says who cancelled it, why, and when it was due'
);
SELECT is(
    (SELECT scheduled FROM outbox.scheduled('sea')), 1::bigint, 'outbox.scheduled() no longer counts it'
);
SET SESSION AUTHORIZATION t_admin;
SELECT lives_ok(
    $$SELECT outbox.cancel(pg_temp.id_of('at'), 'the admin cleans up')$$,
    'a member of pgoutbox_admin cancels another login''s event'
);
RESET SESSION AUTHORIZATION;
SELECT is(
    (SELECT count(*) FROM outbox.cancel_log), 2::bigint, 'every cancel is audited'
);
SELECT outbox.emit('order', '6', 'created', '{"schema_version": 1}', context => 'due');
SELECT throws_ok(
    $$UPDATE outbox.events SET status = 'DEAD_LETTER', last_error = 'by hand' WHERE context = 'due'$$,
    'OB010', NULL, 'PENDING -> DEAD_LETTER of a due event by hand is refused: ILLEGAL_TRANSITION'
);
SELECT outbox.emit(
    'order', '6', 'remind', '{"schema_version": 1}', context => 'hand',
    deliver_after => interval '1 hour'
);
SELECT throws_ok(
    $$UPDATE outbox.events SET status = 'DEAD_LETTER', last_error = 'by hand' WHERE context = 'hand'$$,
    'OB010', NULL, 'an UPDATE around outbox.cancel() is refused: ILLEGAL_TRANSITION'
);
SET LOCAL ROLE pgoutbox_admin;
SELECT is(
    outbox.requeue(ARRAY[pg_temp.id_of('later')], 'the customer wants it after all'),
    1, 'outbox.requeue sends a cancelled event after all'
);
RESET ROLE;

-- Time passing, committed: two sessions through dblink.
CREATE EXTENSION IF NOT EXISTS dblink;
CREATE FUNCTION pg_temp.here() RETURNS text LANGUAGE sql AS $$
    SELECT format(
        'host=%s dbname=%s port=%s user=%s',
        coalesce(host(inet_server_addr()), split_part(current_setting('unix_socket_directories'), ',', 1)),
        current_database(), current_setting('port'), current_user
    )
$$;
-- How many events of context 'soon' a claim in session one takes, as the relay.
CREATE FUNCTION pg_temp.claimed_soon() RETURNS bigint LANGUAGE sql AS $$
    SELECT t.n FROM dblink(
        'one',
        'SET ROLE pgoutbox_relay; SELECT count(*) FROM outbox.claim(''relay-2'', 100, ''1 minute'') AS c'
        || ' WHERE c.context = ''soon'''
    ) AS t (n bigint)
$$;
SELECT dblink_connect('one', pg_temp.here());
SELECT t.id
FROM dblink(
    'one', $$SELECT outbox.emit('order', '8', 'remind', '{"schema_version": 1}',
    context => 'soon', deliver_after => interval '1 second')::text$$
) AS t (id text);
SELECT is(pg_temp.claimed_soon(), 0::bigint, 'committed, an event scheduled a second ahead is not claimable at once');
SELECT pg_sleep(1.2);
SELECT is(pg_temp.claimed_soon(), 1::bigint, 'once due, it is claimable');
SELECT is(pg_temp.claimed_soon(), 0::bigint, 'and taken once');
SELECT dblink_disconnect('one');


-- Archival keeps a day with a pending scheduled event.
SELECT outbox.create_partitions(0, (now() AT TIME ZONE 'UTC')::date - 10);
INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload, created_at, available_at)
VALUES ('sea', 'order', '7', 'remind', '{"schema_version": 1}', now() - interval '10 days', now() + interval '1 day');
SELECT results_eq(
    $$SELECT eligible, open_rows FROM outbox.archivable_partitions(interval '7 days')
      WHERE day = (now() AT TIME ZONE 'UTC')::date - 10$$,
    $$VALUES (FALSE, 1::bigint)$$,
    'archival keeps the day of a pending scheduled event (an open row)'
);

SELECT * FROM finish();
ROLLBACK;
