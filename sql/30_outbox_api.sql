-- The outbox API: emit (apps), claim / mark_published / mark_failed (relays),
-- requeue (operators), backlog (everyone who watches).
--
-- Every function checks all its arguments before it acts and refuses bad
-- ones with a code (docs/reference.md, "Error codes" and "Limits"), never
-- with one of PostgreSQL's own error classes (the argument checks shared with
-- inbox are in sql/05_helpers.sql).

-- Emits one event inside the caller's transaction and returns its event_id.
-- Rolled back with the business change, it never existed.
CREATE OR REPLACE FUNCTION outbox.emit(
    aggregate_type text,
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
    occurred_at timestamptz DEFAULT NULL
)
RETURNS uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    new_id uuid := gen_random_uuid();
BEGIN
    -- Per-key order is id order; holding a per-key lock until commit makes id
    -- order equal commit order, so a relay never sees a later event of a key
    -- while an earlier one is still uncommitted (and so invisible to claim).
    IF emit.ordering_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('pgoutbox.key:' || emit.ordering_key, 0));
    END IF;
    INSERT INTO outbox.events (
        event_id, context, aggregate_type, aggregate_id, event_type, event_version,
        payload, headers, correlation_id, causation_id, tenant_id, ordering_key,
        occurred_at
    ) VALUES (
        new_id,
        coalesce(emit.context, nullif(current_setting('pgoutbox.context', true), '')),
        emit.aggregate_type, emit.aggregate_id, emit.event_type, emit.event_version,
        emit.payload, emit.headers, emit.correlation_id, emit.causation_id,
        emit.tenant_id, emit.ordering_key, coalesce(emit.occurred_at, now())
    );
    RETURN new_id;
END;
$$;
COMMENT ON FUNCTION outbox.emit(
    text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz
) IS 'Writes an event in the caller''s transaction; returns its event_id (the Nats-Msg-Id).';

