-- Dead-letter operations over both sides (sql/67_dead_letters.sql).
-- Scenarios:
--   * normalisation: the error class (HTTP status class, CODE:, exception
--     name, OTHER) and the pattern (uuids, quoted values, numbers masked)
--   * groups: side + owner + subject + class + pattern, with counts, first
--     and last seen, a stable id
--   * filters: side, owner, subject, error (a literal substring: % and _
--     match only themselves), tenant, since/until, group, ids, discarded;
--     bad filters are refused (OB100)
--   * list: keyset pages without overlap or gap; a bad cursor (OB107)
--   * count and replay: the exact count, then batches of max_rows that
--     touch only rows not already asked for, until 0; audited in
--     requeue_log / redrive_log with session_user; reason (OB014),
--     max_rows (OB006), action (OB106) checked
--   * re-failures: a replayed row that dead-letters again counts as refailed
--   * discard and restore: audited in discard_log; a discarded row is
--     neither claimed for replay, redriven, requeued nor listed as a live
--     dead letter; the backlogs count live dead letters only and
--     dlq_summary counts the discarded apart; direct UPDATEs around
--     the functions are refused (OB101, OB102), a restore of a row that is
--     not discarded (OB104) and a discard of one that is not a dead letter
--     (OB103) too; discard_log is append-only (OB060); an outbox event
--     stays DEAD_LETTER, its mark (outbox.discarded_events) one per event
--     and never changed
--   * an event of a sealed partition is listed, but no action counts or
--     takes it (it would refuse the whole batch)
--   * detail: envelope, payload only for a session user that may read the
--     table, history with who and why; unknown (OB105)
--   * roles: pgoutbox_viewer reads (no payload), cannot act or read tables;
--     pgoutbox_admin acts
--   * bulk actions on a fixed set (dlq_prepare, dlq_act, dlq_stop,
--     dlq_action_progress): each target once, failed-again counted, stop,
--     only the role that prepared it (OB110)
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(98);
\ir fixtures/events.sql

-- An inbox dead letter of handler with error err and tenant t1.
CREATE FUNCTION fixture.dead(handler text, err text, subject text DEFAULT 'sea.event.order_created.v1')
RETURNS uuid
LANGUAGE plpgsql
AS $$
DECLARE
    new_id uuid := gen_random_uuid();
BEGIN
    PERFORM inbox.receive(
        new_id, handler, subject,
        jsonb_build_object(
            'message_id', new_id, 'subject', subject, 'tenant_id', 't1',
            'headers', '{"x-trace": "abc"}'::jsonb, 'payload', '{"schema_version": 1, "secret": 42}'::jsonb
        )
    );
    PERFORM inbox.record_error(new_id, handler, err, dead => TRUE);
    RETURN new_id;
END;
$$;

