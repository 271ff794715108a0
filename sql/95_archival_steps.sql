-- Archival steps (the lifecycle is described in sql/91_archival_audit.sql):
-- seal (outbox), record the audit row, remove (drop a partition, purge an
-- inbox or command day), void an audit, list audits, and the archiver's session lock.

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
    -- Index lookups only (events_claimable_idx, events_scheduled_idx,
    -- events_dead_letter_idx, which holds the discarded ones too, the primary
    -- key): claims and marks lock every partition, so they wait for as long
    -- as this transaction holds the lock. No count here.
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM outbox.%1$I WHERE status IN (''PENDING'', ''FAILED'', ''PROCESSING'')'
        ' AND (status <> ''PENDING'' OR claimed_at IS NOT NULL OR ordering_key IS NOT NULL OR available_at <= created_at))'
        ' OR EXISTS (SELECT 1 FROM outbox.%1$I WHERE status = ''PENDING'' AND claimed_at IS NULL'
        ' AND ordering_key IS NULL AND available_at > created_at),'
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

-- The figures of a sealed partition, taken once, right after its seal and
-- before any export, then returned as taken: the rows its archive must hold.
-- From then on a change behind the seal (by an owner who bypasses the
-- triggers) makes record_archive and drop_archived fail with SEAL_BROKEN.
-- (Not in seal_partition's transaction: counting and hashing the day there
-- would hold the lock that keeps writers out, and every relay's claim, for
-- as long as the hash takes.)
CREATE OR REPLACE FUNCTION outbox.seal_figures(partition_name text)
RETURNS TABLE (row_count bigint, checksum numeric)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    part_day date := outbox._partition_day(partition_name);
    sealed outbox.archive_seal;
BEGIN
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key('outbox.events', part_day));
    IF NOT outbox._is_partition(partition_name) THEN
        RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: outbox.events has no partition %', partition_name
            USING ERRCODE = 'OB050';
    END IF;
    IF NOT outbox._is_sealed(partition_name) THEN
        RAISE EXCEPTION 'NOT_SEALED: partition % must be sealed before its figures are taken', partition_name
            USING ERRCODE = 'OB061', HINT = 'Call outbox.seal_partition() first.';
    END IF;
    SELECT * INTO sealed FROM outbox.archive_seal AS s WHERE s.day = part_day AND s.voided_at IS NULL;
    IF FOUND THEN
        row_count := sealed.row_count;
        checksum := sealed.checksum;
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT f.row_count, f.checksum INTO row_count, checksum FROM outbox.archive_figures('outbox.events', part_day) AS f;
    PERFORM outbox._check_seal(partition_name, row_count, checksum);
    INSERT INTO outbox.archive_seal (day, relation, row_count, checksum)
    VALUES (part_day, partition_name, seal_figures.row_count, seal_figures.checksum);
    RETURN NEXT;
END;
$$;
COMMENT ON FUNCTION outbox.seal_figures(text) IS
'Row count and checksum of a sealed day partition, taken once right after the seal: what its archive must match.';

-- Bounds for the report's parallel reads of the live tables (index lookups).
CREATE OR REPLACE FUNCTION outbox.id_range()
RETURNS TABLE (min_id bigint, max_id bigint)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT min(e.id), max(e.id) FROM outbox.events AS e;
$$;

CREATE OR REPLACE FUNCTION inbox.received_range()
RETURNS TABLE (min_received_at timestamptz, max_received_at timestamptz)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT min(m.received_at), max(m.received_at) FROM inbox.messages AS m;
$$;

-- Records the audit row of an exported unit, once the figures the archiver
-- read back from its archive equal the live figures computed here. Same
-- figures and URI again: returns the same row (a re-run after a crash).
CREATE OR REPLACE FUNCTION outbox.record_archive(
    source text,
    day date,
    row_count bigint,
    checksum numeric,
    archive_uri text
)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    live record;
    standing outbox.archive_audit;
    open_rows bigint;
    new_id bigint;
