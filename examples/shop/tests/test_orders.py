"""The shop's events and its projection handler, tested with pgoutbox's
pytest plugin (pytest.ini enables it: -p pgoutbox.testing)."""

from __future__ import annotations

from pgoutbox.testing import event


def place(db, customer: str, total: int) -> str:
    return str(db.execute("SELECT shop.place_order(%s, %s)", (customer, total)).fetchone()[0])


def test_placing_an_order_emits_order_created(db, pgoutbox_capture):
    with pgoutbox_capture(db) as emitted:
        order_id = place(db, "ada", 30)
    emitted.assert_emits_exactly(1, "order_created", {"order_id": order_id, "customer": "ada", "total": 30})


def test_cancelling_an_unknown_order_emits_nothing(db, pgoutbox_capture):
    with pgoutbox_capture(db) as emitted:
        assert db.execute("SELECT shop.cancel_order(gen_random_uuid())").fetchone() == (False,)
    emitted.assert_emits_nothing()


def test_an_order_is_created_then_paid(db, pgoutbox_capture):
    with pgoutbox_capture(db) as emitted:
        order_id = place(db, "cy", 5)
        db.execute("SELECT shop.pay_order(%s), shop.pay_order(%s)", (order_id, order_id))
    emitted.assert_emitted_in_order(["order_created", "order_paid"])
    assert {e.ordering_key for e in emitted.events} == {order_id}


def test_the_projection_applies_a_new_order_once(db, pgoutbox_capture, pgoutbox_handler, projection):
    url, state = projection
    with pgoutbox_capture(db) as emitted:
        order_id = place(db, "ada", 30)
    created = emitted.assert_emits("order_created")
    first = pgoutbox_handler(url, created, handler="order_projection")
    assert (first.status, first.action) == (200, "processed")
    assert first.request_headers["Idempotency-Key"] == created.event_id
    again = pgoutbox_handler(url, created, handler="order_projection", delivery=2)
    assert (again.status, again.action) == (409, "processed")
    assert state.orders[order_id] == {"customer": "ada", "total": 30, "paid": False}


def test_the_projection_dead_letters_an_order_without_a_total(pgoutbox_handler, projection):
    url, _ = projection
    bad = event("order_created", {"schema_version": 1, "order_id": "o-1", "total": "30"}, context="shop")
    result = pgoutbox_handler(url, bad)
    assert (result.status, result.action) == (422, "dead_letter")


def test_the_projection_retries_a_payment_before_its_order(pgoutbox_handler, projection):
    url, _ = projection
    early = event("order_paid", {"schema_version": 1, "order_id": "o-2"}, context="shop")
    result = pgoutbox_handler(url, early)
    assert (result.status, result.action) == (503, "retry")
