-- Upcasters (sql/66_upcasters.sql) and the pgTAP helpers of
-- pgtap/helpers/upcasters.sql.
-- Scenarios:
--   * register_upcaster refuses, with OB070, a function that is not
--     (jsonb) -> jsonb, a set-returning or VOLATILE one, one that would run
--     as the schema owner but is owned by another role (unless SECURITY
--     DEFINER), a bad event type or version; the table's named CHECKs hold
--     the same rules; an upcaster altered since it was registered so that
--     it no longer qualifies is refused when used (OB072)
--   * a registered step goes from_version -> from_version + 1; registering
--     it again replaces the function; unregister removes it, and refuses an
--     unknown step (OB073)
--   * upcast runs the chain v1 -> v3 step by step, returns the payload as
--     it is for equal versions, and raises OB071 for a missing step or a
--     downcast, OB072 for a step that raises or returns no JSON object,
--     OB006 for bad arguments
--   * upcast_gaps lists each registered version whose chain breaks, with
--     the first missing step; the helpers pass on a complete chain
--   * receive_batch_as: in one call, a v1 message to process comes back
--     upcast, a v2 one as it is, a broken one with its own error, a step
--     that raises on one payload of two fails that one only; a
--     PROCESSED duplicate is not upcast; the rows are recorded as
--     receive_batch records them
-- As the roles docs/reference.md gives: registering and upcasting as
-- pgoutbox_admin, receive_batch_as as pgoutbox_consumer; the table, the
-- private step and the test's own helpers as the owner.
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(32);
\ir helpers/upcasters.sql

