-- The shop's events, asserted with the testing kit (docs/testing.md).
-- Scenarios:
--   * placing an order emits order_created with its customer and total,
--     exactly one
--   * cancelling an unknown order emits nothing
--   * placing then paying emits order_created, then order_paid; paying twice
--     emits one order_paid
-- Run by pg_prove as the shop's login, on a database where `pgoutbox
-- testing install-tap` and examples/shop/schema.sql ran; the transaction
-- rolls every order and event back.
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(5);

SELECT pgoutbox_tap.emits(
    $$SELECT shop.place_order('ada', 30)$$, 'order_created', '{"customer": "ada", "total": 30}'
);
SELECT pgoutbox_tap.emits_exactly(1, $$SELECT shop.place_order('bob', 12)$$, 'order_created');
SELECT pgoutbox_tap.emits_nothing($$SELECT shop.cancel_order(gen_random_uuid())$$);
SELECT pgoutbox_tap.emitted_in_order(
    $$SELECT shop.pay_order(shop.place_order('cy', 5))$$, ARRAY['order_created', 'order_paid']
);
SELECT pgoutbox_tap.emits_exactly(
    1, $$SELECT shop.pay_order(o), shop.pay_order(o) FROM shop.place_order('dee', 9) AS o$$, 'order_paid',
    description => 'paying twice emits one order_paid'
);

SELECT * FROM finish();
ROLLBACK;
