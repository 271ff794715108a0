-- 0016_dead_letter_operations (down): back to version 15: no dead-letter
-- operations, no discard, no pgoutbox_viewer grants. Refuses (OB091) while a
-- row is discarded (restore it first: version 15 knows no such state) or a
-- discard or restore is audited (the audit would be lost).
--
-- What it cannot undo: nothing is lost. The role pgoutbox_viewer stays (roles
-- are cluster-wide; another database may use it), without grants here.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 16) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
    IF to_regclass('outbox.discard_log') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.discard_log) OR EXISTS (SELECT 1 FROM inbox.discard_log) THEN
            RAISE EXCEPTION 'DATA_WOULD_BE_LOST: outbox.discard_log or inbox.discard_log holds audited discards'
                USING ERRCODE = 'OB091';
        END IF;
    END IF;
    IF EXISTS (SELECT 1 FROM outbox.events WHERE status = 'DISCARDED')
        OR EXISTS (SELECT 1 FROM inbox.messages WHERE status = 'DEAD_LETTER' AND dlq_metadata ? 'discarded') THEN
        RAISE EXCEPTION 'DATA_WOULD_BE_LOST: discarded dead letters exist; restore them first (outbox.dlq_restore)'
            USING ERRCODE = 'OB091';
    END IF;
END;
$$;

DROP FUNCTION IF EXISTS outbox.dlq_restore(jsonb, text, integer);
DROP FUNCTION IF EXISTS outbox.dlq_discard(jsonb, text, integer);
DROP FUNCTION IF EXISTS outbox.dlq_replay(jsonb, text, integer);
DROP FUNCTION IF EXISTS outbox._dlq_batch(jsonb, text, text, integer);
DROP FUNCTION IF EXISTS outbox.dlq_count(jsonb, text);
DROP FUNCTION IF EXISTS outbox._dlq_targets(jsonb, text);
DROP FUNCTION IF EXISTS outbox.dlq_show(text, uuid, text);
DROP FUNCTION IF EXISTS outbox.dlq_list(jsonb, integer, text);
DROP FUNCTION IF EXISTS outbox.dlq_summary();
DROP FUNCTION IF EXISTS outbox.dlq_groups(jsonb, integer);
DROP FUNCTION IF EXISTS outbox._dlq_rows(jsonb);
DROP FUNCTION IF EXISTS outbox._check_dlq_filter(jsonb);
DROP FUNCTION IF EXISTS outbox.dlq_error_pattern(text);
DROP FUNCTION IF EXISTS outbox.dlq_error_class(text);
DROP FUNCTION IF EXISTS outbox._dlq_error_pattern(text);
DROP FUNCTION IF EXISTS outbox._dlq_error_class(text);
DROP TABLE IF EXISTS outbox.discard_log;
DROP TABLE IF EXISTS inbox.discard_log;
DROP FUNCTION IF EXISTS outbox.tg_discard_log__append_only();
DROP INDEX IF EXISTS outbox.events_discarded_idx;
DROP INDEX IF EXISTS outbox.requeue_log_event_idx;
DROP INDEX IF EXISTS inbox.redrive_log_message_idx;

-- The definitions of version 15.
-- Every status move the trigger's WHEN clause (below) lets through: a no-op,
-- an operator requeue (of a dead letter, or of a COMPLETED event whose
-- message the broker lost), or an illegal move.
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

