-- Incremental checkpoints (docs/checkpoint-store.md, "Incremental checkpoints"). A turn stores its
-- seeded window once, here, and each of its rows only what its step added (a state with `from`);
-- reads rebuild the full window from the base and the turn's rows. Rows written before this
-- migration are full snapshots (no `from`) and are read as they are.
CREATE TABLE IF NOT EXISTS checkpoint_bases (
    agent_id   TEXT    NOT NULL,
    turn_id    TEXT    NOT NULL,
    state      TEXT    NOT NULL CHECK (json_valid(state) AND json_type(state) = 'object'),
    attempt    INTEGER NOT NULL,
    updated_at TEXT    NOT NULL,
    PRIMARY KEY (agent_id, turn_id)
);
-- A delta row's `from` (NULL for a full snapshot), so retention can keep what a delta is built on.
ALTER TABLE checkpoints ADD COLUMN delta_from INTEGER;
-- The rows of one turn in step order (rebuilding a window).
CREATE INDEX IF NOT EXISTS checkpoints_turn_step ON checkpoints (agent_id, turn_id, step);
