-- A step's save writes less (docs/checkpoint-store.md, "Performance"). `checkpoints_turn_written`
-- (turn_id, write_seq) served only `latest` of one turn, which `checkpoints_turn_step`
-- (agent_id, turn_id, step) serves as well — a turn has a few rows, sorted by `write_seq` in
-- memory — so every insert and overwrite maintained one index for nothing.
DROP INDEX IF EXISTS checkpoints_turn_written;
