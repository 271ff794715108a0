-- Roles and privileges, checked by switching roles inside the transaction.
-- Scenarios:
--   * nothing in outbox/inbox is granted to PUBLIC; every API function is
--     SECURITY DEFINER with a pinned search_path
--   * writer: may emit and use the command inbox, nothing else (no claim, no
--     table access)
--   * relay: may claim and mark, not emit, not requeue, not read tables
--   * consumer: may use the inbox functions, not the outbox ones nor the
--     command inbox
--   * admin: may read inbox.commands, not claim commands
--   * admin: may requeue, create partitions and read, but never write tables
--   * archiver: may make the schema check every command makes, not claim,
--     emit or requeue
--   * upcasters: the admin registers them, the consumer may not; the
--     consumer may run a chain
--   * viewer: may read backlogs and dead letters (outbox.dlq_*), not act on
--     them (replay, discard, restore, requeue, redrive, switch replay), nor
--     read a table; the admin may act on them
--   * nobody may DELETE from outbox.events
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(49);

CREATE ROLE t_writer IN ROLE pgoutbox_writer;
CREATE ROLE t_relay IN ROLE pgoutbox_relay;
CREATE ROLE t_consumer IN ROLE pgoutbox_consumer;
CREATE ROLE t_admin IN ROLE pgoutbox_admin;
CREATE ROLE t_archiver IN ROLE pgoutbox_archiver;
CREATE ROLE t_viewer IN ROLE pgoutbox_viewer;
CREATE ROLE t_stranger;

SELECT is_empty(
    $$SELECT p.oid::regprocedure FROM pg_proc AS p
      WHERE p.pronamespace IN ('outbox'::regnamespace, 'inbox'::regnamespace)
        AND has_function_privilege('t_stranger', p.oid, 'EXECUTE')$$,
    'PUBLIC can execute no pgoutbox function'
);
SELECT is_empty(
    $$SELECT p.oid::regprocedure FROM pg_proc AS p
      WHERE p.pronamespace IN ('outbox'::regnamespace, 'inbox'::regnamespace)
        AND p.prorettype NOT IN ('trigger'::regtype, 'event_trigger'::regtype)
        AND (p.prosecdef IS NOT TRUE OR NOT p.proconfig @> ARRAY['search_path=pg_catalog, pg_temp'])
        AND p.proname !~ '^_'$$,
    'every API function (private helpers start with _) is SECURITY DEFINER with a pinned search_path'
);
SELECT ok(
    NOT has_schema_privilege('t_stranger', 'outbox', 'USAGE')
    AND NOT has_schema_privilege('t_stranger', 'inbox', 'USAGE'),
    'PUBLIC has no usage on the schemas'
);
SELECT is_empty(
    $$SELECT r.rolname FROM pg_roles AS r
      WHERE r.rolname IN ('t_writer', 't_relay', 't_consumer', 't_admin', 't_archiver', 't_viewer')
        AND has_table_privilege(r.rolname, 'outbox.events', 'DELETE')$$,
    'no pgoutbox role may DELETE from outbox.events'
);

SET LOCAL ROLE t_writer;
SELECT lives_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', context => 'sea')$$,
    'writer: may emit'
);
SELECT throws_ok($$SELECT * FROM outbox.claim('w', 1, '1 minute')$$, '42501', NULL, 'writer: may not claim');
SELECT throws_ok($$SELECT * FROM outbox.events$$, '42501', NULL, 'writer: may not read the table');
SELECT throws_ok(
    $$INSERT INTO outbox.events (context, aggregate_type, aggregate_id, event_type, payload)
      VALUES ('sea', 'o', '1', 'created', '{"schema_version": 1}')$$,
    '42501', NULL, 'writer: may not insert around emit'
);
SELECT is(
    (SELECT claimed FROM inbox.claim_command('start_run', 'role-k1')), TRUE, 'writer: may claim a command'
);
SELECT is(
    (SELECT status FROM inbox.complete_command('start_run', 'role-k1', '{"run_id": 1}')), 'DONE',
    'writer: may complete a command'
);
SELECT lives_ok(
    $$SELECT * FROM inbox.lookup_command('start_run', 'role-k1')$$, 'writer: may look a command up'
);
SELECT throws_ok($$SELECT * FROM inbox.commands$$, '42501', NULL, 'writer: may not read the command table');
RESET ROLE;

SET LOCAL ROLE t_relay;
SELECT lives_ok($$SELECT * FROM outbox.claim('w', 10, '1 minute')$$, 'relay: may claim');
SELECT throws_ok(
    $$SELECT outbox.mark_published(gen_random_uuid(), ARRAY[gen_random_uuid()])$$, 'OB013', NULL,
    'relay: may mark (a stale token is refused by the function, not by a privilege)'
);
SELECT lives_ok($$SELECT * FROM outbox.backlog()$$, 'relay: may read the backlog');
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', context => 'sea')$$,
    '42501', NULL, 'relay: may not emit'
);
SELECT throws_ok($$SELECT outbox.requeue(ARRAY[]::uuid[], 'x')$$, '42501', NULL, 'relay: may not requeue');
SELECT throws_ok(
    $$UPDATE outbox.events SET status = 'COMPLETED'$$, '42501', NULL, 'relay: may not update the table directly'
);
RESET ROLE;

