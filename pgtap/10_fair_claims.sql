-- Fair claims across tenants.
-- Scenarios:
--   * a claim behind one tenant's backlog serves every tenant with due
--     events, events without a tenant as one tenant of their own, each
--     tenant's first event at the head of the batch
--   * more tenants than the batch: the next claim goes on with the tenants
--     the previous one did not meet
--   * ordering keys stay as strict as in id order, across tenants too
--   * a tenant's weight is its share of a claim; weight 1 removes it
--   * only pgoutbox_admin sets weights; each change is logged; bad
--     arguments are refused with their codes
--   * without a backlog above the claim floor, id order as before
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(19);

CREATE FUNCTION pg_temp.emit(tenant text, n integer, key text DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE sql
AS $$
    SELECT outbox.emit(
        'order', gen_random_uuid()::text, 'created', '{"schema_version": 1}',
        context => 'sea', tenant_id => tenant, ordering_key => key
    )
    FROM generate_series(1, n);
$$;

-- What a claim handed out, per tenant ('-': none).
CREATE FUNCTION pg_temp.tenants_of(worker text, batch integer)
RETURNS TABLE (tenant text, n bigint)
LANGUAGE sql
AS $$
    SELECT coalesce(c.tenant_id, '-'), count(*)
    FROM outbox.claim(worker, batch, '1 minute') AS c
    GROUP BY 1
    ORDER BY 1;
$$;

SELECT count(*) FROM pg_temp.emit('big', 40);
SELECT count(*) FROM pg_temp.emit('a', 2);
SELECT count(*) FROM pg_temp.emit('b', 2);
SELECT count(*) FROM pg_temp.emit(NULL, 2);

SET LOCAL ROLE pgoutbox_relay;
CREATE TEMP TABLE c1 AS
SELECT
    c.*,
    row_number() OVER () AS pos
FROM outbox.claim('w1', 9, '1 minute') AS c;
RESET ROLE;
SELECT results_eq(
    $$SELECT coalesce(tenant_id, '-'), count(*) FROM c1 GROUP BY 1 ORDER BY 1$$,
    $$VALUES ('-', 2::bigint), ('a', 2::bigint), ('b', 2::bigint), ('big', 3::bigint)$$,
    'behind a backlog of 40, a claim of 9 serves all four tenants (no tenant is one) a share of 8, and the oldest event'
);
SELECT is(
    (
        SELECT count(DISTINCT coalesce(c1.tenant_id, '-')) FROM c1
        WHERE c1.pos <= 4
    ),
    4::bigint,
    'the first four events of the batch are one of each tenant'
);
SELECT results_eq(
    $$SELECT * FROM pg_temp.tenants_of('w2', 8)$$,
    $$VALUES ('big', 8::bigint)$$,
    'once the others have nothing due, the backlog has the whole batch'
);

-- More tenants than the batch: round by round.
CREATE TEMP TABLE r (tenant_id text);
GRANT INSERT, SELECT ON r TO pgoutbox_relay;
SELECT count(x.id) FROM generate_series(1, 6) AS g CROSS JOIN LATERAL pg_temp.emit('t' || g::text, 1) AS x (id);
SET LOCAL ROLE pgoutbox_relay;
INSERT INTO r SELECT c.tenant_id FROM outbox.claim('w3', 4, '1 minute') AS c;
INSERT INTO r SELECT c.tenant_id FROM outbox.claim('w3', 4, '1 minute') AS c;
INSERT INTO r SELECT c.tenant_id FROM outbox.claim('w3', 4, '1 minute') AS c;
RESET ROLE;
SELECT is(
    (
        SELECT count(DISTINCT r.tenant_id) FROM r
        WHERE r.tenant_id LIKE 't_'
    ),
    6::bigint,
    'six tenants with one event each and claims of 4 beside a backlog: all six served within three claims'
);

-- Keys: one event of a key in flight, whichever tenants emit it.
SELECT pg_temp.emit('big', 1, 'K') AS k1 \gset
SELECT pg_temp.emit('big', 1, 'K') AS k2 \gset
SELECT pg_temp.emit('a', 1, 'K') AS k3 \gset
SET LOCAL ROLE pgoutbox_relay;
CREATE TEMP TABLE c4 AS SELECT * FROM outbox.claim('w4', 50, '1 minute');
RESET ROLE;
SELECT results_eq(
    $$SELECT event_id FROM c4 WHERE ordering_key = 'K'$$,
    format($$VALUES (%L::uuid)$$, :'k1'),
    'of key K (two tenants) only its oldest event is handed out'
);
SELECT outbox.mark_published(
    (SELECT DISTINCT claim_token FROM c4), (SELECT array_agg(event_id) FROM c4)
);
SELECT results_eq(
    $$SELECT c.event_id FROM outbox.claim('w5', 50, '1 minute') AS c WHERE c.ordering_key = 'K'$$,
    format($$VALUES (%L::uuid)$$, :'k2'),
    'then the next one, not the other tenant''s later event of the key'
);

-- Weights.
CREATE ROLE t_fair_admin IN ROLE pgoutbox_admin;
CREATE ROLE t_fair_relay IN ROLE pgoutbox_relay;
CREATE ROLE t_fair_writer IN ROLE pgoutbox_writer;
SET LOCAL ROLE t_fair_relay;
SELECT throws_ok(
    $$SELECT outbox.set_tenant_weight('big', 3, 'import')$$,
    '42501', NULL, 'a relay may not set a weight'
);
RESET ROLE;
SET LOCAL ROLE t_fair_writer;
SELECT throws_ok(
    $$SELECT outbox.set_tenant_weight('big', 3, 'import')$$,
    '42501', NULL, 'nor may a writer'
);
RESET ROLE;
SET LOCAL ROLE t_fair_admin;
SELECT is(outbox.set_tenant_weight('heavy', 3, 'the import tenant pays for more'), 1, 'an admin may; it was 1');
SELECT results_eq(
    $$SELECT tenant_key, weight_before, weight_after, changed_by = session_user, reason FROM outbox.tenant_weight_log$$,
    $$VALUES ('heavy', 1, 3, TRUE, 'the import tenant pays for more')$$,
    'the change is logged: tenant, before, after, who and why'
);
SELECT throws_ok(
    $$SELECT outbox.set_tenant_weight('heavy', 0, 'off')$$,
    'OB026', NULL, 'weight 0: INVALID_TENANT_WEIGHT'
);
SELECT throws_ok(
    $$SELECT outbox.set_tenant_weight('heavy', 1001, 'more')$$,
    'OB026', NULL, 'weight over 1000: INVALID_TENANT_WEIGHT'
);
SELECT throws_ok(
    $$SELECT outbox.set_tenant_weight(' heavy', 2, 'more')$$,
    'OB027', NULL, 'a tenant id emit would refuse: INVALID_TENANT'
);
SELECT throws_ok(
    $$SELECT outbox.set_tenant_weight('heavy', 2, ' ')$$,
    'OB014', NULL, 'a blank reason: REASON_REQUIRED'
);
RESET ROLE;

-- big's backlog is drained above; two fresh backlogs, one weighted 3.
SET LOCAL ROLE pgoutbox_relay;
SELECT count(*) FROM outbox.claim('w6', 1000, '1 minute');
RESET ROLE;
SELECT count(*) FROM pg_temp.emit('heavy', 40);
SELECT count(*) FROM pg_temp.emit('light', 40);
SET LOCAL ROLE pgoutbox_relay;
SELECT results_eq(
    $$SELECT * FROM pg_temp.tenants_of('w7', 8)$$,
    $$VALUES ('heavy', 6::bigint), ('light', 2::bigint)$$,
    'weight 3 against 1: three quarters of the batch (5 of the 7 shared, and the oldest event)'
);
RESET ROLE;
SET LOCAL ROLE t_fair_admin;
SELECT is(outbox.set_tenant_weight('heavy', 1, 'import done'), 3, 'weight 1 again: it was 3');
RESET ROLE;
SELECT is_empty($$SELECT * FROM outbox.tenant_weights$$, 'weight 1 is no setting at all');
SET LOCAL ROLE pgoutbox_relay;
SELECT results_eq(
    $$SELECT * FROM pg_temp.tenants_of('w8', 8)$$,
    $$VALUES ('heavy', 5::bigint), ('light', 3::bigint)$$,
    'and the two share the 7 alike (4 and 3), the oldest event besides'
);
RESET ROLE;

-- No backlog above the claim floor (the batch takes all there is): id order,
-- the tenant lane skipped. Last, as the floor is a sequence (not rolled back).
SET LOCAL ROLE pgoutbox_relay;
SELECT count(*) FROM outbox.claim('w9', 1000, '1 minute');
RESET ROLE;
SELECT count(*) FROM pg_temp.emit('big', 4);
SELECT count(*) FROM pg_temp.emit('a', 1);
SELECT setval(
    'outbox.claim_floor',
    (SELECT max(e.id) - 4 FROM outbox.events AS e)  -- the first of the five
);
SET LOCAL ROLE pgoutbox_relay;
SELECT results_eq(
    $$SELECT * FROM pg_temp.tenants_of('w9', 4)$$,
    $$VALUES ('big', 4::bigint)$$,
    'four ids above the floor for a claim of four: no backlog, the oldest four in id order'
);
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
