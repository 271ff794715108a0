-- The failing twin of ../test_orders.sql: every expectation is wrong, to
-- show what a failure says (what was expected, what was emitted). The
-- suite runs it and checks that each assertion fails so
-- (tests/testing/test_example_shop.py); it is not a test of the shop.
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(4);

SELECT pgoutbox_tap.emits(
    $$SELECT shop.place_order('ada', 30)$$, 'order_created', '{"customer": "ada", "total": 31}'
);
SELECT pgoutbox_tap.emits_exactly(2, $$SELECT shop.place_order('bob', 12)$$, 'order_created');
SELECT pgoutbox_tap.emits_nothing($$SELECT shop.place_order('eve', 7)$$);
SELECT pgoutbox_tap.emitted_in_order(
    $$SELECT shop.pay_order(shop.place_order('cy', 5))$$, ARRAY['order_paid', 'order_created']
);

SELECT * FROM finish();
ROLLBACK;