SET LOCAL ROLE t_consumer;
SELECT lives_ok(
    $$SELECT inbox.receive(gen_random_uuid(), 'billing', 'sea.event.created.v1')$$, 'consumer: may receive'
);
SELECT throws_ok($$SELECT * FROM outbox.claim('w', 1, '1 minute')$$, '42501', NULL, 'consumer: may not claim');
SELECT throws_ok($$SELECT * FROM inbox.messages$$, '42501', NULL, 'consumer: may not read the table directly');
SELECT throws_ok(
    $$SELECT * FROM inbox.claim_command('start_run', 'role-k2')$$, '42501', NULL, 'consumer: may not claim a command'
);
RESET ROLE;

SET LOCAL ROLE t_admin;
SELECT lives_ok($$SELECT * FROM outbox.events$$, 'admin: may read events');
SELECT lives_ok($$SELECT * FROM inbox.commands$$, 'admin: may read the command table');
SELECT throws_ok(
    $$SELECT * FROM inbox.claim_command('start_run', 'role-k3')$$, '42501', NULL, 'admin: may not claim a command'
);
SELECT lives_ok($$SELECT * FROM outbox.create_partitions(1)$$, 'admin: may create partitions');
SELECT throws_ok(
    $$SELECT outbox.requeue(ARRAY[gen_random_uuid()], 'x')$$, 'OB015', NULL,
    'admin: may requeue (refused here only because the event is not dead)'
);
SELECT throws_ok($$DELETE FROM outbox.events$$, '42501', NULL, 'admin: may not DELETE');
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', context => 'sea')$$,
    '42501', NULL, 'admin: may not emit'
);
RESET ROLE;

CREATE SCHEMA t_app;
CREATE FUNCTION t_app.same(p jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$ SELECT p $$;
GRANT USAGE ON SCHEMA t_app TO t_admin, t_consumer;
SET LOCAL ROLE t_admin;
SELECT lives_ok(
    $$SELECT inbox.register_upcaster('order_created', 1, 't_app.same(jsonb)')$$, 'admin: may register an upcaster'
);
RESET ROLE;
SET LOCAL ROLE t_consumer;
SELECT throws_ok(
    $$SELECT inbox.register_upcaster('order_created', 1, 't_app.same(jsonb)')$$, '42501', NULL,
    'consumer: may not register an upcaster'
);
SELECT throws_ok(
    $$SELECT inbox.unregister_upcaster('order_created', 1)$$, '42501', NULL, 'consumer: may not unregister one'
);
SELECT is(inbox.upcast('order_created', 1, 2, '{"a": 1}'), '{"a": 1}'::jsonb, 'consumer: may run a chain');
RESET ROLE;
SET LOCAL ROLE t_writer;
SELECT is(
    inbox.upcast('order_created', 1, 2, '{"a": 1}'), '{"a": 1}'::jsonb,
    'writer: may run a chain (in its own transaction)'
);
RESET ROLE;
-- The walk-through's GRANT USAGE (docs/in-database.md): without it the admin cannot name the function.
CREATE SCHEMA t_hidden;
CREATE FUNCTION t_hidden.same(p jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$ SELECT p $$;
SET LOCAL ROLE t_admin;
SELECT throws_ok(
    $$SELECT inbox.register_upcaster('order_created', 1, 't_hidden.same(jsonb)')$$, '42501', NULL,
    'admin: may not register an upcaster in a schema it has no USAGE on'
);
RESET ROLE;

SET LOCAL ROLE t_archiver;
SELECT lives_ok(
    $$SELECT outbox.schema_version(), outbox.serves_workers_from()$$,
    'archiver: may make the schema check every command makes'
);
SELECT throws_ok($$SELECT * FROM outbox.claim('w', 1, '1 minute')$$, '42501', NULL, 'archiver: may not claim');
SELECT throws_ok(
    $$SELECT outbox.emit('order', '1', 'created', '{"schema_version": 1}', context => 'sea')$$,
    '42501', NULL, 'archiver: may not emit'
);
SELECT throws_ok($$SELECT outbox.requeue(ARRAY[gen_random_uuid()], 'x')$$, '42501', NULL, 'archiver: may not requeue');
RESET ROLE;

SET LOCAL ROLE t_viewer;
SELECT lives_ok(
    $$SELECT outbox.schema_version(), outbox.serves_workers_from()$$, 'viewer: may make the schema check'
);
SELECT lives_ok(
    $$SELECT * FROM outbox.backlog() AS a, inbox.backlog() AS b,
        outbox.dead_letters() AS c, inbox.dead_letters() AS d$$,
    'viewer: may read the backlogs and dead letters'
);
SELECT lives_ok(
    $$SELECT * FROM outbox.dlq_groups(), outbox.dlq_list(), outbox.dlq_count('{}'), outbox.dlq_summary()$$,
    'viewer: may read dead-letter groups, lists and counts'
);
SELECT throws_ok($$SELECT outbox.dlq_replay('{}', 'x')$$, '42501', NULL, 'viewer: may not replay');
SELECT throws_ok($$SELECT outbox.dlq_discard('{}', 'x')$$, '42501', NULL, 'viewer: may not discard');
SELECT throws_ok($$SELECT outbox.dlq_restore('{}', 'x')$$, '42501', NULL, 'viewer: may not restore');
SELECT throws_ok($$SELECT outbox.requeue(ARRAY[gen_random_uuid()], 'x')$$, '42501', NULL, 'viewer: may not requeue');
SELECT throws_ok(
    $$SELECT inbox.set_replay('billing', FALSE, 'x')$$, '42501', NULL, 'viewer: may not switch replay'
);
SELECT throws_ok($$SELECT * FROM outbox.events$$, '42501', NULL, 'viewer: may not read a table (no payloads)');
RESET ROLE;
SET LOCAL ROLE t_admin;
SELECT is(outbox.dlq_replay('{}', 'x'), 0, 'admin: may replay dead letters (none here)');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
