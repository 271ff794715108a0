-- The shop example's schema (docs/testing.md): orders, and the three
-- functions that change them, each emitting its event in the caller's
-- transaction. Run once as the database owner, after `pgoutbox migrate`:
--
--     psql -v ON_ERROR_STOP=1 -f examples/shop/schema.sql
--
-- Its login needs only pgoutbox_writer (the grants below).

CREATE SCHEMA IF NOT EXISTS shop;

CREATE TABLE IF NOT EXISTS shop.orders (
    order_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    customer text NOT NULL,
    total integer NOT NULL,
    status text NOT NULL DEFAULT 'placed',
    CONSTRAINT total_is_positive CHECK (total > 0)
);

-- A new order: order_created, keyed by the order so that its events reach
-- consumers in order.
CREATE OR REPLACE FUNCTION shop.place_order(customer text, total integer)
RETURNS uuid
LANGUAGE plpgsql
AS $$
DECLARE
    id uuid;
BEGIN
    INSERT INTO shop.orders (customer, total) VALUES (place_order.customer, place_order.total)
    RETURNING order_id INTO id;
    PERFORM outbox.emit(
        'order', id::text, 'order_created',
        jsonb_build_object('schema_version', 1, 'order_id', id, 'customer', customer, 'total', total),
        context => 'shop', ordering_key => id::text
    );
    RETURN id;
END;
$$;

-- A placed order is paid: order_paid. Paying twice emits nothing more.
CREATE OR REPLACE FUNCTION shop.pay_order(order_id uuid)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE shop.orders AS o SET status = 'paid' WHERE o.order_id = pay_order.order_id AND o.status = 'placed';
    IF FOUND THEN
        PERFORM outbox.emit(
            'order', order_id::text, 'order_paid',
            jsonb_build_object('schema_version', 1, 'order_id', order_id),
            context => 'shop', ordering_key => order_id::text
        );
    END IF;
END;
$$;

-- A placed order is cancelled: order_cancelled. An unknown or paid order
-- is left as it is, and nothing is emitted.
CREATE OR REPLACE FUNCTION shop.cancel_order(order_id uuid)
RETURNS boolean
LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE shop.orders AS o SET status = 'cancelled'
    WHERE o.order_id = cancel_order.order_id AND o.status = 'placed';
    IF NOT FOUND THEN
        RETURN FALSE;
    END IF;
    PERFORM outbox.emit(
        'order', order_id::text, 'order_cancelled',
        jsonb_build_object('schema_version', 1, 'order_id', order_id),
        context => 'shop', ordering_key => order_id::text
    );
    RETURN TRUE;
END;
$$;

GRANT USAGE ON SCHEMA shop TO pgoutbox_writer;
GRANT SELECT, INSERT, UPDATE ON shop.orders TO pgoutbox_writer;
GRANT EXECUTE ON FUNCTION shop.place_order(text, integer), shop.pay_order(uuid), shop.cancel_order(uuid)
TO pgoutbox_writer;
