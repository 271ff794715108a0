-- 0014_command_inbox (down): back to version 13, without the command inbox.
--
-- What it cannot undo: it refuses to run while inbox.commands holds any row
-- (DATA_WOULD_BE_LOST): without its keys, every stored command could run
-- again. Nothing else is lost.

BEGIN;

SELECT pg_advisory_xact_lock(hashtextextended('pgoutbox.migrate', 0));

DO $$
BEGIN
    -- Nested IFs: plpgsql plans each condition only when it reaches it.
    IF to_regclass('outbox.schema_migrations') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM outbox.schema_migrations WHERE version > 14) THEN
            RAISE EXCEPTION 'MIGRATION_OUT_OF_ORDER: roll back the newer migrations first'
                USING ERRCODE = 'OB090';
        END IF;
    END IF;
    IF to_regclass('inbox.commands') IS NOT NULL THEN
        IF EXISTS (SELECT 1 FROM inbox.commands) THEN
            RAISE EXCEPTION 'DATA_WOULD_BE_LOST: inbox.commands is not empty'
                USING ERRCODE = 'OB091',
                      HINT = 'Its keys keep commands from running twice; they leave only by audited archival.';
        END IF;
    END IF;
END;
$$;

DROP FUNCTION IF EXISTS inbox.lookup_command(text, text);
DROP FUNCTION IF EXISTS inbox.fail_command(text, text, text);
DROP FUNCTION IF EXISTS inbox.complete_command(text, text, jsonb);
DROP FUNCTION IF EXISTS inbox._refuse_command_move(text, text, text);
DROP FUNCTION IF EXISTS inbox.claim_command(text, text);
DROP FUNCTION IF EXISTS inbox._check_command(text, text);
DROP TABLE IF EXISTS inbox.commands;
DROP FUNCTION IF EXISTS inbox.tg_commands__forbid_delete();
DROP FUNCTION IF EXISTS inbox.tg_commands__guard_update();

DELETE FROM outbox.schema_migrations
WHERE version = 14;

COMMIT;
