-- outbox.events: one row per domain event, range-partitioned by created_at
-- (one partition per UTC day). Rows leave only when a whole partition is
-- archived and dropped; no role may DELETE (see 20_outbox_guards.sql).
--
-- Lifecycle (status), enforced for every UPDATE by tg_events__guard_update:
--   PENDING      emitted, waiting for a relay           -> PROCESSING
--   PROCESSING   claimed under a lease (available_at)   -> COMPLETED | FAILED | DEAD_LETTER
--                                                         | PROCESSING (lease expired, re-claim)
--   FAILED       publish failed, retry at available_at  -> PROCESSING (once due)
--   COMPLETED    acked by JetStream                     -> PENDING (outbox.requeue_completed,
--                                                         audited: the broker lost it)
--   DEAD_LETTER  gave up; needs an operator             -> PENDING (outbox.requeue, audited)
--
-- These five and no other. An operator's discard parks a dead letter for
-- good: it stays DEAD_LETTER with a mark (outbox.discarded_events, written by
-- outbox.dlq_discard, removed by outbox.dlq_restore), and moves nowhere
-- while marked.
--
-- available_at is "when may a relay take this row next": emit time for
-- PENDING, retry time for FAILED, lease expiry for PROCESSING. One column
-- keeps the claim predicate and its index simple.

CREATE TABLE IF NOT EXISTS outbox.events (
    id bigint GENERATED ALWAYS AS IDENTITY,
    event_id uuid NOT NULL DEFAULT gen_random_uuid(),
    context text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    event_type text NOT NULL,
    event_version integer NOT NULL DEFAULT 1,
    -- {context}.event.{event_type}.v{event_version}, written by the INSERT
    -- policy trigger and immutable after (a generated column would be
    -- recomputed by each of the two status updates of every event).
    subject text,
    payload jsonb NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}'::jsonb,
    correlation_id uuid,
    causation_id uuid,
    tenant_id text,
    ordering_key text,
    occurred_at timestamptz NOT NULL DEFAULT now(),
    created_at timestamptz NOT NULL DEFAULT now(),
    available_at timestamptz NOT NULL DEFAULT now(),
    status text NOT NULL DEFAULT 'PENDING',
    attempts integer NOT NULL DEFAULT 0,
    last_error text,
    claimed_at timestamptz,
    claimed_by text,
    claim_token uuid,
    published_at timestamptz,
    PRIMARY KEY (id, created_at)
    -- No CHECK constraints: PostgreSQL reads a table's CHECKs from the
    -- catalog and compiles them at every INSERT statement, which cost emit
    -- (one row per statement) about 8 µs. The event's content is validated
    -- once, at INSERT, by _100_check_policies (codes: docs/reference.md),
    -- which also makes every row born PENDING, unclaimed and unpublished, and
    -- cannot change afterwards (_100_guard_content). The lifecycle invariants
    -- (a known status, attempts >= 0, published_at iff COMPLETED, a claim
    -- while PROCESSING, an error when FAILED or DEAD_LETTER) are checked at
    -- every UPDATE by _500_check_state (20_outbox_guards.sql).
) PARTITION BY RANGE (created_at);

COMMENT ON TABLE outbox.events IS
'Transactional outbox. Write with outbox.emit(); relays move rows with claim/mark_*.';
COMMENT ON COLUMN outbox.events.event_id IS
'Idempotency key: the Nats-Msg-Id on the wire and the consumer''s message_id.';
COMMENT ON COLUMN outbox.events.available_at IS
'When a relay may take the row next: emit time, retry time (FAILED) or lease expiry (PROCESSING).';
COMMENT ON COLUMN outbox.events.attempts IS 'Number of claims, i.e. publish attempts.';
COMMENT ON COLUMN outbox.events.claim_token IS
'Fencing token of the current (or last) claim; mark_* must present it.';

-- Rows whose day has no partition land here rather than failing the
-- business transaction; create_partitions() leaves such a day alone (and says
-- so) until the default partition is archived.
CREATE TABLE IF NOT EXISTS outbox.events_default PARTITION OF outbox.events DEFAULT
WITH (
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0, fillfactor = 50
);

-- Claim scan: claim() walks this partial index in id order; it holds only
-- unfinished rows, so it stays small however long partitions are kept.
-- Scheduled events waiting for their time are not in it (the second term),
-- but in events_scheduled_idx below.
CREATE INDEX IF NOT EXISTS events_claimable_idx ON outbox.events (id)
WHERE status IN ('PENDING', 'FAILED', 'PROCESSING')
AND (status <> 'PENDING' OR claimed_at IS NOT NULL OR ordering_key IS NOT NULL OR available_at <= created_at);