CREATE OR REPLACE FUNCTION inbox.tg_messages__guard_update()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF (NEW.message_id, NEW.handler, NEW.subject, NEW.envelope, NEW.received_at)
        IS DISTINCT FROM
       (OLD.message_id, OLD.handler, OLD.subject, OLD.envelope, OLD.received_at) THEN
        RAISE EXCEPTION 'IMMUTABLE_MESSAGE: message % for handler % is immutable once received', OLD.message_id, OLD.handler
            USING ERRCODE = 'OB011';
    END IF;
    -- Column by column: the generated context is still NULL in NEW here.
    IF (NEW.status, NEW.processed_at, NEW.attempts, NEW.last_error, NEW.dlq_metadata)
        IS NOT DISTINCT FROM
       (OLD.status, OLD.processed_at, OLD.attempts, OLD.last_error, OLD.dlq_metadata)
        OR (OLD.status, NEW.status) IN (
            ('RECEIVED', 'RECEIVED'), ('RECEIVED', 'PROCESSED'), ('RECEIVED', 'FAILED'),
            ('RECEIVED', 'DEAD_LETTER'), ('FAILED', 'FAILED'), ('FAILED', 'PROCESSED'),
            ('FAILED', 'DEAD_LETTER'), ('DEAD_LETTER', 'DEAD_LETTER'),
            ('DEAD_LETTER', 'RECEIVED')
        ) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'ILLEGAL_TRANSITION: message % for handler % cannot move from % to %', OLD.message_id, OLD.handler, OLD.status, NEW.status
        USING ERRCODE = 'OB010';
END;
$$;

-- QRY-051: unprocessed messages per context and handler.
CREATE OR REPLACE FUNCTION inbox.backlog(context text DEFAULT NULL)
RETURNS TABLE (
    context text,
    handler text,
    unprocessed bigint,
    oldest_unprocessed_at timestamptz,
    failed bigint,
    dead_letter bigint
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_context(backlog.context);
    SELECT
        m.context,
        m.handler,
        count(*) FILTER (WHERE m.status IN ('RECEIVED', 'FAILED')),
        min(m.received_at) FILTER (WHERE m.status IN ('RECEIVED', 'FAILED')),
        count(*) FILTER (WHERE m.status = 'FAILED'),
        count(*) FILTER (WHERE m.status = 'DEAD_LETTER')
    FROM inbox.messages AS m
    WHERE m.status <> 'PROCESSED'
        AND (backlog.context IS NULL OR m.context = backlog.context)
    GROUP BY m.context, m.handler
    ORDER BY m.context, m.handler;
$$;
COMMENT ON FUNCTION inbox.backlog(text) IS
'Per context and handler: unprocessed count and oldest, failed and dead-lettered counts.';

-- Takes up to batch_size dead letters whose replay is due and moves them back
-- to RECEIVED, counting the replay in dlq_metadata. The caller keeps its
-- transaction open until the replay messages are published, then commits:
--   * the consumer's inbox.receive() for a replayed message waits on these
--     row locks until the commit, so it cannot see the row still DEAD_LETTER
--     (and skip it as parked) by racing ahead of the commit;
--   * a replayer that dies before committing leaves the rows DEAD_LETTER and
--     due; whatever it had published is skipped as parked, and the next pass
--     publishes again (under new message ids, so JetStream does not drop it).
-- One statement: candidates are locked FOR UPDATE SKIP LOCKED in due order,
-- so two replayers walk past each other; messages_dead_letter_idx serves the
-- scan. A row is due when next_replay_at has passed and either an operator
-- asked for a redrive or automated replay is not switched off for its
-- handler. Rows without a stored envelope cannot be re-published.
CREATE OR REPLACE FUNCTION inbox.claim_replays(
    worker text,
    batch_size integer
)
RETURNS SETOF inbox.messages
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_text(worker, 'worker', 256);
    IF batch_size IS NULL OR batch_size < 1 OR batch_size > 10000 THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: batch_size must be between 1 and 10000, got %', batch_size
            USING ERRCODE = 'OB006';
    END IF;
    RETURN QUERY
    WITH candidates AS (
        SELECT
            m.message_id,
            m.handler,
            coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE) AS redrive
        FROM inbox.messages AS m
        WHERE m.status = 'DEAD_LETTER'
            AND m.envelope IS NOT NULL
            AND NOT m.dlq_metadata ? 'in_database'
            AND (m.dlq_metadata ->> 'next_replay_at')::timestamptz <= now()
            AND (
                coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE)
                OR NOT EXISTS (
                    SELECT 1
                    FROM inbox.replay_switches AS s
                    WHERE s.handler = m.handler AND NOT s.enabled
                )
            )
        ORDER BY (m.dlq_metadata ->> 'next_replay_at')::timestamptz, m.message_id
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    )
    UPDATE inbox.messages AS m
    SET status = 'RECEIVED',
        dlq_metadata = m.dlq_metadata || jsonb_build_object(
            CASE WHEN c.redrive THEN 'redrives' ELSE 'replay_attempts' END,
            coalesce(
                (m.dlq_metadata ->> CASE WHEN c.redrive THEN 'redrives' ELSE 'replay_attempts' END)::integer,
                0
            ) + 1,
            'next_replay_at', NULL,
            'redrive_requested', FALSE,
            'failures', 0,
            'last_replay_at', now(),
            'last_replay_by', worker
        )
    FROM candidates AS c
    WHERE m.message_id = c.message_id AND m.handler = c.handler
    RETURNING m.*;
