-- 0004_wakeup_sequence (up): a cheaper wake-up.
--
--   * the throttle state moves from the unlogged table outbox.wakeups (read
--     by a per-statement plpgsql AFTER trigger with a transition table on
--     every insert) to the unlogged sequence outbox.wakeup_due_at, read by a
--     BEFORE INSERT row trigger (_900_wakeup replaces _900_notify): cheaper
--     per emit (bench/sql_bench.py, emit at 4 writers);
--   * the throttle is one interval for all contexts together (relays claim
--     across contexts); the payload is still the context;
--   * outbox.notify_throttle() rejects a setting that is not an interval
--     from 0 to 1 minute with INVALID_SETTING (OB007).
--
-- Apply with `pgoutbox migrate`, or `psql -v ON_ERROR_STOP=1 -f` this file.
-- Safe to re-run and to run twice at once (one transaction, advisory lock,
-- idempotent DDL). Refuses to run unless the schema is at version 3 or 4.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NULL THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0004 needs 0001 to 0003 applied first'
            USING ERRCODE = 'OB090';
    END IF;
    IF (SELECT coalesce(max(version), 0) FROM outbox.schema_migrations) NOT IN (3, 4) THEN
        RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: 0004 applies on version 3 (or re-runs on 4) only'
            USING ERRCODE = 'OB090';
    END IF;
END;
$$;

DROP TRIGGER IF EXISTS _900_notify ON outbox.events;
DROP FUNCTION IF EXISTS outbox.tg_events__notify();
DROP TABLE IF EXISTS outbox.wakeups;

-- ---- from sql/40_outbox_wakeup.sql (as of this migration) ----
-- Wake-up hints for relays: NOTIFY outbox_v1, payload = the context of the
-- event that sent it.
--
-- A transaction that has issued NOTIFY takes a cluster-wide lock while it
-- commits, which serialises the commits of concurrent writers (measured here:
-- 4 writers fell from ~7,400 to ~2,900 rows/s with a per-row NOTIFY). So one
-- wake-up is sent per throttle interval (pgoutbox.notify_throttle, default
-- 5 ms) for all contexts together: relays claim across contexts, so a wake-up
-- for one context serves them all. Shaped for emit, the hot path of every
-- application using pgoutbox (bench/sql_bench.py):
--   * the throttle state is one number, the time (µs since the epoch) from
--     which the next wake-up is due, in an unlogged sequence: setval takes no
--     row lock, writes no WAL and is visible at once, so an insert that is
--     not due costs one sequence read;
--   * a BEFORE INSERT row trigger, after the policies (_100): PostgreSQL's
--     AFTER trigger machinery (event queue, re-reading the row, firing at
--     commit) measured about 25 µs a transaction, five times the whole
--     wake-up otherwise;
--   * a bulk insert notifies once per throttle interval while it runs, and
--     PostgreSQL folds a transaction's identical notifications into one: at
--     most one per context per transaction;
--   * the wake-up is decided at insert and delivered at commit (a rolled-back
--     transaction sends nothing). Events committed within the interval of a
--     wake-up ride on it: the relay claims again one interval after each one.
--     Left to the relay's fallback poll: events of a quiet moment committed
--     in the interval of a wake-up whose transaction then rolled back, or
--     commits only after the relay's second claim;
--   * two writers inserting at the same microsecond may both notify: a spare
--     hint, never a missing one.
-- Notifications are hints; the table is the truth.

-- The linter (sqlfluff) does not parse UNLOGGED sequences (new in PostgreSQL 15), hence the PRS exemption.
CREATE UNLOGGED SEQUENCE IF NOT EXISTS outbox.wakeup_due_at AS bigint;  -- noqa: PRS
COMMENT ON SEQUENCE outbox.wakeup_due_at IS
'Time (µs since the epoch) from which the next wake-up NOTIFY is due. Throttle state: unlogged, reset by a crash, which costs one extra NOTIFY.';

CREATE OR REPLACE FUNCTION outbox.notify_throttle()
RETURNS interval
LANGUAGE plpgsql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    setting text := nullif(current_setting('pgoutbox.notify_throttle', true), '');
    gap interval;
BEGIN
    IF setting IS NULL THEN
        RETURN interval '5 milliseconds';
    END IF;
    BEGIN
        gap := setting::interval;
    EXCEPTION WHEN invalid_datetime_format OR datetime_field_overflow OR interval_field_overflow THEN
        gap := NULL;
    END;
    -- The upper bound is also tg_events__wakeup's guard against a clock
    -- set back: keep the two equal.
    IF gap IS NULL OR gap < interval '0' OR gap > interval '1 minute' THEN
        RAISE EXCEPTION 'INVALID_SETTING: pgoutbox.notify_throttle = % is not an interval from 0 to 1 minute', quote_literal(setting)
            USING ERRCODE = 'OB007';
    END IF;
    RETURN gap;
END;
$$;
COMMENT ON FUNCTION outbox.notify_throttle() IS
'Minimum gap between two wake-ups (setting pgoutbox.notify_throttle, default 5 ms, at most 1 minute).';

CREATE OR REPLACE FUNCTION outbox.tg_events__wakeup()
RETURNS trigger
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    now_us bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    due_us bigint := coalesce(pg_sequence_last_value('outbox.wakeup_due_at'), 0);
BEGIN
    -- Not due while the due time lies ahead, by at most the largest throttle
    -- (1 minute): a clock set back further cannot mute wake-ups for long. A
    -- sequence never set (fresh, or reset by a crash) reads NULL: due.
    IF due_us - now_us BETWEEN 1 AND 60000000 THEN
        RETURN new;
    END IF;
    PERFORM setval('outbox.wakeup_due_at', now_us + (extract(epoch FROM outbox.notify_throttle()) * 1000000)::bigint);
    PERFORM pg_notify('outbox_v1', new.context);
    RETURN new;
END;
$$;

CREATE OR REPLACE TRIGGER _900_wakeup
BEFORE INSERT ON outbox.events
FOR EACH ROW EXECUTE FUNCTION outbox.tg_events__wakeup();

-- As sql/90_roles.sql does for every function: nothing to PUBLIC.
REVOKE ALL ON FUNCTION outbox.tg_events__wakeup() FROM public;

INSERT INTO outbox.schema_migrations (version, name)
VALUES (4, '0004_wakeup_sequence')
ON CONFLICT (version) DO NOTHING;

COMMIT;