-- Scheduled events (emit's deliver_at / deliver_after) not yet claimed, by
-- delivery time: PENDING, never claimed, due after their commit, without an
-- ordering_key. In id order they would lie among the events emitted since,
-- and every claim would step over each of them (a heap visit apiece: a
-- year of reminders made every claim walk them all) and hold the claim
-- floor at the oldest. claim() takes those fallen due from here, in due
-- order, and gives each a new id at that claim: it joins the id-ordered
-- queue at its delivery time, above the floor (outbox.claim says why).
-- A keyed one keeps its place in its key's id order, and so stays in
-- events_claimable_idx, walked like any event.
CREATE INDEX IF NOT EXISTS events_scheduled_idx ON outbox.events (available_at)
WHERE status = 'PENDING' AND claimed_at IS NULL AND ordering_key IS NULL AND available_at > created_at;

-- Fair claims: the rows of events_claimable_idx that wait (not those in
-- flight, PROCESSING), by tenant, then id, newest first. claim() steps from
-- one tenant with due rows to the next (a loose scan: one descent per
-- tenant, landing on its newest rows, so a tenant with nothing due costs
-- nothing) and takes each tenant's share from its own range. In-flight rows are left out so that neither step walks a
-- backlog's thousands of claimed rows; an expired lease is taken in id
-- order (claim). Events without a tenant are the tenant '' (emit refuses ''
-- as a tenant id). Collation "C": bytewise comparison, cheaper than the
-- database's collation, and any total order will do. No column of
-- outbox.events: claim() returns its row type, and relays of the previous
-- release keep running on a migrated schema.
CREATE INDEX IF NOT EXISTS events_tenant_waiting_idx ON outbox.events ((coalesce(tenant_id, '') COLLATE "C"), id DESC)
WHERE status IN ('PENDING', 'FAILED')
AND (status <> 'PENDING' OR claimed_at IS NOT NULL OR ordering_key IS NOT NULL OR available_at <= created_at);

-- A tenant's weight in fair claims (outbox.set_tenant_weight, admins): its
-- share of a claim that meets several tenants, against 1 for every tenant
-- not listed. tenant_key is the claim's key: '' for events without a tenant.
CREATE TABLE IF NOT EXISTS outbox.tenant_weights (
    tenant_key text COLLATE "C" PRIMARY KEY,
    weight integer NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL,
    CONSTRAINT weight_in_range CHECK (weight BETWEEN 1 AND 1000)
);
COMMENT ON TABLE outbox.tenant_weights IS
'Tenants'' weights in fair claims (1 when not listed); set with outbox.set_tenant_weight().';

-- Every change of a weight: who, when, from what to what, and why.
CREATE TABLE IF NOT EXISTS outbox.tenant_weight_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_key text NOT NULL,
    weight_before integer NOT NULL,
    weight_after integer NOT NULL,
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL,
    reason text NOT NULL,
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);
COMMENT ON TABLE outbox.tenant_weight_log IS
'Who changed which tenant''s weight in fair claims, when, from what to what and why.';

-- Per-key ordering: "is there an earlier unfinished event with my key?"
CREATE INDEX IF NOT EXISTS events_unfinished_key_idx ON outbox.events (ordering_key, id)
WHERE ordering_key IS NOT NULL AND status <> 'COMPLETED';

-- mark_published, mark_failed and hand_back find a claim's rows by token.
-- The predicate is written in collation "C", and so are their status tests,
-- so that this is the only partial index their WHERE clause proves usable.
-- Written plainly, status = 'PROCESSING' also proves events_claimable_idx's
-- predicate, and the planner may walk that index whole: under a snapshot
-- held by another session, ANALYZE counts only live rows, sees (almost) no
-- claimable one, and prices the walk at a page, while the index holds every
-- dead entry the hold keeps (a mark read 128,000 buffers instead of ~60).
-- For text equality "C" is the same test as the database's collation.
CREATE INDEX IF NOT EXISTS events_claim_token_idx ON outbox.events (claim_token)
WHERE status = 'PROCESSING' COLLATE "C";

CREATE INDEX IF NOT EXISTS events_dead_letter_idx ON outbox.events (context)
WHERE status = 'DEAD_LETTER';