-- Moves the claim floor (outbox.claim_floor, 10_outbox_events.sql) up
-- behind the claimable rows and returns it; claim() calls it first. A step at
-- a time, by one claimer at a time (the floor's advisory lock; the others use
-- the floor as it stands), under READ COMMITTED (a snapshot per statement):
--   1. a candidate C: the lowest claimable id at or above the floor, at most
--      the last id events_id_seq gave out + 1 (so that new ids stay above
--      it). It is published (claim_floor_next), and only then does this
--      transaction take its own transaction id X (claim_floor_wait);
--   2. at a later claim, once no transaction with an id up to X is running
--      (the snapshot's xmin > X): the floor becomes the lowest claimable id
--      below C, read in a snapshot taken after that, or C.
-- Why no claimable row ends below the floor, whatever stalls or fails:
-- every INSERT takes its transaction id, then reads the candidate, then the
-- floor (the policy trigger, outbox.tg_events__check_policies), and an id
-- below either lowers them under the floor's lock. An INSERT T of an id
-- below C either read the candidate after C was published, and lowers the
-- floor (it waits for the lock if step 2 holds it, and comes after it); or
-- read it before, so its transaction id came before X (ids are handed out
-- in order) and T ended before step 2 (X's transaction has ended, so the
-- snapshot's xmax is above X and every running id up to X counts in its
-- xmin), whose snapshot then sees T's row as it is.
-- The same holds for a row made claimable again (requeue,
-- requeue_completed): _200_lower_claim_floor takes the lock. Not the
-- snapshot's xmax: it is the latest ended id + 1, and a commit waiting for
-- a synchronous standby keeps a run of ids above it running, whose rows
-- the floor passed. Not a time: a stalled INSERT is still running. A
-- transaction that had its id before step 1 takes no candidate (X would
-- come before the publication). A crash or a promotion resets the unlogged
-- sequences: the floor reads 0 and the candidate is gone.
CREATE OR REPLACE FUNCTION outbox._claim_floor()
RETURNS bigint
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
SET plan_cache_mode TO force_generic_plan
SET enable_seqscan TO off
AS $$
DECLARE
    -- unset (a crash, a promotion): from the lowest id there is
    floor_id bigint := coalesce(pg_sequence_last_value('outbox.claim_floor'), -9223372036854775807 - 1);
    next_id bigint;
    wait_xid bigint;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed'
        OR NOT pg_try_advisory_xact_lock(hashtextextended('pgoutbox.claim_floor', 0)) THEN
        RETURN floor_id;
    END IF;
    floor_id := coalesce(pg_sequence_last_value('outbox.claim_floor'), floor_id);
    next_id := pg_sequence_last_value('outbox.claim_floor_next');
    IF next_id IS NULL THEN
        IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
            RETURN floor_id;
        END IF;
        SELECT least(min(e.id), coalesce(pg_sequence_last_value('outbox.events_id_seq'), 0) + 1) INTO next_id
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
            AND e.id >= floor_id;
        IF next_id > floor_id THEN
            -- An abort between these leaves the wait at its maximum: step 2
            -- then drops the candidate.
            PERFORM setval('outbox.claim_floor_wait', 9223372036854775807);
            PERFORM setval('outbox.claim_floor_next', next_id);
            PERFORM setval('outbox.claim_floor_wait', pg_current_xact_id()::text::bigint);
        END IF;
        RETURN floor_id;
    END IF;
    wait_xid := pg_sequence_last_value('outbox.claim_floor_wait');
    IF wait_xid IS NULL OR wait_xid = 9223372036854775807 THEN
        PERFORM setval('outbox.claim_floor_next', 1, FALSE);
        RETURN floor_id;
    END IF;
    IF pg_snapshot_xmin(pg_current_snapshot())::text::bigint <= wait_xid THEN
        RETURN floor_id;
    END IF;
    SELECT coalesce(min(e.id), next_id) INTO floor_id
    FROM outbox.events AS e
    WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
        AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
        AND e.id >= floor_id AND e.id < next_id;
    PERFORM setval('outbox.claim_floor', floor_id), setval('outbox.claim_floor_next', 1, FALSE);
    RETURN floor_id;
END;
$$;

-- Claims up to batch_size due events for worker, under a lease, and returns
-- them with a fresh claim token. Scheduled events fallen due first, then the
-- rest of the batch, each one statement (the second is the claim proper);
-- the first runs only when a probe finds one (below), so that a claim costs
-- what it did without them:
--   * scheduled events waiting for their time lie in events_scheduled_idx,
--     by time, not in the id-ordered walk (10_outbox_events.sql). Those
--     fallen due (a range of that index that holds only what is due, however
--     many wait for later) are taken in due order, and each takes a new id
--     from the events' sequence as it moves to PROCESSING: it joins the
--     id-ordered queue now, above the claim floor, where a lease that
--     expires finds it like any other. Why the new id never falls below
--     the floor: the claim takes its transaction id first (after
--     _claim_floor), then locks and renumbers; a candidate floor published
--     before the new id was drawn lies at most at the sequence's value
--     then + 1, below it; one published after belongs to a step 2 that
--     waits for this transaction's id, and so sees the row. A separate
--     statement behind an EXISTS probe (about 30 µs over a week of
--     partitions): as a CTE of the claim, that scan and its UPDATE cost
--     every claim about 200 µs (a probe and an UPDATE prepared over every
--     partition), which a claim of five events at moderate rates felt;
--   * fair between tenants when there is a backlog, as one statement of two
--     lanes. Oldest first alone, a tenant that commits a backlog (an import,
--     a replay) would hold every other tenant's events behind it until it
--     drained. So when more ids were given out above the claim floor than
--     the batch takes (a backlog; a test of two sequences), the tenant lane
--     steps from one tenant with waiting due rows to the next in
--     events_tenant_waiting_idx (a loose scan, one descent per tenant: a
--     tenant with nothing due costs nothing; from after the last tenant this
--     session's previous claim met, so that with more tenants than the
--     batch has rows every tenant comes round), gives each tenant a share
--     of the batch by weight (outbox.tenant_weights, 1 if not set) and
--     takes the share from that tenant's own range, weighted rounds
--     deciding when the rounded shares add up to more. Without a backlog
--     the tenant lane is skipped (its anchor is gated by the test), and a
--     claim costs what it did; with one tenant met, its share is 0 and the
--     id lane takes its rows as before. In-flight rows are not in that
--     index, so that neither the step nor a share walks a backlog's
--     thousands of claimed rows. A share's ORDER BY (tenant DESC, id) is
--     an order only that index gives (read backwards): with ORDER BY id
--     the generic plan walked events_claimable_idx, filtering by tenant.
--     created_at <= now() prunes, at run time, the partitions made ahead,
--     whose indexes every step and share would otherwise descend too (a
--     row dated ahead, which only an owner's INSERT can make, is left to
--     the id lane);
--   * the id lane takes the rest of the batch, at least one row, in id order
--     from events_claimable_idx: the oldest due events (expired leases
--     too, which only this lane sees), so nothing waits for ever however
--     many tenants share the batch. Both lanes lock FOR UPDATE SKIP LOCKED,
--     so concurrent claimers walk past each other's rows instead of
--     queueing on them; LIMIT bounds the batch (what the scheduled events
--     left of it);
--   * the batch comes back each tenant's first event first, then each
--     one's second, ...: the relay publishes in that order, so that a
--     tenant with a few due events is published at the head of the
--     batch, not behind a backlog's share;
--   * both lanes start at the claim floor (outbox._claim_floor, moved up
--     just before): below it nothing is claimable, only the index entries
--     of finished events, which a snapshot held by another session keeps
--     from vacuum, and the walk stays as short with it as without (in the
--     tenant index the floor bounds the id within a tenant, so a share
--     starts above it; a step lands on a tenant's newest entry, and passes
--     the entries below the floor on the index page, without a heap visit,
--     only for a tenant with nothing waiting);
--   * available_at <= now() covers all three sources at once: new events,
--     failed events whose retry time has come, and expired leases;
--   * an event with an ordering_key is taken only when no earlier event of
--     its key is unfinished (not COMPLETED), so at most one event per key is
--     in flight and a FAILED or DEAD_LETTER event holds its successors back.
--     The keys' heads (each key's first unfinished event) are found first,
--     by a loose scan of the key index (one seek per key, up to batch_size
--     keys): a keyed row is then a head or not by a look-up in that array,
--     where probing the index for each row of a keyed backlog made a claim
--     walk the whole backlog at an index probe per row to find one event
--     per key. With more keys than batch_size the heads are not gathered
--     and each keyed row is probed as before;
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
--     probed once per id;
--   * jit is off: the generic plan of the heads' recursion is costed above
--     jit_above_cost, and compiling it took seconds at every claim.
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
SET jit TO off
AS $$
DECLARE
    token uuid := gen_random_uuid();
    floor_id bigint;
    released integer := 0;
    fair boolean;
    after_tenant text COLLATE "C" := coalesce(current_setting('pgoutbox.claim_after_tenant', TRUE), '');
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
    IF EXISTS (
        SELECT 1
        FROM outbox.events AS e
        WHERE e.status = 'PENDING' AND e.claimed_at IS NULL AND e.ordering_key IS NULL
            AND e.available_at > e.created_at
            AND e.available_at <= now()
    ) THEN
        PERFORM pg_current_xact_id();  -- before a new id is drawn (above)
        RETURN QUERY
        WITH due AS (
            SELECT e.id, e.created_at
            FROM outbox.events AS e
            WHERE e.status = 'PENDING' AND e.claimed_at IS NULL AND e.ordering_key IS NULL
                AND e.available_at > e.created_at
                AND e.available_at <= now()
            ORDER BY e.available_at
            LIMIT batch_size
            FOR UPDATE OF e SKIP LOCKED
        )
        UPDATE outbox.events AS e
        SET id = DEFAULT,
            status = 'PROCESSING',
            attempts = e.attempts + 1,
            claimed_at = now(),
            claimed_by = worker,
            claim_token = token,
            available_at = now() + lease
        WHERE e.id = ANY(ARRAY(SELECT d.id FROM due AS d))
            AND e.created_at = ANY(ARRAY(SELECT d.created_at FROM due AS d))
            AND e.created_at >= (SELECT min(d.created_at) FROM due AS d)
            AND e.created_at <= (SELECT max(d.created_at) FROM due AS d)
        RETURNING e.*;
        GET DIAGNOSTICS released = ROW_COUNT;
        IF released = batch_size THEN
            RETURN;
        END IF;
    END IF;
    -- More ids given out above the floor than this claim takes: a backlog,
    -- which oldest first would serve alone until it drains (see above).
    fair := coalesce(pg_sequence_last_value('outbox.events_id_seq'), 0) - (batch_size - released) > floor_id;
    RETURN QUERY
    WITH RECURSIVE heads (ordering_key, id, n) AS (
        (
            SELECT k.ordering_key, k.id, 1
            FROM outbox.events AS k
            WHERE k.ordering_key IS NOT NULL AND k.status <> 'COMPLETED'
            ORDER BY k.ordering_key, k.id
            LIMIT 1
        )
        UNION ALL
        SELECT nk.ordering_key, nk.id, h.n + 1
        FROM heads AS h
        CROSS JOIN LATERAL (
            SELECT k.ordering_key, k.id
            FROM outbox.events AS k
            WHERE k.ordering_key > h.ordering_key AND k.status <> 'COMPLETED'
            ORDER BY k.ordering_key, k.id
            LIMIT 1
        ) AS nk
        WHERE h.n <= batch_size
    ),
    head_ids AS (
        -- NULL: more keys than batch_size, probe each keyed row instead
        SELECT CASE WHEN count(*) <= batch_size THEN coalesce(array_agg(h.id), '{}') END AS ids
        FROM heads AS h
    ),
    -- the tenants with due rows waiting (not in flight), from the one after
    -- the last tenant the previous claim of this session met, wrapping
    -- round: one descent each, as many as the batch has rows for them. Each
    -- step lands on the tenant's newest entry (the index holds ids
    -- descending), where a tenant with due rows has them, not on the oldest,
    -- where it has the entries of every event it finished since vacuum
    -- last ran (a snapshot held by another session keeps them)
    tenants (tkey, wrapped, n) AS (
        (
            SELECT f.tkey, f.wrapped, 1
            FROM (
                (
                    SELECT (coalesce(e.tenant_id, '') COLLATE "C") AS tkey, FALSE AS wrapped
                    FROM outbox.events AS e
                    WHERE fair
                        AND e.status IN ('PENDING', 'FAILED')
                        AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
                        AND e.available_at <= now()
                        AND e.created_at <= now()
                        AND (coalesce(e.tenant_id, '') COLLATE "C") > after_tenant
                        AND e.id >= floor_id
                    ORDER BY (coalesce(e.tenant_id, '') COLLATE "C"), e.id DESC
                    LIMIT 1
                )
                UNION ALL
                (
                    SELECT (coalesce(e.tenant_id, '') COLLATE "C"), TRUE
                    FROM outbox.events AS e
                    WHERE fair
                        AND e.status IN ('PENDING', 'FAILED')
                        AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
                        AND e.available_at <= now()
                        AND e.created_at <= now()
                        AND e.id >= floor_id
                    ORDER BY (coalesce(e.tenant_id, '') COLLATE "C"), e.id DESC
                    LIMIT 1
                )
            ) AS f
            LIMIT 1
        )
        UNION ALL
        SELECT nt.tkey, nt.wrapped, t.n + 1
        FROM tenants AS t
        CROSS JOIN LATERAL (
            SELECT f.tkey, f.wrapped
            FROM (
                (
                    SELECT (coalesce(e.tenant_id, '') COLLATE "C") AS tkey, t.wrapped
                    FROM outbox.events AS e
                    WHERE e.status IN ('PENDING', 'FAILED')
                        AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
                        AND e.available_at <= now()
                        AND e.created_at <= now()
                        AND (coalesce(e.tenant_id, '') COLLATE "C") > t.tkey
                        AND e.id >= floor_id
                    ORDER BY (coalesce(e.tenant_id, '') COLLATE "C"), e.id DESC
                    LIMIT 1
                )
                UNION ALL
                (
                    SELECT (coalesce(e.tenant_id, '') COLLATE "C"), TRUE
                    FROM outbox.events AS e
                    WHERE NOT t.wrapped
                        AND e.status IN ('PENDING', 'FAILED')
                        AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
                        AND e.available_at <= now()
                        AND e.created_at <= now()
                        AND e.id >= floor_id
                    ORDER BY (coalesce(e.tenant_id, '') COLLATE "C"), e.id DESC
                    LIMIT 1
                )
            ) AS f
            LIMIT 1
        ) AS nt
        WHERE t.n < batch_size - released - 1 AND NOT (nt.wrapped AND nt.tkey > after_tenant)
    ),
    shares AS (
        SELECT
            t.tkey,
            coalesce(w.weight, 1) AS weight,
            CASE
                WHEN count(*) OVER () > 1
                    THEN ceil((batch_size - released - 1) * coalesce(w.weight, 1)::numeric / sum(coalesce(w.weight, 1)) OVER ())::integer
                ELSE 0  -- one tenant: the id lane takes its rows as well
            END AS share
        FROM tenants AS t
        LEFT JOIN outbox.tenant_weights AS w ON w.tenant_key = t.tkey
    ),
    -- each tenant's share, its oldest due rows, from its own range, from
    -- the floor up
    shared AS (
        SELECT s.tkey, s.weight, c.id, c.created_at
        FROM shares AS s
        CROSS JOIN head_ids AS hi
        CROSS JOIN LATERAL (
            SELECT e.id, e.created_at
            FROM outbox.events AS e
            WHERE e.status IN ('PENDING', 'FAILED')
                AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
                AND (coalesce(e.tenant_id, '') COLLATE "C") = s.tkey
                AND e.id >= floor_id
                AND e.available_at <= now()
                AND e.created_at <= now()
                AND (
                    e.ordering_key IS NULL
                    OR CASE
                        WHEN hi.ids IS NOT NULL THEN e.id = ANY(hi.ids)
                        ELSE NOT EXISTS (
                            SELECT 1
                            FROM outbox.events AS earlier
                            WHERE earlier.ordering_key = e.ordering_key
                                AND earlier.id < e.id
                                AND earlier.status <> 'COMPLETED'
                        )
                    END
                )
            ORDER BY (coalesce(e.tenant_id, '') COLLATE "C") DESC, e.id
            LIMIT s.share
            FOR UPDATE OF e SKIP LOCKED
        ) AS c
    ),
    -- by weighted rounds (a tenant of weight w takes its next row every 1/w)
    -- when the shares, rounded up, add up to more; one row is left to the
    -- id order below, so that the oldest due event (an expired lease, a
    -- retry) is taken at every claim however many tenants share the rest
    fair_part AS (
        SELECT r.id, r.created_at
        FROM (
            SELECT sh.id, sh.created_at, sh.weight, row_number() OVER (PARTITION BY sh.tkey ORDER BY sh.id) AS rn
            FROM shared AS sh
        ) AS r
        ORDER BY (r.rn - 1)::float8 / r.weight, r.id
        LIMIT batch_size - released - 1
    ),
    -- what the shares left, in id order from the claim floor (the oldest
    -- first): the tenants whose due rows outnumber their share, the rows
    -- of tenants not met, and expired leases (in flight, so not in the
    -- tenant index)
    rest AS (
        SELECT e.id, e.created_at
        FROM outbox.events AS e
        CROSS JOIN head_ids AS hi
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
            AND e.id >= floor_id
            AND e.available_at <= now()
            AND (
                e.ordering_key IS NULL
                OR CASE
                    WHEN hi.ids IS NOT NULL THEN e.id = ANY(hi.ids)
                    ELSE NOT EXISTS (
                        SELECT 1
                        FROM outbox.events AS earlier
                        WHERE earlier.ordering_key = e.ordering_key
                            AND earlier.id < e.id
                            AND earlier.status <> 'COMPLETED'
                    )
                END
            )
            AND NOT e.id = ANY(ARRAY(SELECT fp.id FROM fair_part AS fp))
        ORDER BY e.id
        LIMIT batch_size - released - (SELECT count(*) FROM fair_part)
        FOR UPDATE OF e SKIP LOCKED
    ),
    picked AS (
        SELECT fp.id, fp.created_at FROM fair_part AS fp
        UNION ALL
        SELECT r.id, r.created_at FROM rest AS r
    ),
    claimed AS (
        UPDATE outbox.events AS e
        SET status = 'PROCESSING',
            attempts = e.attempts + 1,
            claimed_at = now(),
            claimed_by = worker,
            claim_token = token,
            available_at = now() + lease
        WHERE e.id = ANY(ARRAY(SELECT p.id FROM picked AS p))
            AND e.created_at = ANY(ARRAY(SELECT p.created_at FROM picked AS p))
            AND e.created_at >= (SELECT min(p.created_at) FROM picked AS p)
            AND e.created_at <= (SELECT max(p.created_at) FROM picked AS p)
        RETURNING e AS ev, e.id, e.tenant_id
    ),
    -- where the next claim of this session starts its step (session-wide:
    -- a claim is a transaction of its own)
    resume AS (
        SELECT set_config('pgoutbox.claim_after_tenant', coalesce((SELECT t.tkey FROM tenants AS t ORDER BY t.n DESC LIMIT 1), after_tenant), FALSE)
    )
    -- each tenant's first event, then each one's second, ...: a tenant with
    -- a few due events is published at the head of the batch, not behind
    -- a backlog's share
    SELECT (x.ev).*
    FROM (
        SELECT c.ev, c.id, row_number() OVER (PARTITION BY coalesce(c.tenant_id, '') ORDER BY c.id) AS rn
        FROM claimed AS c
    ) AS x
    CROSS JOIN resume
    ORDER BY x.rn, x.id;
