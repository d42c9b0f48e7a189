-- Persona memory (docs/memory.md): one row per remembered thing. session_id '' = the persona's
-- long-term memory; otherwise the working memory of that session.
CREATE TABLE orch_memory (
    id TEXT PRIMARY KEY,
    persona_id TEXT NOT NULL,
    session_id TEXT NOT NULL DEFAULT '',
    text TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX orch_memory_by_owner ON orch_memory (persona_id, session_id, created_at);