CREATE SCHEMA app;
-- v1 {"amount": n} -> v2 {"total": n}: a renamed field.
CREATE FUNCTION app.order_v1_v2(p jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$ SELECT (p - 'amount') || jsonb_build_object('total', p -> 'amount') $$;
-- v2 -> v3: a new field with a default.
CREATE FUNCTION app.order_v2_v3(p jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$ SELECT p || '{"currency": "EUR"}'::jsonb $$;
CREATE FUNCTION app.raises(p jsonb) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN RAISE EXCEPTION 'no total in %', p USING ERRCODE = '22023'; END $$;
CREATE FUNCTION app.array_out(p jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$ SELECT jsonb_build_array(p) $$;
CREATE FUNCTION app.volatile(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p $$;
CREATE FUNCTION app.text_in(p text) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$ SELECT p::jsonb $$;
CREATE FUNCTION app.set_out(p jsonb) RETURNS SETOF jsonb LANGUAGE sql IMMUTABLE AS $$ SELECT p $$;
-- Raises on a payload with "bad" only.
CREATE FUNCTION app.strict(p jsonb) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p ? 'bad' THEN RAISE EXCEPTION 'bad payload' USING ERRCODE = '22023'; END IF;
    RETURN p || '{"checked": true}';
END $$;
CREATE ROLE t_up_owner;
CREATE FUNCTION app.foreign_owned(p jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$ SELECT p $$;
ALTER FUNCTION app.foreign_owned(jsonb) OWNER TO t_up_owner;
CREATE FUNCTION app.foreign_definer(p jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE SECURITY DEFINER AS $$ SELECT p $$;
ALTER FUNCTION app.foreign_definer(jsonb) OWNER TO t_up_owner;
-- The application lets the admin name its functions (regprocedure input needs USAGE).
GRANT USAGE ON SCHEMA app TO pgoutbox_admin;

-- Refusals, as the role that registers upcasters (docs/reference.md).
SET ROLE pgoutbox_admin;
SELECT throws_ok(
    $$SELECT inbox.register_upcaster('order_created', 1, 'app.text_in(text)')$$, 'OB070', NULL,
    'register refuses a function that does not take jsonb'
);
SELECT throws_ok(
    $$SELECT inbox.register_upcaster('order_created', 1, 'app.set_out(jsonb)')$$, 'OB070', NULL,
    'register refuses a set-returning function'
);
SELECT throws_ok(
    $$SELECT inbox.register_upcaster('order_created', 1, 'app.volatile(jsonb)')$$, 'OB070', NULL,
    'register refuses a VOLATILE function'
);
SELECT throws_ok(
    $$SELECT inbox.register_upcaster('order_created', 1, 'app.foreign_owned(jsonb)')$$, 'OB070', NULL,
    'register refuses a function that would run as the schema owner but is owned by another role'
);
SELECT lives_ok(
    $$SELECT inbox.register_upcaster('parcel_sent', 1, 'app.foreign_definer(jsonb)')$$,
    'a SECURITY DEFINER function of another role registers: it runs as its own owner'
);
RESET ROLE;
ALTER FUNCTION app.foreign_definer(jsonb) SECURITY INVOKER;
SET ROLE pgoutbox_admin;
SELECT throws_ok(
    $$SELECT inbox.upcast('parcel_sent', 1, 2, '{}')$$, 'OB072', NULL,
    'an upcaster altered since so that it no longer qualifies is refused when used'
);
SELECT throws_ok(
    $$SELECT inbox.register_upcaster('order.created', 1, 'app.order_v1_v2(jsonb)')$$, 'OB070', NULL,
    'register refuses an event type that is not a subject token'
);
SELECT throws_ok(
    $$SELECT inbox.register_upcaster('order_created', 0, 'app.order_v1_v2(jsonb)')$$, 'OB070', NULL,
    'register refuses version 0'
);
SELECT throws_ok(
    $$SELECT inbox.register_upcaster('order_created', 1, NULL)$$, 'OB070', NULL,
    'register refuses a missing function'
);
RESET ROLE;  -- the table itself, as its owner
SELECT throws_ok(
    $$INSERT INTO inbox.upcasters (event_type, from_version, upcaster)
      VALUES ('order_created', 999999999, 'app.order_v1_v2(jsonb)')$$,
    '23514', NULL, 'the table itself refuses a step past the last subject version (named CHECK)'
);
SELECT col_is_pk('inbox', 'upcasters', ARRAY['event_type', 'from_version'], 'one upcaster per event type and version');
SET ROLE pgoutbox_admin;

-- Register, replace, unregister.
SELECT is(
    (
        SELECT format('%s %s', to_version, upcaster)
        FROM inbox.register_upcaster('order_created', 1, 'app.raises(jsonb)')
    ),
    '2 app.raises(jsonb)', 'a step goes from_version -> from_version + 1'
);
SELECT is(
    (SELECT upcaster::text FROM inbox.register_upcaster('order_created', 1, 'app.order_v1_v2(jsonb)')),
    'app.order_v1_v2(jsonb)', 'registering a step again replaces its function'
);
SELECT lives_ok(
    $$SELECT inbox.register_upcaster('order_created', 2, 'app.order_v2_v3(jsonb)')$$, 'the next step registers'
);
SELECT throws_ok(
    $$SELECT inbox.unregister_upcaster('order_created', 7)$$, 'OB073', NULL, 'unregister refuses an unknown step'
);

-- Chains.
SELECT is(
    inbox.upcast('order_created', 1, 3, '{"id": 1, "amount": 12345678901234567890.123456789}'),
    '{"id": 1, "total": 12345678901234567890.123456789, "currency": "EUR"}'::jsonb,
    'upcast runs v1 -> v2 -> v3, numbers kept as given'
);
SELECT is(inbox.upcast('order_created', 2, 3, '{"total": 5}'), '{"total": 5, "currency": "EUR"}'::jsonb, 'v2 -> v3');
SELECT is(inbox.upcast('order_created', 3, 3, '{"x": 1}'), '{"x": 1}'::jsonb, 'equal versions: the payload as it is');
SELECT throws_ok(
    $$SELECT inbox.upcast('order_created', 1, 4, '{}')$$, 'OB071', NULL, 'a missing step: UPCAST_MISSING'
);
SELECT throws_ok(
    $$SELECT inbox.upcast('order_created', 3, 2, '{}')$$, 'OB071', NULL, 'no downcast: UPCAST_MISSING'
);
SELECT throws_ok(
    $$SELECT inbox.upcast('order_created', 1, 2, NULL)$$, 'OB006', NULL, 'a payload is required'
);
SELECT inbox.register_upcaster('payment_made', 1, 'app.raises(jsonb)');
SELECT inbox.register_upcaster('refund_made', 1, 'app.array_out(jsonb)');
SELECT inbox.register_upcaster('invoice_sent', 1, 'app.strict(jsonb)');
SELECT throws_ok(
    $$SELECT inbox.upcast('payment_made', 1, 2, '{}')$$, 'OB072', NULL, 'a step that raises: UPCAST_FAILED'
);
SELECT throws_ok(
    $$SELECT inbox.upcast('refund_made', 1, 2, '{}')$$, 'OB072', NULL, 'a step that returns an array: UPCAST_FAILED'
);
RESET ROLE;  -- a private function: the owner's
SELECT alike(
    (SELECT error FROM inbox._upcast_all(ARRAY[1], ARRAY['payment_made'], ARRAY[1], 2, ARRAY['{}'::jsonb])),
    'UPCAST_FAILED [OB072]: payment_made v1 -> v2: app.raises(jsonb) raised [22023] no total in%',
    'the error names the code, the event type, the step, the function and its error'
);

-- Gaps and the helpers.
SET ROLE pgoutbox_admin;
SELECT inbox.register_upcaster('order_created', 4, 'app.order_v2_v3(jsonb)');
SELECT results_eq(
    $$SELECT from_version, missing_from FROM inbox.upcast_gaps('order_created', 5)$$,
    $$VALUES (1, 3), (2, 3)$$,
    'upcast_gaps: every registered version whose chain breaks, with its first missing step'
);
SELECT is_empty($$SELECT * FROM inbox.upcast_gaps('order_created', 3)$$, 'no gap below v3');
RESET ROLE;  -- the helpers live in the test's own schema
SELECT pgoutbox_tap.upcasters_reach('order_created', 3);
SELECT pgoutbox_tap.upcasts_to('order_created', 1, 2, '{"amount": 5}', '{"total": 5}');

-- receive_batch_as, as the consumer calls it.
SET ROLE pgoutbox_consumer;
SELECT gen_random_uuid() AS v1_id \gset
SELECT gen_random_uuid() AS v2_id \gset
SELECT gen_random_uuid() AS bad_id \gset
SELECT gen_random_uuid() AS dup_id \gset
SELECT gen_random_uuid() AS good_invoice_id \gset
SELECT gen_random_uuid() AS bad_invoice_id \gset
SELECT inbox.receive_processed(
    'billing', ARRAY[:'dup_id']::uuid[], ARRAY['sea.event.order_created.v1'],
    ARRAY['{"payload": {"amount": 1}}']::jsonb[]
);
CREATE TEMP TABLE got AS
SELECT * FROM inbox.receive_batch_as(
    'billing',
    ARRAY[:'v1_id', :'v2_id', :'bad_id', :'dup_id', :'good_invoice_id', :'bad_invoice_id']::uuid[],
    ARRAY[
        'sea.event.order_created.v1', 'sea.event.order_created.v2', 'sea.event.payment_made.v1',
        'sea.event.order_created.v1', 'sea.event.invoice_sent.v1', 'sea.event.invoice_sent.v1'
    ],
    ARRAY[
        '{"payload": {"amount": 7}}', '{"payload": {"total": 8}}', '{"payload": {}}', '{"payload": {"amount": 1}}',
        '{"payload": {"n": 1}}', '{"payload": {"bad": 1}}'
    ]::jsonb[],
    2
);
SELECT results_eq(
    $$SELECT ordinal, status, event_version, upcast_payload::jsonb FROM got ORDER BY ordinal$$,
    $$VALUES (1, 'RECEIVED', 1, '{"total": 7}'::jsonb), (2, 'RECEIVED', 2, NULL), (3, 'RECEIVED', 1, NULL),
        (4, 'PROCESSED', 1, NULL), (5, 'RECEIVED', 1, '{"n": 1, "checked": true}'::jsonb), (6, 'RECEIVED', 1, NULL)$$,
    'receive_batch_as: v1 upcast, v2 as it is, the broken ones without a payload, the duplicate not upcast'
);
SELECT is(
    (SELECT array_agg(left(coalesce(upcast_error, '-'), 27) ORDER BY ordinal) FROM got),
    ARRAY['-', '-', 'UPCAST_FAILED [OB072]: paym', '-', '-', 'UPCAST_FAILED [OB072]: invo'],
    'only the broken messages carry an error: a step that raises on one payload of two fails that one only'
);
RESET ROLE;  -- reading the table behind the API
SELECT is(
    (
        SELECT count(*)::integer FROM inbox.messages
        WHERE message_id IN (:'v1_id', :'v2_id', :'bad_id') AND status = 'RECEIVED'
    ),
    3, 'every message is recorded, as receive_batch records it'
);
SET ROLE pgoutbox_consumer;
SELECT throws_ok(
    $$SELECT * FROM inbox.receive_batch_as('billing', '{}', '{}', '{}', 0)$$, 'OB006', NULL,
    'receive_batch_as refuses version 0'
);

SELECT * FROM finish();
ROLLBACK;