BEGIN
    PERFORM outbox._archive_source(source);
    IF day IS NULL OR row_count IS NULL OR checksum IS NULL OR nullif(btrim(archive_uri), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: day, row_count, checksum and archive_uri are required'
            USING ERRCODE = 'OB006';
    END IF;
    PERFORM outbox._check_day(day);
    PERFORM outbox._check_text(archive_uri, 'archive_uri', 2048);
    IF row_count < 0 OR checksum < 0 OR checksum <> trunc(checksum) THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: row_count and checksum must be non-negative integers, got % and %', row_count, checksum
            USING ERRCODE = 'OB006';
    END IF;
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key(source, day));
    IF source = 'outbox.events' AND NOT outbox._is_sealed(outbox._partition_name(day)) THEN
        RAISE EXCEPTION 'NOT_SEALED: partition % must be sealed before its archive is recorded', outbox._partition_name(day)
            USING ERRCODE = 'OB061', HINT = 'Call outbox.seal_partition() before exporting it.';
    END IF;
    IF source = 'inbox.messages' THEN
        PERFORM inbox._check_floor(day);
        SELECT count(*) INTO open_rows FROM inbox.messages AS m
        WHERE m.received_at >= outbox._day_from(day) AND m.received_at < outbox._day_from(day + 1)
            AND m.status IN ('RECEIVED', 'FAILED');
        IF open_rows > 0 THEN
            RAISE EXCEPTION 'NOT_CLOSED: inbox day % has % row(s) still RECEIVED or FAILED', day, open_rows
                USING ERRCODE = 'OB051';
        END IF;
    END IF;
    IF source = 'inbox.commands' THEN
        PERFORM inbox._check_command_floor(day);
    END IF;
    SELECT * INTO live FROM outbox.archive_figures(source, day);
    IF source = 'outbox.events' THEN
        -- The live rows must still be the sealed ones (the archive is compared
        -- with them next): a change since the seal is not archived.
        PERFORM outbox._check_seal(outbox._partition_name(day), live.row_count, live.checksum);
    END IF;
    IF (live.row_count, live.checksum) IS DISTINCT FROM (record_archive.row_count, record_archive.checksum) THEN
        RAISE EXCEPTION 'ARCHIVE_MISMATCH: the archive of % % does not match the live rows', source, day
            USING ERRCODE = 'OB053',
                  DETAIL = format('archive: %s rows, checksum %s; live: %s rows, checksum %s',
                      row_count, checksum, live.row_count, live.checksum);
    END IF;
    SELECT * INTO standing FROM outbox.archive_audit AS a
    WHERE a.source = record_archive.source AND a.day = record_archive.day AND a.voided_at IS NULL;
    IF FOUND THEN
        IF standing.removed_at IS NULL
            AND (standing.row_count, standing.checksum, standing.archive_uri)
            = (record_archive.row_count, record_archive.checksum, record_archive.archive_uri) THEN
            RETURN standing.id;
        END IF;
        RAISE EXCEPTION 'ARCHIVE_CONFLICT: % % already has audit %', source, day, standing.id
            USING ERRCODE = 'OB055',
                  DETAIL = format('audit: %s rows, checksum %s, %s%s; given: %s rows, checksum %s, %s',
                      standing.row_count, standing.checksum, standing.archive_uri,
                      CASE WHEN standing.removed_at IS NULL THEN '' ELSE ', removed' END,
                      row_count, checksum, archive_uri),
                  HINT = 'If the standing audit is wrong and its rows are still live, void it: outbox.void_archive().';
    END IF;
    INSERT INTO outbox.archive_audit (source, day, relation, row_count, checksum, archive_uri)
    VALUES (
        source, day,
        CASE WHEN source = 'outbox.events' THEN outbox._partition_name(day) END,
        row_count, checksum, archive_uri
    )
    RETURNING id INTO new_id;
    RETURN new_id;
END;
$$;
COMMENT ON FUNCTION outbox.record_archive(text, date, bigint, numeric, text) IS
'Records the audit row of an exported day once its archived figures equal the live ones; idempotent.';

CREATE OR REPLACE FUNCTION inbox._check_floor(day date)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF outbox._day_from(day + 1) > now() - inbox.stream_max_age() THEN
        RAISE EXCEPTION 'RETENTION_BELOW_MAX_AGE: inbox day % is younger than the streams'' max_age %', day, inbox.stream_max_age()
            USING ERRCODE = 'OB057';
    END IF;
END;
$$;

