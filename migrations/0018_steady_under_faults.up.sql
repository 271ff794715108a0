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

-- The claim floor (sql/10_outbox_events.sql): claim and backlog walk
-- events_claimable_idx from it, not from the bottom. A claim of schema 17's
-- definition still works on this schema (it walks from the bottom).
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor AS bigint MINVALUE 0;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor_next AS bigint MINVALUE 0;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor_wait AS bigint MINVALUE 0;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor_at AS bigint MINVALUE 0;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor_checked AS bigint MINVALUE 0;  -- noqa: PRS
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.claim_floor_checked_id AS bigint MINVALUE 0;  -- noqa: PRS
COMMENT ON SEQUENCE outbox.claim_floor IS
'No claimable event has a lower id (outbox._claim_floor). Unlogged: reset to 0 (walk from the bottom) by a crash.';

-- generated from sql/20_outbox_guards.sql: outbox.tg_events__lower_claim_floor
-- A finished event made claimable again (requeue, requeue_completed) lowers
-- the claim floor to its id (outbox._claim_floor, sql/30_outbox_api.sql) and
-- cancels a candidate floor taken before it: under the floor's lock, held to
-- the end of the transaction, so that no claimer moves the floor past it
-- before it is committed and seen. Only those moves fire it (WHEN).
CREATE OR REPLACE FUNCTION outbox.tg_events__lower_claim_floor()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('pgoutbox.claim_floor', 0));
    IF NEW.id < coalesce(pg_sequence_last_value('outbox.claim_floor'), 0) THEN
        PERFORM setval('outbox.claim_floor', NEW.id);
    END IF;
    PERFORM setval('outbox.claim_floor_next', 1, FALSE);
    RETURN NEW;
END;
$$;
-- end generated

CREATE OR REPLACE TRIGGER _200_lower_claim_floor
BEFORE UPDATE ON outbox.events
FOR EACH ROW
WHEN (
    old.status NOT IN ('PENDING', 'FAILED', 'PROCESSING')
    AND new.status IN ('PENDING', 'FAILED', 'PROCESSING')
)
EXECUTE FUNCTION outbox.tg_events__lower_claim_floor();