END;
$$;
COMMENT ON FUNCTION inbox.claim_replays(text, integer) IS
'DEAD_LETTER -> RECEIVED for due replays and redrives; commit only after re-publishing them.';

-- Operator redrive: the given dead letters of handler (all of them when
-- message_ids is NULL) become due now, whatever the replay switch and cap
-- say; the replayer re-publishes them. All or nothing, with a reason,
-- written to inbox.redrive_log.
CREATE OR REPLACE FUNCTION inbox.redrive(
    handler text,
    message_ids uuid[],
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
    PERFORM outbox._check_text(reason, 'a redrive''s reason', 1000, TRUE);
    IF handler IS NULL OR handler !~ '^[A-Za-z0-9_.-]{1,128}$' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: a handler name ([A-Za-z0-9_.-], 1-128 chars) is required'
            USING ERRCODE = 'OB006';
    END IF;
    -- NULL means every dead letter of the handler; an array names some.
    IF message_ids IS NOT NULL THEN
        PERFORM outbox._check_ids(message_ids, 'message_ids');
    END IF;
    -- Lock first, so that the checks below still hold when the rows move.
    PERFORM 1 FROM inbox.messages AS m
    WHERE m.handler = redrive.handler
        AND (redrive.message_ids IS NULL OR m.message_id = ANY(redrive.message_ids))
    FOR UPDATE;
    SELECT array_agg(x.id) INTO bad
    FROM unnest(message_ids) AS x (id)
    WHERE NOT EXISTS (
        SELECT 1 FROM inbox.messages AS m
        WHERE m.message_id = x.id AND m.handler = redrive.handler AND m.status = 'DEAD_LETTER'
    );
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'MESSAGE_NOT_DEAD_LETTER: % of the given messages are unknown or not DEAD_LETTER for handler %', cardinality(bad), handler
            USING ERRCODE = 'OB030', DETAIL = array_to_string(bad, ', ');
    END IF;
    SELECT array_agg(m.message_id) INTO bad
    FROM inbox.messages AS m
    WHERE m.handler = redrive.handler AND m.status = 'DEAD_LETTER'
        AND (m.envelope IS NULL OR m.dlq_metadata ? 'in_database')
        AND (redrive.message_ids IS NULL OR m.message_id = ANY(redrive.message_ids));
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'MESSAGE_NOT_REPLAYABLE: % of the messages were written by an in-database handler or have no stored envelope to re-publish', cardinality(bad)
            USING ERRCODE = 'OB031', DETAIL = array_to_string(bad, ', '),
                  HINT = 'Rows written by in-database handlers are redriven by their own application.';
    END IF;
    WITH marked AS (
        UPDATE inbox.messages AS m
        SET dlq_metadata = m.dlq_metadata
            || jsonb_build_object('redrive_requested', TRUE, 'next_replay_at', now())
        WHERE m.handler = redrive.handler
            AND m.status = 'DEAD_LETTER'
            AND (redrive.message_ids IS NULL OR m.message_id = ANY(redrive.message_ids))
        RETURNING m.message_id, m.handler, m.dlq_metadata, m.last_error
    )
    INSERT INTO inbox.redrive_log (
        message_id, handler, redriven_by, reason, replay_attempts_before, last_error
    )
    SELECT
        k.message_id, k.handler, session_user, redrive.reason,
        coalesce((k.dlq_metadata ->> 'replay_attempts')::integer, 0), k.last_error
    FROM marked AS k;
    GET DIAGNOSTICS moved = ROW_COUNT;
    RETURN moved;
END;
$$;
COMMENT ON FUNCTION inbox.redrive(text, uuid[], text) IS
'Makes dead letters of a handler due for re-publication now (NULL ids: all), audited in inbox.redrive_log.';

-- Dead letters (newest first) with their replay state, for operators.
CREATE OR REPLACE FUNCTION inbox.dead_letters(
    handler text DEFAULT NULL,
    max_rows integer DEFAULT 100
)
RETURNS TABLE (
    message_id uuid,
    handler text,
    subject text,
    attempts integer,
    last_error text,
    dead_lettered_at timestamptz,
    replay_attempts integer,
    redrives integer,
    next_replay_at timestamptz,
    replay_enabled boolean
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._check_max_rows(dead_letters.max_rows);
    SELECT outbox._check_text(dead_letters.handler, 'handler', 128) WHERE dead_letters.handler IS NOT NULL;
    SELECT
        m.message_id,
        m.handler,
        m.subject,
        m.attempts,
        m.last_error,
        (m.dlq_metadata ->> 'dead_lettered_at')::timestamptz,
        coalesce((m.dlq_metadata ->> 'replay_attempts')::integer, 0),
        coalesce((m.dlq_metadata ->> 'redrives')::integer, 0),
        (m.dlq_metadata ->> 'next_replay_at')::timestamptz,
        coalesce(s.enabled, TRUE)
    FROM inbox.messages AS m
    LEFT JOIN inbox.replay_switches AS s ON s.handler = m.handler
    WHERE m.status = 'DEAD_LETTER'
        AND (dead_letters.handler IS NULL OR m.handler = dead_letters.handler)
    ORDER BY (m.dlq_metadata ->> 'dead_lettered_at')::timestamptz DESC NULLS LAST, m.message_id
    LIMIT dead_letters.max_rows;
$$;
COMMENT ON FUNCTION inbox.dead_letters(text, integer) IS
'Dead-lettered inbox messages with their replay state; redrive them with inbox.redrive().';

-- Day partitions of outbox.events whose day ended more than `retention` ago,
-- each with what holds it back, if anything. The default partition is never
-- listed: it is not a day, and sealing it would make the rows it exists to
-- catch fail instead.
CREATE OR REPLACE FUNCTION outbox.archivable_partitions(
    retention interval DEFAULT interval '7 days',
    dead_letter_retention interval DEFAULT interval '30 days'
)
RETURNS TABLE (
    partition_name text,
    day date,
    row_count bigint,
    open_rows bigint,
    dead_letters bigint,
    sealed boolean,
    eligible boolean,
    blocked_by text,
    audit_id bigint
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    part text;
BEGIN
    PERFORM outbox._check_retention(retention, 'retention');
    PERFORM outbox._check_retention(dead_letter_retention, 'dead_letter_retention');
    FOR part IN
        SELECT c.relname::text
        FROM pg_inherits AS i
        INNER JOIN pg_class AS c ON i.inhrelid = c.oid
        WHERE i.inhparent = 'outbox.events'::regclass AND c.relname ~ '^events_p[0-9]{8}$'
        ORDER BY c.relname
    LOOP
        day := outbox._partition_day(part);
        CONTINUE WHEN outbox._day_from(day + 1) > now() - retention;
        partition_name := part;
        EXECUTE format(
            'SELECT count(*),'
            ' count(*) FILTER (WHERE status IN (''PENDING'', ''PROCESSING'', ''FAILED'')),'
            ' count(*) FILTER (WHERE status = ''DEAD_LETTER'') FROM outbox.%I', part
        ) INTO row_count, open_rows, dead_letters;
        sealed := outbox._is_sealed(part);
        blocked_by := CASE
            WHEN open_rows > 0 THEN 'open rows (PENDING, PROCESSING or FAILED)'
            WHEN dead_letters > 0 AND outbox._day_from(day + 1) > now() - dead_letter_retention
                THEN 'dead letters younger than dead_letter_retention'
        END;
        eligible := blocked_by IS NULL;
        SELECT a.id INTO audit_id FROM outbox.archive_audit AS a
        WHERE a.source = 'outbox.events' AND a.day = archivable_partitions.day AND a.voided_at IS NULL;
        RETURN NEXT;
    END LOOP;
END;
$$;
COMMENT ON FUNCTION outbox.archivable_partitions(interval, interval) IS
'Day partitions old enough to archive, with row, open and dead-letter counts and what blocks each.';

-- Seals an eligible partition: checks it under a lock that keeps writers
-- out, then installs read-only triggers on it, so nothing can change between
-- the export and the drop (a requeue of one of its dead letters now fails
-- with ARCHIVED_READ_ONLY instead of being lost with the partition), and
-- lets pgoutbox_archiver read it. Idempotent. Returns what the export needs.
CREATE OR REPLACE FUNCTION outbox.seal_partition(
    partition_name text,
    retention interval DEFAULT interval '7 days',
    dead_letter_retention interval DEFAULT interval '30 days',
    lock_timeout interval DEFAULT interval '5 seconds'
)
RETURNS TABLE (
    day date,
    range_from timestamptz,
    range_to timestamptz,
    min_id bigint,
    max_id bigint
)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    has_open boolean;
    has_dead boolean;
BEGIN
    day := outbox._partition_day(partition_name);
    PERFORM outbox._check_retention(retention, 'retention');
    PERFORM outbox._check_retention(dead_letter_retention, 'dead_letter_retention');
    PERFORM outbox._check_lock_timeout(lock_timeout);
    range_from := outbox._day_from(day);
    range_to := outbox._day_from(day + 1);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key('outbox.events', day));
    IF NOT outbox._is_partition(partition_name) THEN
        RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: outbox.events has no partition %', partition_name
            USING ERRCODE = 'OB050';
    END IF;
    IF range_to > now() - retention THEN
        RAISE EXCEPTION 'RETENTION_NOT_REACHED: partition % (day %) is younger than the retention %', partition_name, day, retention
            USING ERRCODE = 'OB052';
    END IF;
    IF NOT outbox._is_sealed(partition_name) THEN
        -- SHARE ROW EXCLUSIVE (what CREATE TRIGGER takes anyway) keeps writers
        -- out from the check to the commit of the triggers.
        PERFORM outbox._with_lock_timeout(
            format('LOCK TABLE outbox.%I IN SHARE ROW EXCLUSIVE MODE', partition_name), lock_timeout
        );
    END IF;
    -- Index lookups only (events_claimable_idx, events_dead_letter_idx, the
    -- primary key): claims and marks lock every partition, so they wait for
    -- as long as this transaction holds the lock. No count here.
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM outbox.%1$I WHERE status IN (''PENDING'', ''FAILED'', ''PROCESSING'')),'
        ' EXISTS (SELECT 1 FROM outbox.%1$I WHERE status = ''DEAD_LETTER''),'
        ' (SELECT min(id) FROM outbox.%1$I), (SELECT max(id) FROM outbox.%1$I)',
        partition_name
    ) INTO has_open, has_dead, min_id, max_id;
    IF has_open THEN
        RAISE EXCEPTION 'NOT_CLOSED: partition % has rows still PENDING, PROCESSING or FAILED', partition_name
            USING ERRCODE = 'OB051', HINT = 'Only partitions whose rows are all terminal are archived.';
    END IF;
    IF has_dead AND range_to > now() - dead_letter_retention THEN
        RAISE EXCEPTION 'RETENTION_NOT_REACHED: partition % holds dead letters younger than %', partition_name, dead_letter_retention
            USING ERRCODE = 'OB052', HINT = 'Requeue them (outbox.requeue) or wait for dead_letter_retention.';
    END IF;
    IF NOT outbox._is_sealed(partition_name) THEN
        EXECUTE format(
            'CREATE TRIGGER _050_archived_read_only BEFORE INSERT OR UPDATE OR DELETE ON outbox.%I'
            ' FOR EACH ROW EXECUTE FUNCTION outbox.tg_events__archived_read_only()', partition_name
        );
        EXECUTE format(
            'CREATE TRIGGER _050_archived_no_truncate BEFORE TRUNCATE ON outbox.%I'
            ' FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_events__archived_read_only()', partition_name
        );
        -- The archiver exports the partition itself, the very relation that
        -- is verified and dropped; it may read no other partition directly.
        EXECUTE format('GRANT SELECT ON outbox.%I TO pgoutbox_archiver', partition_name);
    END IF;
    RETURN NEXT;
