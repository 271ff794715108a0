-- 0018_steady_under_faults (up): what a broker outage, a failing upcaster,
-- a snapshot held by another session and a hostile console input do to
-- pgoutbox: each delays work, none loses or dead-letters it.
--
-- (The sections below are filled by the changes of this release.)
--
-- Expand only: workers of the previous release run on it unchanged.
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 17 or 18.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0018 needs 0001 to 0017 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (17, 18) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0018 applies on version 17 (or re-runs on 18) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

-- ---- broker faults: the relay hands back what JetStream did not answer

-- generated from sql/20_outbox_guards.sql: outbox.tg_events__guard_update
-- Every status move the trigger's WHEN clause (below) lets through: a no-op,
-- an operator requeue (of a dead letter, or of a COMPLETED event whose
-- message the broker lost), a relay's hand-back, or an illegal move.
CREATE OR REPLACE FUNCTION outbox.tg_events__guard_update()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    reason text;
BEGIN
    -- A no-op update is not a move.
    IF (NEW.status, NEW.attempts, NEW.last_error, NEW.available_at, NEW.claimed_at,
        NEW.claimed_by, NEW.claim_token, NEW.published_at)
        IS NOT DISTINCT FROM
       (OLD.status, OLD.attempts, OLD.last_error, OLD.available_at, OLD.claimed_at,
        OLD.claimed_by, OLD.claim_token, OLD.published_at) THEN
        RETURN NEW;
    END IF;

    -- DEAD_LETTER <-> DISCARDED only inside outbox.dlq_discard() and
    -- outbox.dlq_restore() (sql/67_dead_letters.sql), which set
    -- pgoutbox.dlq_action and pgoutbox.dlq_reason; written to
    -- outbox.discard_log here, so that no path around them escapes the audit.
    -- A discarded event moves nowhere else: it is never requeued until restored.
    IF 'DISCARDED' IN (OLD.status, NEW.status)
        OR coalesce(current_setting('pgoutbox.dlq_action', true), '') <> '' THEN
        PERFORM outbox._check_discard_move(
            OLD.event_id, OLD.status, NEW.status,
            (NEW.attempts, NEW.last_error, NEW.available_at, NEW.claimed_at, NEW.claimed_by,
                NEW.claim_token, NEW.published_at)
            IS NOT DISTINCT FROM
            (OLD.attempts, OLD.last_error, OLD.available_at, OLD.claimed_at, OLD.claimed_by,
                OLD.claim_token, OLD.published_at)
        );
        INSERT INTO outbox.discard_log (event_id, action, acted_by, reason, last_error)
        VALUES (
            OLD.event_id, current_setting('pgoutbox.dlq_action', true), session_user,
            current_setting('pgoutbox.dlq_reason', true), OLD.last_error
        );
        RETURN NEW;
    END IF;

    -- PROCESSING -> PENDING only inside outbox.hand_back() (sql/30_outbox_api.sql),
    -- which sets pgoutbox.hand_back to the claim's token: the broker did not
    -- answer, so the event is due now with the claim's attempt undone. Its
    -- claim (token, time, worker) stays as it was, for the record.
    IF OLD.status = 'PROCESSING' AND NEW.status = 'PENDING'
        AND OLD.claim_token::text = current_setting('pgoutbox.hand_back', true)
        AND NEW.attempts = OLD.attempts - 1
        AND NEW.available_at <= now()
        AND (NEW.claimed_at, NEW.claimed_by, NEW.claim_token, NEW.published_at)
        IS NOT DISTINCT FROM (OLD.claimed_at, OLD.claimed_by, OLD.claim_token, OLD.published_at) THEN
        RETURN NEW;
    END IF;

    -- COMPLETED -> PENDING only inside outbox.requeue_completed(), which sets
    -- pgoutbox.requeue_from (sql/35_outbox_repair.sql): the broker lost it.
    IF NEW.status = 'PENDING' AND (
        OLD.status = 'DEAD_LETTER'
        OR (OLD.status = 'COMPLETED' AND current_setting('pgoutbox.requeue_from', true) = 'COMPLETED')
    ) THEN
        reason := nullif(btrim(current_setting('pgoutbox.requeue_reason', true)), '');
        IF reason IS NULL THEN
            RAISE EXCEPTION 'REASON_REQUIRED: requeueing event % needs a reason', OLD.event_id
                USING ERRCODE = 'OB014',
                      HINT = 'Use outbox.requeue(event_ids, reason) or outbox.requeue_completed(event_ids, reason).';
        END IF;
        INSERT INTO outbox.requeue_log (
            event_id, requeued_by, reason, attempts_before, last_error, from_status, published_at_before
        )
        VALUES (OLD.event_id, session_user, reason, OLD.attempts, OLD.last_error, OLD.status, OLD.published_at);
        RETURN NEW;
    END IF;

    RAISE EXCEPTION 'ILLEGAL_TRANSITION: event % cannot move from % to %', OLD.event_id, OLD.status, NEW.status
        USING ERRCODE = 'OB010',
              DETAIL = format('available_at=%s, now=%s', OLD.available_at, now()),
              HINT = 'Legal moves are listed in the README (Lifecycle).';
