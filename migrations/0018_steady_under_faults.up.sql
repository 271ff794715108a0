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

-- ---- upcasters: any error of an upcaster is that message's own outcome

-- ---- held snapshots: the hot path does not grow with the oldest snapshot

-- ---- backfill: a handler that joins late replays the outbox's history

-- generated from sql/68_backfill.sql: outbox.backfill_span
-- What the outbox holds of a handler's subjects in [from_at, until_at): how
-- many events, the first and last created_at among them, and the oldest
-- created_at the outbox keeps at all (older days were archived and dropped:
-- a range starting before it is not whole here). The plan the command prints
-- first is made of it.
CREATE OR REPLACE FUNCTION outbox.backfill_span(
    subjects text[],
    from_at timestamptz,
    until_at timestamptz
)
RETURNS TABLE (events bigint, first_at timestamptz, last_at timestamptz, kept_from timestamptz)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_backfill(subjects, from_at, until_at, 1);
    RETURN QUERY
    SELECT count(*), min(e.created_at), max(e.created_at), (SELECT min(k.created_at) FROM outbox.events AS k)
    FROM outbox.events AS e
    WHERE e.subject = ANY(backfill_span.subjects)
        AND e.created_at >= backfill_span.from_at AND e.created_at < backfill_span.until_at;
END;
$$;
COMMENT ON FUNCTION outbox.backfill_span(text[], timestamptz, timestamptz) IS
'For pgoutbox backfill: how many events of these subjects the outbox holds in a range, and since when it keeps any.';
-- end generated

-- generated from sql/68_backfill.sql: outbox.backfill_page
-- One page of a backfill: the events of the handler's subjects created in
-- [from_at, until_at) with an id above after_id, in id order, whatever their
-- status. Id order is emit order within an ordering key (outbox.emit holds
-- the key's lock until commit), so a backfill that delivers pages in order,
-- one event after the other, keeps every key's order; after_id is the
-- resume point. The columns are those the relay publishes (wire.to_nats).
CREATE OR REPLACE FUNCTION outbox.backfill_page(
    subjects text[],
    from_at timestamptz,
    until_at timestamptz,
    after_id bigint,
    page_size integer
)
RETURNS TABLE (
    id bigint,
    event_id uuid,
    subject text,
    context text,
    aggregate_type text,
    aggregate_id text,
    event_type text,
    event_version integer,
    payload jsonb,
    headers jsonb,
    correlation_id uuid,
    causation_id uuid,
    tenant_id text,
    ordering_key text,
    occurred_at timestamptz,
    created_at timestamptz
)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_backfill(subjects, from_at, until_at, page_size);
    IF after_id IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: after_id is required (0 for the start)'
            USING ERRCODE = 'OB006';
    END IF;
    RETURN QUERY
    SELECT
        e.id, e.event_id, e.subject, e.context, e.aggregate_type, e.aggregate_id, e.event_type,
        e.event_version, e.payload, e.headers, e.correlation_id, e.causation_id, e.tenant_id,
        e.ordering_key, e.occurred_at, e.created_at
    FROM outbox.events AS e
    WHERE e.id > backfill_page.after_id
        AND e.subject = ANY(backfill_page.subjects)
        AND e.created_at >= backfill_page.from_at AND e.created_at < backfill_page.until_at
    ORDER BY e.id
    LIMIT backfill_page.page_size;
END;
$$;
COMMENT ON FUNCTION outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer) IS
'For pgoutbox backfill: the next page of events of these subjects in a range, in id (emit) order.';
-- end generated

-- generated from sql/68_backfill.sql: outbox._check_backfill
CREATE OR REPLACE FUNCTION outbox._check_backfill(
    subjects text[],
    from_at timestamptz,
    until_at timestamptz,
    page_size integer
)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF subjects IS NULL OR cardinality(subjects) = 0 OR array_position(subjects, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: subjects must name at least one subject, and no NULL'
            USING ERRCODE = 'OB006';
    END IF;
    IF from_at IS NULL OR until_at IS NULL OR NOT from_at < until_at THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: from_at must be before until_at, got % and %', from_at, until_at
            USING ERRCODE = 'OB006';
    END IF;
    IF page_size IS NULL OR page_size < 1 OR page_size > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: page_size must be between 1 and 10000, got %', page_size
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;
-- end generated

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgoutbox_backfiller') THEN
        CREATE ROLE pgoutbox_backfiller NOLOGIN;
    END IF;
END;
$$;

REVOKE ALL ON FUNCTION
outbox.backfill_span(text[], timestamptz, timestamptz),
outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer),
outbox._check_backfill(text[], timestamptz, timestamptz, integer)
FROM public;
GRANT USAGE ON SCHEMA outbox, inbox TO pgoutbox_backfiller;
GRANT EXECUTE ON FUNCTION
outbox.schema_version(), outbox.serves_workers_from(),
outbox.backfill_span(text[], timestamptz, timestamptz),
outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer),
inbox.receive(uuid, text, text, jsonb),
inbox.mark_processed(uuid, text),
inbox.record_error(uuid, text, text, boolean, interval)
TO pgoutbox_backfiller;

-- ---- the console

INSERT INTO outbox.schema_migrations (version, name)
VALUES (18, '0018_steady_under_faults')
ON CONFLICT (version) DO NOTHING;

COMMIT;