END;
$$;
COMMENT ON FUNCTION outbox.seal_partition(text, interval, interval, interval) IS
'Checks a day partition is archivable and makes it read-only; returns its range and id bounds.';

-- The lifecycle invariants, at every UPDATE (a row is born in a state that
-- holds them: _100_check_policies): a known status, attempts >= 0,
-- published_at set exactly when COMPLETED, a claim (token, time, worker)
-- while PROCESSING, an error text when FAILED or DEAD_LETTER. They were
-- CHECK constraints until version 8; PostgreSQL compiles those at every
-- INSERT statement too, which cost emit about 8 µs (10_outbox_events.sql).
-- A trigger's WHEN clause holds the same test, runs on UPDATE only, and
-- costs claim and mark what the CHECKs cost them; only a row that breaks
-- an invariant enters the function. A NULL test passes, as in a CHECK.
CREATE OR REPLACE FUNCTION outbox.tg_events__refuse_bad_state()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'ILLEGAL_TRANSITION: event % would be left % with attempts %, published_at %, claim % (% at %) and error %',
        OLD.event_id, NEW.status, NEW.attempts, coalesce(NEW.published_at::text, 'NULL'),
        coalesce(NEW.claim_token::text, 'NULL'), coalesce(NEW.claimed_by, 'NULL'),
        coalesce(NEW.claimed_at::text, 'NULL'), coalesce(left(NEW.last_error, 100), 'NULL')
        USING ERRCODE = 'OB010',
              HINT = 'PROCESSING needs a claim, COMPLETED exactly a published_at, FAILED and DEAD_LETTER an error.';