-- Normalisation.
SELECT is(outbox.dlq_error_class('HTTP 503: Service Unavailable'), '5xx', 'class: an HTTP status class');
SELECT is(outbox.dlq_error_class('HTTP 422'), '4xx', 'class: a bare HTTP status');
SELECT is(outbox.dlq_error_class('UPCAST_MISSING: no step 2 -> 3'), 'UPCAST_MISSING', 'class: a code prefix');
SELECT is(outbox.dlq_error_class('TimeoutError: read timed out'), 'TimeoutError', 'class: an exception name');
SELECT is(outbox.dlq_error_class('something odd'), 'OTHER', 'class: anything else');
SELECT is(
    outbox.dlq_error_pattern(
        'HTTP 500: order 3747fbbb-90e9-4c23-9463-aeda5a9dc15e failed   after 3 tries: "no \"stock\"" / ''it''''s'' 12.5'
    ),
    'HTTP 500: order <uuid> failed after <n> tries: <q> / <q> <n>',
    'pattern: uuids, quoted values and numbers masked, white space collapsed; the HTTP status kept'
);
SELECT is(
    outbox.dlq_error_pattern('  KeyError: ''customer_7''  '), 'KeyError: <q>', 'pattern: trimmed, no status to keep'
);

-- Seeds: billing 3 x 5xx (differing ids and counts), 2 x BAD_PAYLOAD; shipping 1 x 4xx
-- on another subject; two outbox dead letters of context sea.
SELECT fixture.dead('billing', format('HTTP 500: order %s failed after %s tries', gen_random_uuid(), g))
FROM generate_series(1, 3) AS g;
SELECT fixture.dead('billing', 'BAD_PAYLOAD: field "amount" is 12.5') FROM generate_series(1, 2);
SELECT fixture.dead('shipping', 'HTTP 404: no route 100%_sure', 'sea.event.order_shipped.v1') AS ship_id \gset
SELECT fixture.event('DEAD_LETTER') AS ev1 \gset
SELECT fixture.event('DEAD_LETTER') AS ev2 \gset
SELECT fixture.event('FAILED') AS ev_failed \gset

SELECT results_eq(
    $$SELECT side, owner, error_class, dead_letters, discarded, refailed, replayable
      FROM outbox.dlq_groups() ORDER BY side, owner, error_class$$,
    $$VALUES
        ('inbox'::text, 'billing'::text, '5xx'::text, 3::bigint, 0::bigint, 0::bigint, 3::bigint),
        ('inbox', 'billing', 'BAD_PAYLOAD', 2, 0, 0, 2),
        ('inbox', 'shipping', '4xx', 1, 0, 0, 1),
        ('outbox', 'sea', 'OTHER', 2, 0, 0, 2)$$,
    'groups: one per side, owner, subject and normalised error, with counts'
);
SELECT is(
    (
        SELECT error_pattern FROM outbox.dlq_groups('{"owner": "billing"}')
        WHERE error_class = '5xx'
    ),
    'HTTP 500: order <uuid> failed after <n> tries', 'groups: the masked pattern'
);
SELECT ok(
    (SELECT first_seen <= last_seen AND last_seen = now() FROM outbox.dlq_groups('{"side": "outbox"}')),
    'groups: first and last seen'
);
SELECT is(
    (
        SELECT group_id FROM outbox.dlq_groups('{"owner": "billing"}')
        WHERE error_class = '5xx'
    ),
    md5(
        concat_ws(
            E'\n',
            'inbox',
            'billing',
            'sea.event.order_created.v1',
            '5xx',
            'HTTP 500: order <uuid> failed after <n> tries'
        )
    ),
    'groups: the id is the md5 of the key, stable across calls'
);
SELECT (
    SELECT group_id FROM outbox.dlq_groups('{"owner": "billing"}')
    WHERE error_class = '5xx'
) AS g500
\gset

-- Filters.
SELECT is((SELECT count(*) FROM outbox.dlq_list('{"side": "inbox"}')), 6::bigint, 'filter: side');
SELECT is((SELECT count(*) FROM outbox.dlq_list('{"owner": "shipping"}')), 1::bigint, 'filter: owner (a handler)');
SELECT is((SELECT count(*) FROM outbox.dlq_list('{"owner": "sea"}')), 2::bigint, 'filter: owner (a context)');
SELECT is(
    (SELECT count(*) FROM outbox.dlq_list('{"subject": "sea.event.order_shipped.v1"}')), 1::bigint, 'filter: subject'
);
SELECT is(
    (SELECT count(*) FROM outbox.dlq_list('{"error": "bad_PAYLOAD"}')), 2::bigint, 'filter: error, any letter case'
);
SELECT is(
    (SELECT count(*) FROM outbox.dlq_list('{"error": "100%_s"}')), 1::bigint, 'filter: error with % and _ as text'
);
SELECT is((SELECT count(*) FROM outbox.dlq_list('{"error": "1%0"}')), 0::bigint, 'filter: % is no wildcard');
SELECT is((SELECT count(*) FROM outbox.dlq_list('{"tenant": "t1"}')), 6::bigint, 'filter: tenant');
SELECT is(
    (SELECT count(*) FROM outbox.dlq_list(jsonb_build_object('since', now() + interval '1 second'))), 0::bigint,
    'filter: since'
);
SELECT is(
    (SELECT count(*) FROM outbox.dlq_list(jsonb_build_object('until', now() + interval '1 second'))), 8::bigint,
    'filter: until'
);
SELECT is((SELECT count(*) FROM outbox.dlq_list(jsonb_build_object('group', :'g500'))), 3::bigint, 'filter: group');
SELECT is(
    (SELECT count(*) FROM outbox.dlq_list(jsonb_build_object('ids', jsonb_build_array(:'ev1', :'ship_id')))), 2::bigint,
    'filter: ids, across sides'
);
SELECT throws_ok($$SELECT * FROM outbox.dlq_list('{"handler": "x"}')$$, 'OB100', NULL, 'filter: an unknown key');
SELECT throws_ok($$SELECT * FROM outbox.dlq_list('{"owner": 7}')$$, 'OB100', NULL, 'filter: a wrong type');
SELECT throws_ok($$SELECT * FROM outbox.dlq_list('{"side": "both"}')$$, 'OB100', NULL, 'filter: an unknown side');
SELECT throws_ok($$SELECT * FROM outbox.dlq_list('{"since": "yesterday-ish"}')$$, 'OB100', NULL, 'filter: a bad time');
SELECT throws_ok($$SELECT * FROM outbox.dlq_list('{"ids": ["nope"]}')$$, 'OB100', NULL, 'filter: a bad id');
SELECT throws_ok($$SELECT * FROM outbox.dlq_groups('[]')$$, 'OB100', NULL, 'filter: not an object');
SELECT throws_ok($$SELECT * FROM outbox.dlq_groups('{}', 0)$$, 'OB006', NULL, 'groups: max_rows is bounded');

-- Keyset pages.
SELECT l.cursor AS page1_end
FROM outbox.dlq_list('{}', 3) WITH ORDINALITY AS l
ORDER BY l.ordinality DESC
LIMIT 1 \gset
SELECT is(
    (SELECT count(*) FROM (
        SELECT id FROM outbox.dlq_list('{}', 3)
        UNION
        SELECT id FROM outbox.dlq_list('{}', 100, :'page1_end')
    ) AS u),
    8::bigint, 'list: the next page starts right after the cursor (no overlap, no gap)'
);
SELECT is((SELECT count(*) FROM outbox.dlq_list('{}', 100, :'page1_end')), 5::bigint, 'list: the rest after page 1');
SELECT throws_ok($$SELECT * FROM outbox.dlq_list('{}', 10, 'garbage')$$, 'OB107', NULL, 'list: a bad cursor');

-- Counts and batched replay.
SELECT is(outbox.dlq_count(jsonb_build_object('group', :'g500')), 3::bigint, 'count: what a replay of a group touches');
SELECT is(outbox.dlq_count('{}', 'restore'), 0::bigint, 'count: nothing to restore yet');
SELECT throws_ok($$SELECT outbox.dlq_count('{}', 'delete')$$, 'OB106', NULL, 'count: an unknown action');
SELECT throws_ok(
    format($$SELECT outbox.dlq_replay(%L, '  ')$$, jsonb_build_object('group', :'g500')), 'OB014', NULL,
    'replay: a reason is required'
);
SELECT throws_ok($$SELECT outbox.dlq_replay('{}', 'x', 10001)$$, 'OB006', NULL, 'replay: max_rows is bounded');
SELECT is(
    ARRAY[
        outbox.dlq_replay(jsonb_build_object('group', :'g500'), 'handler fixed', 2),
        outbox.dlq_replay(jsonb_build_object('group', :'g500'), 'handler fixed', 2),
        outbox.dlq_replay(jsonb_build_object('group', :'g500'), 'handler fixed', 2)
    ],
    ARRAY[2, 1, 0], 'replay: batches of max_rows until 0, never the same row twice'
);
SELECT is(
    (
        SELECT count(*) FROM inbox.redrive_log
        WHERE reason = 'handler fixed' AND redriven_by = session_user
    ),
    3::bigint, 'replay: each row audited in redrive_log with who and why'
);
SELECT is(outbox.dlq_count(jsonb_build_object('group', :'g500')), 0::bigint, 'count: nothing left to replay');
SELECT is(
    (
        SELECT count(*) FROM outbox.dlq_list(jsonb_build_object('group', :'g500'))
        WHERE redrive_pending
    ), 3::bigint,
    'list: the replayed rows wait for the replayer'
);
SELECT is(outbox.dlq_replay('{"side": "outbox"}', 'broker fixed'), 2, 'replay: outbox dead letters are requeued');
SELECT is(
    (
        SELECT string_agg(DISTINCT status, ',') FROM outbox.events
        WHERE event_id IN (:'ev1', :'ev2')
    ), 'PENDING',
    'replay: outbox rows are PENDING again'
);
SELECT is(
    (
        SELECT count(*) FROM outbox.requeue_log
        WHERE reason = 'broker fixed'
    ), 2::bigint,
    'replay: outbox requeues audited in requeue_log'
);

-- Re-failure: the replayer takes the 5xx rows, the handler fails again.
SELECT is(
    (SELECT count(*) FROM inbox.claim_replays('replayer', 10)), 3::bigint, 'the replayer takes the redriven rows'
);
SELECT
    inbox.record_error(
        message_id, handler, 'HTTP 500: order ' || gen_random_uuid() || ' failed after 9 tries', dead => TRUE
    )
FROM inbox.messages
WHERE status = 'RECEIVED';
SELECT is(
    (SELECT refailed FROM outbox.dlq_groups(jsonb_build_object('group', :'g500'))), 3::bigint,
    'groups: rows dead-lettered again after a replay count as refailed'
);

-- Discard and restore.
SELECT fixture.event('DEAD_LETTER') AS ev3 \gset
SELECT is(outbox.dlq_count('{"side": "outbox"}', 'discard'), 1::bigint, 'count: what a discard touches');
SELECT is(outbox.dlq_discard('{"side": "outbox"}', 'obsolete event'), 1, 'discard: an outbox dead letter');
SELECT is(
    (
        SELECT format('%s|%s', fixture.status(:'ev3'), count(*)) FROM outbox.discarded_events
        WHERE event_id = :'ev3'
    ),
    'DEAD_LETTER|1', 'discard: the event stays DEAD_LETTER, marked in outbox.discarded_events'
);
SELECT is(
    (
        SELECT format('%s|%s|%s', action, acted_by = session_user, reason) FROM outbox.discard_log
        WHERE event_id = :'ev3'
    ),
    'discard|t|obsolete event', 'discard: audited with who and why'
);
SELECT throws_ok(
    format($$SELECT outbox.requeue(ARRAY[%L]::uuid[], 'x')$$, :'ev3'), 'OB101', NULL,
    'a discarded event named to requeue is refused'
);
SELECT throws_ok(
    format($$UPDATE outbox.events SET status = 'PENDING' WHERE event_id = %L$$, :'ev3'), 'OB101', NULL,
    'a direct move of a discarded event is refused'
);
SELECT throws_ok(
    format($$DELETE FROM outbox.discarded_events WHERE event_id = %L$$, :'ev3'), 'OB102', NULL,
    'a restore around dlq_restore is refused'
);
SELECT throws_ok(
    format($$UPDATE outbox.discarded_events SET discarded_at = now() WHERE event_id = %L$$, :'ev3'), 'OB102', NULL,
    'a mark is never changed'
);
SELECT throws_ok(
    format(
        $$INSERT INTO outbox.discarded_events (event_id, row_id, created_at)
        SELECT event_id, id, created_at FROM outbox.events WHERE event_id = %L$$, :'ev_failed'
    ),
    'OB103', NULL, 'only a dead letter can be discarded'
);
SELECT
    set_config('pgoutbox.dlq_action', 'discard', TRUE) AS action,
    set_config('pgoutbox.dlq_reason', 'r', TRUE) AS reason;
SELECT throws_ok(
    format(
        $$INSERT INTO outbox.discarded_events (event_id, row_id, created_at)
        SELECT event_id, id, created_at FROM outbox.events WHERE event_id = %L$$, :'ev_failed'
    ),
    'OB103', NULL, 'only a dead letter can be discarded, inside a discard too'
);
SELECT throws_ok(
    format(
        $$INSERT INTO outbox.discarded_events (event_id, row_id, created_at)
        SELECT event_id, id, created_at FROM outbox.events WHERE event_id = %L$$, :'ev3'
    ),
    '23505', NULL, 'one mark per event'
);
SELECT
    set_config('pgoutbox.dlq_action', 'restore', TRUE) AS action,
    set_config('pgoutbox.dlq_reason', 'r', TRUE) AS reason;
SELECT throws_ok(
    format(
        $$UPDATE inbox.messages SET dlq_metadata = dlq_metadata || '{"failures": 9}' WHERE message_id = %L$$, :'ship_id'
    ),
    'OB104', NULL, 'a restore of a row that is not discarded is refused'
);
SELECT
    set_config('pgoutbox.dlq_action', '', TRUE) AS action,
    set_config('pgoutbox.dlq_reason', '', TRUE) AS reason;

SELECT
    is(
        outbox.dlq_discard(jsonb_build_object('ids', jsonb_build_array(:'ship_id')), 'never routable'),
        1,
        'discard: an inbox dead letter'
    );
SELECT is(
    (
        SELECT format('%s|%s', status, dlq_metadata -> 'discarded' ->> 'reason') FROM inbox.messages
        WHERE message_id = :'ship_id'
    ),
    'DEAD_LETTER|never routable', 'discard: an inbox row stays DEAD_LETTER, marked discarded'
);
SELECT throws_ok(
    format($$SELECT inbox.redrive('shipping', ARRAY[%L]::uuid[], 'x')$$, :'ship_id'), 'OB101', NULL,
    'a discarded message named to redrive is refused'
);
SELECT is(inbox.redrive('shipping', NULL, 'all of them'), 0, 'a redrive of all passes discarded ones by');
SELECT throws_ok(
    format(
        $$UPDATE inbox.messages SET dlq_metadata = dlq_metadata || '{"next_replay_at": "2000-01-01T00:00:00Z"}'
          WHERE message_id = %L$$,
        :'ship_id'
    ),
    'OB101', NULL, 'a discarded message cannot be scheduled for replay around the functions'
);
SELECT throws_ok(
    format($$UPDATE inbox.messages SET dlq_metadata = dlq_metadata - 'discarded' WHERE message_id = %L$$, :'ship_id'),
    'OB102', NULL, 'an inbox restore around dlq_restore is refused'
);
SELECT is(
    (SELECT count(*) FROM inbox.dead_letters('shipping')), 0::bigint, 'dead_letters lists live dead letters only'
);
SELECT is(
    (
        SELECT dead_letter FROM inbox.backlog()
        WHERE handler = 'shipping'
    ), 0::bigint,
    'inbox.backlog counts live dead letters only'
);
SELECT is((SELECT dead_letter FROM outbox.backlog('sea')), 0::bigint, 'outbox.backlog counts live dead letters only');
SELECT results_eq(
    $$SELECT side, context, owner, dead_letters, discarded, replay_enabled FROM outbox.dlq_summary()$$,
    $$VALUES
        ('inbox'::text, 'sea'::text, 'billing'::text, 5::bigint, 0::bigint, TRUE),
        ('inbox', 'sea', 'shipping', 0, 1, TRUE),
        ('outbox', 'sea', 'sea', 0, 1, NULL)$$,
    'dlq_summary counts live and discarded dead letters apart, with the replay switch'
);
SELECT is(
    (SELECT count(*) FROM outbox.dlq_list('{"discarded": true}')), 2::bigint, 'list: discarded ones on request'
);
SELECT is(outbox.dlq_restore('{}', 'wanted after all'), 2, 'restore: both sides');
SELECT is(
    (
        SELECT format('%s|%s', fixture.status(
            :'ev3'), (
            SELECT dlq_metadata ? 'discarded' FROM inbox.messages
            WHERE message_id = :'ship_id'
        ))
    ),
    'DEAD_LETTER|f', 'restore: dead letters again'
);
SELECT is(
    (
        SELECT string_agg(action, ',' ORDER BY id) FROM inbox.discard_log
        WHERE message_id = :'ship_id'
    ),
    'discard,restore', 'restore: audited after the discard'
);
SELECT throws_ok($$UPDATE outbox.discard_log SET reason = 'nothing'$$, 'OB060', NULL, 'discard_log is append-only');

-- An event of a sealed (archived, read-only) partition stays listed, but no
-- action takes it: it would refuse its whole batch (OB056) at every run.
\ir fixtures/archival.sql
SELECT
    (now() AT TIME ZONE 'UTC')::date - 40 AS d40,
    outbox._partition_name((now() AT TIME ZONE 'UTC')::date - 40) AS p40
\gset
SELECT outbox.create_partitions(0, :'d40');
SELECT fixture.old_event(:'d40', 'DEAD_LETTER') AS old_dl \gset
SELECT lives_ok(
    format('SELECT * FROM outbox.seal_partition(%L)', :'p40'), 'a partition with an old dead letter is sealed'
);
SELECT is(
    (SELECT count(*) FROM outbox.dlq_list(jsonb_build_object('ids', jsonb_build_array(:'old_dl')))), 1::bigint,
    'sealed: still listed'
);
SELECT is(
    outbox.dlq_count(jsonb_build_object('ids', jsonb_build_array(:'old_dl'))), 0::bigint, 'sealed: no action counts it'
);
SELECT is(outbox.dlq_replay('{"side": "outbox"}', 'sealed aside'), 1, 'sealed: a batch passes it by, takes the rest');

-- Detail and roles.
SELECT is(
    (SELECT outbox.dlq_show('inbox', :'ship_id', 'shipping') -> 'payload' ->> 'secret'), '42',
    'show: the payload for a session user that may read the table'
);
SELECT is(
    (SELECT jsonb_path_query_array(outbox.dlq_show('inbox', :'ship_id', 'shipping'), '$.history[*].action')),
    '["restore", "discard"]'::jsonb, 'show: the history, newest first'
);
SELECT throws_ok(
    format($$SELECT outbox.dlq_show('inbox', %L, 'billing')$$, :'ship_id'),
    'OB105',
    NULL,
    'show: an unknown dead letter'
);

CREATE ROLE t_viewer IN ROLE pgoutbox_viewer;
CREATE ROLE t_admin IN ROLE pgoutbox_admin;
SET LOCAL SESSION AUTHORIZATION t_viewer;
SELECT is((SELECT count(*) FROM outbox.dlq_groups()), 4::bigint, 'viewer: may read the groups');
SELECT is(
    (
        SELECT format('%s|%s|%s', d ->> 'payload', d ->> 'payload_visible', d -> 'headers' ->> 'x-trace')
        FROM outbox.dlq_show('inbox', :'ship_id', 'shipping') AS d
    ),
    '|false|abc', 'viewer: the detail without its payload'
);
SELECT throws_ok($$SELECT outbox.dlq_replay('{}', 'x')$$, '42501', NULL, 'viewer: may not replay');
SELECT throws_ok($$SELECT outbox.dlq_discard('{}', 'x')$$, '42501', NULL, 'viewer: may not discard');
SELECT throws_ok($$SELECT * FROM inbox.messages$$, '42501', NULL, 'viewer: may not read the table');
RESET SESSION AUTHORIZATION;
SET LOCAL SESSION AUTHORIZATION t_admin;
SELECT is(outbox.dlq_discard('{"side": "inbox", "owner": "shipping"}', 'admin acts'), 1, 'admin: may discard');
SELECT is(
    (
        SELECT acted_by FROM inbox.discard_log
        WHERE reason = 'admin acts'
    ), 't_admin', 'admin: audited as its role'
);
RESET SESSION AUTHORIZATION;

-- Bulk actions on a set fixed when confirmed: prepare fixes and counts it; act
-- takes each target once, the rows that failed again meanwhile too; a row
-- that matches only later is left alone; stop; another role's action: OB110.
SELECT fixture.dead('prepared', 'HTTP 503: busy') FROM generate_series(1, 3);
CREATE ROLE t_other IN ROLE pgoutbox_admin;
SET LOCAL SESSION AUTHORIZATION t_admin;
SELECT
    action_id AS act1,
    total AS act1_total
FROM outbox.dlq_prepare('{"owner": "prepared"}', 'replay') \gset
SELECT is(:act1_total::bigint, 3::bigint, 'prepare: the set is fixed and counted');
RESET SESSION AUTHORIZATION;
SELECT fixture.dead('prepared', 'HTTP 503: busy') AS late_id \gset
SET LOCAL SESSION AUTHORIZATION t_admin;
SELECT is(outbox.dlq_act(:act1, 'fixed set', 2), 2, 'act: a batch of its targets');
RESET SESSION AUTHORIZATION;
-- The replayer takes the two and the handler fails again: dead letters that match again.
SELECT inbox.record_error(r.message_id, r.handler, 'HTTP 503: still busy', dead => TRUE)
FROM inbox.claim_replays('w', 10) AS r;
-- (Later than the batch that took them, as it would be outside this one transaction.)
UPDATE inbox.messages
SET dlq_metadata = dlq_metadata || jsonb_build_object('dead_lettered_at', now() + interval '1 second')
WHERE handler = 'prepared' AND (dlq_metadata ->> 'dead_letters')::integer = 2;
SET LOCAL SESSION AUTHORIZATION t_admin;
SELECT is(outbox.dlq_act(:act1, 'fixed set', 2), 1, 'act: the last target only, not the two that failed again');
SELECT is(outbox.dlq_act(:act1, 'fixed set', 2), 0, 'act: done at the confirmed count');
SELECT is(
    (SELECT format('%s|%s|%s|%s', total, taken, touched, failed_again) FROM outbox.dlq_action_progress(:act1)),
    '3|3|3|2', 'progress: confirmed, taken, moved, failed again'
);
SELECT is(
    (
        SELECT count(*) FROM inbox.redrive_log
        WHERE reason = 'fixed set' AND message_id = :'late_id'
    ),
    0::bigint, 'act: a row that matched only later is left alone'
);
SELECT action_id AS act2 FROM outbox.dlq_prepare('{"owner": "prepared"}', 'replay') \gset
SELECT ok(outbox.dlq_stop(:act2), 'stop: a running action');
SELECT is(outbox.dlq_act(:act2, 'stopped', 10), 0, 'stop: no batch takes anything after');
RESET SESSION AUTHORIZATION;
SET LOCAL SESSION AUTHORIZATION t_other;
SELECT throws_ok(format('SELECT outbox.dlq_act(%s, %L, 1)', :act1, 'x'), 'OB110', NULL, 'act: another role''s action');
RESET SESSION AUTHORIZATION;
SET LOCAL SESSION AUTHORIZATION t_viewer;
SELECT throws_ok($$SELECT * FROM outbox.dlq_prepare('{}', 'replay')$$, '42501', NULL, 'viewer: may not prepare');
RESET SESSION AUTHORIZATION;

SELECT * FROM finish();
ROLLBACK;
