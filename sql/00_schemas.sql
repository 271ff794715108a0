-- Schemas and the schema version record.
--
-- Every file under sql/ is idempotent DDL: migrations/0001 is built from these
-- files, and running a migration twice (or two at once, serialised by the
-- advisory lock the migration takes) must change nothing.

CREATE SCHEMA IF NOT EXISTS outbox;
CREATE SCHEMA IF NOT EXISTS inbox;
COMMENT ON SCHEMA outbox IS 'pgoutbox: transactional outbox (events awaiting relay to JetStream)';
COMMENT ON SCHEMA inbox IS 'pgoutbox: idempotent inbox (one row per message and handler)';

-- One row per applied migration. The relay refuses to start unless the
-- highest version here is one it understands.
CREATE TABLE IF NOT EXISTS outbox.schema_migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    applied_by text NOT NULL DEFAULT session_user,
    CONSTRAINT version_is_positive CHECK (version >= 1),
    CONSTRAINT name_is_snake_case CHECK (name ~ '^[0-9]{4}_[a-z0-9_]+$')
);

CREATE OR REPLACE FUNCTION outbox.schema_version()
RETURNS integer
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT coalesce(max(version), 0) FROM outbox.schema_migrations;
$$;
COMMENT ON FUNCTION outbox.schema_version() IS
'Highest applied migration; workers compare it with the version they were built for.';

-- Expand-then-contract: a migration that only adds leaves this number alone,
-- so workers built for an older schema keep running after it; a contract
-- migration (one that removes or changes what older workers call) raises it.
CREATE OR REPLACE FUNCTION outbox.serves_workers_from()
RETURNS integer
LANGUAGE sql IMMUTABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT 6;
$$;
COMMENT ON FUNCTION outbox.serves_workers_from() IS
'Oldest schema version a worker may be built for and still run on this schema (raised only by contract migrations).';
