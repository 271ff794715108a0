"""The failing twin of tests/test_orders.py: every expectation is wrong, to
show what a failure says (what was expected, what was emitted, or what the
handler answered). The suite runs it and checks that each test fails so
(tests/testing/test_example_shop.py); it is not a test of the shop."""

from __future__ import annotations

from pgoutbox.testing import event


def place(db, customer: str, total: int) -> str:
    return str(db.execute("SELECT shop.place_order(%s, %s)", (customer, total)).fetchone()[0])


def test_wrong_total(db, pgoutbox_capture):
    with pgoutbox_capture(db) as emitted:
        place(db, "ada", 30)
    emitted.assert_emits("order_created", {"customer": "ada", "total": 31})


def test_wrong_count(db, pgoutbox_capture):
    with pgoutbox_capture(db) as emitted:
        place(db, "bob", 12)
    emitted.assert_emits_exactly(2, "order_created")


def test_wrong_nothing(db, pgoutbox_capture):
    with pgoutbox_capture(db) as emitted:
        place(db, "eve", 7)
    emitted.assert_emits_nothing()


def test_wrong_order(db, pgoutbox_capture):
    with pgoutbox_capture(db) as emitted:
        db.execute("SELECT shop.pay_order(shop.place_order('cy', 5))")
    emitted.assert_emitted_in_order(["order_paid", "order_created"])


def test_wrong_answer(pgoutbox_handler, projection):
    url, _ = projection
    bad = event("order_created", {"schema_version": 1, "order_id": "o-1", "total": "30"}, context="shop")
    result = pgoutbox_handler(url, bad)
    assert (result.status, result.action) == (200, "processed")