END;
$$;
COMMENT ON FUNCTION outbox.claim(text, integer, interval) IS
'Claims up to batch_size due events (new, retry due, or lease expired) under a lease.';

-- Sets a tenant's weight in fair claims (claim above): a claim that meets
-- several tenants gives each a share of its batch in proportion to its
-- weight, 1 for every tenant not set. tenant_id NULL names the events
-- without a tenant. Weight 1 removes the setting. Every change is written to
-- outbox.tenant_weight_log with the caller and the reason, and logged.
-- Returns the weight it had.
CREATE OR REPLACE FUNCTION outbox.set_tenant_weight(tenant_id text, weight integer, reason text)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    tkey text COLLATE "C" := coalesce(set_tenant_weight.tenant_id, '');
    before integer;
BEGIN
    IF set_tenant_weight.tenant_id IS NOT NULL
        AND (set_tenant_weight.tenant_id ~ '[\r\n]|^\s|\s$|^$' OR length(set_tenant_weight.tenant_id) > 255) THEN
        RAISE EXCEPTION 'INVALID_TENANT: tenant_id % is not one emit accepts (1-255 characters, no CR / LF, no white space at either end)', quote_literal(left(set_tenant_weight.tenant_id, 100))
            USING ERRCODE = 'OB027';
    END IF;
    IF weight IS NULL OR weight < 1 OR weight > 1000 THEN
        RAISE EXCEPTION 'INVALID_TENANT_WEIGHT: weight must be between 1 and 1000, got %', coalesce(weight::text, 'NULL')
            USING ERRCODE = 'OB026';
    END IF;
    PERFORM outbox._check_text(reason, 'a weight''s reason', 1000, TRUE);
    -- one change at a time per tenant, so that the log's before is right
    PERFORM pg_advisory_xact_lock(hashtextextended('pgoutbox.tenant_weight:' || tkey, 0));
    SELECT w.weight INTO before FROM outbox.tenant_weights AS w WHERE w.tenant_key = tkey;
    before := coalesce(before, 1);
    IF weight = 1 THEN
        DELETE FROM outbox.tenant_weights AS w WHERE w.tenant_key = tkey;
    ELSE
        INSERT INTO outbox.tenant_weights AS w (tenant_key, weight, changed_by)
        VALUES (tkey, weight, session_user)
        ON CONFLICT (tenant_key) DO UPDATE
        SET weight = excluded.weight, changed_at = now(), changed_by = excluded.changed_by;
    END IF;
    INSERT INTO outbox.tenant_weight_log (tenant_key, weight_before, weight_after, changed_by, reason)
    VALUES (tkey, before, weight, session_user, reason);
    RAISE LOG 'pgoutbox: tenant % weight % -> % by %: %',
        coalesce(quote_literal(set_tenant_weight.tenant_id), 'NULL (no tenant)'), before, weight, session_user, reason;
    RETURN before;