END;
$$;

CREATE OR REPLACE TRIGGER _500_check_state
BEFORE UPDATE ON outbox.events
FOR EACH ROW
WHEN (
    NOT (
        new.status IN ('PENDING', 'PROCESSING', 'COMPLETED', 'FAILED', 'DEAD_LETTER')
        AND new.attempts >= 0
        AND (new.status = 'COMPLETED') = (new.published_at IS NOT NULL)
        AND (
            new.status <> 'PROCESSING'
            OR (new.claim_token IS NOT NULL AND new.claimed_at IS NOT NULL AND new.claimed_by IS NOT NULL)
        )
        AND (new.status NOT IN ('FAILED', 'DEAD_LETTER') OR new.last_error IS NOT NULL)
    )
)
EXECUTE FUNCTION outbox.tg_events__refuse_bad_state();

DROP FUNCTION IF EXISTS outbox._check_discard_move(uuid, text, text, boolean);

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pgoutbox_viewer') THEN
        REVOKE ALL ON FUNCTION
        outbox.schema_version(), outbox.serves_workers_from(),
        outbox.backlog(text), inbox.backlog(text),
        outbox.dead_letters(text, integer), inbox.dead_letters(text, integer)
        FROM pgoutbox_viewer;
        REVOKE USAGE ON SCHEMA outbox, inbox FROM pgoutbox_viewer;
    END IF;
END;
$$;

DELETE FROM outbox.schema_migrations
WHERE version = 16;

COMMIT;
