-- Dead-letter operations over both sides, for `pgoutbox dead-letters` and
-- the console: groups by cause, filtered lists, one dead letter's detail,
-- and matching actions in batches (replay, discard, restore).
--
-- A dead letter is an outbox event in DEAD_LETTER (by context) or an inbox
-- row in DEAD_LETTER (by handler). Discarded = parked for good by an
-- operator, kept, reversible:
--   outbox   status stays DEAD_LETTER (one of the five statuses, nothing
--            else) with a row in outbox.discarded_events, its mark: the
--            relay's claim never looks at a dead letter, requeue and replay
--            refuse or pass by a marked one, and it still holds back later
--            events of its ordering key, as the dead letter did
--   inbox    status stays DEAD_LETTER with dlq_metadata.discarded =
--            {at, by, reason}: every worker version treats it as parked,
--            claim_replays and redrive pass it by, and the named status
--            CHECK is unchanged
-- Both moves happen only inside dlq_discard/dlq_restore, which set
-- pgoutbox.dlq_action and pgoutbox.dlq_reason for their writes; the guards
-- (the mark's triggers below, sql/50_inbox.sql) refuse any other way
-- (_check_discard_move) and write the audit rows below. Archival counts a
-- discarded row as a dead letter (sql/91_archival_audit.sql).
--
-- The filter, one jsonb object shared by every function here (unknown keys
-- and bad values: OB100):
--   side       "outbox" | "inbox" (absent or null: both)
--   owner      context (outbox) or handler (inbox)
--   subject    exact subject
--   error      case-insensitive substring of last_error, taken literally
--   tenant     outbox tenant_id, inbox envelope.tenant_id
--   since, until   timestamps: since <= seen_at < until
--   group      a group_id of dlq_groups
--   ids        array of event_id / message_id (a selection)
--   discarded  false (absent): live dead letters; true: discarded; null: both
-- seen_at: when the row last became a dead letter (inbox
-- dlq_metadata.dead_lettered_at, else received_at; outbox claimed_at, the
-- claim of its last attempt, else created_at).
--
-- A group is side + owner + subject + error class + error pattern (the
-- error with uuids, quoted values and numbers masked), identified by the md5
-- of those five; refailed counts rows that became dead letters again after
-- a replay, redrive or requeue.

-- Discard and restore, audited (append-only, like every audit table here:
-- no role may write them, the owner may not change them). No foreign key:
-- rows may leave by archival while their history stays.
CREATE TABLE IF NOT EXISTS outbox.discard_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id uuid NOT NULL,
    action text NOT NULL,
    acted_at timestamptz NOT NULL DEFAULT now(),
    acted_by text NOT NULL,
    reason text NOT NULL,
    last_error text,
    CONSTRAINT action_is_known CHECK (action IN ('discard', 'restore')),
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);
COMMENT ON TABLE outbox.discard_log IS
'Who discarded or restored which dead-lettered event, when and why (outbox.dlq_discard/dlq_restore).';

CREATE TABLE IF NOT EXISTS inbox.discard_log (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id uuid NOT NULL,
    handler text NOT NULL,
    action text NOT NULL,
    acted_at timestamptz NOT NULL DEFAULT now(),
    acted_by text NOT NULL,
    reason text NOT NULL,
    last_error text,
    CONSTRAINT action_is_known CHECK (action IN ('discard', 'restore')),
    CONSTRAINT reason_is_given CHECK (btrim(reason) <> '')
);
COMMENT ON TABLE inbox.discard_log IS
'Who discarded or restored which dead-lettered message, when and why (outbox.dlq_discard/dlq_restore).';

CREATE INDEX IF NOT EXISTS discard_log_event_idx ON outbox.discard_log (event_id);
CREATE INDEX IF NOT EXISTS discard_log_message_idx ON inbox.discard_log (message_id, handler);
-- A dead letter's history (dlq_show) and its re-failures (dlq_groups).
CREATE INDEX IF NOT EXISTS requeue_log_event_idx ON outbox.requeue_log (event_id);
CREATE INDEX IF NOT EXISTS redrive_log_message_idx ON inbox.redrive_log (message_id, handler);

CREATE OR REPLACE FUNCTION outbox.tg_discard_log__append_only()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'AUDIT_IMMUTABLE: % is append-only', TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME
        USING ERRCODE = 'OB060';
END;
$$;

CREATE OR REPLACE TRIGGER _100_append_only
BEFORE UPDATE OR DELETE ON outbox.discard_log
FOR EACH ROW EXECUTE FUNCTION outbox.tg_discard_log__append_only();
CREATE OR REPLACE TRIGGER _100_append_only_truncate
BEFORE TRUNCATE ON outbox.discard_log
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_discard_log__append_only();
CREATE OR REPLACE TRIGGER _100_append_only
BEFORE UPDATE OR DELETE ON inbox.discard_log
FOR EACH ROW EXECUTE FUNCTION outbox.tg_discard_log__append_only();
CREATE OR REPLACE TRIGGER _100_append_only_truncate
BEFORE TRUNCATE ON inbox.discard_log
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_discard_log__append_only();

-- A mark is written or removed only as a discard or restore of a dead
-- letter (_check_discard_move, with the event's status read under a share
-- lock: a requeue of the same event waits, then sees the mark and is
-- refused, DISCARDED OB101); nothing else changes it.
CREATE OR REPLACE FUNCTION outbox.tg_discarded_events__guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    mark outbox.discarded_events := CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
    event_status text;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        RAISE EXCEPTION 'UNAUDITED_DISCARD: a discard mark is added by outbox.dlq_discard and removed by outbox.dlq_restore, never changed'
            USING ERRCODE = 'OB102';
    END IF;
    SELECT e.status INTO event_status
    FROM outbox.events AS e
    WHERE e.id = mark.row_id AND e.created_at = mark.created_at AND e.event_id = mark.event_id
    FOR SHARE;
    IF TG_OP = 'INSERT' THEN
        PERFORM outbox._check_discard_move(mark.event_id, coalesce(event_status, 'UNKNOWN'), 'DISCARDED', TRUE);
        NEW.discarded_at := now();
        RETURN NEW;
    END IF;
    PERFORM outbox._check_discard_move(mark.event_id, 'DISCARDED', coalesce(event_status, 'UNKNOWN'), TRUE);
    RETURN OLD;
END;
$$;

-- After the mark is written (an insert that ON CONFLICT passes by fires
-- nothing here): the audit row and the dead letter's entry.
CREATE OR REPLACE FUNCTION outbox.tg_discarded_events__audit()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    mark outbox.discarded_events := CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
BEGIN
    INSERT INTO outbox.discard_log (event_id, action, acted_by, reason, last_error)
    SELECT
        mark.event_id, current_setting('pgoutbox.dlq_action', true), session_user,
        current_setting('pgoutbox.dlq_reason', true), e.last_error
    FROM outbox.events AS e
    WHERE e.id = mark.row_id AND e.created_at = mark.created_at;
    UPDATE outbox.dlq_entries AS x
    SET discarded = TG_OP = 'INSERT', replayable = TG_OP = 'DELETE'
    WHERE x.side = 'outbox' AND x.id = mark.event_id AND x.handler = '';
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER _100_guard
BEFORE INSERT OR UPDATE OR DELETE ON outbox.discarded_events
FOR EACH ROW EXECUTE FUNCTION outbox.tg_discarded_events__guard();
CREATE OR REPLACE TRIGGER _100_guard_truncate
BEFORE TRUNCATE ON outbox.discarded_events
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_discard_log__append_only();
CREATE OR REPLACE TRIGGER _600_audit
AFTER INSERT OR DELETE ON outbox.discarded_events
FOR EACH ROW EXECUTE FUNCTION outbox.tg_discarded_events__audit();

