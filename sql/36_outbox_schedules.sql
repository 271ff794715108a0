-- emit's options, in an overload of its own: a caller's event id (safe to
-- retry) and a delivery time (delayed and scheduled events); cancelling a
-- scheduled event; what the relays and operators ask about schedules.
--
-- Scheduling rides on available_at ("when may a relay take this row next",
-- 10_outbox_events.sql): an event emitted with a delivery time is born
-- PENDING with available_at at that time, and archival keeps its day (a
-- PENDING row is an open row). No new status, and no column: outbox.events
-- keeps the row type claim returns. Until it is claimed, such an event lies
-- in events_scheduled_idx by its time, not in the claim's id-ordered walk
-- (10_outbox_events.sql), so that a year of reminders costs a claim nothing.

-- When an event emitted with deliver_at or deliver_after falls due, checked:
-- one of the two, finite, not more than a minute in the past (a clock a
-- little behind the database's: due now), and at most 366 days ahead (a
-- year of reminders; further is a parked event nobody sees, and it keeps its
-- day's partition from archival meanwhile).
CREATE OR REPLACE FUNCTION outbox._delivery_time(deliver_at timestamptz, deliver_after interval)
RETURNS timestamptz
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    due timestamptz;
BEGIN
    IF deliver_at IS NOT NULL AND deliver_after IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: give deliver_at or deliver_after, not both'
            USING ERRCODE = 'OB006';
    END IF;
    due := coalesce(deliver_at, now() + deliver_after);
    IF NOT isfinite(due) AND due > now() OR due > now() + interval '366 days' THEN
        RAISE EXCEPTION 'DELIVERY_TOO_FAR: delivery time % is more than 366 days ahead', due
            USING ERRCODE = 'OB023';
    END IF;
    IF NOT isfinite(due) OR due < now() - interval '1 minute' THEN
        RAISE EXCEPTION 'DELIVERY_IN_PAST: delivery time % is more than a minute in the past', due
            USING ERRCODE = 'OB022',
                  HINT = 'Leave deliver_at and deliver_after out to deliver at once.';
    END IF;
    RETURN greatest(due, now());
END;
$$;

-- outbox.emit with three options more (30_outbox_api.sql has the common
-- case): returns the event id.
--
-- event_id: the caller's own id for the event, to retry safely (e.g. a
-- UUIDv5 of its business key, after a commit whose acknowledgement was
-- lost). Emitted again with the same content (outbox._event_fingerprint), it
-- returns the id and writes nothing; with other content, EVENT_ID_CONFLICT.
-- A version-4 id is refused (INVALID_EVENT_ID): those are the ids emit draws,
-- which are not registered (outbox.event_keys). emit registers a given id
-- itself and tells the INSERT policy trigger so (pgoutbox.registered_event_id),
-- which registers the id of any other INSERT: an owner's is held to the same
-- rule.
--
-- deliver_at / deliver_after: the event commits with the business change and
-- is published when due (outbox._delivery_time says which times are taken),
-- not before; it is entered in outbox.schedules, which tells relays when to
-- wake (outbox.next_scheduled) and operators what waits (outbox.scheduled).
-- A scheduled event with an ordering_key holds its key's later events back
-- until it is published, as every unfinished event of a key does.
--
-- Why aggregate_type is character varying here: PostgreSQL refuses a call
-- that two functions with the same types at the given positions could take
-- with their defaults ("is not unique"), and every call of the first
-- signature would match this one too. With one type differing, it chooses:
-- a text or untyped (literal) argument goes to the first signature, whose
-- text is the preferred type of strings; a varchar one comes here, which
-- does the same with the three options left out. Calls that name an option
-- can only come here.
CREATE OR REPLACE FUNCTION outbox.emit(
    aggregate_type character varying,
    aggregate_id text,
    event_type text,
    payload jsonb,
    context text DEFAULT NULL,
    event_version integer DEFAULT 1,
    headers jsonb DEFAULT '{}'::jsonb,
    correlation_id uuid DEFAULT NULL,
    causation_id uuid DEFAULT NULL,
    tenant_id text DEFAULT NULL,
    ordering_key text DEFAULT NULL,
    occurred_at timestamptz DEFAULT NULL,
    event_id uuid DEFAULT NULL,
    deliver_at timestamptz DEFAULT NULL,
    deliver_after interval DEFAULT NULL
)
RETURNS uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    new_id uuid := coalesce(emit.event_id, gen_random_uuid());
    ctx text := coalesce(emit.context, nullif(current_setting('pgoutbox.context', true), ''));
    due timestamptz := now();
    fingerprint uuid;
