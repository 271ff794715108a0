-- The testing kit's emit assertions (pgtap/helpers/events.sql), on events
-- written by outbox.emit (sql/30_outbox_api.sql).
-- Scenarios:
--   * emits passes when the statement emits the event type with a payload
--     containing the given keys; fails, naming what was expected and what
--     was emitted, on another type, another payload, or nothing emitted
--   * emits_exactly counts only matching events; emits_nothing fails when
--     anything is emitted and lists it; emitted_in_order compares the
--     emitted event types in emit order, no more and no fewer
--   * a statement that raises fails every assertion, with its SQLSTATE
--   * only the statement's own events count, not those the test's
--     transaction emitted before it; a prepared statement's name runs it
--   * a role holding only pgoutbox_writer (no table grant) uses them all
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(42);
\ir helpers/events.sql

CREATE SCHEMA app;
CREATE FUNCTION app.place(customer text, total integer) RETURNS uuid
LANGUAGE sql AS $$
    SELECT outbox.emit('order', customer, 'order_created', jsonb_build_object('customer', customer, 'total', total, 'schema_version', 1),
        'shop', ordering_key => customer)
$$;
CREATE FUNCTION app.place_and_pay(customer text) RETURNS void
LANGUAGE sql AS $$
    SELECT app.place(customer, 5);
    SELECT outbox.emit('order', customer, 'order_paid', '{"schema_version": 1}', 'shop', ordering_key => customer);
$$;
GRANT USAGE ON SCHEMA app TO pgoutbox_writer;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA app TO pgoutbox_writer;

-- check_test(output, ok, name, description[, diagnostics]): 2 tests, or 3 with diagnostics.
SELECT * FROM check_test(
    pgoutbox_tap.emits($$SELECT app.place('c-1', 5)$$, 'order_created', '{"total": 5}'),
    TRUE, 'emits passes on a matching event', 'emits order_created whose payload contains {"total": 5}', ''
);
SELECT * FROM check_test(
    pgoutbox_tap.emits($$SELECT app.place('c-1', 5)$$, 'order_created', '{"total": 6}', 'total six'),
    FALSE, 'emits fails on another payload, naming expected and emitted', 'total six',
    E'expected: an event order_created whose payload contains {"total": 6}\n'
    'emitted:  1 event(s)\n    order_created {"total": 5, "customer": "c-1", "schema_version": 1} (ordering_key c-1)'
);
SELECT * FROM check_test(
    pgoutbox_tap.emits($$SELECT app.place('c-1', 5)$$, 'order_paid'),
    FALSE, 'emits fails on another event type', 'emits order_paid',
    E'expected: an event order_paid\nemitted:  1 event(s)\n'
    '    order_created {"total": 5, "customer": "c-1", "schema_version": 1} (ordering_key c-1)'
);
SELECT * FROM check_test(
    pgoutbox_tap.emits('SELECT 1', 'order_created'),
    FALSE, 'emits fails when nothing is emitted', 'emits order_created',
    E'expected: an event order_created\nemitted:  nothing'
);

-- emits_exactly
SELECT * FROM check_test(
    pgoutbox_tap.emits_exactly(
        2, $$SELECT app.place('c-1', 5), app.place('c-2', 5), app.place('c-3', 7)$$, 'order_created', '{"total": 5}'
    ),
    TRUE, 'emits_exactly counts matching events only',
    'emits exactly 2 order_created whose payload contains {"total": 5}'
);
SELECT * FROM check_test(
    pgoutbox_tap.emits_exactly(1, $$SELECT app.place('c-1', 5), app.place('c-2', 5)$$, 'order_created'),
    FALSE, 'emits_exactly fails on another count', 'emits exactly 1 order_created',
    E'expected: exactly 1 event(s) order_created\nemitted:  2 event(s)\n'
    '    order_created {"total": 5, "customer": "c-1", "schema_version": 1} (ordering_key c-1)\n'
    '    order_created {"total": 5, "customer": "c-2", "schema_version": 1} (ordering_key c-2)'
);

