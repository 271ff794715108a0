-- Archival: rows leave outbox.events, inbox.messages and inbox.commands
-- only by export -> verify -> audit -> remove, one UTC day at a time. The
-- Spark job (spark/) does the export; every rule lives in SQL, in
-- sql/91_archival_audit.sql to sql/95_archival_steps.sql.
--
-- A unit is one day of one source:
--   outbox.events    the day partition events_pYYYYMMDD (removed by DROP TABLE)
--   inbox.messages   the rows received that UTC day (the inbox is keyed by
--                    (message_id, handler) for dedup, which a partition key
--                    would break; removed by one audited set DELETE)
--   inbox.commands   the keys first claimed that UTC day (first_claimed_at
--                    never changes; removed by one audited set DELETE)
--
-- Lifecycle of a unit:
--   eligible  its day ended more than `retention` ago and every row is terminal
--             (outbox: COMPLETED or DEAD_LETTER; inbox: PROCESSED or DEAD_LETTER;
--             commands: DONE or FAILED, and settled more than `retention` ago)
--   sealed    (outbox) read-only triggers on the partition: from here on no
--             path through the API can change it; the archiver may read it
--             (seal_partition)
--   exported  Parquet written, re-read and its count + checksum computed (Spark)
--   audited   an archive_audit row, recorded only when the exported figures
--             equal the live figures computed here (record_archive)
--   removed   drop_archived / purge_archived / purge_archived_commands: the
--             live figures are computed
--             again and must still equal the audit row, in the transaction
--             that removes the rows
--
-- DEAD_LETTER rule: a dead-lettered row is terminal for archival only once
-- its day ended more than `dead_letter_retention` ago (default 30 days, the
-- operator's window to requeue or replay it); until then it holds its whole
-- day back. Archived dead letters keep their status and last_error in the
-- archive, and the delivery report counts them. A discarded dead letter
-- (still DEAD_LETTER: outbox with a row in outbox.discarded_events, inbox
-- with dlq_metadata.discarded) is restorable, so it is a dead letter here
-- too; the outbox's marks are kept when its day leaves, like discard_log.
--
-- Inbox retention: never below the streams' max_age (inbox.retention_policy,
-- default 7 days): a message the stream may still redeliver must
-- find its inbox row, or dedup has a hole. archivable_days refuses a shorter
-- retention, and record/purge refuse a day younger than the floor whatever
-- retention the caller used.
--
-- Command retention: a key is the answer to a client's retry, so it is
-- kept at least the clients' retry window after it settled (DONE or FAILED;
-- inbox.command_policy, default 7 days): archivable_command_days refuses a
-- shorter retention, and record/purge refuse a day holding a key that
-- settled within the window. IN_PROGRESS keys hold their day back (close
-- them with inbox.fail_command). A key claimed after its day was purged is
-- claimed afresh: its command runs again.
--
-- Checksum, computed identically here and in spark/pgoutbox_spark/checksum.py:
--   per row   the stored, non-generated columns in table order, each rendered
--             as text (timestamptz as epoch microseconds; text, json and
--             jsonb with '\' -> '\\' and '|' -> '\|'; NULL as '\N'), joined
--             with '|'; the row's value is the first 15 hex digits of the
--             md5 of that text, as an integer (60 bits, non-negative)
--   per unit  the exact (numeric) sum of the row values, with the row count
-- A sum does not depend on row order, so any number of parallel readers can
-- compute it. Derived columns are functions of the others and are left out:
-- generated ones (inbox context) and outbox.events.subject (generated until
-- schema version 5, so that audits recorded before keep matching).

CREATE TABLE IF NOT EXISTS outbox.archive_audit (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source text NOT NULL,
    day date NOT NULL,
    relation text,
    row_count bigint NOT NULL,
    checksum numeric NOT NULL,
    archive_uri text NOT NULL,
    archived_at timestamptz NOT NULL DEFAULT now(),
    archived_by text NOT NULL DEFAULT session_user,
    removed_at timestamptz,
    removed_by text,
    voided_at timestamptz,
    voided_by text,
    void_reason text,
    CONSTRAINT source_is_known CHECK (source IN ('outbox.events', 'inbox.messages', 'inbox.commands')),
    CONSTRAINT outbox_audit_names_its_partition CHECK (
        (source = 'outbox.events') = (relation IS NOT NULL)
    ),
    CONSTRAINT row_count_is_non_negative CHECK (row_count >= 0),
    CONSTRAINT checksum_is_a_non_negative_integer CHECK (
        checksum >= 0 AND checksum = trunc(checksum)
    ),
    CONSTRAINT archive_uri_is_given CHECK (btrim(archive_uri) <> ''),
    CONSTRAINT removed_says_by_whom CHECK ((removed_at IS NULL) = (removed_by IS NULL)),
    CONSTRAINT voided_says_by_whom_and_why CHECK (
        (voided_at IS NULL) = (voided_by IS NULL)
        AND (voided_at IS NULL) = (void_reason IS NULL)
    ),
    CONSTRAINT removed_or_voided_not_both CHECK (removed_at IS NULL OR voided_at IS NULL)
);
COMMENT ON TABLE outbox.archive_audit IS
'One row per archived day of outbox.events, inbox.messages or inbox.commands: the figures its rows left against.';

-- One standing (not voided) audit per unit: a second archive of a day must
-- go through void_archive, and a removed day can never be archived again
-- (its archive would be overwritten).
CREATE UNIQUE INDEX IF NOT EXISTS archive_audit_one_standing_per_day
ON outbox.archive_audit (source, day) WHERE voided_at IS NULL;

-- Audit rows are evidence: inserted, then marked removed or voided once.
CREATE OR REPLACE FUNCTION outbox.tg_archive_audit__guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'UPDATE'
        AND (NEW.id, NEW.source, NEW.day, NEW.relation, NEW.row_count, NEW.checksum,
            NEW.archive_uri, NEW.archived_at, NEW.archived_by)
        IS NOT DISTINCT FROM
        (OLD.id, OLD.source, OLD.day, OLD.relation, OLD.row_count, OLD.checksum,
            OLD.archive_uri, OLD.archived_at, OLD.archived_by)
        AND OLD.removed_at IS NULL AND OLD.voided_at IS NULL THEN
        RETURN NEW;  -- marking a standing audit removed or voided
    END IF;
    RAISE EXCEPTION 'AUDIT_IMMUTABLE: archive audit rows are only marked removed or voided, once'
        USING ERRCODE = 'OB060';
END;
$$;

SELECT outbox._attach_guards(
    'outbox.archive_audit', 'outbox.tg_archive_audit__guard()', 'ROW', 'outbox.tg_archive_audit__guard()'
);

-- The figures of a sealed partition, taken right after its seal (before any
-- export): the rows the archive must hold. record_archive and drop_archived
-- compare against them, so a change made after the seal by someone who
-- bypasses the read-only triggers (an owner with session_replication_role =
-- replica, or who disabled them) fails the archive instead of being archived
-- and dropped. Voided with the audit by void_archive (the partition is
-- unsealed then); one standing row per day.
CREATE TABLE IF NOT EXISTS outbox.archive_seal (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    day date NOT NULL,
    relation text NOT NULL,
    row_count bigint NOT NULL,
    checksum numeric NOT NULL,
    sealed_at timestamptz NOT NULL DEFAULT now(),
    sealed_by text NOT NULL DEFAULT session_user,
    voided_at timestamptz,
    CONSTRAINT seal_row_count_is_non_negative CHECK (row_count >= 0),
    CONSTRAINT seal_checksum_is_a_non_negative_integer CHECK (
        checksum >= 0 AND checksum = trunc(checksum)
    )
);
COMMENT ON TABLE outbox.archive_seal IS
'Row count and checksum of each sealed outbox day partition, taken right after the seal.';

CREATE UNIQUE INDEX IF NOT EXISTS archive_seal_one_standing_per_day
ON outbox.archive_seal (day) WHERE voided_at IS NULL;

-- Seal figures are evidence too: inserted, then voided once.
CREATE OR REPLACE FUNCTION outbox.tg_archive_seal__guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'UPDATE'
        AND (NEW.id, NEW.day, NEW.relation, NEW.row_count, NEW.checksum, NEW.sealed_at, NEW.sealed_by)
        IS NOT DISTINCT FROM
        (OLD.id, OLD.day, OLD.relation, OLD.row_count, OLD.checksum, OLD.sealed_at, OLD.sealed_by)
        AND OLD.voided_at IS NULL THEN
        RETURN NEW;  -- voiding a standing seal
    END IF;
    RAISE EXCEPTION 'AUDIT_IMMUTABLE: seal figures are only voided, once'
        USING ERRCODE = 'OB060';
END;
$$;

SELECT outbox._attach_guards(
    'outbox.archive_seal', 'outbox.tg_archive_seal__guard()', 'ROW', 'outbox.tg_archive_seal__guard()'
);

-- The inbox retention floor. One row; only admins change it (set_stream_max_age),
-- so an archiver cannot lower it for its own session.
CREATE TABLE IF NOT EXISTS inbox.retention_policy (
    singleton boolean PRIMARY KEY DEFAULT TRUE,
    stream_max_age interval NOT NULL DEFAULT interval '7 days',
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL DEFAULT session_user,
    CONSTRAINT one_row_only CHECK (singleton),
    CONSTRAINT stream_max_age_is_positive CHECK (stream_max_age > interval '0')
);
COMMENT ON TABLE inbox.retention_policy IS
'Longest max_age of the streams feeding this inbox: inbox rows are never removed younger than that.';
INSERT INTO inbox.retention_policy (singleton) VALUES (TRUE) ON CONFLICT DO NOTHING;

-- The command retention floor: the longest time a client may retry a
-- command. One row; only admins change it (set_command_retry_window).
CREATE TABLE IF NOT EXISTS inbox.command_policy (
    singleton boolean PRIMARY KEY DEFAULT TRUE,
    retry_window interval NOT NULL DEFAULT interval '7 days',
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL DEFAULT session_user,
    CONSTRAINT one_row_only CHECK (singleton),
    CONSTRAINT retry_window_is_positive CHECK (retry_window > interval '0')
);
COMMENT ON TABLE inbox.command_policy IS
'Longest time a client may retry a command: command keys are never removed sooner after they settled.';
INSERT INTO inbox.command_policy (singleton) VALUES (TRUE) ON CONFLICT DO NOTHING;

-- Day ranges of the command inbox (by first_claimed_at, which never changes).
CREATE INDEX IF NOT EXISTS commands_first_claimed_at_idx ON inbox.commands (first_claimed_at);

-- Day ranges of the inbox (the archive reads, and purge deletes, by received_at).
CREATE INDEX IF NOT EXISTS messages_received_at_idx ON inbox.messages (received_at);

-- Installed on a partition by seal_partition (not on the parent: the hot
-- partitions pay nothing). Fires before the inherited _100 guards.
CREATE OR REPLACE FUNCTION outbox.tg_events__archived_read_only()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'ARCHIVED_READ_ONLY: partition outbox.% is sealed for archival', TG_TABLE_NAME
        USING ERRCODE = 'OB056',
              HINT = 'To change its rows, void the archive first: outbox.void_archive(source, day, reason).';
END;
$$;
