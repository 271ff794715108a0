-- Roles (NOLOGIN groups: grant them to your login roles). Everything goes
-- through SECURITY DEFINER functions with a pinned search_path; the tables
-- themselves are granted to nobody but the owner, and admins may only read.
-- Roles are cluster-wide: created once, shared by every database using pgoutbox.
-- Every GRANT of the schema lives in this file, which runs after every other
-- definition file (a function must exist before it is granted). Every role
-- is created here, each granted what it needs below.

DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY[
        'pgoutbox_writer', 'pgoutbox_relay', 'pgoutbox_consumer', 'pgoutbox_admin',
        'pgoutbox_archiver', 'pgoutbox_viewer', 'pgoutbox_backfiller'
    ] LOOP
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

-- The command inbox: called by applications inside their own transactions.
GRANT EXECUTE ON FUNCTION
inbox.claim_command(text, text),
inbox.complete_command(text, text, jsonb),
inbox.fail_command(text, text, text),
inbox.lookup_command(text, text)
TO pgoutbox_writer;

GRANT EXECUTE ON FUNCTION
outbox.claim(text, integer, interval),
outbox.mark_published(uuid, uuid[]),
outbox.mark_failed(uuid, uuid[], text[], timestamptz[]),
outbox.hand_back(uuid, uuid[], text),
outbox.notify_throttle()
TO pgoutbox_relay;

GRANT EXECUTE ON FUNCTION
inbox.receive(uuid, text, text, jsonb),
inbox.mark_processed(uuid, text),
inbox.record_error(uuid, text, text, boolean, interval),
inbox.record_dlq_notice(uuid, text, text, bigint),
inbox.claim_replays(text, integer),
inbox.receive_batch(text, uuid[], text[], jsonb[]),
inbox.settle(text, uuid[], uuid[], text[]),
inbox.receive_processed(text, uuid[], text[], jsonb[]),
inbox.record_in_database_error(uuid, text, text, jsonb, text, boolean),
inbox.receive_batch_as(text, uuid[], text[], jsonb[], integer)
TO pgoutbox_consumer;

-- Upcasters: the admin registers them; the consumer (in-database handlers,
-- the replayer) and the admin run and check chains.
GRANT EXECUTE ON FUNCTION
inbox.register_upcaster(text, integer, regprocedure),
inbox.unregister_upcaster(text, integer)
TO pgoutbox_admin;
GRANT EXECUTE ON FUNCTION
inbox.upcast(text, integer, integer, jsonb),
inbox.upcast_gaps(text, integer)
TO pgoutbox_consumer, pgoutbox_admin;
-- An application upcasts in its own transaction too (docs/in-database.md).
GRANT EXECUTE ON FUNCTION inbox.upcast(text, integer, integer, jsonb) TO pgoutbox_writer;

GRANT EXECUTE ON FUNCTION
outbox.requeue(uuid[], text),
outbox.create_partitions(integer, date),
outbox.set_notify_throttle(interval),
outbox.notify_throttle(),
inbox.redrive(text, uuid[], text),
inbox.set_replay(text, boolean, text)
TO pgoutbox_admin;
GRANT EXECUTE ON FUNCTION outbox.requeue_completed(uuid[], text, timestamptz, bigint[]) TO pgoutbox_admin;
-- Tenants' weights in fair claims (sql/30_outbox_api.sql), audited.
GRANT EXECUTE ON FUNCTION outbox.set_tenant_weight(text, integer, text) TO pgoutbox_admin;
GRANT SELECT ON outbox.tenant_weights, outbox.tenant_weight_log TO pgoutbox_admin;

-- Read-only functions every worker uses for health and start-up checks; the
-- relay keeps partitions created ahead as part of its housekeeping.
GRANT EXECUTE ON FUNCTION
outbox.schema_version(), outbox.serves_workers_from(),
outbox.backlog(text), outbox.dead_letters(text, integer),
inbox.backlog(text), inbox.dead_letters(text, integer)
TO pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin;
-- What holds back vacuum (the relay exports it as a metric).
GRANT EXECUTE ON FUNCTION outbox.oldest_snapshots(integer)
TO pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin;
GRANT EXECUTE ON FUNCTION outbox.create_partitions(integer, date) TO pgoutbox_relay;

-- Named tables, not ALL TABLES: partitions are read through their parent,
-- and a re-run must not widen grants to partitions created since.
GRANT SELECT ON outbox.events, outbox.requeue_log, outbox.schema_migrations, outbox.wakeup_policy,
inbox.messages, inbox.replay_switches, inbox.redrive_log, inbox.commands, inbox.upcasters TO pgoutbox_admin;

-- pgoutbox_archiver: what the archival job and the report need, nothing more.
-- It reads the three tables and the partitions it sealed (Spark reads them over
-- JDBC) and calls the archival steps; it cannot write or delete rows, nor
-- void an audit. (seal_partition grants it each partition it seals.)
GRANT USAGE ON SCHEMA outbox, inbox TO pgoutbox_archiver;
GRANT SELECT ON outbox.events, inbox.messages, inbox.commands TO pgoutbox_archiver;
GRANT SELECT ON outbox.archive_audit, inbox.retention_policy, inbox.command_policy TO pgoutbox_admin;
GRANT SELECT ON outbox.archive_seal TO pgoutbox_admin;