-- A day of command keys may leave only once none is IN_PROGRESS (OB051)
-- and every one settled longer ago than the clients' retry window (OB057),
-- whatever retention the caller listed with.
CREATE OR REPLACE FUNCTION inbox._check_command_floor(day date)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    open_rows bigint;
    last_settled timestamptz;
BEGIN
    IF outbox._day_from(day + 1) > now() - inbox.command_retry_window() THEN
        RAISE EXCEPTION 'RETENTION_BELOW_MAX_AGE: command day % is younger than the clients'' retry window %', day, inbox.command_retry_window()
            USING ERRCODE = 'OB057';
    END IF;
    SELECT count(*) FILTER (WHERE c.status = 'IN_PROGRESS'), max(c.settled_at)
    INTO open_rows, last_settled
    FROM inbox.commands AS c
    WHERE c.first_claimed_at >= outbox._day_from(day) AND c.first_claimed_at < outbox._day_from(day + 1);
    IF open_rows > 0 THEN
        RAISE EXCEPTION 'NOT_CLOSED: command day % has % key(s) still IN_PROGRESS', day, open_rows
            USING ERRCODE = 'OB051', HINT = 'Settle them: inbox.complete_command() or inbox.fail_command().';
    END IF;
    IF last_settled > now() - inbox.command_retry_window() THEN
        RAISE EXCEPTION 'RETENTION_BELOW_MAX_AGE: command day % has keys settled within the clients'' retry window %', day, inbox.command_retry_window()
            USING ERRCODE = 'OB057';
    END IF;
END;
$$;

-- The audit row that a removal is checked against; OB054 without one.
CREATE OR REPLACE FUNCTION outbox._standing_audit(source text, day date)
RETURNS outbox.archive_audit
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    standing outbox.archive_audit;
    live record;
BEGIN
    SELECT * INTO standing FROM outbox.archive_audit AS a
    WHERE a.source = _standing_audit.source AND a.day = _standing_audit.day AND a.voided_at IS NULL;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'NOT_ARCHIVED: % % has no audit row', source, day
            USING ERRCODE = 'OB054', HINT = 'Rows are removed only after an audited export.';
    END IF;
    IF standing.removed_at IS NULL THEN
        SELECT * INTO live FROM outbox.archive_figures(source, day);
        IF (live.row_count, live.checksum) IS DISTINCT FROM (standing.row_count, standing.checksum) THEN
            RAISE EXCEPTION 'ARCHIVE_MISMATCH: % % changed since audit %', source, day, standing.id
                USING ERRCODE = 'OB053',
                      DETAIL = format('audit: %s rows, checksum %s; live: %s rows, checksum %s',
                          standing.row_count, standing.checksum, live.row_count, live.checksum),
                      HINT = 'Nothing was removed. Find out who changed it; void the audit to archive it again.';
        END IF;
    END IF;
    RETURN standing;
END;
$$;

-- Drops an audited partition after re-checking its live figures against
-- the audit and the seal figures. The partition is sealed, so only a
-- trigger-bypassing owner could change it between the check and the DROP.
-- Already dropped: returns 0.
CREATE OR REPLACE FUNCTION outbox.drop_archived(
    partition_name text,
    lock_timeout interval DEFAULT interval '5 seconds'
)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    part_day date := outbox._partition_day(partition_name);
    standing outbox.archive_audit;
