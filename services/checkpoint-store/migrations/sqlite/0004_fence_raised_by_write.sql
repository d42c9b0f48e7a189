-- A step's fenced save in one statement (docs/checkpoint-store.md, "Fencing"): writing a turn's
-- row raises that turn's attempt record in the same statement, so the save is the checked upsert
-- alone — one commit instead of two (the raise, then the upsert). The record only ever goes up,
-- and rows without a turn or an attempt (unfenced saves) leave it alone.
CREATE TRIGGER IF NOT EXISTS checkpoints_raise_fence_on_insert
AFTER INSERT ON checkpoints
WHEN NEW.turn_id IS NOT NULL AND NEW.attempt IS NOT NULL
BEGIN
    INSERT INTO turn_attempts (turn_id, max_attempt, updated_at)
    VALUES (NEW.turn_id, NEW.attempt, NEW.updated_at)
    ON CONFLICT (turn_id) DO UPDATE SET
        max_attempt = MAX(turn_attempts.max_attempt, excluded.max_attempt),
        updated_at = excluded.updated_at;
END;

CREATE TRIGGER IF NOT EXISTS checkpoints_raise_fence_on_update
AFTER UPDATE OF attempt ON checkpoints
WHEN NEW.turn_id IS NOT NULL AND NEW.attempt IS NOT NULL
BEGIN
    INSERT INTO turn_attempts (turn_id, max_attempt, updated_at)
    VALUES (NEW.turn_id, NEW.attempt, NEW.updated_at)
    ON CONFLICT (turn_id) DO UPDATE SET
        max_attempt = MAX(turn_attempts.max_attempt, excluded.max_attempt),
        updated_at = excluded.updated_at;
END;
