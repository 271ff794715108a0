-- Wake-up hints for relays: NOTIFY outbox_v1, payload = the context of the
-- event that sent it.
--
-- A transaction that has issued NOTIFY takes a cluster-wide lock while it
-- commits, which serialises the commits of concurrent writers (measured here:
-- 4 writers fell from ~7,400 to ~2,900 rows/s with a per-row NOTIFY). So one
-- wake-up is sent per throttle interval (outbox.notify_throttle(), default
-- 5 ms) for all contexts together: relays claim across contexts, so a wake-up
-- for one context serves them all. Shaped for emit, the hot path of every
-- application using pgoutbox (bench/emit_bench.py, bench/sql_bench.py):
--   * the throttle state is one number, the time (µs since the epoch) from
--     which the next wake-up is due, in an unlogged sequence: setval takes no
--     row lock, writes no WAL and is visible at once, so an insert that is
--     not due costs one sequence read;
--   * the test runs at the end of the INSERT policy trigger
--     (_100_check_policies, 20_outbox_guards.sql), once the row has passed
--     the policies: a BEFORE row trigger of its own cost 2-3 µs an event
--     more, and PostgreSQL's AFTER trigger machinery (event queue, re-reading
--     the row, firing at commit) about 25 µs. The test, _wakeup_is_due, is a
--     SQL function that PostgreSQL inlines into the trigger's expression;
--     only a due insert calls _wake_relays, which reads the throttle;
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

-- The throttle is shared by every writer, so no writer may set it for the
-- others (a session setting would let one silence everyone's wake-ups): one
-- row, changed only through outbox.set_notify_throttle (admins), whose CHECK
-- makes an invalid value impossible. Read once per wake-up, not per insert.
CREATE TABLE IF NOT EXISTS outbox.wakeup_policy (
    singleton boolean PRIMARY KEY DEFAULT TRUE,
    notify_throttle interval NOT NULL DEFAULT interval '5 milliseconds',
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text NOT NULL DEFAULT session_user,
    CONSTRAINT one_row_only CHECK (singleton),
    -- The upper bound is also _wakeup_is_due's guard against a clock set
    -- back: keep the two equal.
    CONSTRAINT notify_throttle_is_in_range CHECK (
        notify_throttle >= interval '0' AND notify_throttle <= interval '1 minute'
    )
);
COMMENT ON TABLE outbox.wakeup_policy IS
'Minimum gap between two wake-up NOTIFYs, for all writers; changed with outbox.set_notify_throttle().';
INSERT INTO outbox.wakeup_policy (singleton) VALUES (TRUE) ON CONFLICT DO NOTHING;

CREATE OR REPLACE FUNCTION outbox.notify_throttle()
RETURNS interval
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
    SELECT coalesce((SELECT p.notify_throttle FROM outbox.wakeup_policy AS p), interval '5 milliseconds');
$$;
COMMENT ON FUNCTION outbox.notify_throttle() IS
'Minimum gap between two wake-ups (outbox.wakeup_policy, default 5 ms, at most 1 minute).';

CREATE OR REPLACE FUNCTION outbox.set_notify_throttle(throttle interval)
RETURNS interval
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    IF throttle IS NULL OR throttle < interval '0' OR throttle > interval '1 minute' THEN
        RAISE EXCEPTION 'INVALID_SETTING: notify_throttle % is not an interval from 0 to 1 minute', coalesce(throttle::text, 'NULL')
            USING ERRCODE = 'OB007';
    END IF;
    RETURN outbox._set_policy('outbox.wakeup_policy', 'notify_throttle', throttle);
END;
$$;
COMMENT ON FUNCTION outbox.set_notify_throttle(interval) IS
'Sets the minimum gap between two wake-ups for every writer (admins); relays read it at start-up.';

-- Whether the next wake-up is due. Not due while the due time lies ahead, by
-- at most the largest throttle (1 minute): a clock set back further cannot
-- mute wake-ups for long. A sequence never set (fresh, or reset by a crash)
-- reads NULL: due. No SET clause and no SECURITY DEFINER, so that it is
-- inlined (it runs inside the policy trigger, under its search_path). A
-- range rather than BETWEEN, which would read the sequence and the clock twice.
-- date_part, not extract: extract's numeric arithmetic cost every emit about
-- 1 µs more (float8 carries today's microseconds since the epoch exactly).
CREATE OR REPLACE FUNCTION outbox._wakeup_is_due()
RETURNS boolean
LANGUAGE sql VOLATILE
AS $$
    SELECT NOT pg_catalog.int8range(1, 60000000, '[]') @> (
        coalesce(pg_catalog.pg_sequence_last_value('outbox.wakeup_due_at'), 0)
        - (pg_catalog.date_part('epoch', pg_catalog.clock_timestamp()) * 1000000)::bigint
    );
$$;

-- Sends the wake-up for an event of context (delivered at commit) and sets
-- the next one due one throttle interval from now: one statement.
CREATE OR REPLACE FUNCTION outbox._wake_relays(context text)
RETURNS void
LANGUAGE plpgsql
SET search_path TO pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM
        setval('outbox.wakeup_due_at', (extract(epoch FROM clock_timestamp() + coalesce(
            (SELECT p.notify_throttle FROM outbox.wakeup_policy AS p), interval '5 milliseconds'
        )) * 1000000)::bigint),
        pg_notify('outbox_v1', context);
END;
$$;