-- emits_nothing
SELECT * FROM check_test(
    pgoutbox_tap.emits_nothing('SELECT 1'), TRUE, 'emits_nothing passes when nothing is emitted', 'emits nothing'
);
SELECT * FROM check_test(
    pgoutbox_tap.emits_nothing($$SELECT app.place_and_pay('c-9')$$),
    FALSE, 'emits_nothing fails and lists what was emitted', 'emits nothing',
    E'expected: no event\nemitted:  2 event(s)\n'
    '    order_created {"total": 5, "customer": "c-9", "schema_version": 1} (ordering_key c-9)\n'
    '    order_paid {"schema_version": 1} (ordering_key c-9)'
);

-- emitted_in_order
SELECT * FROM check_test(
    pgoutbox_tap.emitted_in_order($$SELECT app.place_and_pay('c-1')$$, ARRAY['order_created', 'order_paid']),
    TRUE, 'emitted_in_order passes on the emit order', 'emits order_created, order_paid in this order'
);
SELECT * FROM check_test(
    pgoutbox_tap.emitted_in_order($$SELECT app.place_and_pay('c-1')$$, ARRAY['order_paid', 'order_created']),
    FALSE, 'emitted_in_order fails on another order', 'emits order_paid, order_created in this order',
    E'expected: order_paid, order_created, in this order\nemitted:  2 event(s)\n'
    '    order_created {"total": 5, "customer": "c-1", "schema_version": 1} (ordering_key c-1)\n'
    '    order_paid {"schema_version": 1} (ordering_key c-1)'
);
SELECT * FROM check_test(
    pgoutbox_tap.emitted_in_order($$SELECT app.place_and_pay('c-1')$$, ARRAY['order_created']),
    FALSE, 'emitted_in_order fails on an extra event', 'emits order_created in this order'
);

-- a statement that raises
SELECT * FROM check_test(
    pgoutbox_tap.emits(
        $$SELECT outbox.emit('order', 'o', 'bad type!', '{"schema_version": 1}', 'shop')$$, 'order_created'
    ),
    FALSE, 'emits fails when the statement raises', 'emits order_created'
);
SELECT * FROM check_test(
    pgoutbox_tap.emits_nothing($$SELECT 1/0$$),
    FALSE, 'the diagnostic of a statement that raises gives its SQLSTATE', 'emits nothing',
    E'expected: no event\nraised:   [22012] division by zero'
);

-- only the statement's own events; a prepared statement by name
SELECT app.place('before', 1);
SELECT * FROM check_test(
    pgoutbox_tap.emits_nothing('SELECT 1'), TRUE,
    'an event emitted earlier in the transaction is not the statement''s', 'emits nothing'
);
PREPARE place_c5 AS SELECT app.place('c-5', 5);
SELECT * FROM check_test(
    pgoutbox_tap.emits('place_c5', 'order_created', '{"customer": "c-5"}'),
    TRUE, 'a prepared statement runs by its name', 'emits order_created whose payload contains {"customer": "c-5"}'
);

-- as a role with pgoutbox_writer only (check_test itself needs the test's owner)
SET LOCAL ROLE pgoutbox_writer;
SELECT pgoutbox_tap.emits_exactly(1, $$SELECT app.place('c-7', 7)$$, 'order_created', '{"total": 7}') AS as_writer \gset
SELECT count(*) AS writer_reads FROM pgoutbox_tap.emitted_since(0) \gset
RESET ROLE;
SELECT * FROM check_test(
    :'as_writer', TRUE, 'pgoutbox_writer can use the assertions',
    'emits exactly 1 order_created whose payload contains {"total": 7}'
);
SELECT is(:writer_reads, 19, 'emitted_since shows pgoutbox_writer the events of its transaction');
SELECT ok(
    NOT has_table_privilege('pgoutbox_writer', 'outbox.events', 'SELECT'),
    'while pgoutbox_writer may not read the table itself'
);

SELECT * FROM finish();
ROLLBACK;