-- The claim floor: every row of events_claimable_idx (claimable, PENDING,
-- FAILED or PROCESSING, and not a scheduled event waiting) has an id at or
-- above it, so claim() and backlog() start their walk of
-- events_claimable_idx there. Without it, each walk starts at the lowest id
-- of the index and steps over every entry of the events finished since
-- vacuum last ran: a few hundred while vacuum keeps up, but while another
-- session holds an old snapshot (a report, pg_dump, a forgotten BEGIN)
-- nothing can be vacuumed nor marked dead, and every claim walked past two
-- entries (and their heap tuples) of every event since: the cost of a claim
-- grew with the age of the snapshot, until delivery fell minutes behind
-- (docs/benchmarks.md, "Held snapshot").
--
-- The floor is kept in unlogged sequences (outbox._claim_floor(), called by
-- claim): setval writes in place, with no row version to leave behind, no
-- WAL and no row lock. A crash or a promotion resets them: the floor reads 0,
-- the walk starts at the bottom until the floor moves up again, safe and slow.
-- claim_floor_next/_wait: a candidate floor and the transaction id whose
-- end it waits for (outbox._claim_floor says why that is enough).
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor_next AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor_wait AS bigint MINVALUE -9223372036854775808;  -- noqa: PRS
COMMENT ON SEQUENCE outbox.claim_floor IS
'No claimable event has a lower id (outbox._claim_floor). Unlogged: unset (walk from the bottom) after a crash.';

-- Deliberately no index on event_id: every claim and mark would insert a
-- random UUID into it (scattered page writes, full-page images in the WAL),
-- which cost a third of the claim + mark throughput when measured. Marks find
-- rows by claim token, requeue by the DEAD_LETTER index; an operator's lookup
-- by event_id scans (add a created_at range to prune partitions).

-- A business flow by its correlation id (outbox.flow): partial, so an event
-- emitted without one costs its INSERT nothing here. An event with one pays
-- an entry per row version (emit, claim, mark: each changes status, so no
-- update is HOT), as every index of this table does.
CREATE INDEX IF NOT EXISTS events_correlation_idx ON outbox.events (correlation_id, id)
WHERE correlation_id IS NOT NULL;