BEGIN
    PERFORM outbox._check_lock_timeout(lock_timeout);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key('outbox.events', part_day));
    IF NOT outbox._is_partition(partition_name) THEN
        IF EXISTS (
            SELECT 1 FROM outbox.archive_audit AS a
            WHERE a.source = 'outbox.events' AND a.day = part_day
                AND a.voided_at IS NULL AND a.removed_at IS NOT NULL
        ) THEN
            RETURN 0;
        END IF;
        RAISE EXCEPTION 'ARCHIVE_UNKNOWN_UNIT: outbox.events has no partition %', partition_name
            USING ERRCODE = 'OB050';
    END IF;
    standing := outbox._standing_audit('outbox.events', part_day);
    IF NOT outbox._is_sealed(partition_name) THEN
        RAISE EXCEPTION 'NOT_SEALED: partition % lost its seal after audit %', partition_name, standing.id
            USING ERRCODE = 'OB061';
    END IF;
    -- The live rows equal the audit (just checked); they must equal the seal too.
    PERFORM outbox._check_seal(partition_name, standing.row_count, standing.checksum);
    -- DROP takes ACCESS EXCLUSIVE on outbox.events for the rest of this short
    -- transaction; lock_timeout keeps emitters from queueing behind us.
    PERFORM outbox._with_lock_timeout(format('DROP TABLE outbox.%I', partition_name), lock_timeout);
    -- Its dead letters' entries (sql/67_dead_letters.sql): DROP fires no row trigger.
    DELETE FROM outbox.dlq_entries AS x
    WHERE x.side = 'outbox' AND x.created_at >= (part_day::timestamp AT TIME ZONE 'UTC')
        AND x.created_at < ((part_day + 1)::timestamp AT TIME ZONE 'UTC');
    -- Its scheduled events' rows (sql/10_outbox_events.sql), all delivered: a
    -- day with a pending scheduled event is not archivable. Else they would
    -- stay for good, a row per reminder ever sent.
    DELETE FROM outbox.schedules AS s
    WHERE s.created_at >= (part_day::timestamp AT TIME ZONE 'UTC')
        AND s.created_at < ((part_day + 1)::timestamp AT TIME ZONE 'UTC');
    UPDATE outbox.archive_audit SET removed_at = now(), removed_by = session_user
    WHERE id = standing.id;
    RETURN standing.row_count;
END;
$$;
COMMENT ON FUNCTION outbox.drop_archived(text, interval) IS
'Drops a sealed, audited day partition whose live count and checksum still match its audit row.';

-- Deletes an audited day of an inbox source (its rows by _day_column) in
-- one statement, hashing exactly the rows it deletes (DELETE ... RETURNING),
-- and rolls back unless they match the audit row: a row changed, added or
-- removed since the audit aborts it. The day must be past the source's
-- floor (_check_floor, _check_command_floor); the delete guard lets the rows
-- go while the source's purge flag is on. Already purged: returns 0. The one
-- audited purge of both inbox tables.
CREATE OR REPLACE FUNCTION inbox._purge_audited(source text, day date)
RETURNS bigint
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    messages boolean := source = 'inbox.messages';
    flag text := CASE WHEN messages THEN 'pgoutbox.inbox_purge' ELSE 'pgoutbox.command_purge' END;
    standing outbox.archive_audit;
    n bigint;
    sum_hash numeric;
BEGIN
    PERFORM outbox._check_day(day);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key(source, day));
    standing := outbox._standing_audit(source, day);
    IF standing.removed_at IS NOT NULL THEN
        RETURN 0;
    END IF;
    IF messages THEN
        PERFORM inbox._check_floor(day);
    ELSE
        PERFORM inbox._check_command_floor(day);
    END IF;
    PERFORM set_config(flag, 'on', true);
    EXECUTE format(
        'WITH gone AS (DELETE FROM %s AS d'
        ' WHERE d.%I >= $1 AND d.%I < $2 RETURNING d.*)'
        ' SELECT count(*), coalesce(sum(%s), 0)::numeric FROM gone AS r',
        outbox._archive_source(source), outbox._day_column(source), outbox._day_column(source),
        outbox._row_hash_sql(source)
    ) INTO n, sum_hash USING outbox._day_from(day), outbox._day_from(day + 1);
    PERFORM set_config(flag, '', true);
    IF (n, sum_hash) IS DISTINCT FROM (standing.row_count, standing.checksum) THEN
        RAISE EXCEPTION 'ARCHIVE_MISMATCH: % day % changed since audit %',
            CASE WHEN messages THEN 'inbox' ELSE 'command' END, day, standing.id
            USING ERRCODE = 'OB053',
                  DETAIL = format('audit: %s rows, checksum %s; deleting: %s rows, checksum %s',
                      standing.row_count, standing.checksum, n, sum_hash),
                  HINT = 'Nothing was removed (the delete is rolled back).';
    END IF;
    UPDATE outbox.archive_audit SET removed_at = now(), removed_by = session_user
    WHERE id = standing.id;
    RETURN n;
END;
$$;

-- Deletes an audited inbox day whose deleted rows hash exactly to its audit
-- row, all or nothing (_purge_audited). Already purged: returns 0.
CREATE OR REPLACE FUNCTION inbox.purge_archived(day date)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT inbox._purge_audited('inbox.messages', day);
$$;
COMMENT ON FUNCTION inbox.purge_archived(date) IS
'Deletes an audited inbox day whose deleted rows hash exactly to its audit row; all or nothing.';

