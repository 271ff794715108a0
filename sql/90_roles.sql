-- Roles (NOLOGIN groups: grant them to your login roles). Everything goes
-- through SECURITY DEFINER functions with a pinned search_path; the tables
-- themselves are granted to nobody but the owner, and admins may only read.
-- Roles are cluster-wide: created once, shared by every database using pgoutbox.

DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['pgoutbox_writer', 'pgoutbox_relay', 'pgoutbox_consumer', 'pgoutbox_admin'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', r);
        END IF;
    END LOOP;
END;
$$;

REVOKE ALL ON SCHEMA outbox, inbox FROM public;
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA outbox, inbox FROM public;

GRANT USAGE ON SCHEMA outbox, inbox
TO pgoutbox_writer, pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin;

GRANT EXECUTE ON FUNCTION
outbox.emit(text, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz)
TO pgoutbox_writer;

GRANT EXECUTE ON FUNCTION
outbox.claim(text, integer, interval),
outbox.mark_published(uuid, uuid[]),
outbox.mark_failed(uuid, uuid[], text[], timestamptz[]),
outbox.notify_throttle()
TO pgoutbox_relay;

GRANT EXECUTE ON FUNCTION
inbox.receive(uuid, text, text, jsonb),
inbox.mark_processed(uuid, text),
inbox.record_error(uuid, text, text, boolean, interval),
inbox.claim_replays(text, integer)
TO pgoutbox_consumer;

GRANT EXECUTE ON FUNCTION
outbox.requeue(uuid[], text),
outbox.create_partitions(integer, date),
outbox.set_notify_throttle(interval),
outbox.notify_throttle(),
inbox.redrive(text, uuid[], text),
inbox.set_replay(text, boolean, text)
TO pgoutbox_admin;

-- Read-only functions every worker uses for health and start-up checks; the
-- relay keeps partitions created ahead as part of its housekeeping.
GRANT EXECUTE ON FUNCTION
outbox.schema_version(), outbox.backlog(text), outbox.dead_letters(text, integer),
inbox.backlog(text), inbox.dead_letters(text, integer)
TO pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin;
GRANT EXECUTE ON FUNCTION outbox.create_partitions(integer, date) TO pgoutbox_relay;

-- Named tables, not ALL TABLES: partitions are read through their parent,
-- and a re-run must not widen grants to partitions created since.
GRANT SELECT ON outbox.events, outbox.requeue_log, outbox.schema_migrations, outbox.wakeup_policy,
inbox.messages, inbox.replay_switches, inbox.redrive_log TO pgoutbox_admin;
