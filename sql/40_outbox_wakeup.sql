-- Wake-up hints for relays: NOTIFY outbox_v1, payload = the context of the
-- event whose commit sent it.
--
-- A transaction that has issued NOTIFY takes a cluster-wide lock while it
-- commits, which serialises the commits of concurrent writers (measured here:
-- 4 writers fell from ~7,400 to ~2,900 rows/s with a per-row NOTIFY). So one
-- wake-up is sent per throttle interval (pgoutbox.notify_throttle, default
-- 5 ms) for all contexts together: relays claim across contexts, so a wake-up
-- for one context serves them all. Shaped for emit, the hot path of every
-- application using pgoutbox:
--   * a deferred constraint trigger: the wake-up is decided at COMMIT, when
--     the event becomes visible. A transaction that runs on long after its
--     emit, or rolls back, neither holds back the wake-ups of others nor has
--     its own skipped because of what was true at insert time;
--   * the throttle state is one number, the time (µs since the epoch) from
--     which the next wake-up is due, in an unlogged sequence: setval takes no
--     row lock, writes no WAL and is visible at once, so reading it is the
--     whole cost of a commit that does not notify;
--   * no WHEN clause: PostgreSQL re-reads a trigger's WHEN expression each
--     time an INSERT starts, which measured dearer than this function call;
--   * a bulk insert queues one call per row; the first notifies, the others
--     return at once (about 2 µs a row, at commit), so a transaction notifies
--     at most once;
--   * two writers committing at the same microsecond may both notify: a
--     spare hint, never a missing one.
-- A hint skipped by the throttle is covered by the relay, which keeps
-- claiming while work remains, claims again one throttle interval after a
-- wake-up, and polls on a fallback interval. Notifications are hints; the
-- table is the truth. (Pending deferred events make PostgreSQL refuse DDL on
-- outbox.events later in the same transaction; nothing in pgoutbox needs it.)

-- sqlfluff does not parse UNLOGGED sequences (new in PostgreSQL 15), hence the PRS exemption.
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
    -- The upper bound is also tg_events__notify's guard against a clock
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

CREATE OR REPLACE FUNCTION outbox.tg_events__notify()
RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
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
        RETURN NULL;
    END IF;
    PERFORM setval('outbox.wakeup_due_at', now_us + (extract(epoch FROM outbox.notify_throttle()) * 1000000)::bigint);
    PERFORM pg_notify('outbox_v1', new.context);
    RETURN NULL;
END;
$$;

DROP TRIGGER IF EXISTS _900_notify ON outbox.events;
CREATE CONSTRAINT TRIGGER _900_notify
AFTER INSERT ON outbox.events
DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION outbox.tg_events__notify();
