-- Checkpoint identity across turns (docs/checkpoint-store.md, "Identity and write order").
-- A turn's rows are `{owner}:{turn_id}:{step}`, so `(agent_id, step)` is no longer unique: two turns
-- of one owner each have a step 1. `write_seq` is the rowid (an INTEGER PRIMARY KEY, so VACUUM keeps
-- it); every save sets it above every other row's (a new row gets max + 1, an overwrite is moved to
-- max + 1), and `latest`, `list` and `keep_last` go by it: the most recently written row, never the
-- highest step. SQLite cannot drop a constraint, so the table is rebuilt; existing rows are numbered
-- in the order they were last written.
CREATE TABLE checkpoints_by_write (
    write_seq  INTEGER PRIMARY KEY,
    id         TEXT    NOT NULL UNIQUE,
    agent_id   TEXT    NOT NULL,
    step       INTEGER NOT NULL CHECK (step >= 0),
    state      TEXT    NOT NULL CHECK (json_valid(state) AND json_type(state) = 'object'),
    turn_id    TEXT,
    attempt    INTEGER,
    created_at TEXT    NOT NULL,
    updated_at TEXT    NOT NULL
);
INSERT INTO checkpoints_by_write
    (write_seq, id, agent_id, step, state, turn_id, attempt, created_at, updated_at)
SELECT row_number() OVER (ORDER BY updated_at, step, id),
       id, agent_id, step, state, turn_id, attempt, created_at, updated_at
FROM checkpoints;
DROP TABLE checkpoints;
ALTER TABLE checkpoints_by_write RENAME TO checkpoints;
CREATE INDEX checkpoints_owner_written ON checkpoints (agent_id, write_seq);
CREATE INDEX checkpoints_turn_written ON checkpoints (turn_id, write_seq);
