-- 0004_wakeup_sequence (down): back to the per-context wake-up of 0001
-- (unlogged table outbox.wakeups, per-statement AFTER trigger _900_notify).
--
-- What it cannot undo: nothing is lost. The throttle state is a hint and
-- starts empty either way (the next insert notifies), and a
-- pgoutbox.notify_throttle setting above 1 minute or below 0, refused by
-- version 4, is accepted again.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 4) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
END;
$$;

DROP TRIGGER IF EXISTS _900_wakeup ON outbox.events;
DROP FUNCTION IF EXISTS outbox.tg_events__wakeup();
DROP SEQUENCE IF EXISTS outbox.wakeup_due_at;

-- ---- from migrations/0001_initial.up.sql ----
CREATE UNLOGGED TABLE IF NOT EXISTS outbox.wakeups (
    context text PRIMARY KEY,
    notified_at timestamptz NOT NULL
);
COMMENT ON TABLE outbox.wakeups IS
'Last wake-up NOTIFY per context (throttle state; unlogged, losing it only costs one extra NOTIFY).';

CREATE OR REPLACE FUNCTION outbox.notify_throttle()
RETURNS interval
LANGUAGE sql STABLE
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT coalesce(nullif(current_setting('pgoutbox.notify_throttle', true), '')::interval, interval '5 milliseconds');
$$;
COMMENT ON FUNCTION outbox.notify_throttle() IS
'Minimum gap between two wake-ups of one context (setting pgoutbox.notify_throttle, default 5 ms).';

CREATE OR REPLACE FUNCTION outbox.tg_events__notify()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    ctx text;
    last_at timestamptz;
    gap interval := outbox.notify_throttle();
BEGIN
    FOR ctx IN SELECT DISTINCT n.context FROM new_rows AS n LOOP
        -- Plain read first: within the interval (the common case under load)
        -- the trigger neither locks nor writes anything.
        SELECT w.notified_at INTO last_at FROM outbox.wakeups AS w WHERE w.context = ctx;
        IF NOT FOUND THEN
            INSERT INTO outbox.wakeups (context, notified_at)
            VALUES (ctx, clock_timestamp())
            ON CONFLICT DO NOTHING;
            CONTINUE WHEN NOT FOUND;  -- another writer created it and notifies
        ELSE
            CONTINUE WHEN last_at > clock_timestamp() - gap;
            -- Due: one writer takes the row, the others skip instead of waiting.
            PERFORM 1 FROM outbox.wakeups AS w WHERE w.context = ctx FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;
            UPDATE outbox.wakeups AS w SET notified_at = clock_timestamp()
            WHERE w.context = ctx AND w.notified_at <= clock_timestamp() - gap;
            CONTINUE WHEN NOT FOUND;  -- notified by a writer that committed meanwhile
        END IF;
        PERFORM pg_notify('outbox_v1', ctx);
    END LOOP;
    RETURN NULL;
END;
$$;

CREATE TRIGGER _900_notify
AFTER INSERT ON outbox.events
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION outbox.tg_events__notify();

GRANT SELECT ON outbox.wakeups TO pgoutbox_admin;
REVOKE ALL ON FUNCTION outbox.tg_events__notify() FROM public;

DELETE FROM outbox.schema_migrations
WHERE version = 4;

COMMIT;