BEGIN
    IF emit.deliver_at IS NOT NULL OR emit.deliver_after IS NOT NULL THEN
        due := outbox._delivery_time(emit.deliver_at, emit.deliver_after);
    END IF;
    -- Per-key order is id order; holding a per-key lock until commit makes id
    -- order equal commit order (30_outbox_api.sql).
    IF emit.ordering_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('pgoutbox.key:' || emit.ordering_key, 0));
    END IF;
    IF emit.event_id IS NOT NULL THEN
        IF substr(emit.event_id::text, 15, 1) = '4' THEN
            RAISE EXCEPTION 'INVALID_EVENT_ID: % is a version-4 (random) UUID, the kind emit draws itself', emit.event_id
                USING ERRCODE = 'OB019',
                      HINT = 'Derive the id from your business key, e.g. a UUIDv5 (uuid_generate_v5, Python''s uuid.uuid5).';
        END IF;
        fingerprint := outbox._event_fingerprint(
            ctx, emit.aggregate_type, emit.aggregate_id, emit.event_type, emit.event_version,
            emit.payload, emit.correlation_id, emit.causation_id, emit.tenant_id, emit.ordering_key
        );
        -- NULL when a required part is missing: the INSERT's policies then
        -- refuse the event with that part's code, before any registering.
        IF fingerprint IS NOT NULL THEN
            IF NOT outbox._register_event_id(new_id, fingerprint) THEN
                RETURN new_id;  -- the same event again: it exists, nothing is written
            END IF;
            -- For this statement only: a later INSERT of the same transaction
            -- (an owner's) has another statement_timestamp, and is checked.
            PERFORM set_config('pgoutbox.registered_event_id', new_id::text || '@' || statement_timestamp()::text, true);
        END IF;
    END IF;
    INSERT INTO outbox.events (
        event_id, context, aggregate_type, aggregate_id, event_type, event_version,
        payload, headers, correlation_id, causation_id, tenant_id, ordering_key,
        occurred_at, available_at
    ) VALUES (
        new_id, ctx, emit.aggregate_type, emit.aggregate_id, emit.event_type, emit.event_version,
        emit.payload, emit.headers, emit.correlation_id, emit.causation_id,
        emit.tenant_id, emit.ordering_key, coalesce(emit.occurred_at, now()), due
    );
    IF due > now() THEN
        INSERT INTO outbox.schedules (event_id, created_at, context, deliver_at, emitted_by)
        VALUES (new_id, now(), ctx, due, session_user);
    END IF;
    RETURN new_id;
END;
$$;
COMMENT ON FUNCTION outbox.emit(
    character varying, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz,
    uuid, timestamptz, interval
) IS 'emit with a caller''s event id (safe to retry) and a delivery time (deliver_at or deliver_after).';

-- Cancels a scheduled event before it falls due: PENDING -> DEAD_LETTER with
-- last_error 'CANCELLED: reason', written to outbox.cancel_log by the update
-- guard (20_outbox_guards.sql). Only the login that emitted it, or a member
-- of pgoutbox_admin, may. An event that is due already is not cancelled (a
-- relay may be publishing it): NOT_CANCELLABLE, as for an event emitted
-- without a delivery time, unknown, or cancelled already. A cancelled event
-- is a dead letter: outbox.requeue() sends it after all. Returns the
-- delivery time it had.
CREATE OR REPLACE FUNCTION outbox.cancel(event_id uuid, reason text)
RETURNS timestamptz
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    s outbox.schedules;
    moved integer;
BEGIN
    PERFORM outbox._check_text(reason, 'a cancel''s reason', 1000, TRUE);
    IF cancel.event_id IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_id is required' USING ERRCODE = 'OB006';
    END IF;
    SELECT * INTO s FROM outbox.schedules AS x WHERE x.event_id = cancel.event_id FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'NOT_CANCELLABLE: % is not a scheduled event (unknown, emitted without a delivery time, or cancelled already)', cancel.event_id
            USING ERRCODE = 'OB024';
    END IF;
    IF s.emitted_by <> session_user AND NOT pg_has_role(session_user, 'pgoutbox_admin', 'MEMBER') THEN
        RAISE EXCEPTION 'CANCEL_NOT_ALLOWED: event % was emitted by another login; only it or pgoutbox_admin may cancel it', cancel.event_id
            USING ERRCODE = 'OB025';
    END IF;
    PERFORM set_config('pgoutbox.cancel_reason', reason, true);
    UPDATE outbox.events AS e
    SET status = 'DEAD_LETTER', last_error = outbox._clip_error('CANCELLED: ' || reason)
    WHERE e.event_id = cancel.event_id AND e.created_at = s.created_at
        AND e.status = 'PENDING' AND e.available_at > now();
    GET DIAGNOSTICS moved = ROW_COUNT;
    PERFORM set_config('pgoutbox.cancel_reason', '', true);
    IF moved = 0 THEN
        RAISE EXCEPTION 'NOT_CANCELLABLE: event % is due already (or published, or dead-lettered)', cancel.event_id
            USING ERRCODE = 'OB024';
    END IF;
    DELETE FROM outbox.schedules AS x WHERE x.event_id = cancel.event_id;
    RETURN s.deliver_at;
END;
$$;
COMMENT ON FUNCTION outbox.cancel(uuid, text) IS
'Cancels a scheduled event before it falls due (its emitter or pgoutbox_admin), audited in outbox.cancel_log.';

-- Scheduled events per context: how many wait for their delivery time, and
-- the first and last of those times. Apart from outbox.backlog(), whose
-- unpublished count holds them too: a year of reminders is not an outage.
CREATE OR REPLACE FUNCTION outbox.scheduled(context text DEFAULT NULL)
RETURNS TABLE (
    context text,
    scheduled bigint,
    next_due_at timestamptz,
    last_due_at timestamptz
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(scheduled.context);
    SELECT s.context, count(*), min(s.deliver_at), max(s.deliver_at)
    FROM outbox.schedules AS s
    WHERE s.deliver_at > now()
        AND (scheduled.context IS NULL OR s.context = scheduled.context)
    GROUP BY s.context
    ORDER BY s.context;
$$;
COMMENT ON FUNCTION outbox.scheduled(text) IS
'Per context: events waiting for their delivery time, the next and the last of those times.';

-- When the next scheduled event falls due (NULL: none is waiting). The relay
-- asks after a claim that found nothing, and sleeps until then rather than
-- until its next poll: one probe of schedules_deliver_at_idx.
CREATE OR REPLACE FUNCTION outbox.next_scheduled()
RETURNS timestamptz
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT min(s.deliver_at) FROM outbox.schedules AS s WHERE s.deliver_at > now();
$$;
COMMENT ON FUNCTION outbox.next_scheduled() IS
'When the next scheduled event falls due, or NULL; relays sleep until then.';
