-- Memory she gathers herself (docs/memory.md, "Memory she gathers herself").
-- `source`: for an entry memory extraction wrote, the JSON {"session_id","turn_id","persona"} of
-- the turn it was gathered from; NULL for an entry written by hand.
ALTER TABLE orch_memory ADD COLUMN source TEXT;
-- One row per turn whose extraction is done, written in the same transaction as its entries:
-- a redelivered job finds it and writes nothing twice.
CREATE TABLE orch_memory_jobs (
    turn_id TEXT PRIMARY KEY,
    persona_id TEXT NOT NULL,
    entries INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