-- Deletes an audited day of command keys like purge_archived does an inbox
-- day (_purge_audited): a key claimed again since the audit aborts it. A
-- claim waiting on a deleted key claims it afresh (claim_command). Already
-- purged: returns 0.
CREATE OR REPLACE FUNCTION inbox.purge_archived_commands(day date)
RETURNS bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT inbox._purge_audited('inbox.commands', day);
$$;
COMMENT ON FUNCTION inbox.purge_archived_commands(date) IS
'Deletes an audited day of command keys whose deleted rows hash exactly to its audit row; all or nothing.';

-- Voids the standing audit of a unit whose rows are still live, and unseals
-- an outbox partition, so it can change again and be archived afresh.
-- Refused once the rows are removed: then the archive is all there is.
CREATE OR REPLACE FUNCTION outbox.void_archive(
    source text,
    day date,
    reason text,
    lock_timeout interval DEFAULT interval '5 seconds'
)
RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    standing outbox.archive_audit;
    part text := outbox._partition_name(day);
BEGIN
    PERFORM outbox._archive_source(source);
    PERFORM outbox._check_day(day);
    PERFORM outbox._check_text(reason, 'voiding an archive''s reason', 1000, TRUE);
    PERFORM outbox._check_lock_timeout(lock_timeout);
    PERFORM pg_advisory_xact_lock(outbox._archive_lock_key(source, day));
    SELECT * INTO standing FROM outbox.archive_audit AS a
    WHERE a.source = void_archive.source AND a.day = void_archive.day AND a.voided_at IS NULL;
    IF FOUND AND standing.removed_at IS NOT NULL THEN
        RAISE EXCEPTION 'ARCHIVE_CONFLICT: % % was removed after audit %; its archive is the only copy', source, day, standing.id
            USING ERRCODE = 'OB055';
    END IF;
    IF FOUND THEN
        UPDATE outbox.archive_audit
        SET voided_at = now(), voided_by = session_user, void_reason = reason
        WHERE id = standing.id;
    END IF;
    IF source = 'outbox.events' THEN
        UPDATE outbox.archive_seal AS s SET voided_at = now()
        WHERE s.day = void_archive.day AND s.voided_at IS NULL;
    END IF;
    IF source = 'outbox.events' AND outbox._is_sealed(part) THEN
        PERFORM outbox._with_lock_timeout(
            format('DROP TRIGGER _050_archived_read_only ON outbox.%I', part), lock_timeout
        );
        EXECUTE format('DROP TRIGGER _050_archived_no_truncate ON outbox.%I', part);
        EXECUTE format('REVOKE SELECT ON outbox.%I FROM pgoutbox_archiver', part);
    END IF;
    RETURN standing.id;
END;
$$;
COMMENT ON FUNCTION outbox.void_archive(text, date, text, interval) IS
'Voids the standing audit of a day whose rows are still live and unseals it (admins; reason required).';

CREATE OR REPLACE FUNCTION outbox.archive_audits(source text DEFAULT NULL)
RETURNS SETOF outbox.archive_audit
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._archive_source(archive_audits.source) WHERE archive_audits.source IS NOT NULL;
    SELECT * FROM outbox.archive_audit AS a
    WHERE archive_audits.source IS NULL OR a.source = archive_audits.source
    ORDER BY a.source, a.day, a.id;
$$;
COMMENT ON FUNCTION outbox.archive_audits(text) IS
'Every archive audit row (standing, removed and voided), by source and day.';

-- Session-level: held by one archiver for a whole unit; released by
-- unlock_archive or when its connection ends (a crash frees it).
CREATE OR REPLACE FUNCTION outbox.try_lock_archive(source text, day date)
RETURNS boolean
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._archive_source(source), outbox._check_day(day);
    SELECT pg_try_advisory_lock(outbox._archive_lock_key(source, day));
$$;

CREATE OR REPLACE FUNCTION outbox.unlock_archive(source text, day date)
RETURNS boolean
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._archive_source(source), outbox._check_day(day);
    SELECT pg_advisory_unlock(outbox._archive_lock_key(source, day));
$$;
