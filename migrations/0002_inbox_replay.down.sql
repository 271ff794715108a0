-- 0002_inbox_replay (down): back to the 0001 inbox.
--
-- What it cannot undo:
--   * the replay bookkeeping already written into inbox.messages.dlq_metadata
--     (dead_letters, replay_attempts, next_replay_at, redrives, ...) stays:
--     0001 ignores those keys, and removing them would lose history;
--   * it refuses to run while inbox.redrive_log or inbox.replay_switches hold
--     any row: the redrive audit and the operators' switches would be lost.
--     Export and empty them deliberately first.
-- After it, dead letters are parked for good (nothing replays them) until
-- 0002 is applied again.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 2) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
    IF to_regclass('inbox.redrive_log') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM inbox.redrive_log) THEN
            RAISE EXCEPTION 'DATA_WOULD_BE_LOST: inbox.redrive_log is not empty'
                USING ERRCODE = 'OB091', HINT = 'Export the redrive audit, then empty it deliberately.';
        END IF;
        IF EXISTS (SELECT 1 FROM inbox.replay_switches) THEN
            RAISE EXCEPTION 'DATA_WOULD_BE_LOST: inbox.replay_switches is not empty'
                USING ERRCODE = 'OB091';
        END IF;
    END IF;
END;
$$;

DROP FUNCTION IF EXISTS inbox.dead_letters(text, integer);
DROP FUNCTION IF EXISTS inbox.set_replay(text, boolean, text);
DROP FUNCTION IF EXISTS inbox.redrive(text, uuid[], text);
DROP FUNCTION IF EXISTS inbox.claim_replays(text, integer);
DROP INDEX IF EXISTS inbox.messages_dead_letter_idx;
DROP TABLE IF EXISTS inbox.redrive_log;
DROP TABLE IF EXISTS inbox.replay_switches;
DROP FUNCTION IF EXISTS inbox.record_error(uuid, text, text, boolean, interval);

-- ---- inbox.record_error as 0001 created it ----
-- Records a handler failure: FAILED (transient, will be redelivered) or,
-- with dead => true, DEAD_LETTER (poison, or the last allowed delivery).
CREATE OR REPLACE FUNCTION inbox.record_error(
    message_id uuid,
    handler text,
    error text,
    dead boolean DEFAULT FALSE
)
RETURNS inbox.messages
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path TO pg_catalog, pg_temp
AS $$
DECLARE
    row inbox.messages;
BEGIN
    IF nullif(btrim(error), '') IS NULL THEN
        RAISE EXCEPTION 'INVALID_ARGUMENT: an error text is required' USING ERRCODE = 'OB006';
    END IF;
    UPDATE inbox.messages AS m
    SET status = CASE WHEN dead THEN 'DEAD_LETTER' ELSE 'FAILED' END,
        last_error = record_error.error
    WHERE m.message_id = record_error.message_id AND m.handler = record_error.handler
        AND m.status IN ('RECEIVED', 'FAILED')
    RETURNING * INTO row;
    IF NOT FOUND THEN
        PERFORM inbox._refuse_move(message_id, handler, CASE WHEN dead THEN 'DEAD_LETTER' ELSE 'FAILED' END);
    END IF;
    RETURN row;
END;
$$;
COMMENT ON FUNCTION inbox.record_error(uuid, text, text, boolean) IS
'RECEIVED/FAILED -> FAILED, or -> DEAD_LETTER with dead => true.';

REVOKE ALL ON FUNCTION inbox.record_error(uuid, text, text, boolean) FROM public;
GRANT EXECUTE ON FUNCTION inbox.record_error(uuid, text, text, boolean) TO pgoutbox_consumer;

DELETE FROM outbox.schema_migrations
WHERE version = 2;

COMMIT;
