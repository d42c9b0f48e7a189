-- Checkpoint identity across turns (docs/checkpoint-store.md, "Identity and write order").
-- A turn's rows are `{owner}:{turn_id}:{step}`, so `(agent_id, step)` is no longer unique: two turns
-- of one owner each have a step 1. Every save stamps `write_seq` from one sequence (a fresh value on
-- insert and on overwrite), and `latest`, `list` and `keep_last` go by it: the most recently written
-- row, never the highest step. Existing rows are numbered in the order they were last written.
CREATE SEQUENCE IF NOT EXISTS checkpoints_write_seq AS BIGINT;
ALTER TABLE checkpoints ADD COLUMN write_seq BIGINT;
WITH ordered AS (
    SELECT id, row_number() OVER (ORDER BY updated_at, step, id) AS n FROM checkpoints
)
UPDATE checkpoints SET write_seq = ordered.n FROM ordered WHERE checkpoints.id = ordered.id;
SELECT setval('checkpoints_write_seq', COALESCE((SELECT MAX(write_seq) FROM checkpoints), 0) + 1, false);
ALTER TABLE checkpoints ALTER COLUMN write_seq SET DEFAULT nextval('checkpoints_write_seq');
ALTER TABLE checkpoints ALTER COLUMN write_seq SET NOT NULL;
ALTER SEQUENCE checkpoints_write_seq OWNED BY checkpoints.write_seq;
ALTER TABLE checkpoints DROP CONSTRAINT IF EXISTS checkpoints_owner_step;
CREATE INDEX IF NOT EXISTS checkpoints_owner_written ON checkpoints (agent_id, write_seq);
CREATE INDEX IF NOT EXISTS checkpoints_turn_written ON checkpoints (turn_id, write_seq);
