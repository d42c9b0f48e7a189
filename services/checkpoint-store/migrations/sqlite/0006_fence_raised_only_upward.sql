-- A step's save leaves its turn's attempt record alone unless it raises it (docs/checkpoint-store.md,
-- "Fencing" and "Performance"). Migration 0004's triggers rewrote the record on every save of the
-- turn, only to set `updated_at` again: one more page written to the WAL per save. Now they write it
-- only when the row's attempt is above the recorded one (or none is recorded). The fence is the
-- same: the checked upsert still reads the record before it writes, and a newer attempt still
-- raises it in the statement that writes its row.
--
-- The record's `updated_at` is then the time its attempt was last raised (a save of a newer
-- attempt, or a fenced read), no longer the turn's last save; an `older_than_secs` retention takes
-- the turn's rows into account instead (`DROP_OLD_ATTEMPTS`). A deleted row of a turn hands its
-- write time to the turn's record (the last trigger), so retention still sees the turn's last save
-- after `keep_last` or a restart from the base removed it.
DROP TRIGGER IF EXISTS checkpoints_raise_fence_on_insert;
DROP TRIGGER IF EXISTS checkpoints_raise_fence_on_update;

CREATE TRIGGER checkpoints_raise_fence_on_insert
AFTER INSERT ON checkpoints
WHEN NEW.turn_id IS NOT NULL AND NEW.attempt IS NOT NULL
    AND NOT EXISTS (SELECT 1 FROM turn_attempts
                    WHERE turn_id = NEW.turn_id AND max_attempt >= NEW.attempt)
BEGIN
    INSERT INTO turn_attempts (turn_id, max_attempt, updated_at)
    VALUES (NEW.turn_id, NEW.attempt, NEW.updated_at)
    ON CONFLICT (turn_id) DO UPDATE SET
        max_attempt = MAX(turn_attempts.max_attempt, excluded.max_attempt),
        updated_at = excluded.updated_at;
END;

CREATE TRIGGER checkpoints_raise_fence_on_update
AFTER UPDATE OF attempt ON checkpoints
WHEN NEW.turn_id IS NOT NULL AND NEW.attempt IS NOT NULL
    AND NOT EXISTS (SELECT 1 FROM turn_attempts
                    WHERE turn_id = NEW.turn_id AND max_attempt >= NEW.attempt)
BEGIN
    INSERT INTO turn_attempts (turn_id, max_attempt, updated_at)
    VALUES (NEW.turn_id, NEW.attempt, NEW.updated_at)
    ON CONFLICT (turn_id) DO UPDATE SET
        max_attempt = MAX(turn_attempts.max_attempt, excluded.max_attempt),
        updated_at = excluded.updated_at;
END;

CREATE TRIGGER IF NOT EXISTS checkpoints_keep_turn_activity_on_delete
AFTER DELETE ON checkpoints
WHEN OLD.turn_id IS NOT NULL
BEGIN
    UPDATE turn_attempts SET updated_at = OLD.updated_at
    WHERE turn_id = OLD.turn_id AND updated_at < OLD.updated_at;
END;