-- The outbox's discarded mark: one row per discarded dead letter, written
-- by outbox.dlq_discard and deleted by outbox.dlq_restore (nothing else
-- may: its triggers in sql/67_dead_letters.sql). A table of its own rather
-- than a column of outbox.events, whose row type outbox.claim returns: a
-- column added there fails the calls of running relays once (42804) when
-- the migration commits. Kept when the event's day is archived, like
-- outbox.discard_log; granted to no one but pgoutbox_admin (SELECT).
CREATE TABLE IF NOT EXISTS outbox.discarded_events (
    event_id uuid PRIMARY KEY,
    row_id bigint NOT NULL,
    created_at timestamptz NOT NULL,
    discarded_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE outbox.discarded_events IS
'Discarded dead letters of outbox.events (status stays DEAD_LETTER): outbox.dlq_discard adds, dlq_restore removes.';
-- dlq_restore finds the marks by the events' keys.
CREATE INDEX IF NOT EXISTS discarded_events_row_idx ON outbox.discarded_events (row_id, created_at);

-- The event ids callers gave emit (event_id => ...), one row each, kept for
-- good (a retry after its event was archived is still the same event).
-- Drawn ids (version-4 UUIDs, 122 random bits) are never registered: that
-- every event id is unique then rests on the primary key here for given ids,
-- on chance for drawn ones, and on a given id never being of version 4 (emit
-- refuses one). The INSERT policy trigger registers the id of any other
-- INSERT (an owner's); a dump restores this table with the events, so a
-- restored database keeps the rule. content_md5: what a second emit with the
-- same id must match (outbox._event_fingerprint).
CREATE TABLE IF NOT EXISTS outbox.event_keys (
    event_id uuid PRIMARY KEY,
    content_md5 uuid NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE outbox.event_keys IS
'Event ids given by callers (outbox.emit(event_id => ...)): one event per id, kept for good.';

-- Events emitted with a delivery time (deliver_at, deliver_after), one row
-- each, written by emit only for them: the common case pays nothing. It
-- answers what outbox.events could answer only by a scan or by an index
-- every emit would pay for: when the next one falls due (the relay sleeps
-- until then), how many wait per context (pgoutbox status), and who emitted
-- one (outbox.cancel). A cancelled event's row is deleted.
CREATE TABLE IF NOT EXISTS outbox.schedules (
    event_id uuid PRIMARY KEY,
    created_at timestamptz NOT NULL,
    context text NOT NULL,
    deliver_at timestamptz NOT NULL,
    emitted_by text NOT NULL
);
CREATE INDEX IF NOT EXISTS schedules_deliver_at_idx ON outbox.schedules (deliver_at);
COMMENT ON TABLE outbox.schedules IS
'Events emitted with a delivery time: when each falls due, its context, who emitted it.';

-- Scheduled events cancelled before they fell due (PENDING -> DEAD_LETTER),
-- written by the update guard itself so that no path around outbox.cancel()
-- escapes it.
CREATE TABLE IF NOT EXISTS outbox.cancel_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id uuid NOT NULL,
    cancelled_at timestamptz NOT NULL DEFAULT now(),
    cancelled_by text NOT NULL,
    reason text NOT NULL,
    deliver_at timestamptz NOT NULL,
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);
COMMENT ON TABLE outbox.cancel_log IS
'Who cancelled which scheduled event, when and why (outbox.cancel).';

-- DEAD_LETTER -> PENDING audit trail, written by the update guard itself so
-- that no path around outbox.requeue() escapes it.
CREATE TABLE IF NOT EXISTS outbox.requeue_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id uuid NOT NULL,
    requeued_at timestamptz NOT NULL DEFAULT now(),
    requeued_by text NOT NULL,
    reason text NOT NULL,
    attempts_before integer NOT NULL,
    last_error text,
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);

-- Rows leave outbox.events only with a whole archived partition
-- (sql/20_outbox_guards.sql puts this guard on the table; create_partitions,
-- below, on each new partition).
CREATE OR REPLACE FUNCTION outbox.tg_events__forbid_delete()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'DELETE_FORBIDDEN: rows leave outbox.events only by audited partition archival'
        USING ERRCODE = 'OB012';
END;
$$;

-- Creates the daily partitions from from_day to from_day + days_ahead
-- (UTC days), returning the names it created. Idempotent and serialised.
CREATE OR REPLACE FUNCTION outbox.create_partitions(
    days_ahead integer DEFAULT 7,
    from_day date DEFAULT (now() AT TIME ZONE 'UTC')::date
)
RETURNS SETOF text
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    d date;
    part text;
    lo timestamptz;
    hi timestamptz;
BEGIN
    IF days_ahead IS NULL OR days_ahead < 0 OR days_ahead > 366 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: days_ahead must be between 0 and 366, got %', days_ahead
            USING ERRCODE = 'OB006';
    END IF;
    -- Partition names carry a four-digit year.
    IF from_day IS NULL OR NOT (from_day >= '1900-01-01' AND from_day + days_ahead <= '9999-12-30') THEN
        RAISE EXCEPTION 'TIMESTAMP_OUT_OF_RANGE: from_day must be a day from 1900-01-01 to 9999-12-30 - days_ahead, got %', from_day
            USING ERRCODE = 'OB008';
    END IF;
    -- Two callers at once would race on CREATE TABLE.
    PERFORM pg_advisory_xact_lock(hashtextextended('pgoutbox.create_partitions', 0));
    FOR d IN SELECT generate_series(from_day, from_day + days_ahead, interval '1 day')::date LOOP
        part := 'events_p' || to_char(d, 'YYYYMMDD');
        CONTINUE WHEN to_regclass(format('outbox.%I', part)) IS NOT NULL;
        lo := d::timestamp AT TIME ZONE 'UTC';
        hi := (d + 1)::timestamp AT TIME ZONE 'UTC';
        IF EXISTS (
            SELECT 1 FROM outbox.events_default
            WHERE created_at >= lo AND created_at < hi
        ) THEN
            RAISE WARNING 'outbox: rows for % are in outbox.events_default; partition % not created', d, part
                USING HINT = 'Archive the default partition, then call outbox.create_partitions() again.';
            CONTINUE;
        END IF;
        EXECUTE format(
            'CREATE TABLE outbox.%I PARTITION OF outbox.events FOR VALUES FROM (%L) TO (%L)'
            -- Each event leaves two dead row versions (claim, mark) and dead
            -- entries in events_claimable_idx that every claim walks past:
            -- vacuum a day partition every 10,000 dead rows, not at 20 %.
            -- fillfactor 50: claim and mark each write a new version of the
            -- row; with room on its page it stays there, logged as a diff
            -- against the old one (a third less WAL, and a quarter less heap
            -- after the drain, measured), and pruning frees the dead ones.
            -- The price: a backlog waiting unclaimed takes twice the pages.
            || ' WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,'
            || ' autovacuum_vacuum_cost_delay = 0, fillfactor = 50)',
            part, lo, hi
        );
        -- TRUNCATE of a partition by name fires only its own triggers.
        EXECUTE format(
            'CREATE OR REPLACE TRIGGER _100_forbid_truncate BEFORE TRUNCATE ON outbox.%I'
            ' FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_events__forbid_delete()', part
        );
        RETURN NEXT part;
    END LOOP;
END;
$$;
COMMENT ON FUNCTION outbox.create_partitions(integer, date) IS
'Creates daily partitions of outbox.events ahead of time; safe to call any number of times.';
