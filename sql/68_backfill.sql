-- `pgoutbox backfill` (docs/backfill.md): a handler that joins late replays
-- history from the outbox's own partitions, through its ordinary inbox path
-- (inbox.receive dedups). These two functions are all it reads of the
-- outbox; pgoutbox_backfiller holds them and the inbox calls, no table.

-- What the outbox holds of a handler's subjects in [from_at, until_at) (a
-- scheduled event not yet due left out, as backfill_page leaves it; the later
-- events of its key are counted, though that page holds them back): how
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
        AND e.created_at >= backfill_span.from_at AND e.created_at < backfill_span.until_at
        AND NOT (e.status = 'PENDING' AND e.claimed_at IS NULL AND e.available_at > now());
END;
$$;
COMMENT ON FUNCTION outbox.backfill_span(text[], timestamptz, timestamptz) IS
'For pgoutbox backfill: how many events of these subjects the outbox holds in a range, and since when it keeps any.';

-- One page of a backfill: the events of the handler's subjects created in
-- [from_at, until_at) with an id above after_id, in id order, whatever their
-- status, but one: a scheduled event not yet due is no history yet. It and
-- the later events of its key are left out (they would reach the handler
-- before their time, or before it); the relay publishes them when it falls
-- due, and the handler's consumer takes them then. Id order is emit order
-- within an ordering key (outbox.emit holds the key's lock until commit), so
-- a backfill that delivers pages in order, one event after the other, keeps
-- every key's order; after_id is the resume point. The columns are those the
-- relay publishes (wire.to_nats).
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
        AND NOT (e.status = 'PENDING' AND e.claimed_at IS NULL AND e.available_at > now())
        AND NOT (
            e.ordering_key IS NOT NULL AND EXISTS (
                SELECT 1
                FROM outbox.events AS k
                -- (status <> 'COMPLETED': events_unfinished_key_idx's predicate)
                WHERE k.ordering_key = e.ordering_key AND k.id < e.id AND k.status <> 'COMPLETED'
                    AND k.status = 'PENDING' AND k.claimed_at IS NULL AND k.available_at > now()
            )
        )
    ORDER BY e.id
    LIMIT backfill_page.page_size;
END;
$$;
COMMENT ON FUNCTION outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer) IS
'For pgoutbox backfill: the next page of events of these subjects in a range, in id (emit) order.';

-- A backfill's range [from_at, until_at): both given, from_at first.
CREATE OR REPLACE FUNCTION outbox._check_backfill_range(from_at timestamptz, until_at timestamptz)
RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF from_at IS NULL OR until_at IS NULL OR NOT from_at < until_at THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: from_at must be before until_at, got % and %', from_at, until_at
            USING ERRCODE = 'OB006';
    END IF;
END;
$$;

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
    PERFORM outbox._check_backfill_range(from_at, until_at);
    PERFORM outbox._check_range('page_size', page_size, 1, 10000, 'between 1 and 10000');
END;
$$;

-- The archived days a backfill reads from the Parquet archive: days of
-- outbox.events with a standing audit whose partition was removed (a day
-- archived but still live is read from the outbox), overlapping
-- [from_at, until_at), in day order, with the audited figures the archive
-- must still show (outbox.backfill_verify_archived_day).
CREATE OR REPLACE FUNCTION outbox.backfill_archived_days(
    from_at timestamptz,
    until_at timestamptz
)
RETURNS TABLE (day date, archive_uri text, row_count bigint, checksum numeric)
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_backfill_range(from_at, until_at);
    RETURN QUERY
    SELECT a.day, a.archive_uri, a.row_count, a.checksum
    FROM outbox.archive_audit AS a
    WHERE a.source = 'outbox.events' AND a.voided_at IS NULL AND a.removed_at IS NOT NULL
        AND (a.day::timestamp AT TIME ZONE 'UTC') < backfill_archived_days.until_at
        AND ((a.day + 1)::timestamp AT TIME ZONE 'UTC') > backfill_archived_days.from_at
    ORDER BY a.day;
END;
$$;
COMMENT ON FUNCTION outbox.backfill_archived_days(timestamptz, timestamptz) IS
'For pgoutbox backfill: the archived and removed days of outbox.events in a range, with their audited figures.';

-- The gate before a backfill delivers an archived day: the row count and
-- checksum it computed over the day's Parquet files (the archival job's
-- checksum, spark/pgoutbox_spark/checksum.py) must equal the standing audit,
-- else the day was altered after it was archived: ARCHIVE_TAMPERED (OB111),
-- and not one of its rows is delivered. A day without a standing audit is
-- ARCHIVE_NOT_AUDITED (OB112). Returns the audited archive URI.
CREATE OR REPLACE FUNCTION outbox.backfill_verify_archived_day(
    day date,
    row_count bigint,
    checksum numeric
)
RETURNS text
LANGUAGE plpgsql
STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    -- Scalars, not a row of outbox.archive_audit: this file runs before the
    -- one that creates that table (sql/91), and a declared row type must exist.
    audited_rows bigint;
    audited_sum numeric;
    audited_uri text;
BEGIN
    IF day IS NULL OR row_count IS NULL OR checksum IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: day, row_count and checksum are required'
            USING ERRCODE = 'OB006';
    END IF;
    SELECT a.row_count, a.checksum, a.archive_uri INTO audited_rows, audited_sum, audited_uri
    FROM outbox.archive_audit AS a
    WHERE a.source = 'outbox.events' AND a.day = backfill_verify_archived_day.day AND a.voided_at IS NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'ARCHIVE_NOT_AUDITED: outbox.events has no standing archive audit for %', day
            USING ERRCODE = 'OB112';
    END IF;
    IF audited_rows <> backfill_verify_archived_day.row_count
        OR audited_sum <> backfill_verify_archived_day.checksum THEN
        RAISE EXCEPTION 'ARCHIVE_TAMPERED: the archive of outbox.events for % is not what was audited',
            day
            USING ERRCODE = 'OB111',
            DETAIL = format(
                'audited %s rows, checksum %s; the files at %s give %s rows, checksum %s',
                audited_rows, audited_sum, audited_uri,
                backfill_verify_archived_day.row_count, backfill_verify_archived_day.checksum
            );
    END IF;
    RETURN audited_uri;
END;
$$;
COMMENT ON FUNCTION outbox.backfill_verify_archived_day(date, bigint, numeric) IS
'For pgoutbox backfill: checks an archived day''s figures against its audit (OB111 when they differ).';