-- generated from sql/30_outbox_api.sql: outbox._claim_floor
-- Moves the claim floor (outbox.claim_floor, 10_outbox_events.sql) up
-- behind the claimable rows and returns it; claim() calls it first. A step at
-- a time, by one claimer at a time (the others use the floor as it stands):
--   1. a candidate: read the last id events_id_seq gave out, then, in the
--      next statement (a newer snapshot), the lowest claimable id at or above
--      the floor; the candidate is the lower of that and the last id + 1.
--      Every id below it was given out before the snapshot was taken, so it
--      belongs to a row the snapshot saw finished or to a transaction
--      running then (at most the snapshot's xmax);
--   2. at a later claim, once every transaction below that xmax has ended
--      and 250 ms have passed: the lowest claimable id between the floor and
--      the candidate, in a snapshot that now sees what those transactions
--      wrote; the floor becomes it, or the candidate.
-- Each walk covers what was finished since the previous step, however old
-- the oldest snapshot. The 250 ms cover an INSERT that took its id just
-- before step 1 but had no transaction id yet; for one stalled longer than
-- that, once a minute a claim looks at the ids the floor passed since its
-- previous look and lowers it: such an event is delivered late, not
-- reordered (an ordering key's successors wait for it as always). Only an
-- INSERT stalled for longer than that minute between taking its id and
-- writing its row would stay below the floor (until a crash resets it). A row that becomes claimable again
-- (requeue, requeue_completed) lowers the floor itself, under the same lock
-- (tg_events__lower_claim_floor), and cancels a pending candidate.
-- Only under READ COMMITTED, where each statement takes a new snapshot.
CREATE OR REPLACE FUNCTION outbox._claim_floor()
RETURNS bigint
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    floor_id bigint := coalesce(pg_sequence_last_value('outbox.claim_floor'), 0);
    now_us bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    next_id bigint;
    last_id bigint;
    lowest bigint;
    snap pg_snapshot;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed'
        OR NOT pg_try_advisory_xact_lock(hashtextextended('pgoutbox.claim_floor', 0)) THEN
        RETURN floor_id;
    END IF;
    floor_id := coalesce(pg_sequence_last_value('outbox.claim_floor'), 0);
    IF now_us - coalesce(pg_sequence_last_value('outbox.claim_floor_checked'), 0) >= 60000000 THEN
        -- Only the ids the floor passed since the previous look: a walk from
        -- the bottom would step over every dead entry, seconds held long.
        last_id := coalesce(pg_sequence_last_value('outbox.claim_floor_checked_id'), 0);
        PERFORM setval('outbox.claim_floor_checked', now_us), setval('outbox.claim_floor_checked_id', floor_id);
        SELECT min(e.id) INTO lowest
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING') AND e.id >= last_id AND e.id < floor_id;
        IF lowest IS NOT NULL THEN
            PERFORM setval('outbox.claim_floor', lowest), setval('outbox.claim_floor_next', 1, FALSE);
            RETURN lowest;
        END IF;
    END IF;
    next_id := pg_sequence_last_value('outbox.claim_floor_next');
    IF next_id IS NULL THEN
        last_id := coalesce(pg_sequence_last_value('outbox.events_id_seq'), 0);
        SELECT min(e.id), pg_current_snapshot() INTO lowest, snap
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING') AND e.id >= floor_id;
        PERFORM
            setval('outbox.claim_floor_next', greatest(least(lowest, last_id + 1), floor_id)),
            setval('outbox.claim_floor_wait', pg_snapshot_xmax(snap)::text::bigint),
            setval('outbox.claim_floor_at', now_us);
        RETURN floor_id;
    END IF;
    IF now_us - pg_sequence_last_value('outbox.claim_floor_at') < 250000
        OR pg_snapshot_xmin(pg_current_snapshot())::text::bigint
        < pg_sequence_last_value('outbox.claim_floor_wait') THEN
        RETURN floor_id;
    END IF;
    SELECT min(e.id) INTO lowest
    FROM outbox.events AS e
    WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING') AND e.id >= floor_id AND e.id < next_id;
    floor_id := coalesce(lowest, next_id);
    PERFORM setval('outbox.claim_floor', floor_id), setval('outbox.claim_floor_next', 1, FALSE);
    RETURN floor_id;
END;
$$;
-- end generated

-- generated from sql/30_outbox_api.sql: outbox.claim
-- Claims up to batch_size due events for worker, under a lease, and returns
-- them with a fresh claim token. One statement:
--   * the CTE picks candidates in id order from events_claimable_idx and locks
--     them FOR UPDATE SKIP LOCKED, so concurrent claimers walk past each
--     other's rows instead of queueing on them, and LIMIT bounds the batch;
--   * it starts at the claim floor (outbox._claim_floor, moved up just
--     before): below it nothing is claimable, only the index entries of
--     finished events, which a snapshot held by another session keeps from
--     vacuum, and the walk stays as short with it as without;
--   * available_at <= now() covers all three sources at once: new events,
--     failed events whose retry time has come, and expired leases;
--   * an event with an ordering_key is taken only when no earlier event of
--     its key is unfinished (not COMPLETED), so at most one event per key is
--     in flight and a FAILED or DEAD_LETTER event holds its successors back;
--   * the UPDATE moves the locked rows to PROCESSING and RETURNING hands them
--     out, with no window in which another claimer could see them as due;
--   * plans are generic (planned once per session): planning an UPDATE over
--     every partition costs more than executing it. The locked keys reach
--     the UPDATE as arrays (= ANY) so that the generic plan probes the
--     primary key instead of hash-joining the whole table;
--   * enable_seqscan is off because a generic plan lives as long as the
--     relay's session: made while tomorrow's partition is empty, a plan
--     with a sequential scan of it would scan the whole growing partition
--     at every claim of the next day (until an ANALYZE re-plans). The
--     created_at range of the locked rows lets the executor skip (prune)
--     the partitions that hold none of them, which array conditions
--     cannot do; without it every empty partition's primary key would be
--     probed once per id.
CREATE OR REPLACE FUNCTION outbox.claim(
    worker text,
    batch_size integer,
    lease interval
)
RETURNS SETOF outbox.events
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    token uuid := gen_random_uuid();
    floor_id bigint;
BEGIN
    PERFORM outbox._check_text(worker, 'worker', 256);
    IF batch_size IS NULL OR batch_size < 1 OR batch_size > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: batch_size must be between 1 and 10000, got %', batch_size
            USING ERRCODE = 'OB006';
    END IF;
    IF lease IS NULL OR lease <= interval '0' OR lease > interval '1 day' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: lease must be positive and at most 1 day, got %', lease
            USING ERRCODE = 'OB006';
    END IF;
    floor_id := outbox._claim_floor();
    RETURN QUERY
    WITH candidates AS (
        SELECT e.id, e.created_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND e.id >= floor_id
            AND e.available_at <= now()
            AND (
                e.ordering_key IS NULL
                OR NOT EXISTS (
                    SELECT 1
                    FROM outbox.events AS earlier
                    WHERE earlier.ordering_key = e.ordering_key
                        AND earlier.id < e.id
                        AND earlier.status <> 'COMPLETED'
                )
            )
        ORDER BY e.id
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox.events AS e
    SET status = 'PROCESSING',
        attempts = e.attempts + 1,
        claimed_at = now(),
        claimed_by = worker,
        claim_token = token,
        available_at = now() + lease
    WHERE e.id = ANY(ARRAY(SELECT c.id FROM candidates AS c))
        AND e.created_at = ANY(ARRAY(SELECT c.created_at FROM candidates AS c))
        AND e.created_at >= (SELECT min(c.created_at) FROM candidates AS c)
        AND e.created_at <= (SELECT max(c.created_at) FROM candidates AS c)
    RETURNING e.*;
END;
$$;
COMMENT ON FUNCTION outbox.claim(text, integer, interval) IS
'Claims up to batch_size due events (new, retry due, or lease expired) under a lease.';
-- end generated

-- generated from sql/30_outbox_api.sql: outbox.backlog
-- Backlog per context (QRY-050). "due" is what a relay could take right now;
-- oldest_due_age growing while due > 0 means no relay is making progress,
-- whereas a large unpublished count with nothing due is just parked retries.
-- The unfinished rows are read from the claim floor up (see claim).
CREATE OR REPLACE FUNCTION outbox.backlog(context text DEFAULT NULL)
RETURNS TABLE (
    context text,
    unpublished bigint,
    oldest_unpublished_at timestamptz,
    due bigint,
    oldest_due_age interval,
    processing bigint,
    failed bigint,
    dead_letter bigint
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(backlog.context);
    -- Two branches so that each is served by its own partial index.
    WITH unfinished AS (
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND e.id >= (
                -- (a standby cannot read an unlogged sequence: from the bottom there)
                SELECT CASE WHEN pg_is_in_recovery() THEN 0
                    ELSE coalesce(pg_sequence_last_value('outbox.claim_floor'), 0) END
            )
            AND (backlog.context IS NULL OR e.context = backlog.context)
        UNION ALL
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status = 'DEAD_LETTER'
            AND (backlog.context IS NULL OR e.context = backlog.context)
    ),
    contexts AS (
        SELECT DISTINCT u.context FROM unfinished AS u
        UNION
        SELECT backlog.context WHERE backlog.context IS NOT NULL
    )
    SELECT
        c.context,
        count(u.status) FILTER (WHERE u.status <> 'DEAD_LETTER'),
        min(u.created_at) FILTER (WHERE u.status <> 'DEAD_LETTER'),
        count(u.status) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now()),
        -- greatest(): a row stored by an older version with available_at
        -- -infinity is due and very old, not an error (interval has no infinity).
        now() - greatest(
            min(u.available_at) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now()),
            timestamptz '0001-01-01 00:00:00+00'
        ),
        count(u.status) FILTER (WHERE u.status = 'PROCESSING'),
        count(u.status) FILTER (WHERE u.status = 'FAILED'),
        count(u.status) FILTER (WHERE u.status = 'DEAD_LETTER')
    FROM contexts AS c
    LEFT JOIN unfinished AS u ON u.context = c.context
    GROUP BY c.context
    ORDER BY c.context;
$$;
COMMENT ON FUNCTION outbox.backlog(text) IS
'Per context: unpublished count and oldest, due count and age of the oldest due, by status.';
-- end generated

-- generated from sql/30_outbox_api.sql: outbox.oldest_snapshots
-- The oldest snapshot that keeps vacuum from removing pgoutbox's dead rows,
-- and what holds it, oldest first: sessions of this database (and WAL
-- senders: a standby's hot_standby_feedback) by backend_xmin, replication
-- slots by xmin and catalog_xmin (the catalog's horizon only), prepared
-- transactions by their xid. The age in xids orders them; the age in seconds
-- runs from the session's transaction start (an upper bound under READ
-- COMMITTED, where the snapshot is the running statement's) or from the
-- PREPARE, and is NULL for a slot (a slot records no time). Never query text.
-- SECURITY DEFINER: reading other sessions' backend_xmin takes the owner's
-- right (superuser, or pg_read_all_stats).
CREATE OR REPLACE FUNCTION outbox.oldest_snapshots(max_rows integer DEFAULT 5)
RETURNS TABLE (
    kind text,
    age_xids integer,
    age_seconds double precision,
    pid integer,
    slot_name text,
    gid text,
    application_name text,
    state text,
    xact_start timestamptz
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_max_rows(oldest_snapshots.max_rows);
    SELECT h.kind, h.age_xids, h.age_seconds, h.pid, h.slot_name, h.gid, h.application_name, h.state, h.xact_start
    FROM (
        SELECT
            'session' AS kind, age(a.backend_xmin) AS age_xids,
            extract(epoch FROM now() - coalesce(a.xact_start, a.backend_start))::double precision AS age_seconds,
            a.pid, NULL::text AS slot_name, NULL::text AS gid, a.application_name, a.state, a.xact_start
        FROM pg_stat_activity AS a
        WHERE a.backend_xmin IS NOT NULL
            AND a.pid <> pg_backend_pid()
            AND (a.datname = current_database() OR a.backend_type = 'walsender')
        UNION ALL
        SELECT 'slot', age(s.xmin), NULL, s.active_pid, s.slot_name::text, NULL, NULL, NULL, NULL
        FROM pg_replication_slots AS s
        WHERE s.xmin IS NOT NULL
        UNION ALL
        SELECT 'slot catalog', age(s.catalog_xmin), NULL, s.active_pid, s.slot_name::text, NULL, NULL, NULL, NULL
        FROM pg_replication_slots AS s
        WHERE s.catalog_xmin IS NOT NULL
        UNION ALL
        SELECT
            'prepared', age(p.transaction), extract(epoch FROM now() - p.prepared)::double precision,
            NULL, NULL, p.gid, NULL, NULL, p.prepared
        FROM pg_prepared_xacts AS p
    ) AS h
    ORDER BY h.age_xids DESC, h.age_seconds DESC NULLS LAST
    LIMIT oldest_snapshots.max_rows;
$$;
COMMENT ON FUNCTION outbox.oldest_snapshots(integer) IS
'What holds back vacuum of pgoutbox''s tables, oldest first: sessions, replication slots, prepared transactions.';
-- end generated

REVOKE ALL ON FUNCTION outbox._claim_floor(), outbox.tg_events__lower_claim_floor(),
outbox.oldest_snapshots(integer) FROM public;
GRANT EXECUTE ON FUNCTION outbox.oldest_snapshots(integer)
TO pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin, pgoutbox_viewer;

-- ---- the console

INSERT INTO outbox.schema_migrations (version, name)
VALUES (18, '0018_steady_under_faults')
ON CONFLICT (version) DO NOTHING;

COMMIT;