END;
$$;
COMMENT ON FUNCTION outbox.set_tenant_weight(text, integer, text) IS
'Sets a tenant''s weight (1-1000) in fair claims (admins), audited in outbox.tenant_weight_log.';

-- Marks the claim's events COMPLETED. Rows no longer held by claim_token (the
-- lease expired and another relay took them) are left alone: fencing. Returns
-- how many were marked; raises STALE_CLAIM when it could mark none of them.
-- (enable_seqscan off: see claim; the token's index probe in an empty
-- partition costs next to nothing. The status test in collation "C" makes
-- events_claim_token_idx the only index the plan can walk, whatever the
-- statistics say: sql/10_outbox_events.sql.)
CREATE OR REPLACE FUNCTION outbox.mark_published(
    claim_token uuid,
    event_ids uuid[]
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
    PERFORM outbox._check_claim(claim_token, event_ids);
    UPDATE outbox.events AS e
    SET status = 'COMPLETED', published_at = now(), last_error = NULL
    WHERE e.claim_token = mark_published.claim_token
        AND e.status = 'PROCESSING' COLLATE "C"  -- events_claim_token_idx only
        AND e.event_id = ANY(mark_published.event_ids);
    GET DIAGNOSTICS marked = ROW_COUNT;
    IF marked = 0 THEN
        PERFORM outbox._stale_claim(claim_token, event_ids, TRUE);
    END IF;
    RETURN marked;
END;
$$;
COMMENT ON FUNCTION outbox.mark_published(uuid, uuid[]) IS
'PROCESSING -> COMPLETED for the events still held by claim_token; returns the count.';

-- Records failed publishes. Parallel arrays: event_ids[i] failed with
-- errors[i]; it becomes FAILED, due again at retry_at[i], or DEAD_LETTER when
-- retry_at[i] is NULL (the relay's retry policy decided to give up). A retry
-- time lies at most 30 days ahead: further is a parked event nobody sees.
CREATE OR REPLACE FUNCTION outbox.mark_failed(
    claim_token uuid,
    event_ids uuid[],
    errors text[],
    retry_at timestamptz[]
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
    PERFORM outbox._check_claim(claim_token, event_ids);
    IF cardinality(event_ids) IS DISTINCT FROM cardinality(errors)
        OR cardinality(event_ids) IS DISTINCT FROM cardinality(retry_at)
        OR array_ndims(errors) > 1 OR array_ndims(retry_at) > 1 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: event_ids, errors and retry_at must be one-dimensional and of the same length'
            USING ERRCODE = 'OB006';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(errors) AS x (err) WHERE nullif(btrim(x.err), '') IS NULL) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: every failure needs an error text'
            USING ERRCODE = 'OB006';
    END IF;
    IF EXISTS (
        SELECT 1 FROM unnest(retry_at) AS r (at)
        WHERE NOT (r.at >= '1900-01-01 00:00:00+00' AND r.at <= now() + interval '30 days')
    ) THEN
        RAISE EXCEPTION 'TIMESTAMP_OUT_OF_RANGE: every retry_at must be NULL (dead letter) or a finite time at most 30 days ahead'
            USING ERRCODE = 'OB008';
    END IF;
    UPDATE outbox.events AS e
    SET status = CASE WHEN f.retry_at IS NULL THEN 'DEAD_LETTER' ELSE 'FAILED' END,
        last_error = outbox._clip_error(f.error),
        available_at = coalesce(f.retry_at, e.available_at)
    FROM unnest(event_ids, errors, retry_at) AS f (event_id, error, retry_at)
    WHERE e.claim_token = mark_failed.claim_token
        AND e.status = 'PROCESSING' COLLATE "C"  -- events_claim_token_idx only
        AND e.event_id = f.event_id;
    GET DIAGNOSTICS marked = ROW_COUNT;
    IF marked = 0 THEN
        PERFORM outbox._stale_claim(claim_token, event_ids, FALSE);
    END IF;
    RETURN marked;
END;
$$;
COMMENT ON FUNCTION outbox.mark_failed(uuid, uuid[], text[], timestamptz[]) IS
'PROCESSING -> FAILED (retry at retry_at[i]) or DEAD_LETTER (retry_at[i] NULL); returns the count.';

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
    PERFORM outbox._check_claim(claim_token, event_ids);
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
        AND e.status = 'PROCESSING' COLLATE "C"  -- events_claim_token_idx only
        AND e.event_id = ANY(hand_back.event_ids);
    GET DIAGNOSTICS marked = ROW_COUNT;
    PERFORM set_config('pgoutbox.hand_back', '', TRUE);
    IF marked = 0 THEN
        PERFORM outbox._stale_claim(claim_token, event_ids, FALSE);
    END IF;
    RETURN marked;
END;
$$;
COMMENT ON FUNCTION outbox.hand_back(uuid, uuid[], text) IS
'PROCESSING -> PENDING, due now, with the claim''s attempt undone (the broker did not answer); returns the count.';

-- What a relay's mark (mark_published, mark_failed, hand_back) names: its
-- claim's token and the ids of the events it marks (_check_ids).
CREATE OR REPLACE FUNCTION outbox._check_claim(claim_token uuid, event_ids uuid[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF claim_token IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: claim_token is required' USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_ids(event_ids, 'event_ids');
END;
$$;

-- A mark that found none of the given events still held by its claim: the
-- lease expired and another relay re-claimed them (mark_published's error
-- says so; a relay that gets it from mark_failed or hand_back has nothing
-- left to undo either).
CREATE OR REPLACE FUNCTION outbox._stale_claim(claim_token uuid, event_ids uuid[], with_hint boolean)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF with_hint THEN
        RAISE EXCEPTION 'STALE_CLAIM: claim % holds none of the % given events', claim_token, cardinality(event_ids)
            USING ERRCODE = 'OB013',
                  HINT = 'The lease expired and another relay re-claimed them; it will publish them (deduplicated by Nats-Msg-Id).';
    END IF;
    RAISE EXCEPTION 'STALE_CLAIM: claim % holds none of the % given events', claim_token, cardinality(event_ids)
        USING ERRCODE = 'OB013';
END;
$$;

-- Operator redrive: DEAD_LETTER -> PENDING with attempts reset, recorded in
-- outbox.requeue_log by the update guard. All or nothing.
CREATE OR REPLACE FUNCTION outbox.requeue(
    event_ids uuid[],
    reason text
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    bad uuid [];
    moved integer;
BEGIN
    PERFORM outbox._check_text(reason, 'a requeue''s reason', 1000, TRUE);
    PERFORM outbox._check_ids(event_ids, 'event_ids');
    SELECT array_agg(x.id) INTO bad
    FROM unnest(event_ids) AS x (id)
    WHERE NOT EXISTS (
        SELECT 1 FROM outbox.events AS e
        WHERE e.event_id = x.id AND e.status = 'DEAD_LETTER'
    );
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'NOT_DEAD_LETTER: % of the given events are unknown or not DEAD_LETTER', cardinality(bad)
            USING ERRCODE = 'OB015', DETAIL = array_to_string(bad, ', ');
    END IF;
    PERFORM set_config('pgoutbox.requeue_reason', reason, true);
    UPDATE outbox.events AS e
    SET status = 'PENDING', attempts = 0, available_at = now()
    WHERE e.event_id = ANY(requeue.event_ids) AND e.status = 'DEAD_LETTER';
    GET DIAGNOSTICS moved = ROW_COUNT;
    PERFORM set_config('pgoutbox.requeue_reason', '', true);
    RETURN moved;
END;
$$;
COMMENT ON FUNCTION outbox.requeue(uuid[], text) IS
'DEAD_LETTER -> PENDING for the given events (all or nothing), audited in outbox.requeue_log.';

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
    -- Three branches so that each is served by its own partial index (the
    -- scheduled events' one is not walked from the floor: they keep their
    -- ids until claimed). A discarded dead letter (outbox.discarded_events)
    -- is parked for good: counted nowhere here.
    WITH unfinished AS (
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status = 'PENDING' AND e.claimed_at IS NULL AND e.ordering_key IS NULL
            AND e.available_at > e.created_at
            AND (backlog.context IS NULL OR e.context = backlog.context)
        UNION ALL
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status IN ('PENDING', 'FAILED', 'PROCESSING')
            AND (e.status <> 'PENDING' OR e.claimed_at IS NOT NULL OR e.ordering_key IS NOT NULL OR e.available_at <= e.created_at)
            AND e.id >= (
                -- (a standby cannot read an unlogged sequence: from the bottom there)
                SELECT CASE WHEN pg_is_in_recovery() THEN -9223372036854775807 - 1
                    ELSE coalesce(pg_sequence_last_value('outbox.claim_floor'), -9223372036854775807 - 1) END
            )
            AND (backlog.context IS NULL OR e.context = backlog.context)
        UNION ALL
        SELECT e.context, e.status, e.created_at, e.available_at
        FROM outbox.events AS e
        WHERE e.status = 'DEAD_LETTER'
            AND (backlog.context IS NULL OR e.context = backlog.context)
            AND NOT EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = e.event_id)
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
        -- A row stored by an older version with available_at -infinity is
        -- due and very old, not an error (interval has no infinity); with
        -- nothing due, NULL (greatest() would skip the NULL and make it
        -- 2,000 years).
        now() - CASE
            WHEN min(u.available_at) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now())
                < timestamptz '0001-01-01 00:00:00+00' THEN timestamptz '0001-01-01 00:00:00+00'
            ELSE min(u.available_at) FILTER (WHERE u.status <> 'DEAD_LETTER' AND u.available_at <= now())
        END,
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

-- Dead-lettered events, newest first, for operators deciding what to requeue.
CREATE OR REPLACE FUNCTION outbox.dead_letters(
    context text DEFAULT NULL,
    max_rows integer DEFAULT 100
)
RETURNS TABLE (
    event_id uuid,
    context text,
    subject text,
    ordering_key text,
    attempts integer,
    last_error text,
    created_at timestamptz
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(dead_letters.context), outbox._check_max_rows(dead_letters.max_rows);
    SELECT e.event_id, e.context, e.subject, e.ordering_key, e.attempts, e.last_error, e.created_at
    FROM outbox.events AS e
    WHERE e.status = 'DEAD_LETTER'
        AND (dead_letters.context IS NULL OR e.context = dead_letters.context)
        -- discarded ones are parked for good (outbox.dlq_list shows them)
        AND NOT EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = e.event_id)
    ORDER BY e.id DESC
    LIMIT dead_letters.max_rows;
$$;
COMMENT ON FUNCTION outbox.dead_letters(text, integer) IS
'Dead-lettered events (newest first) with their last error; requeue them with outbox.requeue().';
