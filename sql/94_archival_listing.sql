-- Archival listing: which units are old enough to archive and what holds each
-- back, and the inbox retention floor (the streams' max_age) that bounds them.

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
            -- discarded events are dead letters too (kept, and restorable)
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

-- UTC days of inbox.messages that ended more than `retention` ago. Refuses a
-- retention shorter than the streams' max_age (inbox.retention_policy).
CREATE OR REPLACE FUNCTION inbox.archivable_days(
    retention interval DEFAULT interval '14 days',
    dead_letter_retention interval DEFAULT interval '30 days'
)
RETURNS TABLE (
    day date,
    row_count bigint,
    open_rows bigint,
    dead_letters bigint,
    eligible boolean,
    blocked_by text,
    audit_id bigint
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_retention(dead_letter_retention, 'dead_letter_retention');
    IF retention > interval '100 years' THEN
        PERFORM outbox._check_retention(retention, 'retention');
    END IF;
    IF retention IS NULL OR retention < inbox.stream_max_age() THEN
        RAISE EXCEPTION 'RETENTION_BELOW_MAX_AGE: inbox retention % is shorter than the streams'' max_age %', retention, inbox.stream_max_age()
            USING ERRCODE = 'OB057',
                  HINT = 'A redelivered message must find its inbox row; keep inbox rows at least as long as the streams keep messages.';
    END IF;
    RETURN QUERY
    WITH days AS (
        SELECT
            (m.received_at AT TIME ZONE 'UTC')::date AS d,
            count(*) AS n,
            count(*) FILTER (WHERE m.status IN ('RECEIVED', 'FAILED')) AS open_n,
            count(*) FILTER (WHERE m.status = 'DEAD_LETTER') AS dead_n
        FROM inbox.messages AS m
        WHERE m.received_at < now() - retention
        GROUP BY 1
    )
    SELECT
        days.d,
        days.n,
        days.open_n,
        days.dead_n,
        b.why IS NULL,
        b.why,
        a.id
    FROM days
    CROSS JOIN LATERAL (
        SELECT CASE
            WHEN outbox._day_from(days.d + 1) > now() - retention THEN 'day not over by retention yet'
            WHEN days.open_n > 0 THEN 'open rows (RECEIVED or FAILED)'
            WHEN days.dead_n > 0 AND outbox._day_from(days.d + 1) > now() - dead_letter_retention
                THEN 'dead letters younger than dead_letter_retention'
        END AS why
    ) AS b
    LEFT JOIN outbox.archive_audit AS a
        ON a.source = 'inbox.messages' AND a.day = days.d AND a.voided_at IS NULL
    ORDER BY days.d;
END;
$$;
COMMENT ON FUNCTION inbox.archivable_days(interval, interval) IS
'UTC days of inbox.messages old enough to archive (never younger than the streams'' max_age), and what blocks each.';

CREATE OR REPLACE FUNCTION inbox.stream_max_age()
RETURNS interval
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT p.stream_max_age FROM inbox.retention_policy AS p), interval '7 days');
$$;
COMMENT ON FUNCTION inbox.stream_max_age() IS
'The inbox retention floor: the longest max_age of the streams feeding this inbox.';

CREATE OR REPLACE FUNCTION inbox.set_stream_max_age(max_age interval)
RETURNS interval
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF max_age IS NULL OR max_age <= interval '0' OR max_age > interval '100 years' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: max_age must be positive and at most 100 years, got %', max_age
            USING ERRCODE = 'OB006';
    END IF;
    RETURN outbox._set_policy('inbox.retention_policy', 'stream_max_age', max_age);
END;
$$;
COMMENT ON FUNCTION inbox.set_stream_max_age(interval) IS
'Sets the inbox retention floor to the longest max_age of the streams feeding this inbox (admins).';

-- UTC days of inbox.commands (by first_claimed_at) that ended more than
-- `retention` ago. A day is eligible once none of its keys is IN_PROGRESS
-- and every key settled (DONE or FAILED) more than `retention` ago: a key
-- answers a client's retry for at least that long after its last outcome.
-- Refuses a retention shorter than the clients' retry window
-- (inbox.command_policy).
CREATE OR REPLACE FUNCTION inbox.archivable_command_days(retention interval DEFAULT interval '30 days')
RETURNS TABLE (
    day date,
    row_count bigint,
    open_rows bigint,
    failed_rows bigint,
    eligible boolean,
    blocked_by text,
    audit_id bigint
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF retention > interval '100 years' THEN
        PERFORM outbox._check_retention(retention, 'retention');
    END IF;
    IF retention IS NULL OR retention < inbox.command_retry_window() THEN
        RAISE EXCEPTION 'RETENTION_BELOW_MAX_AGE: command retention % is shorter than the clients'' retry window %', retention, inbox.command_retry_window()
            USING ERRCODE = 'OB057',
                  HINT = 'A retried command must find its key; keep keys at least as long as clients retry (inbox.set_command_retry_window).';
    END IF;
    RETURN QUERY
    WITH days AS (
        SELECT
            (c.first_claimed_at AT TIME ZONE 'UTC')::date AS d,
            count(*) AS n,
            count(*) FILTER (WHERE c.status = 'IN_PROGRESS') AS open_n,
            count(*) FILTER (WHERE c.status = 'FAILED') AS failed_n,
            max(c.settled_at) AS last_settled
        FROM inbox.commands AS c
        WHERE c.first_claimed_at < now() - retention
        GROUP BY 1
    )
    SELECT
        days.d,
        days.n,
        days.open_n,
        days.failed_n,
        b.why IS NULL,
        b.why,
        a.id
    FROM days
    CROSS JOIN LATERAL (
        SELECT CASE
            WHEN outbox._day_from(days.d + 1) > now() - retention THEN 'day not over by retention yet'
            WHEN days.open_n > 0 THEN 'open rows (IN_PROGRESS)'
            WHEN days.last_settled > now() - retention THEN 'keys settled within the retention'
        END AS why
    ) AS b
    LEFT JOIN outbox.archive_audit AS a
        ON a.source = 'inbox.commands' AND a.day = days.d AND a.voided_at IS NULL
    ORDER BY days.d;
END;
$$;
COMMENT ON FUNCTION inbox.archivable_command_days(interval) IS
'UTC days of inbox.commands old enough to archive (keys settled longer ago than the retention), and what blocks each.';

CREATE OR REPLACE FUNCTION inbox.command_retry_window()
RETURNS interval
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT p.retry_window FROM inbox.command_policy AS p), interval '7 days');
$$;
COMMENT ON FUNCTION inbox.command_retry_window() IS
'The command retention floor: the longest time a client may retry a command.';

CREATE OR REPLACE FUNCTION inbox.set_command_retry_window(retry_window interval)
RETURNS interval
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF retry_window IS NULL OR retry_window <= interval '0' OR retry_window > interval '100 years' THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: retry_window must be positive and at most 100 years, got %', retry_window
            USING ERRCODE = 'OB006';
    END IF;
    RETURN outbox._set_policy('inbox.command_policy', 'retry_window', retry_window);
END;
$$;
COMMENT ON FUNCTION inbox.set_command_retry_window(interval) IS
'Sets the command retention floor to the longest time a client may retry a command (admins).';