GRANT EXECUTE ON FUNCTION
outbox.checksum_columns(text),
outbox.archive_figures(text, date),
outbox.archivable_partitions(interval, interval),
inbox.archivable_days(interval, interval),
inbox.stream_max_age(),
outbox.seal_partition(text, interval, interval, interval),
outbox.seal_figures(text),
outbox.id_range(),
inbox.received_range(),
outbox.record_archive(text, date, bigint, numeric, text),
outbox.drop_archived(text, interval),
inbox.purge_archived(date),
inbox.archivable_command_days(interval),
inbox.command_retry_window(),
inbox.purge_archived_commands(date),
outbox.archive_audits(text),
outbox.try_lock_archive(text, date),
outbox.unlock_archive(text, date)
TO pgoutbox_archiver, pgoutbox_admin;
-- The schema check every command makes when it connects (core/db.py).
GRANT EXECUTE ON FUNCTION outbox.schema_version(), outbox.serves_workers_from() TO pgoutbox_archiver;

GRANT EXECUTE ON FUNCTION
outbox.void_archive(text, date, text, interval),
inbox.set_stream_max_age(interval),
inbox.set_command_retry_window(interval)
TO pgoutbox_admin;

-- pgoutbox_viewer: the read-only operator (the console's viewers). It reads
-- through functions only, no table: so it sees dead letters, never payloads
-- (outbox.dlq_show shows one only to a role that may read the table).
GRANT USAGE ON SCHEMA outbox, inbox TO pgoutbox_viewer;
GRANT EXECUTE ON FUNCTION
outbox.schema_version(), outbox.serves_workers_from(),
outbox.backlog(text), outbox.dead_letters(text, integer),
inbox.backlog(text), inbox.dead_letters(text, integer)
TO pgoutbox_viewer;
GRANT EXECUTE ON FUNCTION outbox.oldest_snapshots(integer) TO pgoutbox_viewer;
-- Dead-letter operations (sql/67_dead_letters.sql): the viewer and the admin
-- read, only the admin acts.
GRANT EXECUTE ON FUNCTION
outbox.dlq_groups(jsonb, integer),
outbox.dlq_summary(),
outbox.dlq_list(jsonb, integer, text),
outbox.dlq_show(text, uuid, text),
outbox.dlq_count(jsonb, text),
outbox.dlq_error_class(text),
outbox.dlq_error_pattern(text)
TO pgoutbox_viewer, pgoutbox_admin;
GRANT EXECUTE ON FUNCTION
outbox.dlq_replay(jsonb, text, integer),
outbox.dlq_discard(jsonb, text, integer),
outbox.dlq_restore(jsonb, text, integer),
outbox.dlq_prepare(jsonb, text),
outbox.dlq_act(bigint, text, integer),
outbox.dlq_stop(bigint),
outbox.dlq_action_progress(bigint)
TO pgoutbox_admin;
GRANT SELECT ON outbox.discard_log, inbox.discard_log, outbox.discarded_events TO pgoutbox_admin;

-- pgoutbox_backfiller: `pgoutbox backfill` (sql/68_backfill.sql). It reads
-- the outbox through the backfill functions only (no table) and records
-- each delivery in the inbox as the consumer does: receive, then processed or
-- an error. It holds no NATS durable and no other inbox call.
GRANT USAGE ON SCHEMA outbox, inbox TO pgoutbox_backfiller;
GRANT EXECUTE ON FUNCTION
outbox.schema_version(), outbox.serves_workers_from(),
outbox.backfill_span(text[], timestamptz, timestamptz),
outbox.backfill_page(text[], timestamptz, timestamptz, bigint, integer),
inbox.receive(uuid, text, text, jsonb),
inbox.mark_processed(uuid, text),
inbox.record_error(uuid, text, text, boolean, interval)
TO pgoutbox_backfiller;

-- A business flow by its correlation id (sql/70_flows.sql): read-only, no payload.
GRANT EXECUTE ON FUNCTION outbox.flow(uuid, integer) TO pgoutbox_viewer, pgoutbox_admin;

-- emit's options, cancelling, and schedules (sql/36_outbox_schedules.sql).
GRANT EXECUTE ON FUNCTION
outbox.emit(
    character varying, text, text, jsonb, text, integer, jsonb, uuid, uuid, text, text, timestamptz,
    uuid, timestamptz, interval
),
outbox.cancel(uuid, text)
TO pgoutbox_writer;
GRANT EXECUTE ON FUNCTION outbox.cancel(uuid, text) TO pgoutbox_admin;
GRANT EXECUTE ON FUNCTION outbox.next_scheduled() TO pgoutbox_relay;
GRANT EXECUTE ON FUNCTION outbox.scheduled(text)
TO pgoutbox_relay, pgoutbox_consumer, pgoutbox_admin, pgoutbox_viewer;
GRANT SELECT ON outbox.event_keys, outbox.schedules, outbox.cancel_log TO pgoutbox_admin;

-- The Parquet archive as a source: which days it holds, the checksum's
-- columns (to compute the archival job's checksum over a day's files), and
-- the gate that compares it with the audit. No table, no archive write.
GRANT EXECUTE ON FUNCTION
outbox.backfill_archived_days(timestamptz, timestamptz),
outbox.backfill_verify_archived_day(date, bigint, numeric),
outbox.checksum_columns(text)
TO pgoutbox_backfiller;