END;
$$;
-- end generated

-- generated from sql/30_outbox_api.sql: outbox.hand_back
-- Hands events back that the broker did not answer for (JetStream away: no
-- ack in time, no responders, not connected, a 503 / no-leader / no-quorum
-- API error; docs/relay.md, "JetStream away"): PROCESSING -> PENDING, due
-- now, and the claim's attempt undone (attempts - 1), so that an outage of
-- the broker never uses up an event's attempts. reason becomes last_error
-- (it says why the event waits). Fenced by claim_token like mark_failed: rows
-- no longer held by it are left alone; STALE_CLAIM when it held none. The
-- update guard lets this move through only while pgoutbox.hand_back holds
-- the claim's token, which this function sets for its own transaction.
CREATE OR REPLACE FUNCTION outbox.hand_back(
    claim_token uuid,
    event_ids uuid[],
    reason text
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    marked integer;
BEGIN
    IF claim_token IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: claim_token is required' USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_ids(event_ids, 'event_ids');
    IF nullif(btrim(reason), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: a hand-back needs a reason' USING ERRCODE = 'OB006';
    END IF;
    PERFORM set_config('pgoutbox.hand_back', hand_back.claim_token::text, TRUE);
    UPDATE outbox.events AS e
    SET status = 'PENDING',
        attempts = e.attempts - 1,
        available_at = now(),
        last_error = outbox._clip_error(hand_back.reason)
    WHERE e.claim_token = hand_back.claim_token
        AND e.status = 'PROCESSING'
        AND e.event_id = ANY(hand_back.event_ids);
    GET DIAGNOSTICS marked = ROW_COUNT;
    PERFORM set_config('pgoutbox.hand_back', '', TRUE);
    IF marked = 0 THEN
        RAISE EXCEPTION 'STALE_CLAIM: claim % holds none of the % given events', claim_token, cardinality(event_ids)
            USING ERRCODE = 'OB013';
    END IF;
    RETURN marked;
END;
$$;
COMMENT ON FUNCTION outbox.hand_back(uuid, uuid[], text) IS
'PROCESSING -> PENDING, due now, with the claim''s attempt undone (the broker did not answer); returns the count.';
-- end generated

REVOKE ALL ON FUNCTION outbox.hand_back(uuid, uuid[], text) FROM public;
GRANT EXECUTE ON FUNCTION outbox.hand_back(uuid, uuid[], text) TO pgoutbox_relay;

-- ---- upcasters: any error of an upcaster is that message's own outcome

-- ---- held snapshots: the hot path does not grow with the oldest snapshot

-- ---- the console

INSERT INTO outbox.schema_migrations (version, name)
VALUES (18, '0018_steady_under_faults')
ON CONFLICT (version) DO NOTHING;

COMMIT;