-- The class of an error text: the status class of `HTTP nnn` (4xx, 5xx),
-- the code of `CODE: ...` (BAD_PAYLOAD, UPCAST_MISSING, REPLAY_UNPUBLISHABLE),
-- the exception's name of `NameError: ...`, else OTHER. No SET clause, every
-- name qualified: so that _dlq_rows inlines it (a function with SET runs as
-- a query of its own per row, which made a group listing 5 times slower).
CREATE OR REPLACE FUNCTION outbox._dlq_error_class(error text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN error OPERATOR(pg_catalog.~) '^HTTP [1-5][0-9][0-9]($|[^0-9])'
            THEN pg_catalog.substr(error, 6, 1) OPERATOR(pg_catalog.||) 'xx'
        WHEN error OPERATOR(pg_catalog.~) '^[A-Z][A-Z0-9_]{1,63}:'
            THEN pg_catalog.substring(error, '^([A-Z][A-Z0-9_]{1,63}):')
        WHEN error OPERATOR(pg_catalog.~) '^[A-Za-z_][A-Za-z0-9_.]{0,127}(Error|Exception|Timeout|Failure)[A-Za-z0-9_]*:'
            THEN pg_catalog.substring(
                error, '^([A-Za-z_][A-Za-z0-9_.]{0,127}(Error|Exception|Timeout|Failure)[A-Za-z0-9_]*):'
            )
        ELSE 'OTHER'
    END;
$$;

-- An error text with what differs between occurrences of one cause masked:
-- uuids (<uuid>), double- or single-quoted values (<q>), numbers (<n>);
-- white space runs become one space; at most 500 characters. A leading HTTP
-- status stays as it is (`HTTP 422: ...`): the handler's answer is the
-- cause, and 422 and 400 are different ones. Inlined like _dlq_error_class.
CREATE OR REPLACE FUNCTION outbox._dlq_error_pattern(error text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT pg_catalog.left(pg_catalog.btrim(
        CASE WHEN error OPERATOR(pg_catalog.~) '^HTTP [1-5][0-9][0-9]($|[^0-9])'
            THEN pg_catalog.substr(error, 1, 8) ELSE '' END
        OPERATOR(pg_catalog.||)
        pg_catalog.regexp_replace(pg_catalog.regexp_replace(
            pg_catalog.regexp_replace(pg_catalog.regexp_replace(pg_catalog.regexp_replace(
                CASE WHEN error OPERATOR(pg_catalog.~) '^HTTP [1-5][0-9][0-9]($|[^0-9])'
                    THEN pg_catalog.substr(error, 9) ELSE coalesce(error, '') END,
                '[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}', '<uuid>', 'g'),
                '"([^"\\]|\\.)*"', '<q>', 'g'),
                '''([^'']|'''')*''', '<q>', 'g'),
            '[0-9]+([.][0-9]+)?', '<n>', 'g'),
            '\s+', ' ', 'g')),
        500);
$$;

CREATE OR REPLACE FUNCTION outbox.dlq_error_class(error text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._dlq_error_class(error);
$$;
COMMENT ON FUNCTION outbox.dlq_error_class(text) IS
'An error''s class: 4xx/5xx for HTTP nnn, CODE for "CODE: ...", the exception name for "NameError: ...", else OTHER.';

CREATE OR REPLACE FUNCTION outbox.dlq_error_pattern(error text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._dlq_error_pattern(error);
$$;
COMMENT ON FUNCTION outbox.dlq_error_pattern(text) IS
'An error with uuids, quoted values and numbers masked (<uuid>, <q>, <n>): the cause part of a dead-letter group.';

-- The filter's checks (OB100), all of them before anything is read.
CREATE OR REPLACE FUNCTION outbox._check_dlq_filter(filter jsonb)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    bad text;
    value jsonb;
BEGIN
    IF jsonb_typeof(filter) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION 'INVALID_FILTER: the filter must be a JSON object, got %', coalesce(jsonb_typeof(filter), 'NULL')
            USING ERRCODE = 'OB100';
    END IF;
    SELECT string_agg(quote_literal(left(k, 64)), ', ') INTO bad
    FROM jsonb_object_keys(filter) AS k
    WHERE k NOT IN ('side', 'owner', 'subject', 'error', 'tenant', 'since', 'until', 'group', 'ids', 'discarded');
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_FILTER: unknown key %', bad
            USING ERRCODE = 'OB100',
                  HINT = 'Keys: side, owner, subject, error, tenant, since, until, group, ids, discarded.';
    END IF;
    -- null stands for "any" everywhere; every other value must be a string
    -- but discarded (a boolean) and ids (an array).
    SELECT string_agg(f.key, ', ') INTO bad
    FROM jsonb_each(filter) AS f (key, value)
    WHERE jsonb_typeof(f.value) <> 'null'
        AND jsonb_typeof(f.value) <> CASE f.key WHEN 'discarded' THEN 'boolean' WHEN 'ids' THEN 'array' ELSE 'string' END;
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'INVALID_FILTER: wrong JSON type for %', bad
            USING ERRCODE = 'OB100', HINT = 'discarded is a boolean, ids an array of uuids, every other key a string.';
    END IF;
    IF filter ->> 'side' NOT IN ('outbox', 'inbox') THEN
        RAISE EXCEPTION 'INVALID_FILTER: side must be outbox or inbox, got %', quote_literal(left(filter ->> 'side', 50))
            USING ERRCODE = 'OB100';
    END IF;
    IF filter ->> 'owner' !~ '^[A-Za-z0-9_.-]{1,128}$' THEN
        RAISE EXCEPTION 'INVALID_FILTER: owner % is not a context or handler name ([A-Za-z0-9_.-], 1-128 chars)', quote_literal(left(filter ->> 'owner', 150))
            USING ERRCODE = 'OB100';
    END IF;
    IF filter ->> 'subject' ~ '\s' OR length(filter ->> 'subject') NOT BETWEEN 1 AND 1024 THEN
        RAISE EXCEPTION 'INVALID_FILTER: subject is not a NATS subject of 1-1024 characters'
            USING ERRCODE = 'OB100';
    END IF;
    IF length(filter ->> 'error') NOT BETWEEN 1 AND 1000 OR length(filter ->> 'tenant') NOT BETWEEN 1 AND 255 THEN
        RAISE EXCEPTION 'INVALID_FILTER: error (1-1000 characters) or tenant (1-255) is empty or too long'
            USING ERRCODE = 'OB100';
    END IF;
    IF filter ->> 'group' !~ '^[0-9a-f]{32}$' THEN
        RAISE EXCEPTION 'INVALID_FILTER: group % is not a group id (32 hex digits)', quote_literal(left(filter ->> 'group', 50))
            USING ERRCODE = 'OB100';
    END IF;
    BEGIN
        IF NOT (coalesce((filter ->> 'since')::timestamptz, now()) BETWEEN '1900-01-01 00:00:00+00' AND '10000-01-01 00:00:00+00'
            AND coalesce((filter ->> 'until')::timestamptz, now()) BETWEEN '1900-01-01 00:00:00+00' AND '10000-01-01 00:00:00+00') THEN
            RAISE EXCEPTION 'since or until out of range' USING ERRCODE = '22008';
        END IF;
    EXCEPTION WHEN data_exception THEN
        RAISE EXCEPTION 'INVALID_FILTER: since and until must be times from 1900 to 9999 (ISO 8601 with an offset)'
            USING ERRCODE = 'OB100';
    END;
    value := filter -> 'ids';
    IF jsonb_typeof(value) = 'array' THEN
        IF jsonb_array_length(value) NOT BETWEEN 1 AND 10000 THEN
            RAISE EXCEPTION 'INVALID_FILTER: ids must hold 1 to 10000 ids, got %', jsonb_array_length(value)
                USING ERRCODE = 'OB100';
        END IF;
        IF EXISTS (
            SELECT FROM jsonb_array_elements(value) AS i (id)
            WHERE jsonb_typeof(i.id) <> 'string'
                OR (i.id #>> '{}') !~* '^\{?[0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12}\}?$'
        ) THEN
            RAISE EXCEPTION 'INVALID_FILTER: ids must be uuids as strings'
                USING ERRCODE = 'OB100';
        END IF;
    END IF;
END;
$$;

-- Every dead letter, classified once: when a row becomes a dead letter (or
-- changes while it is one: discarded, restored, asked to replay), a trigger
-- on its table writes its entry here with its group (error class, pattern
-- and group id computed then, never again at a page view), and deletes it
-- when the row leaves. The pages read only this table: at 20,000 dead
-- letters, classifying every row at every call cost 2 to 4 s a page. Holds
-- what _dlq_rows returns; handler is '' for the outbox (part of the key).
-- Granted to no one: the SECURITY DEFINER functions below read it.
CREATE TABLE IF NOT EXISTS outbox.dlq_entries (
    side text NOT NULL,
    owner text NOT NULL,
    id uuid NOT NULL,
    handler text NOT NULL,
    subject text NOT NULL,
    tenant text,
    attempts integer NOT NULL,
    last_error text,
    error_class text NOT NULL,
    error_pattern text NOT NULL,
    group_id text NOT NULL,
    seen_at timestamptz NOT NULL,
    discarded boolean NOT NULL,
    refailed boolean NOT NULL,
    replays integer NOT NULL,
    redrive_pending boolean NOT NULL,
    replayable boolean NOT NULL,
    row_id bigint,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (side, id, handler),
    CONSTRAINT side_is_known CHECK (side IN ('outbox', 'inbox'))
);
COMMENT ON TABLE outbox.dlq_entries IS
'Every dead letter of both sides with its group; kept by triggers on outbox.events and inbox.messages.';
-- A group's page (newest first, keyset), the groups' newest error, the list.
CREATE INDEX IF NOT EXISTS dlq_entries_group_idx ON outbox.dlq_entries (group_id, seen_at DESC, side, id, handler);
CREATE INDEX IF NOT EXISTS dlq_entries_seen_idx ON outbox.dlq_entries (seen_at DESC, side, id, handler);
CREATE INDEX IF NOT EXISTS dlq_entries_owner_idx ON outbox.dlq_entries (owner, side);

-- Writes a dead letter's entry: a new one, or every column of the one it
-- replaces (same side, id and handler), with its error's class and pattern
-- and its group: the md5 of side, owner, subject, class and pattern. The
-- one writer of an entry, under _dlq_enter_event and _dlq_enter_message.
CREATE OR REPLACE FUNCTION outbox._dlq_enter(
    side text, owner text, id uuid, handler text, subject text, tenant text, attempts integer, last_error text,
    seen_at timestamptz, discarded boolean, refailed boolean, replays integer, redrive_pending boolean,
    replayable boolean, row_id bigint, created_at timestamptz
)
RETURNS void
LANGUAGE sql
SET search_path TO pg_catalog, pg_temp
AS $$
    INSERT INTO outbox.dlq_entries (
        side, owner, id, handler, subject, tenant, attempts, last_error, error_class, error_pattern, group_id,
        seen_at, discarded, refailed, replays, redrive_pending, replayable, row_id, created_at
    )
    SELECT
        _dlq_enter.side, _dlq_enter.owner, _dlq_enter.id, _dlq_enter.handler, _dlq_enter.subject,
        _dlq_enter.tenant, _dlq_enter.attempts, _dlq_enter.last_error, c.cls, c.pattern,
        md5(concat_ws(E'\n', _dlq_enter.side, _dlq_enter.owner, _dlq_enter.subject, c.cls, c.pattern)),
        _dlq_enter.seen_at, _dlq_enter.discarded, _dlq_enter.refailed, _dlq_enter.replays,
        _dlq_enter.redrive_pending, _dlq_enter.replayable, _dlq_enter.row_id, _dlq_enter.created_at
    FROM (
        SELECT outbox._dlq_error_class(_dlq_enter.last_error) AS cls,
            outbox._dlq_error_pattern(_dlq_enter.last_error) AS pattern
    ) AS c
    ON CONFLICT ON CONSTRAINT dlq_entries_pkey DO UPDATE
    SET owner = excluded.owner, subject = excluded.subject, tenant = excluded.tenant, attempts = excluded.attempts,
        last_error = excluded.last_error, error_class = excluded.error_class,
        error_pattern = excluded.error_pattern, group_id = excluded.group_id, seen_at = excluded.seen_at,
        discarded = excluded.discarded, refailed = excluded.refailed, replays = excluded.replays,
        redrive_pending = excluded.redrive_pending, replayable = excluded.replayable,
        row_id = excluded.row_id, created_at = excluded.created_at;
$$;

-- An outbox event's entry, written or removed as its status says.
CREATE OR REPLACE FUNCTION outbox._dlq_enter_event(e outbox.events)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    n integer;
    discarded boolean;
BEGIN
    IF e.status <> 'DEAD_LETTER' THEN
        DELETE FROM outbox.dlq_entries AS x WHERE x.side = 'outbox' AND x.id = e.event_id AND x.handler = '';
        RETURN;
    END IF;
    SELECT count(*) INTO n FROM outbox.requeue_log AS q WHERE q.event_id = e.event_id AND q.from_status = 'DEAD_LETTER';
    discarded := EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = e.event_id);
    -- A row written around emit may have no subject (the relay dead-letters it
    -- BAD_SUBJECT): its entry says '' rather than fail the relay's mark.
    PERFORM outbox._dlq_enter(
        side => 'outbox', owner => e.context, id => e.event_id, handler => '', subject => coalesce(e.subject, ''),
        tenant => e.tenant_id, attempts => e.attempts, last_error => e.last_error,
        seen_at => coalesce(e.claimed_at, e.created_at), discarded => discarded, refailed => n > 0, replays => n,
        redrive_pending => FALSE, replayable => NOT discarded, row_id => e.id, created_at => e.created_at
    );
END;
$$;

-- An inbox message's entry, written or removed as its status says.
CREATE OR REPLACE FUNCTION outbox._dlq_enter_message(m inbox.messages)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    asked boolean;
BEGIN
    IF m.status IS DISTINCT FROM 'DEAD_LETTER' THEN
        DELETE FROM outbox.dlq_entries AS x WHERE x.side = 'inbox' AND x.id = m.message_id AND x.handler = m.handler;
        RETURN;
    END IF;
    asked := coalesce((m.dlq_metadata ->> 'redrive_requested')::boolean, FALSE);
    PERFORM outbox._dlq_enter(
        side => 'inbox', owner => m.handler, id => m.message_id, handler => m.handler, subject => m.subject,
        tenant => m.envelope ->> 'tenant_id', attempts => m.attempts, last_error => m.last_error,
        seen_at => coalesce((m.dlq_metadata ->> 'dead_lettered_at')::timestamptz, m.received_at),
        discarded => m.dlq_metadata ? 'discarded',
        refailed => coalesce((m.dlq_metadata ->> 'dead_letters')::integer, 1) > 1,
        replays => coalesce((m.dlq_metadata ->> 'replay_attempts')::integer, 0)
            + coalesce((m.dlq_metadata ->> 'redrives')::integer, 0),
        redrive_pending => asked,
        replayable => NOT m.dlq_metadata ? 'discarded' AND m.envelope IS NOT NULL
            AND NOT m.dlq_metadata ? 'in_database' AND NOT asked,
        row_id => NULL, created_at => m.received_at
    );
END;
$$;

CREATE OR REPLACE FUNCTION outbox.tg_events__dlq_entry()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._dlq_enter_event(NEW);
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION outbox.tg_messages__dlq_entry()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        DELETE FROM outbox.dlq_entries AS x WHERE x.side = 'inbox' AND x.id = OLD.message_id AND x.handler = OLD.handler;
    ELSE
        PERFORM outbox._dlq_enter_message(NEW);
    END IF;
    RETURN NULL;
END;
$$;

-- Only updates that touch a dead letter fire (the WHEN clause runs without
-- entering PL/pgSQL): claim and mark of live events pay nothing. Outbox
-- events are never inserted as dead letters, nor deleted (a day leaves by
-- DROP of its partition: outbox.drop_archived deletes that day's entries).
CREATE OR REPLACE TRIGGER _600_dlq_entry
AFTER UPDATE ON outbox.events
FOR EACH ROW
WHEN (old.status = 'DEAD_LETTER' OR new.status = 'DEAD_LETTER')
EXECUTE FUNCTION outbox.tg_events__dlq_entry();
CREATE OR REPLACE TRIGGER _600_dlq_entry
AFTER UPDATE ON inbox.messages
FOR EACH ROW
WHEN (old.status = 'DEAD_LETTER' OR new.status = 'DEAD_LETTER')
EXECUTE FUNCTION outbox.tg_messages__dlq_entry();
CREATE OR REPLACE TRIGGER _600_dlq_entry_insert
AFTER INSERT ON inbox.messages
FOR EACH ROW
WHEN (new.status = 'DEAD_LETTER')
EXECUTE FUNCTION outbox.tg_messages__dlq_entry();
CREATE OR REPLACE TRIGGER _600_dlq_entry_delete
AFTER DELETE ON inbox.messages
FOR EACH ROW
WHEN (old.status = 'DEAD_LETTER')
EXECUTE FUNCTION outbox.tg_messages__dlq_entry();

-- Every dead letter the filter matches, both sides, with its group and
-- state: the rows of outbox.dlq_entries, handler NULL for the outbox. Called
-- by the functions below (already checked filter); granted to no one. No
-- SET clause: so that the planner inlines it into its callers (whose
-- search_path is pinned) and uses the entries' indexes for a group, an owner
-- or a time range.
CREATE OR REPLACE FUNCTION outbox._dlq_rows(filter jsonb)
RETURNS SETOF outbox.dlq_entries
LANGUAGE sql STABLE
AS $$
    SELECT
        x.side, x.owner, x.id, NULLIF(x.handler, ''), x.subject, x.tenant, x.attempts, x.last_error,
        x.error_class, x.error_pattern, x.group_id, x.seen_at, x.discarded, x.refailed,
        x.replays, x.redrive_pending, x.replayable, x.row_id, x.created_at
    FROM outbox.dlq_entries AS x
    WHERE (filter ->> 'side' IS NULL OR x.side = filter ->> 'side')
        AND (filter ->> 'owner' IS NULL OR x.owner = filter ->> 'owner')
        AND (filter ->> 'group' IS NULL OR x.group_id = filter ->> 'group')
        AND (filter ->> 'subject' IS NULL OR x.subject = filter ->> 'subject')
        AND (filter ->> 'tenant' IS NULL OR x.tenant = filter ->> 'tenant')
        AND (filter ->> 'since' IS NULL OR x.seen_at >= (filter ->> 'since')::timestamptz)
        AND (filter ->> 'until' IS NULL OR x.seen_at < (filter ->> 'until')::timestamptz)
        AND (filter ->> 'error' IS NULL OR strpos(lower(x.last_error), lower(filter ->> 'error')) > 0)
        AND (jsonb_typeof(filter -> 'ids') IS DISTINCT FROM 'array'
            OR x.id = ANY(ARRAY(SELECT (jsonb_array_elements_text(filter -> 'ids'))::uuid)))
        AND CASE coalesce(filter -> 'discarded', 'false')
            WHEN 'null' THEN TRUE WHEN 'true' THEN x.discarded ELSE NOT x.discarded END;
$$;

-- Dead letters grouped by cause, newest group first.
CREATE OR REPLACE FUNCTION outbox.dlq_groups(
    filter jsonb DEFAULT '{}'::jsonb,
    max_rows integer DEFAULT 100
)
RETURNS TABLE (
    group_id text,
    side text,
    owner text,
    subject text,
    error_class text,
    error_pattern text,
    sample_error text,
    dead_letters bigint,
    discarded bigint,
    refailed bigint,
    replayable bigint,
    first_seen timestamptz,
    last_seen timestamptz
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_dlq_filter(filter);
    PERFORM outbox._check_max_rows(max_rows);
    -- Counted over the entries (one pass, no regular expression: 100,000 in
    -- about 100 ms); what names a group (the same on all its rows) and its
    -- newest error are read by index for the groups shown only.
    RETURN QUERY
    SELECT
        g.group_id, k.side, k.owner, k.subject, k.error_class, k.error_pattern, k.last_error,
        g.live, g.gone, g.refailed, g.replayable, g.first_seen, g.last_seen
    FROM (
        SELECT
            r.group_id,
            count(*) FILTER (WHERE NOT r.discarded) AS live,
            count(*) FILTER (WHERE r.discarded) AS gone,
            count(*) FILTER (WHERE r.refailed) AS refailed,
            count(*) FILTER (WHERE r.replayable) AS replayable,
            min(r.seen_at) AS first_seen,
            max(r.seen_at) AS last_seen
        FROM outbox._dlq_rows(filter) AS r
        GROUP BY r.group_id
        ORDER BY max(r.seen_at) DESC, r.group_id
        LIMIT max_rows
    ) AS g
    CROSS JOIN LATERAL (
        SELECT x.side, x.owner, x.subject, x.error_class, x.error_pattern, x.last_error
        FROM outbox.dlq_entries AS x
        WHERE x.group_id = g.group_id
        ORDER BY x.seen_at DESC
        LIMIT 1
    ) AS k
    ORDER BY g.last_seen DESC, g.group_id;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_groups(jsonb, integer) IS
'Dead letters of both sides grouped by side, owner, subject and normalised error, with counts and first/last seen.';

-- Per side, context and owner: live and discarded dead letters, re-failures,
-- replays asked for and not yet taken, and (inbox) whether automated replay is
-- on. The backlog functions keep their columns (workers of older releases
-- read them) and count live dead letters only; the discarded are counted here.
CREATE OR REPLACE FUNCTION outbox.dlq_summary()
RETURNS TABLE (
    side text,
    context text,
    owner text,
    dead_letters bigint,
    discarded bigint,
    refailed bigint,
    redrive_pending bigint,
    replay_enabled boolean
)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT
        r.side,
        split_part(r.subject, '.', 1),
        r.owner,
        count(*) FILTER (WHERE NOT r.discarded),
        count(*) FILTER (WHERE r.discarded),
        count(*) FILTER (WHERE r.refailed AND NOT r.discarded),
        count(*) FILTER (WHERE r.redrive_pending),
        CASE WHEN r.side = 'inbox' THEN coalesce(bool_and(s.enabled), TRUE) END
    FROM outbox._dlq_rows('{"discarded": null}'::jsonb) AS r
    LEFT JOIN inbox.replay_switches AS s ON r.side = 'inbox' AND s.handler = r.owner
    GROUP BY r.side, split_part(r.subject, '.', 1), r.owner
    ORDER BY r.side, 2, r.owner;
$$;
COMMENT ON FUNCTION outbox.dlq_summary() IS
'Per side, context and owner: live and discarded dead letters, re-failures, pending replays, replay switch.';

-- Dead letters one by one, newest first, a page at a time: pass the last
-- row's cursor as `after` for the next page (OB107: not such a cursor).
CREATE OR REPLACE FUNCTION outbox.dlq_list(
    filter jsonb DEFAULT '{}'::jsonb,
    max_rows integer DEFAULT 100,
    after text DEFAULT NULL
)
RETURNS TABLE (
    side text,
    owner text,
    id uuid,
    handler text,
    subject text,
    tenant text,
    attempts integer,
    last_error text,
    error_class text,
    group_id text,
    seen_at timestamptz,
    discarded boolean,
    refailed boolean,
    replays integer,
    redrive_pending boolean,
    cursor text
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    c_seen timestamptz;
    c_side text;
    c_id uuid;
    c_handler text;
BEGIN
    PERFORM outbox._check_dlq_filter(filter);
    PERFORM outbox._check_max_rows(max_rows);
    IF after IS NOT NULL THEN
        BEGIN
            SELECT (a ->> 0)::timestamptz, a ->> 1, (a ->> 2)::uuid, a ->> 3
            INTO STRICT c_seen, c_side, c_id, c_handler
            FROM (SELECT after::jsonb AS a) AS x
            WHERE jsonb_typeof(x.a) = 'array' AND jsonb_array_length(x.a) = 4
                AND x.a ->> 0 IS NOT NULL AND x.a ->> 1 IS NOT NULL AND x.a ->> 2 IS NOT NULL AND x.a ->> 3 IS NOT NULL;
        EXCEPTION WHEN data_exception OR no_data_found THEN
            RAISE EXCEPTION 'INVALID_CURSOR: after must be the cursor of a row of outbox.dlq_list'
                USING ERRCODE = 'OB107';
        END;
    END IF;
    RETURN QUERY
    SELECT
        r.side, r.owner, r.id, r.handler, r.subject, r.tenant, r.attempts, r.last_error,
        r.error_class, r.group_id, r.seen_at, r.discarded, r.refailed, r.replays, r.redrive_pending,
        jsonb_build_array(r.seen_at, r.side, r.id, coalesce(r.handler, ''))::text
    FROM outbox._dlq_rows(filter) AS r
    WHERE after IS NULL
        OR r.seen_at < c_seen
        OR (r.seen_at = c_seen AND (r.side, r.id, coalesce(r.handler, '')) > (c_side, c_id, c_handler))
    ORDER BY r.seen_at DESC, r.side, r.id, coalesce(r.handler, '')
    LIMIT max_rows;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_list(jsonb, integer, text) IS
'Dead letters of both sides matching a filter, newest first, with keyset pagination (cursor -> after).';

-- One dead letter (live or discarded) as a JSON document: its envelope,
-- headers, payload (only for a session_user that may read the table, i.e.
-- not pgoutbox_viewer), recorded attempts and replay state, and its history
-- (requeues, redrives, discards and restores, newest first; seq is the
-- audit row's id in its own log, which orders entries of one transaction).
CREATE OR REPLACE FUNCTION outbox.dlq_show(
    side text,
    id uuid,
    handler text DEFAULT NULL
)
RETURNS jsonb
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    r record;
    doc jsonb;
    visible boolean;
    history jsonb;
BEGIN
    IF side IS NULL OR side NOT IN ('outbox', 'inbox') OR id IS NULL THEN
        RAISE EXCEPTION 'INVALID_FILTER: side (outbox or inbox) and id are required'
            USING ERRCODE = 'OB100';
    END IF;
    IF side = 'inbox' AND (handler IS NULL OR handler !~ '^[A-Za-z0-9_.-]{1,128}$') THEN
        RAISE EXCEPTION 'INVALID_FILTER: an inbox dead letter is named by its message id and handler'
            USING ERRCODE = 'OB100';
    END IF;
    SELECT x.* INTO r
    FROM outbox._dlq_rows(
        jsonb_build_object(
            'side', dlq_show.side, 'ids', jsonb_build_array(dlq_show.id), 'discarded', NULL, 'owner', dlq_show.handler
        )
    ) AS x;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'DEAD_LETTER_NOT_FOUND: no % dead letter % %', dlq_show.side, dlq_show.id, coalesce('for handler ' || dlq_show.handler, '')
            USING ERRCODE = 'OB105';
    END IF;
    doc := jsonb_build_object(
        'side', r.side, 'owner', r.owner, 'id', r.id, 'handler', r.handler, 'subject', r.subject,
        'status', 'DEAD_LETTER', 'discarded', r.discarded,
        'tenant', r.tenant, 'attempts', r.attempts, 'last_error', r.last_error,
        'error_class', r.error_class, 'error_pattern', r.error_pattern, 'group_id', r.group_id,
        'seen_at', r.seen_at, 'created_at', r.created_at, 'refailed', r.refailed, 'replays', r.replays,
        'redrive_pending', r.redrive_pending
    );
    IF side = 'outbox' THEN
        visible := has_table_privilege(session_user, 'outbox.events', 'SELECT');
        SELECT doc || jsonb_build_object(
            'envelope', to_jsonb(e) - 'payload' - 'headers',
            'headers', e.headers,
            'payload', CASE WHEN visible THEN e.payload END,
            'dlq_metadata', NULL, 'replay_enabled', NULL, 'dlq_stream', NULL, 'dlq_stream_sequence', NULL
        ) INTO doc
        FROM outbox.events AS e
        WHERE e.id = r.row_id AND e.created_at = r.created_at;
        SELECT coalesce(jsonb_agg(h ORDER BY h.at DESC, h.seq DESC), '[]') INTO history
        FROM (
            SELECT q.id AS seq, q.requeued_at AS at, 'requeue' AS action, q.requeued_by AS by, q.reason,
                jsonb_build_object('from_status', q.from_status, 'attempts_before', q.attempts_before,
                    'last_error', q.last_error) AS detail
            FROM outbox.requeue_log AS q WHERE q.event_id = r.id
            UNION ALL
            SELECT d.id, d.acted_at, d.action, d.acted_by, d.reason, jsonb_build_object('last_error', d.last_error)
            FROM outbox.discard_log AS d WHERE d.event_id = r.id
        ) AS h;
    ELSE
        visible := has_table_privilege(session_user, 'inbox.messages', 'SELECT');
        SELECT doc || jsonb_build_object(
            'envelope', m.envelope - 'payload',
            'headers', m.envelope -> 'headers',
            'payload', CASE WHEN visible THEN m.envelope -> 'payload' END,
            'dlq_metadata', m.dlq_metadata,
            'replay_enabled', coalesce(s.enabled, TRUE),
            -- the notice's place in the DLQ stream (inbox.record_dlq_notice)
            'dlq_stream', m.dlq_metadata -> 'dlq_stream',
            'dlq_stream_sequence', m.dlq_metadata -> 'dlq_stream_sequence'
        ) INTO doc
        FROM inbox.messages AS m
        LEFT JOIN inbox.replay_switches AS s ON s.handler = m.handler
        WHERE m.message_id = r.id AND m.handler = r.handler;
        SELECT coalesce(jsonb_agg(h ORDER BY h.at DESC, h.seq DESC), '[]') INTO history
        FROM (
            SELECT q.id AS seq, q.redriven_at AS at, 'redrive' AS action, q.redriven_by AS by, q.reason,
                jsonb_build_object('replay_attempts_before', q.replay_attempts_before,
                    'last_error', q.last_error) AS detail
            FROM inbox.redrive_log AS q WHERE q.message_id = r.id AND q.handler = r.handler
            UNION ALL
            SELECT d.id, d.acted_at, d.action, d.acted_by, d.reason, jsonb_build_object('last_error', d.last_error)
            FROM inbox.discard_log AS d WHERE d.message_id = r.id AND d.handler = r.handler
        ) AS h;
    END IF;
    RETURN doc || jsonb_build_object('payload_visible', visible, 'history', history);
END;
$$;
COMMENT ON FUNCTION outbox.dlq_show(text, uuid, text) IS
'One dead letter: envelope, headers, payload (for roles that may read the table), attempts, replay state, history.';

-- The rows an action may take now: replay the live replayable ones, discard
-- the live ones, restore the discarded ones; never an event of a sealed
-- (archived, read-only) partition, which refuses every UPDATE (OB056): one
-- such row would refuse its whole batch, at every run. They stay listed.
-- No SET clause, like _dlq_rows: inlined into its callers, whose plans see
-- the filter's values and take a group's or an owner's rows by index (with
-- SET it ran as a query of its own, with the filter unknown to its plan:
-- every entry scanned, 2 s a dialog at 100,000 dead letters).
CREATE OR REPLACE FUNCTION outbox._dlq_targets(filter jsonb, action text)
RETURNS TABLE (side text, id uuid, handler text, row_id bigint, created_at timestamptz, seen_at timestamptz)
LANGUAGE sql STABLE
AS $$
    WITH sealed AS (
        SELECT to_date(right(c.relname::text, 8), 'YYYYMMDD') AS day
        FROM pg_trigger AS t
        INNER JOIN pg_class AS c ON t.tgrelid = c.oid
        INNER JOIN pg_inherits AS i ON c.oid = i.inhrelid
        WHERE i.inhparent = 'outbox.events'::regclass
            AND t.tgname = '_050_archived_read_only'
            AND c.relname ~ '^events_p[0-9]{8}$'
    )
    SELECT r.side, r.id, r.handler, r.row_id, r.created_at, r.seen_at
    -- (jsonb_build_object is STABLE: a constant object keeps the filter foldable.)
    FROM outbox._dlq_rows(
        filter || CASE WHEN action = 'restore' THEN '{"discarded": true}'::jsonb ELSE '{"discarded": false}'::jsonb END
    ) AS r
    WHERE (action <> 'replay' OR r.replayable)
        AND (
            r.side = 'inbox'
            OR NOT EXISTS (SELECT 1 FROM sealed AS s WHERE s.day = (r.created_at AT TIME ZONE 'UTC')::date)
        );
$$;

-- An action of the dead-letter functions: replay, discard or restore
-- (OB106 otherwise). With may_act, also that session_user may run it: its
-- grant is that of the action's own function (outbox.dlq_replay, ...), so
-- only a role that may act by filter may prepare or take an action's
-- targets (42501 otherwise).
CREATE OR REPLACE FUNCTION outbox._check_dlq_action(action text, may_act boolean)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF action IS NULL OR action NOT IN ('replay', 'discard', 'restore') THEN
        RAISE EXCEPTION 'INVALID_ACTION: action must be replay, discard or restore, got %', quote_literal(left(coalesce(action, 'NULL'), 50))
            USING ERRCODE = 'OB106';
    END IF;
    IF may_act AND NOT has_function_privilege(
        session_user, format('outbox.dlq_%s(jsonb, text, integer)', action), 'EXECUTE'
    ) THEN
        RAISE EXCEPTION 'permission denied for function dlq_%', action USING ERRCODE = '42501';
    END IF;
END;
$$;

-- The exact number of rows an action would touch now, over all its batches.
CREATE OR REPLACE FUNCTION outbox.dlq_count(
    filter jsonb DEFAULT '{}'::jsonb,
    action text DEFAULT 'replay'
)
RETURNS bigint
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_dlq_filter(filter);
    PERFORM outbox._check_dlq_action(action, FALSE);
    RETURN (SELECT count(*) FROM outbox._dlq_targets(filter, action));
END;
$$;
COMMENT ON FUNCTION outbox.dlq_count(jsonb, text) IS
'How many dead letters outbox.dlq_replay / dlq_discard / dlq_restore would touch for this filter (all batches).';

-- The rows an action takes in this call: the oldest first, at most max_rows.
CREATE OR REPLACE FUNCTION outbox._dlq_batch(filter jsonb, action text, reason text, max_rows integer)
RETURNS TABLE (side text, id uuid, handler text, row_id bigint, created_at timestamptz)
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM outbox._check_text(reason, format('a %s''s reason', action), 1000, TRUE);
    PERFORM outbox._check_dlq_filter(filter);
    PERFORM outbox._check_max_rows(max_rows);
    RETURN QUERY
    SELECT t.side, t.id, t.handler, t.row_id, t.created_at
    FROM outbox._dlq_targets(filter, action) AS t
    ORDER BY t.seen_at, t.side, t.id, t.handler
    LIMIT max_rows;
END;
$$;

-- Applies `action` to the rows named by the parallel arrays (outbox: row id
-- and created_at; inbox: message id and handler), each only while it is
-- still what the action takes: replay a live dead letter (outbox
-- DEAD_LETTER -> PENDING as outbox.requeue does, audited in
-- outbox.requeue_log; inbox: due now for the replayer as inbox.redrive does,
-- audited in inbox.redrive_log, unless already asked for), discard a live one
-- (parked for good, kept, an inbox row's pending replay cancelled; audited in
-- outbox/inbox.discard_log), restore a discarded one (back to DEAD_LETTER,
-- parked). Returns how many it moved. The one writer of every dead-letter
-- action: dlq_replay/dlq_discard/dlq_restore (by filter) and dlq_act (a
-- prepared action's targets) pick the rows, this moves them.
CREATE OR REPLACE FUNCTION outbox._dlq_apply(
    action text,
    reason text,
    row_ids bigint[],
    created timestamptz[],
    message_ids uuid[],
    handlers text[]
)
RETURNS integer
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    outbox_moved integer;
    inbox_moved integer;
BEGIN
    IF action = 'replay' THEN
        PERFORM set_config('pgoutbox.requeue_reason', reason, true);
        UPDATE outbox.events AS e
        SET status = 'PENDING', attempts = 0, available_at = now()
        FROM unnest(row_ids, created) AS p (row_id, created_at)
        WHERE e.id = p.row_id AND e.created_at = p.created_at AND e.status = 'DEAD_LETTER'
            AND NOT EXISTS (SELECT 1 FROM outbox.discarded_events AS d WHERE d.event_id = e.event_id);
        GET DIAGNOSTICS outbox_moved = ROW_COUNT;
        PERFORM set_config('pgoutbox.requeue_reason', '', true);
        RETURN outbox_moved + inbox._redrive(message_ids, handlers, reason, FALSE);
    END IF;
    PERFORM set_config('pgoutbox.dlq_action', action, true);
    PERFORM set_config('pgoutbox.dlq_reason', reason, true);
    IF action = 'discard' THEN
        -- The mark's triggers check the move and write the audit row.
        INSERT INTO outbox.discarded_events (event_id, row_id, created_at)
        SELECT e.event_id, e.id, e.created_at
        FROM outbox.events AS e
        INNER JOIN unnest(row_ids, created) AS p (row_id, created_at)
            ON e.id = p.row_id AND e.created_at = p.created_at
        WHERE e.status = 'DEAD_LETTER'
        ON CONFLICT (event_id) DO NOTHING;
        GET DIAGNOSTICS outbox_moved = ROW_COUNT;
        UPDATE inbox.messages AS m
        SET dlq_metadata = m.dlq_metadata || jsonb_build_object(
            'discarded', jsonb_build_object('at', now(), 'by', session_user, 'reason', _dlq_apply.reason),
            'next_replay_at', NULL,
            'redrive_requested', FALSE
        )
        FROM unnest(message_ids, handlers) AS p (message_id, handler)
        WHERE m.message_id = p.message_id AND m.handler = p.handler
            AND m.status = 'DEAD_LETTER' AND NOT m.dlq_metadata ? 'discarded';
        GET DIAGNOSTICS inbox_moved = ROW_COUNT;
    ELSE
        DELETE FROM outbox.discarded_events AS d
        USING unnest(row_ids, created) AS p (row_id, created_at)
        WHERE d.row_id = p.row_id AND d.created_at = p.created_at;
        GET DIAGNOSTICS outbox_moved = ROW_COUNT;
        UPDATE inbox.messages AS m
        SET dlq_metadata = m.dlq_metadata - 'discarded'
        FROM unnest(message_ids, handlers) AS p (message_id, handler)
        WHERE m.message_id = p.message_id AND m.handler = p.handler
            AND m.status = 'DEAD_LETTER' AND m.dlq_metadata ? 'discarded';
        GET DIAGNOSTICS inbox_moved = ROW_COUNT;
    END IF;
    PERFORM set_config('pgoutbox.dlq_action', '', true);
    PERFORM set_config('pgoutbox.dlq_reason', '', true);
    RETURN outbox_moved + inbox_moved;
END;
$$;

-- One batch of `action` by filter: the rows _dlq_batch picks, moved by _dlq_apply.
CREATE OR REPLACE FUNCTION outbox._dlq_act_on(filter jsonb, action text, reason text, max_rows integer)
RETURNS integer
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    picked record;
BEGIN
    SELECT
        coalesce(array_agg(b.row_id) FILTER (WHERE b.side = 'outbox'), '{}') AS row_ids,
        coalesce(array_agg(b.created_at) FILTER (WHERE b.side = 'outbox'), '{}') AS created,
        coalesce(array_agg(b.id) FILTER (WHERE b.side = 'inbox'), '{}') AS message_ids,
        coalesce(array_agg(b.handler) FILTER (WHERE b.side = 'inbox'), '{}') AS handlers
    INTO picked
    FROM outbox._dlq_batch(filter, action, reason, max_rows) AS b;
    RETURN outbox._dlq_apply(action, reason, picked.row_ids, picked.created, picked.message_ids, picked.handlers);
END;
$$;

-- Replays the dead letters matching the filter, max_rows per call, and
-- returns how many it took; call again until 0 (each call its own
-- transaction). Outbox: DEAD_LETTER -> PENDING as outbox.requeue does,
-- audited in outbox.requeue_log. Inbox: due now for the replayer, as
-- inbox.redrive does, audited in inbox.redrive_log; rows already asked for,
-- without an envelope or of an in-database handler are not taken. A row
-- that fails again matches again: a bulk action that must end takes a set
-- fixed beforehand (dlq_prepare, dlq_act).
CREATE OR REPLACE FUNCTION outbox.dlq_replay(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._dlq_act_on(filter, 'replay', reason, max_rows);
$$;
COMMENT ON FUNCTION outbox.dlq_replay(jsonb, text, integer) IS
'Requeues (outbox) or redrives (inbox) up to max_rows dead letters matching a filter, audited; call until 0.';

-- Discards the live dead letters matching the filter, max_rows per call
-- (call until 0): parked for good, kept, reversible by dlq_restore; an inbox
-- row's pending replay is cancelled. Audited in outbox/inbox.discard_log.
CREATE OR REPLACE FUNCTION outbox.dlq_discard(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._dlq_act_on(filter, 'discard', reason, max_rows);
$$;
COMMENT ON FUNCTION outbox.dlq_discard(jsonb, text, integer) IS
'Discards up to max_rows live dead letters matching a filter (kept, restorable), audited; call until 0.';

-- Restores the discarded dead letters matching the filter, max_rows per
-- call (call until 0): back to DEAD_LETTER, parked (no replay scheduled).
CREATE OR REPLACE FUNCTION outbox.dlq_restore(
    filter jsonb,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE sql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT outbox._dlq_act_on(filter, 'restore', reason, max_rows);
$$;
COMMENT ON FUNCTION outbox.dlq_restore(jsonb, text, integer) IS
'Restores up to max_rows discarded dead letters matching a filter to DEAD_LETTER, audited; call until 0.';

-- A bulk action of the console (or any operator) on a set fixed when it is
-- confirmed: outbox.dlq_prepare records the rows an action would touch now
-- as the action's targets and returns their number (the count the
-- confirmation shows); outbox.dlq_act then takes them in batches, each
-- target once, through dlq_replay / dlq_discard / dlq_restore (audited as
-- they are), until none is left or the action is stopped. A row that fails
-- again while the action runs matches the filter again but is not a target
-- any more: it is counted as failed again (dlq_action_progress), never taken
-- twice. These two tables are the actions' own bookkeeping: no row of
-- outbox.events or inbox.messages is written here but through the audited
-- action functions. An action older than a week leaves with its targets
-- (dlq_prepare sweeps them).
CREATE TABLE IF NOT EXISTS outbox.dlq_actions (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    action text NOT NULL,
    filter jsonb NOT NULL,
    created_by text NOT NULL DEFAULT session_user,
    created_at timestamptz NOT NULL DEFAULT now(),
    total bigint NOT NULL DEFAULT 0,
    reason text,
    started_at timestamptz,
    taken bigint NOT NULL DEFAULT 0,
    touched bigint NOT NULL DEFAULT 0,
    stopped_at timestamptz,
    stopped_by text,
    finished_at timestamptz,
    CONSTRAINT action_is_known CHECK (action IN ('replay', 'discard', 'restore')),
    CONSTRAINT touched_at_most_taken_at_most_total CHECK (touched <= taken AND taken <= total)
);
COMMENT ON TABLE outbox.dlq_actions IS
'Bulk dead-letter actions on a set fixed at confirmation (outbox.dlq_prepare), taken in batches by outbox.dlq_act.';

CREATE TABLE IF NOT EXISTS outbox.dlq_action_targets (
    action_id bigint NOT NULL REFERENCES outbox.dlq_actions (id) ON DELETE CASCADE,
    seq integer NOT NULL,
    side text NOT NULL,
    id uuid NOT NULL,
    handler text,
    row_id bigint,
    created_at timestamptz,
    taken_at timestamptz,
    PRIMARY KEY (action_id, seq),
    CONSTRAINT side_is_known CHECK (side IN ('outbox', 'inbox'))
);
COMMENT ON TABLE outbox.dlq_action_targets IS
'The rows a bulk action was confirmed for, in the order it takes them; taken_at: when a batch took the row.';
-- The next batch: the targets not taken yet, in order.
CREATE INDEX IF NOT EXISTS dlq_action_targets_open_idx ON outbox.dlq_action_targets (action_id, seq)
WHERE taken_at IS NULL;

-- Fixes the set an action will touch (the rows dlq_count counts now) and
-- returns the action's id and that number. Only a role that may run the
-- action itself may prepare it (42501 otherwise).
CREATE OR REPLACE FUNCTION outbox.dlq_prepare(
    filter jsonb,
    action text
)
RETURNS TABLE (action_id bigint, total bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    new_id bigint;
    n bigint;
BEGIN
    PERFORM outbox._check_dlq_filter(filter);
    PERFORM outbox._check_dlq_action(action, TRUE);
    DELETE FROM outbox.dlq_actions AS a WHERE a.created_at < now() - interval '7 days';
    INSERT INTO outbox.dlq_actions (action, filter) VALUES (dlq_prepare.action, dlq_prepare.filter)
    RETURNING id INTO new_id;
    INSERT INTO outbox.dlq_action_targets (action_id, seq, side, id, handler, row_id, created_at)
    SELECT
        new_id, row_number() OVER (ORDER BY t.seen_at, t.side, t.id, t.handler),
        t.side, t.id, t.handler, t.row_id, t.created_at
    FROM outbox._dlq_targets(filter, action) AS t;
    GET DIAGNOSTICS n = ROW_COUNT;
    UPDATE outbox.dlq_actions AS a SET total = n WHERE a.id = new_id;
    RETURN QUERY SELECT new_id, n;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_prepare(jsonb, text) IS
'Fixes the rows a replay/discard/restore would touch now as an action''s targets: (action_id, total).';

-- The action `action_id` of this session_user (OB110 otherwise).
CREATE OR REPLACE FUNCTION outbox._dlq_action(action_id bigint)
RETURNS outbox.dlq_actions
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    a outbox.dlq_actions;
BEGIN
    SELECT x.* INTO a FROM outbox.dlq_actions AS x WHERE x.id = action_id AND x.created_by = session_user;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'ACTION_NOT_FOUND: no action % prepared by %', action_id, session_user
            USING ERRCODE = 'OB110';
    END IF;
    RETURN a;
END;
$$;

-- One batch of a prepared action: takes its next max_rows targets (each
-- once: taken_at is set in the same transaction) and acts on those still
-- eligible, through the action's own audited function. Returns the targets
-- taken (those no longer eligible, e.g. replayed by someone else meanwhile,
-- are taken and not touched); 0 when none is left or the action was stopped.
CREATE OR REPLACE FUNCTION outbox.dlq_act(
    action_id bigint,
    reason text,
    max_rows integer DEFAULT 100
)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    a outbox.dlq_actions;
    n integer;
    row_ids bigint[];
    created timestamptz[];
    message_ids uuid[];
    handlers text[];
    moved integer := 0;
BEGIN
    PERFORM outbox._check_text(reason, 'a bulk action''s reason', 1000, TRUE);
    PERFORM outbox._check_max_rows(max_rows);
    a := outbox._dlq_action(action_id);
    PERFORM outbox._check_dlq_action(a.action, TRUE);
    IF a.stopped_at IS NOT NULL OR a.finished_at IS NOT NULL THEN
        RETURN 0;
    END IF;
    WITH next AS (
        SELECT t.action_id, t.seq
        FROM outbox.dlq_action_targets AS t
        WHERE t.action_id = a.id AND t.taken_at IS NULL
        ORDER BY t.seq
        LIMIT max_rows
        FOR UPDATE SKIP LOCKED
    ),
    taken AS (
        UPDATE outbox.dlq_action_targets AS t
        SET taken_at = now()
        FROM next
        WHERE t.action_id = next.action_id AND t.seq = next.seq
        RETURNING t.side, t.id, t.handler, t.row_id, t.created_at
    )
    SELECT
        count(*),
        coalesce(array_agg(k.row_id) FILTER (WHERE k.side = 'outbox'), '{}'),
        coalesce(array_agg(k.created_at) FILTER (WHERE k.side = 'outbox'), '{}'),
        coalesce(array_agg(k.id) FILTER (WHERE k.side = 'inbox'), '{}'),
        coalesce(array_agg(k.handler) FILTER (WHERE k.side = 'inbox'), '{}')
    INTO n, row_ids, created, message_ids, handlers
    FROM taken AS k;
    IF n > 0 THEN
        moved := outbox._dlq_apply(a.action, reason, row_ids, created, message_ids, handlers);
    END IF;
    UPDATE outbox.dlq_actions AS x
    SET reason = coalesce(x.reason, dlq_act.reason),
        started_at = coalesce(x.started_at, now()),
        taken = x.taken + n,
        touched = x.touched + moved,
        finished_at = CASE WHEN n = 0 THEN now() END
    WHERE x.id = a.id;
    RETURN n;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_act(bigint, text, integer) IS
'One batch of a prepared action: its next max_rows targets, each taken once; 0 when done or stopped.';

-- Stops a running action of this session_user: no batch takes anything after.
CREATE OR REPLACE FUNCTION outbox.dlq_stop(action_id bigint)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    a outbox.dlq_actions;
BEGIN
    a := outbox._dlq_action(action_id);
    UPDATE outbox.dlq_actions AS x SET stopped_at = now(), stopped_by = session_user
    WHERE x.id = a.id AND x.stopped_at IS NULL AND x.finished_at IS NULL;
    RETURN FOUND;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_stop(bigint) IS
'Stops an action of outbox.dlq_prepare / dlq_act: later batches take nothing. True when it was running.';

-- Where an action of this session_user stands: its counts, and (replay) how
-- many of the rows it took are dead letters again since (dead-lettered after
-- the batch that took them).
CREATE OR REPLACE FUNCTION outbox.dlq_action_progress(action_id bigint)
RETURNS TABLE (
    action text,
    total bigint,
    taken bigint,
    touched bigint,
    failed_again bigint,
    started_at timestamptz,
    stopped_at timestamptz,
    finished_at timestamptz
)
LANGUAGE plpgsql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    a outbox.dlq_actions;
    again bigint := 0;
BEGIN
    a := outbox._dlq_action(action_id);
    IF a.action = 'replay' THEN
        SELECT count(*) INTO again
        FROM outbox.dlq_action_targets AS t
        WHERE t.action_id = a.id AND t.taken_at IS NOT NULL
            AND CASE t.side
                WHEN 'outbox' THEN EXISTS (
                    SELECT 1 FROM outbox.events AS e
                    WHERE e.id = t.row_id AND e.created_at = t.created_at
                        AND e.status = 'DEAD_LETTER' AND e.claimed_at > t.taken_at
                )
                ELSE EXISTS (
                    SELECT 1 FROM inbox.messages AS m
                    WHERE m.message_id = t.id AND m.handler = t.handler AND m.status = 'DEAD_LETTER'
                        AND (m.dlq_metadata ->> 'dead_lettered_at')::timestamptz > t.taken_at
                )
            END;
    END IF;
    RETURN QUERY SELECT a.action, a.total, a.taken, a.touched, again, a.started_at, a.stopped_at, a.finished_at;
END;
$$;
COMMENT ON FUNCTION outbox.dlq_action_progress(bigint) IS
'An action''s total, taken, touched and (replay) failed-again counts, and when it started, stopped or finished.';
