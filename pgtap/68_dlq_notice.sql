-- A dead letter names its DLQ notice (inbox.record_dlq_notice, 0017).
-- Scenarios:
--   * arguments: message, handler, stream name and sequence are checked
--     (OB020, OB006; OB021 for an unknown row)
--   * only a live dead letter takes it: a RECEIVED, FAILED, discarded or
--     in-database row is left unchanged (FALSE)
--   * an older notice of the same stream never replaces a newer one; a
--     new dead letter (record_error, dead => true) drops the old notice
--   * dlq_show reports dlq_stream and dlq_stream_sequence
--   * roles: pgoutbox_consumer may call it; the writer, the viewer and the
--     relay may not; the viewer sees the sequence through dlq_show
\set ON_ERROR_STOP true
BEGIN;
SELECT plan(22);
\ir fixtures/inbox.sql

-- The rows' ids as transaction-local settings: readable by every role below.
SELECT
    set_config('t.dead', fixture.message('billing', 'DEAD_LETTER')::text, TRUE) AS dead,
    set_config('t.failed', fixture.message('billing', 'FAILED')::text, TRUE) AS failed,
    set_config('t.received', fixture.message('billing', 'RECEIVED')::text, TRUE) AS received,
    set_config('t.discarded', fixture.message('shipping', 'DEAD_LETTER')::text, TRUE) AS discarded;

-- Arguments.
SELECT throws_ok(
    format($$SELECT inbox.record_dlq_notice(%L, 'billing', 'SEA_DLQ', 0)$$, current_setting('t.dead')::uuid),
    'OB006', NULL, 'arguments: a sequence below 1'
);
SELECT throws_ok(
    format($$SELECT inbox.record_dlq_notice(%L, 'billing', NULL, 1)$$, current_setting('t.dead')::uuid),
    'OB006', NULL, 'arguments: no stream'
);
SELECT throws_ok(
    format($$SELECT inbox.record_dlq_notice(%L, 'billing', 'SEA.DLQ', 1)$$, current_setting('t.dead')::uuid),
    'OB006', NULL, 'arguments: a stream name with a subject token'
);
SELECT throws_ok(
    format($$SELECT inbox.record_dlq_notice(%L, 'billing', 'SEA DLQ', 1)$$, current_setting('t.dead')::uuid),
    'OB006', NULL, 'arguments: a stream name with a space'
);
SELECT throws_ok(
    $$SELECT inbox.record_dlq_notice(NULL, 'billing', 'SEA_DLQ', 1)$$, 'OB020', NULL, 'arguments: no message id'
);
SELECT throws_ok(
    $$SELECT inbox.record_dlq_notice(gen_random_uuid(), 'billing', 'SEA_DLQ', 1)$$,
    'OB021', NULL, 'arguments: an unknown message'
);

-- Only a live dead letter.
SELECT is(
    inbox.record_dlq_notice(current_setting('t.failed')::uuid, 'billing', 'SEA_DLQ', 5), FALSE,
    'guard: a FAILED row takes no notice'
);
SELECT is(
    inbox.record_dlq_notice(current_setting('t.received')::uuid, 'billing', 'SEA_DLQ', 5), FALSE,
    'guard: a RECEIVED row takes no notice'
);
SELECT is(
    (
        SELECT count(*) FROM inbox.messages
        WHERE dlq_metadata ? 'dlq_stream_sequence'
    ), 0::bigint,
    'guard: nothing changed'
);
SELECT is(
    inbox.record_dlq_notice(current_setting('t.dead')::uuid, 'billing', 'SEA_DLQ', 7), TRUE,
    'a dead letter takes its notice'
);
SELECT is(
    (
        SELECT dlq_metadata -> 'dlq_stream_sequence' FROM inbox.messages
        WHERE message_id = current_setting('t.dead')::uuid
    ),
    '7'::jsonb, 'the sequence is in dlq_metadata'
);
SELECT is(
    inbox.record_dlq_notice(current_setting('t.dead')::uuid, 'billing', 'SEA_DLQ', 3), FALSE,
    'an older notice of the same stream does not replace a newer one'
);
SELECT is(
    inbox.record_dlq_notice(current_setting('t.dead')::uuid, 'billing', 'SEA_DLQ', 7), FALSE,
    'the same notice twice changes nothing'
);
SELECT is(
    outbox.dlq_show('inbox', current_setting('t.dead')::uuid, 'billing') - ARRAY[
        'dlq_metadata', 'envelope', 'headers', 'payload', 'history', 'seen_at', 'created_at', 'id', 'group_id',
        'error_class', 'error_pattern', 'last_error', 'attempts', 'tenant', 'subject', 'replays', 'refailed',
        'redrive_pending', 'discarded', 'status', 'replay_enabled', 'payload_visible', 'side', 'owner', 'handler'
    ],
    '{"dlq_stream": "SEA_DLQ", "dlq_stream_sequence": 7}'::jsonb,
    'dlq_show names the notice'
);

-- A discarded dead letter is left alone.
SELECT is(
    outbox.dlq_discard(
        jsonb_build_object('side', 'inbox', 'ids', jsonb_build_array(current_setting('t.discarded')::uuid)),
        'noise'
    ),
    1, 'fixture: one row discarded'
);
SELECT is(
    inbox.record_dlq_notice(current_setting('t.discarded')::uuid, 'shipping', 'SEA_DLQ', 9), FALSE,
    'guard: a discarded dead letter takes no notice'
);

-- A new dead letter drops the previous notice.
SELECT lives_ok(
    format(
        $$SELECT inbox.redrive('billing', ARRAY[%L]::uuid[], 'again')$$, current_setting('t.dead')::uuid
    ),
    'fixture: redriven'
);
SELECT lives_ok(
    format(
        $$SELECT * FROM inbox.claim_replays('w', 10)$$
    ),
    'fixture: replay claimed'
);
SELECT lives_ok(
    format(
        $$SELECT inbox.record_error(%L, 'billing', 'HTTP 500', dead => TRUE)$$, current_setting('t.dead')::uuid
    ),
    'fixture: dead-lettered again'
);
SELECT is(
    (
        SELECT dlq_metadata ?| ARRAY['dlq_stream', 'dlq_stream_sequence'] FROM inbox.messages
        WHERE message_id = current_setting('t.dead')::uuid
    ),
    FALSE, 'a new dead letter drops the previous notice'
);

-- Roles.
CREATE ROLE t_consumer IN ROLE pgoutbox_consumer;
CREATE ROLE t_writer IN ROLE pgoutbox_writer;
SET LOCAL SESSION AUTHORIZATION t_consumer;
SELECT is(
    inbox.record_dlq_notice(current_setting('t.dead')::uuid, 'billing', 'SEA_DLQ', 11), TRUE,
    'consumer: may record a notice'
);
RESET SESSION AUTHORIZATION;
SET LOCAL SESSION AUTHORIZATION t_writer;
SELECT throws_ok(
    format($$SELECT inbox.record_dlq_notice(%L, 'billing', 'SEA_DLQ', 12)$$, current_setting('t.dead')::uuid),
    '42501', NULL, 'writer: may not record a notice'
);
RESET SESSION AUTHORIZATION;

SELECT * FROM finish();
ROLLBACK;
